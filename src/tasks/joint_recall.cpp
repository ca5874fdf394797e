#include "tasks/joint_recall.h"

#include "core/error.h"
#include "core/rng.h"

namespace hax {

namespace {

// derive_seed stream of joint recall samples.
constexpr uint64_t kJointRecallStream = 0x4A52'0001;

// Writes one section: the nested blocks of `level` and below for the table entries under `prefix`
// (the flat table index of the enclosing combination). `supervise` marks the value tokens.
struct SectionWriter {
  const JointRecallTask& task;
  const std::vector<int64_t>& sizes;
  const std::vector<int32_t>& table;  // value index per combination, row-major, level 1 slowest
  Rng& rng;
  Sample& out;
  bool supervise;

  void write(size_t level, int64_t prefix) {
    const bool keys = level + 1 == sizes.size();
    for (int i : rng.permutation((int)sizes[level])) {
      out.tokens.push_back(task.level_id((int64_t)level, i));
      out.mask.push_back(0);
      const int64_t flat = prefix * sizes[level] + i;
      if (keys) {
        out.tokens.push_back(task.value_id(table[flat]));
        out.mask.push_back(supervise ? 1 : 0);
      } else {
        write(level + 1, flat);
      }
    }
  }
};

}  // namespace

JointRecallTask::JointRecallTask(const TaskConfig& config)
    : config_(config), lo_(config.level_min_sizes()), hi_(config.level_max_sizes()) {
  const auto vocab = config.level_vocab_sizes();
  level_base_.assign(lo_.size(), 0);
  int64_t next = kFirstValueId + config.num_values;  // the keys (last level) come first
  for (size_t l = lo_.size(); l-- > 0;) {
    level_base_[l] = next;
    next += vocab[l];
  }
  for (size_t l = 0; l < lo_.size(); ++l) grid_size_ *= hi_[l] - lo_[l] + 1;
}

int64_t JointRecallTask::min_vocab() const {
  return level_base_.empty() ? kFirstValueId + config_.num_values
                             : level_base_[0] + config_.level_vocab_sizes()[0];
}

int64_t JointRecallTask::length(const std::vector<int64_t>& sizes) {
  int64_t section = 0;
  for (size_t l = sizes.size(); l-- > 0;)
    section = l + 1 == sizes.size() ? 2 * sizes[l] : sizes[l] * (1 + section);
  return 2 + 2 * section;
}

int64_t JointRecallTask::max_length() const { return length(hi_); }

std::vector<int64_t> JointRecallTask::sizes(int64_t index) const {
  int64_t cell = index % grid_size_;
  if (cell < 0) cell += grid_size_;
  std::vector<int64_t> s(lo_.size());
  for (size_t l = lo_.size(); l-- > 0;) {  // the last level varies fastest
    const int64_t span = hi_[l] - lo_[l] + 1;
    s[l] = lo_[l] + cell % span;
    cell /= span;
  }
  return s;
}

Sample JointRecallTask::sample(uint64_t seed, int64_t index) const {
  const auto n = sizes(index);
  Rng rng(derive_seed(seed, kJointRecallStream, (uint64_t)index));
  int64_t entries = 1;
  for (auto x : n) entries *= x;
  std::vector<int32_t> table(entries);
  for (auto& v : table) v = (int32_t)rng.below((uint64_t)config_.num_values);

  Sample s;
  const int64_t len = length(n);
  s.tokens.reserve(len);
  s.mask.reserve(len);
  s.tokens.push_back(kBosId);
  s.mask.push_back(0);
  SectionWriter{*this, n, table, rng, s, false}.write(0, 0);
  s.tokens.push_back(kSepId);
  s.mask.push_back(0);
  SectionWriter{*this, n, table, rng, s, true}.write(0, 0);

  s.params = {{"sizes", n}};
  if (n.size() == 2) s.params.update({{"n_c", n[0]}, {"n_k", n[1]}});
  return s;
}

}  // namespace hax
