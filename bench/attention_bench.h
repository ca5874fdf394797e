// `hax bench attention`: forward and forward+backward time and peak memory of every sparse
// pattern (pattern building included) beside dense causal attention, single head.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace hax::bench {

struct AttentionBenchConfig {
  std::vector<std::string> patterns = {"sw", "d", "sw+d", "a", "lsh", "ks", "hax", "full"};
  std::vector<int64_t> lengths = {1024, 4096, 16384, 65536};
  std::vector<int64_t> dims = {32, 64};  // head dims (queries, keys and values)
  int64_t keys = 64;                     // k
  int64_t heads = 1;
  int repeats = 5;                       // timed runs (median)
  double budget_s = 30;                  // per measurement
  double full_max_s = 60;                // skip full attention at longer L once one run takes longer
};

nlohmann::json run_attention_bench(const AttentionBenchConfig& cfg);

// Peak resident memory added while fn runs (bytes), measured through /proc/self (VmHWM reset).
int64_t peak_memory_during(const std::function<void()>& fn);

}  // namespace hax::bench
