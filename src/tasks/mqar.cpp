#include "tasks/mqar.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_set>

#include "core/rng.h"

namespace hax {

namespace {

// derive_seed stream of MQAR samples.
constexpr uint64_t kMqarStream = 0x4D51'0001;

// k distinct integers from [lo, hi), in random order; k <= hi - lo.
std::vector<int32_t> distinct(Rng& rng, int64_t lo, int64_t hi, int64_t k) {
  const int64_t range = hi - lo;
  std::vector<int32_t> out;
  out.reserve(k);
  if (2 * k > range) {  // dense: partial Fisher–Yates over the whole range
    std::vector<int32_t> all(range);
    std::iota(all.begin(), all.end(), (int32_t)lo);
    for (int64_t i = 0; i < k; ++i) std::swap(all[i], all[i + rng.below(range - i)]);
    out.assign(all.begin(), all.begin() + k);
    return out;
  }
  std::unordered_set<int32_t> seen;  // sparse: rejection
  seen.reserve(2 * k);
  while ((int64_t)out.size() < k) {
    const auto x = (int32_t)(lo + (int64_t)rng.below(range));
    if (seen.insert(x).second) out.push_back(x);
  }
  return out;
}

}  // namespace

MqarTask::MqarTask(const TaskConfig& config) : config_(config) {
  const int64_t max_space = (config.seq_len - 2 * config.kv_min) / 2;
  scale_.resize(std::max<int64_t>(max_space, 0));
  for (size_t g = 0; g < scale_.size(); ++g) scale_[g] = std::pow((double)(g + 1), 1 - config.power_a);
}

int64_t MqarTask::num_kv_pairs(int64_t index) const {
  const int64_t span = config_.kv_max - config_.kv_min + 1;
  int64_t r = index % span;
  if (r < 0) r += span;
  return config_.kv_min + r;
}

Sample MqarTask::sample(uint64_t seed, int64_t index) const {
  const int64_t kv = num_kv_pairs(index), V = config_.vocab_size, T = config_.seq_len + 1;
  Rng rng(derive_seed(seed, kMqarStream, (uint64_t)index));
  const auto keys = distinct(rng, 1, V / 2, kv);
  const auto values = distinct(rng, V / 2, V, kv);

  // Gaps: Efraimidis–Spirakis with exponential keys, the kv smallest in ascending order.
  const int64_t space = (config_.seq_len - 2 * kv) / 2;
  std::vector<std::pair<double, int32_t>> order(space);
  for (int64_t g = 0; g < space; ++g) order[g] = {-std::log1p(-rng.uniform()) * scale_[g], (int32_t)g};
  std::partial_sort(order.begin(), order.begin() + kv, order.end());

  Sample s;
  s.tokens.resize(T);
  s.mask.assign(T, 0);
  for (int64_t i = 0; i < kv; ++i) {
    s.tokens[2 * i] = keys[i];
    s.tokens[2 * i + 1] = values[i];
  }
  const int64_t q0 = 2 * kv;
  for (int64_t t = q0; t < T; ++t) s.tokens[t] = (int32_t)rng.below((uint64_t)V);
  for (int64_t i = 0; i < kv; ++i) {
    const int64_t pos = q0 + 2 * (int64_t)order[i].second;
    s.tokens[pos] = keys[i];
    s.tokens[pos + 1] = values[i];
    s.mask[pos + 1] = 1;
  }
  s.params = {{"num_kv_pairs", kv}, {"seq_len", config_.seq_len}};
  return s;
}

}  // namespace hax
