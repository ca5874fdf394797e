// Timing helpers for `hax bench`: median wall time of repeated runs after warm-up.
#pragma once
#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace hax::bench {

struct Timing {
  double median_ms = 0, min_ms = 0;
  int runs = 0;
};

// Runs fn `warmup` times untimed, then until `repeats` runs or `budget_s` seconds have passed
// (at least one run); returns the median and minimum.
inline Timing time_it(const std::function<void()>& fn, int warmup, int repeats, double budget_s) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  const auto start = std::chrono::steady_clock::now();
  while ((int)ms.size() < repeats) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    if (std::chrono::duration<double>(t1 - start).count() > budget_s) break;
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), (int)ms.size()};
}

}  // namespace hax::bench
