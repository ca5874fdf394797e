// Fixed validation and test sets and the training stream of a task, without duplicates across them.
//
// Each split draws from its own derive_seed stream: item i of split s, attempt r, is
// task.sample(derive_seed(seed, s, r), i). Attempt 0 is the plain stream; a sample whose tokens
// equal an earlier one (valid, then test, then the eval sets for training) is redrawn with the next
// attempt at the same index, so it keeps its grid cell (joint recall's (n_c, n_k), MQAR's pair
// count) and every split stays balanced over the grid. Samples are identified by a 128-bit
// fingerprint of their tokens.
#pragma once
#include <cstdint>
#include <unordered_set>
#include <vector>

#include "tasks/task.h"

namespace hax {

// 128-bit fingerprint of a token sequence (two independent 64-bit hashes).
struct TokenHash {
  uint64_t lo = 0, hi = 0;
  bool operator==(const TokenHash& o) const { return lo == o.lo && hi == o.hi; }
};
TokenHash token_hash(const std::vector<int32_t>& tokens);
struct TokenHashHasher {
  size_t operator()(const TokenHash& h) const { return (size_t)h.lo; }
};
using TokenHashSet = std::unordered_set<TokenHash, TokenHashHasher>;

// Most redraws for one sample before a split is declared impossible without duplicates.
constexpr int64_t kMaxRedraws = 1000;

struct EvalSplits {
  std::vector<Sample> valid;  // (n_valid) validation samples, index i in grid cell i
  std::vector<Sample> test;   // (n_test) test samples, index i in grid cell i
};

// The validation and test sets of `task` for `seed`: distinct within and across the two. Throws
// hax::UsageError naming --n-valid/--n-test when the task has too few distinct samples for them.
// First draws of a block of samples are made in parallel (at::parallel_for); redraws, and the check
// against earlier samples, go in order, so the result does not depend on the thread count.
EvalSplits make_eval_splits(const Task& task, uint64_t seed, int64_t n_valid, int64_t n_test);

// The same splits without keeping every sample (long sequences: 14.4K + 14.4K samples of 16K tokens
// are 2.4 GB): the fingerprints of all of them, and only the first keep_valid validation and
// keep_test test samples, equal to make_eval_splits's.
struct EvalFingerprints {
  TokenHashSet hashes;        // (n_valid + n_test) every validation and test sample's fingerprint
  std::vector<Sample> valid;  // (keep_valid) the first validation samples
  std::vector<Sample> test;   // (keep_test) the first test samples
  int64_t n_valid = 0, n_test = 0;
};
EvalFingerprints eval_fingerprints(const Task& task, uint64_t seed, int64_t n_valid, int64_t n_test,
                                   int64_t keep_valid, int64_t keep_test);

// The training samples: a pure function of (seed, index), never equal to a validation or test
// sample. Thread-safe (const). Keeps a reference to `task`, which must outlive it.
class TrainStream {
 public:
  TrainStream(const Task& task, uint64_t seed, const EvalSplits& eval);
  TrainStream(const Task& task, uint64_t seed, const EvalFingerprints& eval);
  // Training sample `index` (>= 0). Throws hax::UsageError when the eval sets leave no training
  // sample in this index's grid cell.
  Sample at(int64_t index) const;
  // Whether `tokens` equal a validation or test sample.
  bool in_eval(const std::vector<int32_t>& tokens) const;

 private:
  const Task& task_;
  uint64_t seed_;
  int64_t n_valid_, n_test_;
  TokenHashSet eval_;
};

}  // namespace hax
