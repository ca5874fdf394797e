// Timing helpers for `hax bench`: median wall time of repeated runs after warm-up.
#pragma once
#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace hax::bench {

// Median (the upper one of an even count), minimum and maximum of some values.
struct Spread {
  double median = 0, min = 0, max = 0;
};
inline Spread spread_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

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
  const Spread t = spread_of(ms);
  return {t.median, t.min, (int)ms.size()};
}

}  // namespace hax::bench
