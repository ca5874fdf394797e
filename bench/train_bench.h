// `hax bench train`: training steps per second of the paper's joint-recall models (Table 1
// variants, batch 64, the task's full length of 1057 tokens at the paper's n_c, n_k <= 16): a whole
// step (forward, Key Selection ranking loss, backward, gradient clipping, AdamW) on prepared batches.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace hax::bench {

struct TrainBenchConfig {
  std::vector<std::string> variants = {"mamba2+base", "mamba2+hax"};  // Table 1 names
  std::string device = "auto";  // cpu, cuda or auto
  int64_t batch = 64;           // samples per step (paper: 64)
  int64_t steps = 50;           // timed steps
  int64_t warmup = 5;           // untimed steps first
  int64_t sparse_keys = 64;     // k (paper: 64)
  int64_t chunk_size = 64;      // Mamba-2 SSD chunk
  // Model initializations timed per variant and step kind (seeds 1..seeds). A sparse variant's step
  // cost depends on the patterns its activations give (bucket sizes, tile overflow), so one
  // training trajectory is one sample: any change to the numerics moves it (BENCHMARKS.md,
  // eighteenth pass). With several, each run is a row and the JSON's "summary" has their median (the upper
  // one of an even count, as the other benches), min and max.
  int64_t seeds = 1;
  std::string precision = "fp32";  // fp32 or bf16 (autocast)
  // The step as it was before the host-side work (for comparison): the loss, accuracy and
  // gradient norm read back every step, per-tensor AdamW and clipping, device-value argument
  // checks on. Off: the trainer's step (metrics stay on the device, fused optimizer on CUDA).
  bool host_sync = false;
  // Which steps to time: "both" (eager, then replayed from CUDA graphs where they can run),
  // "off" (eager only) or "on" (graphs only).
  std::string graphs = "both";
  // The steps as `hax train --deterministic` runs them: hax's backward kernels in fixed order and
  // LibTorch's deterministic ops (ops::set_deterministic), eager steps only (as the trainer does).
  bool deterministic = false;
  // After timing, count the LibTorch operator calls of two more steps and print the `op_counts`
  // most frequent (0: don't count). The counting slows those steps; they are not timed.
  int op_counts = 0;
};

nlohmann::json run_train_bench(const TrainBenchConfig& cfg);

}  // namespace hax::bench
