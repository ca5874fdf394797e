// `hax bench ssm`: forward and forward+backward throughput of the Mamba and Mamba-2 mixers, and
// of the chunked SSD scan against the naive sequential recurrence.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

namespace hax::bench {

struct SsmBenchConfig {
  std::vector<int64_t> lengths = {1024, 4096, 16384};  // sequence lengths L
  int64_t batch = 1;          // batch size B
  int64_t d_model = 256;      // mixer width (d_inner = 2 * d_model)
  int64_t headdim = 64;       // Mamba-2 head dim P
  int64_t d_state_mamba2 = 64;  // Mamba-2 state size N
  int64_t d_state_mamba = 16;   // Mamba state size N
  int64_t chunk = 64;         // SSD chunk length
  int64_t naive_max_len = 4096;  // longest L at which the naive recurrence is timed
  int repeats = 5;            // timed runs per measurement (median reported)
  double budget_s = 20;       // stop repeating a measurement after this many seconds
};

// Runs the benchmark, printing a table to stdout; returns the JSON report.
nlohmann::json run_ssm_bench(const SsmBenchConfig& cfg);

}  // namespace hax::bench
