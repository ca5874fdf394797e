#include "bench/ssm_bench.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include "bench/timing.h"
#include "layers/mamba.h"
#include "layers/mamba2.h"
#include "ops/ssd/ssd.h"

namespace hax::bench {
namespace {

struct Row {
  std::string what;
  int64_t L;
  Timing fwd, fwdbwd;
};

Row time_mixer(const std::string& name, Mixer& mixer, int64_t B, int64_t L, int64_t d, const SsmBenchConfig& cfg) {
  at::Tensor x = at::randn({B, L, d});
  Row r{name, L, {}, {}};
  r.fwd = time_it([&] {
    torch::NoGradGuard ng;
    mixer.forward(x, at::Tensor(), nullptr, nullptr);
  }, 1, cfg.repeats, cfg.budget_s);
  at::Tensor xg = x.clone().requires_grad_();
  r.fwdbwd = time_it([&] {
    at::Tensor y = mixer.forward(xg, at::Tensor(), nullptr, nullptr);
    y.sum().backward();
    mixer.zero_grad();
    xg.mutable_grad() = at::Tensor();
  }, 1, cfg.repeats, cfg.budget_s);
  return r;
}

}  // namespace

nlohmann::json run_ssm_bench(const SsmBenchConfig& cfg) {
  ModelConfig m2;
  m2.mixer = "mamba2", m2.d_model = cfg.d_model, m2.headdim = cfg.headdim, m2.d_state = cfg.d_state_mamba2;
  m2.chunk_size = cfg.chunk;
  m2.validate();
  ModelConfig m1 = m2;
  m1.mixer = "mamba", m1.d_state = cfg.d_state_mamba;
  torch::manual_seed(0);
  Mamba2Mixer mamba2(m2, 0);
  MambaMixer mamba(m1, 0);
  const int64_t B = cfg.batch, H = m2.nheads(), P = m2.headdim, N = m2.d_state;

  std::vector<Row> rows;
  for (int64_t L : cfg.lengths) {
    rows.push_back(time_mixer("mamba2 mixer", mamba2, B, L, cfg.d_model, cfg));
    rows.push_back(time_mixer("mamba mixer", mamba, B, L, cfg.d_model, cfg));
    // The SSD scan alone: chunked kernel vs. the naive per-step recurrence.
    at::Tensor x = at::randn({B, L, H, P}), dt = at::softplus(at::randn({B, L, H}) - 2), A = -at::rand({H}) - 0.5;
    at::Tensor Bm = at::randn({B, L, 1, N}), Cm = at::randn({B, L, 1, N});
    Row chunked{"ssd chunked", L, {}, {}};
    chunked.fwd = time_it([&] { ops::ssd_forward(x, dt, A, Bm, Cm, {}, {}, cfg.chunk); }, 1, cfg.repeats, cfg.budget_s);
    std::vector<at::Tensor> leaves = {x.clone().requires_grad_(), dt.clone().requires_grad_(), A.clone().requires_grad_(),
                                      Bm.clone().requires_grad_(), Cm.clone().requires_grad_()};
    auto fb = [&](bool naive) {
      return [&, naive] {
        auto [y, f] = naive ? ops::ssd_reference(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], {}, {})
                            : ops::ssd(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], {}, {}, cfg.chunk);
        y.sum().backward();
        for (auto& t : leaves) t.mutable_grad() = at::Tensor();
      };
    };
    chunked.fwdbwd = time_it(fb(false), 1, cfg.repeats, cfg.budget_s);
    rows.push_back(chunked);
    if (L <= cfg.naive_max_len) {
      Row naive{"ssd naive recurrence", L, {}, {}};
      naive.fwd = time_it([&] {
        torch::NoGradGuard ng;
        ops::ssd_reference(x, dt, A, Bm, Cm, {}, {});
      }, 0, std::min(cfg.repeats, 3), cfg.budget_s);
      naive.fwdbwd = time_it(fb(true), 0, std::min(cfg.repeats, 3), cfg.budget_s);
      rows.push_back(naive);
    }
  }

  nlohmann::json report;
  report["device"] = "cpu";
  report["threads"] = at::get_num_threads();
  report["config"] = {{"batch", B},          {"d_model", cfg.d_model},      {"d_inner", m2.d_inner()},
                      {"mamba2_heads", H},   {"headdim", P},                {"mamba2_d_state", N},
                      {"mamba_d_state", cfg.d_state_mamba}, {"chunk", cfg.chunk}, {"dtype", "float32"}};
  fmt::print("hax bench ssm: CPU, {} threads, batch {}, d_model {} (d_inner {}), Mamba-2 {} heads x {} (N={}), "
             "Mamba N={}, chunk {}, float32\n",
             at::get_num_threads(), B, cfg.d_model, m2.d_inner(), H, P, N, cfg.d_state_mamba, cfg.chunk);
  fmt::print("{:<22} {:>7} {:>12} {:>14} {:>12} {:>14}\n", "what", "L", "fwd ms", "fwd tok/s", "fwd+bwd ms",
             "fwd+bwd tok/s");
  for (auto& r : rows) {
    const double tok = (double)B * r.L;
    fmt::print("{:<22} {:>7} {:>12.2f} {:>14.0f} {:>12.2f} {:>14.0f}\n", r.what, r.L, r.fwd.median_ms,
               tok / (r.fwd.median_ms / 1e3), r.fwdbwd.median_ms, tok / (r.fwdbwd.median_ms / 1e3));
    report["results"].push_back({{"what", r.what},
                                 {"L", r.L},
                                 {"fwd_ms", r.fwd.median_ms},
                                 {"fwd_tokens_per_s", tok / (r.fwd.median_ms / 1e3)},
                                 {"fwdbwd_ms", r.fwdbwd.median_ms},
                                 {"fwdbwd_tokens_per_s", tok / (r.fwdbwd.median_ms / 1e3)},
                                 {"runs", r.fwd.runs}});
  }
  // Speedup of the chunked scan over the naive recurrence at each length where both ran.
  for (auto& a : rows)
    for (auto& b : rows)
      if (a.what == "ssd chunked" && b.what == "ssd naive recurrence" && a.L == b.L) {
        const double sf = b.fwd.median_ms / a.fwd.median_ms, sfb = b.fwdbwd.median_ms / a.fwdbwd.median_ms;
        fmt::print("chunked SSD vs naive recurrence at L={}: {:.1f}x faster forward, {:.1f}x forward+backward\n", a.L, sf,
                   sfb);
        report["speedup_chunked_vs_naive"].push_back({{"L", a.L}, {"fwd", sf}, {"fwdbwd", sfb}});
      }
  return report;
}

}  // namespace hax::bench
