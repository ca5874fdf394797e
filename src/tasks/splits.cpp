#include "tasks/splits.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "core/error.h"
#include "core/rng.h"

namespace hax {

namespace {

// derive_seed streams of the splits (distinct from the tasks' own streams).
constexpr uint64_t kValidStream = 0x5350'0001;
constexpr uint64_t kTestStream = 0x5350'0002;
constexpr uint64_t kTrainStream = 0x5350'0003;

// Tokens of first draws held at once by draw_split (a block of samples is drawn in parallel).
constexpr int64_t kBlockTokens = 1 << 24;

// Draws split item `index` from attempt `first` on, redrawing until its tokens are new to `seen`
// (then adds them).
Sample draw_distinct(const Task& task, uint64_t seed, uint64_t stream, int64_t index,
                     TokenHashSet& seen, const char* split, int64_t n_valid, int64_t n_test,
                     int64_t first = 0) {
  for (int64_t attempt = first; attempt < kMaxRedraws; ++attempt) {
    Sample s = task.sample(derive_seed(seed, stream, (uint64_t)attempt), index);
    if (seen.insert(token_hash(s.tokens)).second) return s;
  }
  fail("--n-valid {} and --n-test {} need that many distinct samples, but task {} has too few: "
       "{} sample {} ({}) still repeated an earlier one after {} redraws; lower --n-valid/--n-test",
       n_valid, n_test, task.name(), split, index,
       task.sample(derive_seed(seed, stream, 0), index).params.dump(), kMaxRedraws);
}

// Items 0..n-1 of split `stream`, each distinct from `seen` and added to it, in order; keep(i, sample)
// receives item i when i < keep_first (the others only leave their fingerprint). The first draws of
// a block are made in parallel; the result equals drawing one item at a time.
template <class Keep>
void draw_split(const Task& task, uint64_t seed, uint64_t stream, int64_t n, TokenHashSet& seen,
                const char* split, int64_t n_valid, int64_t n_test, int64_t keep_first, Keep&& keep) {
  const int64_t block = std::clamp<int64_t>(kBlockTokens / std::max<int64_t>(task.max_length(), 1), 1, 1024);
  std::vector<Sample> drawn;
  std::vector<TokenHash> hashes;
  const uint64_t first_seed = derive_seed(seed, stream, 0);
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t m = std::min(block, n - b0);
    drawn.assign(m, Sample{});
    hashes.assign(m, TokenHash{});
    at::parallel_for(0, m, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t j = lo; j < hi; ++j) {
        drawn[j] = task.sample(first_seed, b0 + j);
        hashes[j] = token_hash(drawn[j].tokens);
        if (b0 + j >= keep_first) drawn[j] = Sample{};  // only its fingerprint is needed
      }
    });
    for (int64_t j = 0; j < m; ++j) {
      const int64_t i = b0 + j;
      if (seen.insert(hashes[j]).second) {
        if (i < keep_first) keep(std::move(drawn[j]));
      } else {
        Sample s = draw_distinct(task, seed, stream, i, seen, split, n_valid, n_test, 1);
        if (i < keep_first) keep(std::move(s));
      }
    }
  }
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

EvalFingerprints eval_fingerprints(const Task& task, uint64_t seed, int64_t n_valid, int64_t n_test,
                                   int64_t keep_valid, int64_t keep_test) {
  HAX_CHECK(n_valid >= 0, "--n-valid {} must be >= 0", n_valid);
  HAX_CHECK(n_test >= 0, "--n-test {} must be >= 0", n_test);
  EvalFingerprints out;
  out.n_valid = n_valid;
  out.n_test = n_test;
  keep_valid = std::clamp<int64_t>(keep_valid, 0, n_valid);
  keep_test = std::clamp<int64_t>(keep_test, 0, n_test);
  out.hashes.reserve(n_valid + n_test);
  out.valid.reserve(keep_valid);
  out.test.reserve(keep_test);
  draw_split(task, seed, kValidStream, n_valid, out.hashes, "validation", n_valid, n_test, keep_valid,
             [&](Sample&& s) { out.valid.push_back(std::move(s)); });
  draw_split(task, seed, kTestStream, n_test, out.hashes, "test", n_valid, n_test, keep_test,
             [&](Sample&& s) { out.test.push_back(std::move(s)); });
  return out;
}

EvalSplits make_eval_splits(const Task& task, uint64_t seed, int64_t n_valid, int64_t n_test) {
  EvalFingerprints f = eval_fingerprints(task, seed, n_valid, n_test, n_valid, n_test);
  return {std::move(f.valid), std::move(f.test)};
}

TrainStream::TrainStream(const Task& task, uint64_t seed, const EvalSplits& eval)
    : task_(task), seed_(seed), n_valid_((int64_t)eval.valid.size()), n_test_((int64_t)eval.test.size()) {
  eval_.reserve(eval.valid.size() + eval.test.size());
  for (const auto& s : eval.valid) eval_.insert(token_hash(s.tokens));
  for (const auto& s : eval.test) eval_.insert(token_hash(s.tokens));
}

TrainStream::TrainStream(const Task& task, uint64_t seed, const EvalFingerprints& eval)
    : task_(task), seed_(seed), n_valid_(eval.n_valid), n_test_(eval.n_test), eval_(eval.hashes) {}

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
