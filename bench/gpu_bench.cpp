#include "bench/gpu_bench.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "bench/timing.h"
#include "core/cuda_util.h"
#include "core/error.h"
#include "layers/sparse_branch.h"
#include "ops/ssd/ssd.h"

namespace hax::bench {
namespace {

struct GpuTiming {
  double median_ms = 0, min_ms = 0;  // per call, `calls` back-to-back calls per timed run
  double call_ms = 0;                // median of single calls (host overhead included)
  int runs = 0;
  int calls = 1;                     // back-to-back calls per timed run (1 for calls over 2 ms)
};

// Median and minimum over `repeats` timed runs of `calls` back-to-back calls each (per call),
// after `warmup` untimed calls; then the median of `repeats` single calls. A call of more than
// 2 ms is timed alone (host overhead is then negligible, and dense attention at long L is slow).
GpuTiming time_gpu(const std::function<void()>& fn, int warmup, int repeats, int calls, double alone_ms) {
  for (int i = 0; i < warmup; ++i) fn();
  cuda_synchronize();
  if (cuda_elapsed_ms(fn, 1) > alone_ms) calls = 1;
  auto median_of = [&](int n, double* min_out) {
    std::vector<double> ms;
    for (int i = 0; i < repeats; ++i) ms.push_back(cuda_elapsed_ms(fn, n));
    const Spread t = spread_of(ms);
    if (min_out) *min_out = t.min;
    return t.median;
  };
  GpuTiming t;
  t.median_ms = median_of(calls, &t.min_ms);
  t.call_ms = calls == 1 ? t.median_ms : median_of(1, nullptr);
  t.runs = repeats;
  t.calls = calls;
  return t;
}

// Peak GPU memory that one run of fn allocates beyond what was allocated before it.
int64_t gpu_peak_during(const std::function<void()>& fn) {
  cuda_synchronize();
  const int64_t before = cuda_allocated_bytes();
  cuda_reset_peak_memory();
  fn();
  cuda_synchronize();
  return cuda_peak_memory_bytes() - before;
}

at::ScalarType parse_dtype(const std::string& s) {
  HAX_CHECK(s == "bf16" || s == "fp32", "--dtype {} is unknown; choose bf16 or fp32", s);
  return s == "bf16" ? at::kBFloat16 : at::kFloat;
}

// LibTorch's dense causal SDPA on (B, L, H, D) tensors (it wants (B, H, L, D)).
at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), {}, 0.0, true)
      .transpose(1, 2);
#else
  fail("sdpa: LibTorch {}.{} has no scaled_dot_product_attention (it needs 2.0 or later)", TORCH_VERSION_MAJOR,
       TORCH_VERSION_MINOR);
#endif
}

}  // namespace

nlohmann::json run_attention_bench_cuda(const GpuAttentionBenchConfig& cfg) {
  const at::ScalarType dt = parse_dtype(cfg.dtype);
  const at::Device dev(at::kCUDA, 0);
  const int64_t B = cfg.batch, H = cfg.heads, D = cfg.dim;
  nlohmann::json report;
  report["device"] = cuda_device_name();
  report["config"] = {{"keys", cfg.keys}, {"heads", H}, {"dim", D}, {"batch", B}, {"dtype", cfg.dtype},
                      {"warmup", cfg.warmup}, {"repeats", cfg.repeats}, {"calls", cfg.calls}, {"alone_ms", cfg.alone_ms},
                      {"timer", "CUDA events, median over repeats of the mean of `calls` back-to-back calls"},
                      {"backward", "a fixed random cotangent of the output"}};
  fmt::print("hax bench attention: {}, batch {}, {} heads, head dim {}, k = {}, {}; median of {} runs of {} "
             "back-to-back calls (CUDA events; '1 call': one call alone, host overhead included); backward of a "
             "random cotangent; sparse times include building the pattern\n",
             cuda_device_name(), B, H, D, cfg.keys, cfg.dtype, cfg.repeats, cfg.calls);
  fmt::print("{:<6} {:>7} {:>10} {:>12} {:>12} {:>10} {:>12} {:>11}\n", "pattern", "L", "fwd ms", "fwd+bwd ms",
             "1 call ms", "peak MB", "bytes/token", "x vs sdpa");
  bool dense_too_slow = false;
  for (int64_t L : cfg.lengths) {
    torch::manual_seed(0);
    const auto o = at::TensorOptions().device(dev).dtype(dt);
    at::Tensor q0 = at::randn({B, L, H, D}, o), k0 = at::randn({B, L, H, D}, o) / std::sqrt((double)D);
    at::Tensor v0 = at::randn({B, L, H, D}, o), x0 = at::randn({B, L, D}, o);
    double sdpa_ms = NAN;
    bool dense_slow_now = false;
    for (const auto& pattern : cfg.patterns) {
      const bool dense = pattern == "sdpa" || pattern == "full";
      if (dense && dense_too_slow) continue;
      std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)> fwd;
      std::shared_ptr<SparseAttentionBranch> branch;
      ForwardContext ctx;
      if (pattern == "sdpa") {
        fwd = sdpa;
      } else {
        ModelConfig mc;
        mc.d_model = D, mc.d_state = D, mc.sparse = pattern, mc.sparse_keys = cfg.keys, mc.attn_heads = H;
        mc.qk_dim = D;
        mc.dilated_span = std::max<int64_t>(2048, L);
        mc.hsa_chunk = 64, mc.hsa_topk = std::max<int64_t>(1, cfg.keys / 64);
        torch::manual_seed(1);
        branch = std::make_shared<SparseAttentionBranch>(mc, D, D * H, 0);
        branch->to(dev, dt);
        fwd = [&, branch](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
          return branch->attend(x0, q, k, v, {}, &ctx, nullptr);
        };
      }
      GpuTiming tf = time_gpu([&] {
        torch::NoGradGuard ng;
        fwd(q0, k0, v0);
      }, cfg.warmup, cfg.repeats, cfg.calls, cfg.alone_ms);
      at::Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
      at::Tensor dout;  // the output's cotangent (random, fixed)
      {
        torch::NoGradGuard ng;
        dout = at::randn_like(fwd(q0, k0, v0));
      }
      auto fb = [&] {
        fwd(q, k, v).backward(dout);
        q.mutable_grad() = at::Tensor(), k.mutable_grad() = at::Tensor(), v.mutable_grad() = at::Tensor();
        if (branch) branch->zero_grad();
      };
      GpuTiming tb = time_gpu(fb, cfg.warmup, cfg.repeats, cfg.calls, cfg.alone_ms);
      const int64_t peak = gpu_peak_during(fb);
      if (pattern == "sdpa") sdpa_ms = tb.median_ms;
      if (dense && tb.median_ms > cfg.dense_max_ms / 16) dense_slow_now = true;  // the next L is 4x: 16x the work
      const double speedup = std::isnan(sdpa_ms) ? NAN : sdpa_ms / tb.median_ms;
      fmt::print("{:<6} {:>7} {:>10.3f} {:>12.3f} {:>12.3f} {:>10.1f} {:>12.0f} {:>11}\n", pattern, L, tf.median_ms,
                 tb.median_ms, tb.call_ms, peak / 1e6, (double)peak / L,
                 std::isnan(speedup) ? std::string("-") : fmt::format("{:.1f}x", speedup));
      std::fflush(stdout);
      report["results"].push_back({{"pattern", pattern},
                                   {"L", L},
                                   {"fwd_ms", tf.median_ms},
                                   {"fwdbwd_ms", tb.median_ms},
                                   {"fwd_min_ms", tf.min_ms},
                                   {"fwdbwd_min_ms", tb.min_ms},
                                   {"fwd_call_ms", tf.call_ms},
                                   {"fwdbwd_call_ms", tb.call_ms},
                                   {"fwd_calls", tf.calls},
                                   {"fwdbwd_calls", tb.calls},
                                   {"peak_bytes", peak},
                                   {"peak_bytes_per_token", (double)peak / L},
                                   {"speedup_fwdbwd_vs_sdpa", std::isnan(speedup) ? nlohmann::json() : nlohmann::json(speedup)},
                                   {"runs", tb.runs}});
    }
    dense_too_slow = dense_too_slow || dense_slow_now;
  }
  return report;
}

nlohmann::json run_ssm_bench_cuda(const GpuSsmBenchConfig& cfg) {
  const at::ScalarType dt = parse_dtype(cfg.dtype);
  const at::Device dev(at::kCUDA, 0);
  const int64_t B = cfg.batch, H = cfg.heads, P = cfg.headdim, N = cfg.d_state, G = cfg.groups;
  HAX_CHECK(G > 0 && H % G == 0, "--groups {} must divide --heads {}", G, H);
  nlohmann::json report;
  report["device"] = cuda_device_name();
  report["config"] = {{"batch", B}, {"heads", H}, {"headdim", P}, {"d_state", N}, {"groups", G}, {"chunk", cfg.chunk},
                      {"dtype", cfg.dtype}, {"warmup", cfg.warmup}, {"repeats", cfg.repeats},
                      {"calls", cfg.calls}, {"alone_ms", cfg.alone_ms},
                      {"timer", "CUDA events, median over repeats of the mean of `calls` back-to-back calls"},
                      {"backward", "a fixed random cotangent of y"}};
  fmt::print("hax bench ssm: {}, Mamba-2 SSD scan, batch {}, {} heads x {}, d_state {}, {} group(s), chunk {}, {}; "
             "median of {} runs of {} back-to-back calls; backward of a random cotangent\n",
             cuda_device_name(), B, H, P, N, G, cfg.chunk, cfg.dtype, cfg.repeats, cfg.calls);
  fmt::print("{:<10} {:>7} {:>10} {:>12} {:>12} {:>10} {:>12}\n", "op", "L", "fwd ms", "fwd+bwd ms", "1 call ms",
             "peak MB", "bytes/token");
  for (int64_t L : cfg.lengths) {
    torch::manual_seed(0);
    const auto o = at::TensorOptions().device(dev).dtype(dt);
    at::Tensor x = at::randn({B, L, H, P}, o);
    at::Tensor dtv = at::softplus(at::randn({B, L, H}, o) - 3);
    at::Tensor A = -at::exp(at::randn({H}, o) * 0.5);
    at::Tensor Bm = at::randn({B, L, G, N}, o) / std::sqrt((double)N), Cm = at::randn({B, L, G, N}, o);
    GpuTiming tf = time_gpu([&] {
      torch::NoGradGuard ng;
      ops::ssd(x, dtv, A, Bm, Cm, {}, {}, cfg.chunk);
    }, cfg.warmup, cfg.repeats, cfg.calls, cfg.alone_ms);
    std::vector<at::Tensor> leaves;
    for (const at::Tensor& t : {x, dtv, A, Bm, Cm}) leaves.push_back(t.clone().requires_grad_());
    const at::Tensor dy = at::randn_like(x);  // y's cotangent (random, fixed); y has x's shape
    auto fb = [&] {
      auto [y, fin] = ops::ssd(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], {}, {}, cfg.chunk);
      y.backward(dy);
      for (auto& t : leaves) t.mutable_grad() = at::Tensor();
    };
    GpuTiming tb = time_gpu(fb, cfg.warmup, cfg.repeats, cfg.calls, cfg.alone_ms);
    const int64_t peak = gpu_peak_during(fb);
    fmt::print("{:<10} {:>7} {:>10.3f} {:>12.3f} {:>12.3f} {:>10.1f} {:>12.0f}\n", "ssd", L, tf.median_ms,
               tb.median_ms, tb.call_ms, peak / 1e6, (double)peak / L);
    std::fflush(stdout);
    report["results"].push_back({{"op", "ssd"},
                                 {"L", L},
                                 {"fwd_ms", tf.median_ms},
                                 {"fwdbwd_ms", tb.median_ms},
                                 {"fwd_min_ms", tf.min_ms},
                                 {"fwdbwd_min_ms", tb.min_ms},
                                 {"fwd_call_ms", tf.call_ms},
                                 {"fwdbwd_call_ms", tb.call_ms},
                                 {"fwd_calls", tf.calls},
                                 {"fwdbwd_calls", tb.calls},
                                 {"peak_bytes", peak},
                                 {"peak_bytes_per_token", (double)peak / L},
                                 {"runs", tb.runs}});
  }
  return report;
}

}  // namespace hax::bench
