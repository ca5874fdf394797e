// The HAX paper's Table 1 grid: every sparse variant on the Mamba and Mamba-2 bases, the
// double-width bases and Samba, trained on multi-query joint recall under one budget, with the
// test accuracy written beside the paper's numbers.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/model_config.h"
#include "tasks/task_config.h"

namespace hax {

struct Table1Config {
  std::vector<std::string> variants;  // e.g. "mamba2+hax", "mamba+dim", "samba"; empty = the whole grid
  std::vector<uint64_t> seeds = {1};  // one run per seed; the table shows the mean (and range)
  int64_t steps = 2000;               // optimizer steps per run
  int64_t batch_size = 32;            // samples per step
  double lr = 2e-3;                   // peak learning rate
  int64_t warmup_steps = 100;         // linear warmup
  int64_t eval_every = 500;           // validation interval (best checkpoint)
  int64_t n_valid = 512, n_test = 1024;
  int64_t sparse_keys = 64;           // k of every sparse variant (paper: 64)
  int64_t chunk_size = 64;            // Mamba-2 SSD chunk (speed only)
  TaskConfig task;                    // the joint recall instance
  std::string runs_dir = "runs/table1";  // one run directory per variant and seed (reused if finished)
  std::string out_md = "results/table1.md", out_json = "results/table1.json";
  std::string command;                // the command line that produced the table (written into it)
  int threads = 0;
};

// The paper's model of a Table 1 variant ("mamba2+hax", "mamba+base", "samba", ...) with cfg's
// sparse_keys and chunk_size.
ModelConfig table1_model(const std::string& variant, const Table1Config& cfg);

// The names of the whole grid, in the table's order.
std::vector<std::string> table1_variants();

// Trains every variant x seed (skipping runs whose summary.json already exists), then writes the
// markdown table and JSON and prints the table.
void run_table1(const Table1Config& cfg);

}  // namespace hax
