// Configuration of a training run (optimizer, schedule, evaluation, run directory).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace hax {

struct TrainConfig {
  std::string run_dir = "runs/default";  // where config.toml, metrics.jsonl and checkpoints go
  uint64_t seed = 1;            // seeds model init, data streams and splits
  int threads = 0;              // CPU threads; 0 = all cores
  std::string device = "cpu";   // "cpu", "cuda" (or "cuda:N") or "auto" (cuda when available)
  std::string precision = "fp32";  // "fp32", or "bf16": autocast on CUDA (float32 weights and optimizer state)
  bool deterministic = false;   // CUDA backward passes sum in a fixed order (bit-identical reruns; a little slower)
  // CUDA: replay each step from a captured CUDA graph (fixed-shape padded batches; train/step_graph.h).
  // "auto" = where it can run (fused optimizer, not deterministic) and is faster than eager steps
  // (timed at the start), "on" = required, "off" = eager.
  std::string cuda_graphs = "auto";
  int64_t steps = 400000;       // optimizer steps (paper: 400K)
  int64_t batch_size = 64;      // samples per step (paper: 64)
  double lr = 2e-3;             // peak learning rate (paper grid 1e-3..3e-3)
  double min_lr = 0.0;          // cosine schedule floor
  std::string schedule = "constant";  // after warmup: "constant" (the reference) or "cosine"
  int64_t warmup_steps = 5000;  // linear warmup from 0 (paper: 5000)
  double weight_decay = 0.01;   // AdamW decoupled weight decay, applied to every parameter as in the reference
  double beta1 = 0.9;           // AdamW betas and epsilon
  double beta2 = 0.999;
  double adam_eps = 1e-8;
  double grad_clip = 1.0;       // clip the global gradient norm to this; 0 disables
  double ranking_alpha = 0.1;   // weight α of the summed Key Selection ranking losses (reference: 0.1)
  // Window warm-up (HSA seed): the sliding-window attention layers train with a window of
  // swa_warmup_window keys for the first swa_warmup_steps steps, then with the model's
  // --swa-window, so that a small window makes the model learn to retrieve first. 0 = off.
  int64_t swa_warmup_window = 0;
  int64_t swa_warmup_steps = 0;
  bool pack = true;             // pack variable-length samples into rows (state resets between them)
  int64_t pack_len = 0;         // packed row length in tokens; 0 = the task's max sample length
  int64_t log_every = 50;       // steps between training-metric lines
  int64_t eval_every = 500;     // steps between validations (best checkpoint by validation accuracy)
  int64_t save_every = 500;     // steps between "last" checkpoints (also written at every validation)
  int64_t n_valid = 14400;      // validation samples (paper: 14.4K)
  int64_t n_test = 14400;       // test samples (paper: 14.4K)
  int64_t eval_batch_size = 128;  // samples per evaluation batch
  bool resume = false;          // continue the run in run_dir from its last checkpoint
  bool overwrite = false;       // start afresh even if run_dir already holds a run (replacing it)
  bool progress = true;         // show a progress bar (on a terminal) or periodic lines

  void validate() const;
  nlohmann::ordered_json to_json() const;  // fields in declaration order
};

}  // namespace hax
