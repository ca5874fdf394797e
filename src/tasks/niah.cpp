#include "tasks/niah.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <unordered_set>

#include "core/error.h"
#include "core/rng.h"
#include "tasks/joint_recall.h"

namespace hax {

namespace {

// derive_seed stream of NIAH samples.
constexpr uint64_t kNiahStream = 0x4E49'0001;

// k distinct integers from [0, n), ascending (Floyd's algorithm: k draws, whatever n is).
std::vector<int64_t> sorted_distinct(Rng& rng, int64_t n, int64_t k) {
  std::unordered_set<int64_t> chosen;
  chosen.reserve(2 * k);
  std::vector<int64_t> out;
  out.reserve(k);
  for (int64_t j = n - k; j < n; ++j) {
    const int64_t t = (int64_t)rng.below((uint64_t)j + 1);
    const int64_t pick = chosen.count(t) ? j : t;
    chosen.insert(pick);
    out.push_back(pick);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Start positions of k needles of `len` tokens placed uniformly at random in the `capacity` tokens
// from position `first` on (k * len <= capacity): every arrangement of the needles among the
// capacity - k * len filler tokens is equally likely. Ascending.
std::vector<int64_t> random_starts(Rng& rng, int64_t first, int64_t capacity, int64_t k, int64_t len) {
  const int64_t filler = capacity - k * len;
  std::vector<int64_t> slots = sorted_distinct(rng, filler + k, k);  // item slots among filler + k items
  for (int64_t i = 0; i < k; ++i) slots[i] = first + slots[i] + i * (len - 1);
  return slots;
}

}  // namespace

NiahShape niah_shape(const TaskConfig& c) {
  NiahShape s;
  s.needle_len = c.niah_key_len + c.niah_value_len + 2;
  const int64_t answer = c.niah_key_len + 2 + c.niah_value_len;  // [Q, key, V, passkey]
  if (c.niah_variant == "single") {
    s.needles = s.targets = 1;
    s.query_len = answer;
  } else if (c.niah_variant == "multikey") {
    s.needles = c.niah_needles;
    s.targets = 1;
    s.query_len = answer;
  } else if (c.niah_variant == "multivalue") {
    s.needles = s.targets = c.niah_values;
    s.query_len = c.niah_key_len + 2 + c.niah_values * c.niah_value_len;
  } else {  // multiquery
    s.needles = s.targets = c.niah_needles;
    s.query_len = c.niah_needles * answer;
  }
  s.min_filler = s.needles > s.targets ? s.needle_len - 1 : 0;
  return s;
}

NiahTask::NiahTask(const TaskConfig& config) : config_(config), shape_(niah_shape(config)) {}

int64_t NiahTask::min_vocab() const { return first_filler_id() + config_.niah_vocab; }

Sample NiahTask::sample(uint64_t seed, int64_t index) const {
  const TaskConfig& c = config_;
  const int64_t T = c.seq_len + 1, R = haystack_len(), Ln = shape_.needle_len, m = shape_.needles;
  const int64_t K = c.niah_key_len, P = c.niah_value_len;
  const bool multivalue = c.niah_variant == "multivalue";
  Rng rng(derive_seed(seed, kNiahStream, (uint64_t)index));

  // Keys (one for multivalue, else m distinct ones) and one passkey per needle.
  std::vector<std::vector<int32_t>> keys;
  std::set<std::vector<int32_t>> seen;
  while ((int64_t)keys.size() < (multivalue ? 1 : m)) {
    std::vector<int32_t> key(K);
    for (auto& t : key) t = (int32_t)(kNiahFirstKeyId + rng.below((uint64_t)c.niah_key_vocab));
    if (seen.insert(key).second) keys.push_back(std::move(key));
  }
  std::vector<std::vector<int32_t>> values(m, std::vector<int32_t>(P));
  for (auto& v : values)
    for (auto& t : v) t = (int32_t)(kNiahFirstDigitId + rng.below(kNiahDigits));
  auto key_of = [&](int64_t needle) -> const std::vector<int32_t>& { return keys[multivalue ? 0 : needle]; };

  // Needles 0..targets-1 are the targets (in query order), the rest distractors. start[i] is the
  // position of needle i's N marker.
  const int64_t targets = shape_.targets;
  std::vector<int64_t> start(m);
  const bool fixed = c.niah_depth >= 0;
  if (fixed) {
    const int64_t B = targets * Ln;
    const int64_t s = 1 + std::llround(c.niah_depth * (double)(R - B));
    // multiquery: the block's order is independent of the query order; multivalue: passkey order.
    std::vector<int> slot = multivalue ? std::vector<int>() : rng.permutation((int)targets);
    for (int64_t i = 0; i < targets; ++i) start[i] = s + (multivalue ? i : slot[i]) * Ln;
    // Distractors: each goes before the block with probability (room before) / (room in all),
    // clamped so that both sides hold theirs (min_filler = Ln - 1 guarantees a valid split).
    const int64_t D = m - targets, before = s - 1, after = R - B - before;
    int64_t d_before = 0;
    for (int64_t i = 0; i < D; ++i) d_before += (int64_t)rng.below((uint64_t)(before + after)) < before;
    d_before = std::clamp(d_before, std::max<int64_t>(0, D - after / Ln), std::min(D, before / Ln));
    const auto lo = random_starts(rng, 1, before, d_before, Ln);
    const auto hi = random_starts(rng, s + B, after, D - d_before, Ln);
    std::copy(lo.begin(), lo.end(), start.begin() + targets);
    std::copy(hi.begin(), hi.end(), start.begin() + targets + d_before);
  } else {
    // Every arrangement equally likely: random places, then a random assignment of needles to them.
    const auto places = random_starts(rng, 1, R, m, Ln);
    std::vector<int> who = rng.permutation((int)m);
    for (int64_t i = 0; i < m; ++i) start[who[i]] = places[i];
  }

  Sample s;
  s.tokens.resize(T);
  s.mask.assign(T, 0);
  s.tokens[0] = kBosId;
  const int32_t filler0 = first_filler_id();
  for (int64_t t = 1; t <= R; ++t) s.tokens[t] = (int32_t)(filler0 + rng.below((uint64_t)c.niah_vocab));
  for (int64_t i = 0; i < m; ++i) {
    int64_t t = start[i];
    s.tokens[t++] = kNiahNeedleId;
    for (int32_t k : key_of(i)) s.tokens[t++] = k;
    s.tokens[t++] = kNiahValueId;
    for (int32_t v : values[i]) s.tokens[t++] = v;
  }

  // Haystack order of the needles; multivalue answers its passkeys in that order.
  std::vector<int64_t> order(m);
  for (int64_t i = 0; i < m; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return start[a] < start[b]; });
  std::vector<int64_t> rank(m);
  for (int64_t r = 0; r < m; ++r) rank[order[r]] = r;

  // Query section.
  int64_t t = 1 + R;
  auto put = [&](int32_t tok, bool target) {
    s.tokens[t] = tok;
    s.mask[t++] = target ? 1 : 0;
  };
  std::vector<int64_t> queried;  // needle indices in query order
  if (multivalue) {
    put(kNiahQueryId, false);
    for (int32_t k : keys[0]) put(k, false);
    put(kNiahValueId, false);
    for (int64_t r = 0; r < m; ++r) {
      queried.push_back(order[r]);
      for (int32_t v : values[order[r]]) put(v, true);
    }
  } else {
    for (int64_t i = 0; i < targets; ++i) {
      queried.push_back(i);
      put(kNiahQueryId, false);
      for (int32_t k : keys[i]) put(k, false);
      put(kNiahValueId, false);
      for (int32_t v : values[i]) put(v, true);
    }
  }
  HAX_CHECK(t == T, "internal: NIAH sample has {} tokens, expected {}", t, T);

  std::vector<int64_t> positions(m), queried_rank;
  for (int64_t r = 0; r < m; ++r) positions[r] = start[order[r]];
  for (int64_t i : queried) queried_rank.push_back(rank[i]);
  const double depth = fixed ? c.niah_depth
                             : (R > Ln ? (double)(start[queried[0]] - 1) / (double)(R - Ln) : 0.0);
  s.params = {{"variant", c.niah_variant},
              {"seq_len", c.seq_len},
              {"depth", depth},
              {"needle_positions", positions},
              {"queried", queried_rank}};
  return s;
}

}  // namespace hax
