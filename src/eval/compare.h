// hax compare: a set of model variants trained on one long-context task (NIAH or MQAR) under one
// budget, each then evaluated at its training length and at multiples of it (length
// extrapolation), written as a markdown table with the command and budget that produced it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tasks/task_config.h"

namespace hax {

struct CompareConfig {
  // --variants: which models; empty = all of compare_variants(): "full" (Transformer, full causal
  // attention, RoPE), "swa" (sliding window, RoPE), "swa+hsa" (sliding window + HSA), "mamba2",
  // "mamba2+hax", "mamba2+dma", "mamba2+hsa".
  std::vector<std::string> variants;
  TaskConfig task;                     // the task at its training length (task.seq_len)
  uint64_t seed = 1;                   // --seed: model init, data and evaluation samples
  int64_t steps = 1000;                // --steps per run
  int64_t batch_size = 32;             // --batch-size
  double lr = 2e-3;                    // --lr (peak; linear warmup, then constant)
  int64_t warmup_steps = 100;          // --warmup-steps
  int64_t eval_every = 250;            // --eval-every: validation interval (best checkpoint)
  int64_t n_valid = 256, n_test = 256;  // --n-valid, --n-test
  int64_t d_model = 64;                // --d-model of every variant
  int64_t n_layers = 2;                // --n-layers of every variant
  int64_t sparse_keys = 64;            // --sparse-keys: k of HAX and DMA
  int64_t swa_window = 64;             // --swa-window of the Transformer variants
  int64_t hsa_chunk = 64, hsa_topk = 4;  // --hsa-chunk, --hsa-topk
  std::vector<int64_t> factors = {1, 4, 16};  // --factors: evaluation lengths = factor x training length
  std::vector<double> depths;          // --depths: NIAH needle depths averaged per length (empty: random)
  int64_t eval_n = 64;                 // --eval-n: samples per (length, depth)
  std::string runs_dir = "runs/compare";      // one run directory per variant (finished runs reused)
  std::string out_md = "results/compare.md", out_json = "results/compare.json";
  std::string command;                 // written into the table
};

std::vector<std::string> compare_variants();

// Trains (or reuses) every variant, evaluates each best checkpoint at every factor's length, and
// writes and prints the table.
void run_compare(const CompareConfig& cfg);

}  // namespace hax
