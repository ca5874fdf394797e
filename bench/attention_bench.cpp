#include "bench/attention_bench.h"

#include <fmt/format.h>
#include <malloc.h>
#include <torch/torch.h>

#include <fstream>
#include <map>

#include "bench/timing.h"
#include "layers/sparse_branch.h"
#include "ops/attention/attention.h"
#include "ops/causal_attention/causal_attention.h"

namespace hax::bench {
namespace {

int64_t status_kb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::string(key).size()));
  return -1;
}

}  // namespace

int64_t peak_memory_during(const std::function<void()>& fn) {
  malloc_trim(0);
  const int64_t before = status_kb("VmRSS:");
  {
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";  // resets VmHWM to the current RSS
  }
  fn();
  const int64_t peak = status_kb("VmHWM:");
  return before < 0 || peak < 0 ? -1 : (peak - before) * 1024;
}

nlohmann::json run_attention_bench(const AttentionBenchConfig& cfg) {
  nlohmann::json report;
  report["device"] = "cpu";
  report["threads"] = at::get_num_threads();
  report["config"] = {{"keys", cfg.keys}, {"heads", cfg.heads}, {"dtype", "float32"}, {"batch", 1}};
  fmt::print("hax bench attention: CPU, {} threads, batch 1, {} head(s), k = {}, float32; times include building "
             "the pattern\n",
             at::get_num_threads(), cfg.heads, cfg.keys);
  fmt::print("{:<6} {:>4} {:>7} {:>11} {:>13} {:>12} {:>14} {:>11}\n", "pattern", "D", "L", "fwd ms", "fwd+bwd ms",
             "peak MB", "bytes/token", "x vs full");
  std::map<std::pair<int64_t, int64_t>, double> full_ms;  // (D, L) -> fwd+bwd ms of full attention
  bool full_too_slow = false;
  for (int64_t D : cfg.dims) {
    full_too_slow = false;
    for (int64_t L : cfg.lengths) {
      torch::manual_seed(0);
      const int64_t B = 1, H = cfg.heads;
      at::Tensor q0 = at::randn({B, L, H, D}), k0 = at::randn({B, L, H, D}) / std::sqrt((double)D);
      at::Tensor v0 = at::randn({B, L, H, D});
      at::Tensor x0 = at::randn({B, L, D});  // the branch's input: HSA retrieves from it
      // Full attention first, so that every sparse row can show its speed-up at this length.
      std::vector<std::string> order = {"full"};
      for (auto& p : cfg.patterns)
        if (p != "full") order.push_back(p);
      for (const auto& pattern : order) {
        if (std::find(cfg.patterns.begin(), cfg.patterns.end(), pattern) == cfg.patterns.end()) continue;
        if (pattern == "full" && full_too_slow) continue;
        ModelConfig mc;
        mc.d_model = D, mc.d_state = D, mc.sparse = pattern, mc.sparse_keys = cfg.keys, mc.attn_heads = H;
        mc.qk_dim = D;
        mc.dilated_span = std::max<int64_t>(2048, L);  // stride spreads the dilated keys over the sequence
        mc.hsa_chunk = 64, mc.hsa_topk = std::max<int64_t>(1, cfg.keys / 64);  // HSA: k keys = k / 64 chunks
        torch::manual_seed(1);
        SparseAttentionBranch branch(mc, D, D * H, 0);
        ForwardContext ctx;
        auto fwd = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
          return branch.attend(x0, q, k, v, {}, &ctx, nullptr);
        };
        Timing tf = time_it([&] {
          torch::NoGradGuard ng;
          fwd(q0, k0, v0);
        }, 1, cfg.repeats, cfg.budget_s);
        at::Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
        auto fb = [&] {
          fwd(q, k, v).sum().backward();
          q.mutable_grad() = at::Tensor(), k.mutable_grad() = at::Tensor(), v.mutable_grad() = at::Tensor();
          branch.zero_grad();
        };
        Timing tb = time_it(fb, 1, cfg.repeats, cfg.budget_s);
        const int64_t peak = peak_memory_during(fb);
        if (pattern == "full") {
          full_ms[{D, L}] = tb.median_ms;
          if (tb.median_ms / 1e3 > cfg.full_max_s / 4) full_too_slow = true;  // next L is ~4x longer
        }
        auto fit = full_ms.find({D, L});
        const double speedup = fit != full_ms.end() ? fit->second / tb.median_ms : NAN;
        fmt::print("{:<6} {:>4} {:>7} {:>11.2f} {:>13.2f} {:>12.1f} {:>14.0f} {:>11}\n", pattern, D, L, tf.median_ms,
                   tb.median_ms, peak / 1e6, (double)peak / L,
                   std::isnan(speedup) ? std::string("-") : fmt::format("{:.1f}x", speedup));
        std::fflush(stdout);
        report["results"].push_back({{"pattern", pattern},
                                     {"D", D},
                                     {"L", L},
                                     {"fwd_ms", tf.median_ms},
                                     {"fwdbwd_ms", tb.median_ms},
                                     {"fwd_min_ms", tf.min_ms},  // the fastest run: how much noise the median carries
                                     {"fwdbwd_min_ms", tb.min_ms},
                                     {"peak_bytes", peak},
                                     {"peak_bytes_per_token", (double)peak / L},
                                     {"speedup_fwdbwd_vs_full", std::isnan(speedup) ? nlohmann::json() : nlohmann::json(speedup)},
                                     {"runs", tf.runs}});
      }
    }
  }
  return report;
}

}  // namespace hax::bench
