#include "tasks/splits.h"

#include "core/error.h"
#include "core/rng.h"

namespace hax {

namespace {

// derive_seed streams of the splits (distinct from the tasks' own streams).
constexpr uint64_t kValidStream = 0x5350'0001;
constexpr uint64_t kTestStream = 0x5350'0002;
constexpr uint64_t kTrainStream = 0x5350'0003;

// Draws split item `index`, redrawing until its tokens are new to `seen` (then adds them).
Sample draw_distinct(const Task& task, uint64_t seed, uint64_t stream, int64_t index,
                     TokenHashSet& seen, const char* split, int64_t n_valid, int64_t n_test) {
  for (int64_t attempt = 0; attempt < kMaxRedraws; ++attempt) {
    Sample s = task.sample(derive_seed(seed, stream, (uint64_t)attempt), index);
    if (seen.insert(token_hash(s.tokens)).second) return s;
  }
  fail("--n-valid {} and --n-test {} need that many distinct samples, but task {} has too few: "
       "{} sample {} ({}) still repeated an earlier one after {} redraws; lower --n-valid/--n-test",
       n_valid, n_test, task.name(), split, index,
       task.sample(derive_seed(seed, stream, 0), index).params.dump(), kMaxRedraws);
}

}  // namespace

TokenHash token_hash(const std::vector<int32_t>& tokens) {
  uint64_t a = 0x243F6A8885A308D3ull ^ tokens.size(), b = 0x13198A2E03707344ull + tokens.size();
  for (int32_t t : tokens) {
    const uint64_t x = (uint32_t)t;
    a = (a ^ x) * 0x100000001B3ull;  // FNV-1a style
    a ^= a >> 29;
    b = (b + x) * 0x9E3779B97F4A7C15ull;
    b ^= b >> 32;
  }
  return {splitmix64(a), splitmix64(b)};
}

EvalSplits make_eval_splits(const Task& task, uint64_t seed, int64_t n_valid, int64_t n_test) {
  HAX_CHECK(n_valid >= 0, "--n-valid {} must be >= 0", n_valid);
  HAX_CHECK(n_test >= 0, "--n-test {} must be >= 0", n_test);
  EvalSplits out;
  TokenHashSet seen;
  seen.reserve(n_valid + n_test);
  out.valid.reserve(n_valid);
  out.test.reserve(n_test);
  for (int64_t i = 0; i < n_valid; ++i)
    out.valid.push_back(draw_distinct(task, seed, kValidStream, i, seen, "validation", n_valid, n_test));
  for (int64_t i = 0; i < n_test; ++i)
    out.test.push_back(draw_distinct(task, seed, kTestStream, i, seen, "test", n_valid, n_test));
  return out;
}

TrainStream::TrainStream(const Task& task, uint64_t seed, const EvalSplits& eval)
    : task_(task), seed_(seed), n_valid_((int64_t)eval.valid.size()), n_test_((int64_t)eval.test.size()) {
  eval_.reserve(eval.valid.size() + eval.test.size());
  for (const auto& s : eval.valid) eval_.insert(token_hash(s.tokens));
  for (const auto& s : eval.test) eval_.insert(token_hash(s.tokens));
}

bool TrainStream::in_eval(const std::vector<int32_t>& tokens) const {
  return eval_.count(token_hash(tokens)) > 0;
}

Sample TrainStream::at(int64_t index) const {
  for (int64_t attempt = 0; attempt < kMaxRedraws; ++attempt) {
    Sample s = task_.sample(derive_seed(seed_, kTrainStream, (uint64_t)attempt), index);
    if (!in_eval(s.tokens)) return s;
  }
  fail("--n-valid {} and --n-test {} leave no training samples: training sample {} of task {} "
       "equalled a validation or test sample in all {} redraws; lower --n-valid/--n-test",
       n_valid_, n_test_, index, task_.name(), kMaxRedraws);
}

}  // namespace hax
