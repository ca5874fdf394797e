// `hax bench attention --device cuda` and `hax bench ssm --device cuda`: GPU forward and
// forward+backward times (CUDA events, warm-up, median of many runs) and peak GPU memory, with
// LibTorch's dense causal scaled-dot-product attention (SDPA) timed in the same run.
//
// A timed run is `calls` back-to-back calls between two events (their mean), so that the host
// enqueues the next call while the GPU runs the last one, as a training loop does; the one-call
// latency (host overhead included) is reported beside it. A call that takes longer than alone_ms
// (one untimed probe) is timed alone: at the SSD's 64K (2.1 ms) both ways agree within noise
// (2.07-2.13 ms back-to-back against 2.12-2.13 alone, H200, 2026-11-29). forward+backward
// applies a fixed random cotangent to the op's output (as FlashAttention's benchmarks do), so
// that no loss reduction or expanded-gradient copy is timed with the op.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace hax::bench {

struct GpuAttentionBenchConfig {
  // Patterns of hax (pattern building included) plus "full" (hax's causal kernel) and "sdpa"
  // (LibTorch's dense causal SDPA, the baseline).
  std::vector<std::string> patterns = {"sdpa", "full", "sw", "d", "sw+d", "a", "lsh", "ks", "hax", "dma", "hsa"};
  std::vector<int64_t> lengths = {4096, 16384, 65536, 262144};
  int64_t dim = 64;          // head dim D (queries, keys, values)
  int64_t heads = 16;        // H
  int64_t batch = 1;         // B
  int64_t keys = 64;         // k per query
  std::string dtype = "bf16";  // "bf16" or "fp32"
  int warmup = 3;            // untimed runs first
  int repeats = 20;          // timed runs (median)
  int calls = 4;             // back-to-back calls per timed run
  double alone_ms = 2.0;     // a call longer than this (one untimed probe) is timed alone, calls = 1
  double dense_max_ms = 2000;  // skip dense attention (sdpa, full) at longer L once fwd+bwd took this long
};

struct GpuSsmBenchConfig {
  std::vector<int64_t> lengths = {4096, 16384, 65536, 262144};
  int64_t batch = 1, heads = 16, headdim = 64, d_state = 128, groups = 1, chunk = 64;
  std::string dtype = "bf16";
  int warmup = 3, repeats = 20;
  int calls = 4;         // back-to-back calls per timed run
  double alone_ms = 2.0;  // a call longer than this (one untimed probe) is timed alone, calls = 1
};

nlohmann::json run_attention_bench_cuda(const GpuAttentionBenchConfig& cfg);
nlohmann::json run_ssm_bench_cuda(const GpuSsmBenchConfig& cfg);

}  // namespace hax::bench
