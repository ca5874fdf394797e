// Multi-query (multi-level) joint recall, the paper's task (section 3, appendix C).
//
// Token ids: bos=1, eos=2, pad=3, sep=4; values 10..10+num_values-1; then the ids of the last level
// (the keys), then the level above it, and so on, so that level 1 has the highest ids. With the
// defaults (2 levels, 16 values, 16 ids per level): values 10..25, keys 26..41, contexts 42..57.
//
// A sample with level sizes n_1..n_w uses the first n_l ids of every level. Its table maps every
// combination (i_1..i_w) to a value drawn i.i.d. uniformly. The sequence is
//   [bos] section [sep] section
// where a section lists the whole table as nested blocks: every level-1 id in a random order, each
// followed by its block of level-2 ids in a random order, and so on down to the keys, each key
// followed by its value. Every block at every level gets its own fresh permutation, independently in
// the two sections. The query section contains the values too (teacher forcing); the supervised
// positions are exactly its value tokens (n_1 * ... * n_w of them). No eos, no padding.
//
// Level sizes cycle over the grid of all size combinations by sample index (level 1 slowest), as the
// reference's nested loops over n_c then n_k; every run of grid-size consecutive indices holds each
// combination once. w = 1 is associative recall, w = 2 joint recall.
#pragma once
#include "tasks/task.h"
#include "tasks/task_config.h"

namespace hax {

// Reserved token ids shared by the recall tasks.
constexpr int32_t kBosId = 1;
constexpr int32_t kEosId = 2;
constexpr int32_t kPadId = 3;
constexpr int32_t kSepId = 4;
constexpr int32_t kFirstValueId = 10;

class JointRecallTask : public Task {
 public:
  // `config` must be valid (make_task validates).
  explicit JointRecallTask(const TaskConfig& config);

  std::string name() const override { return config_.name; }
  int64_t min_vocab() const override;
  int64_t max_length() const override;
  Sample sample(uint64_t seed, int64_t index) const override;
  nlohmann::json describe() const override { return config_.describe(); }

  // Number of levels w.
  int64_t levels() const { return (int64_t)lo_.size(); }
  // Number of size combinations; sample i uses combination i mod grid_size().
  int64_t grid_size() const override { return grid_size_; }
  // The level sizes (n_1..n_w) of sample `index`.
  std::vector<int64_t> sizes(int64_t index) const;
  // Token id of item i (0-based) of level l (0-based, 0 = outermost); l = w-1 are the keys.
  int32_t level_id(int64_t l, int64_t i) const { return (int32_t)(level_base_[l] + i); }
  // Token id of value v in [0, num_values).
  int32_t value_id(int64_t v) const { return (int32_t)(kFirstValueId + v); }
  // Sequence length of a sample with these level sizes: 2 + 2 * section length.
  static int64_t length(const std::vector<int64_t>& sizes);

 private:
  TaskConfig config_;
  std::vector<int64_t> lo_, hi_, level_base_;
  int64_t grid_size_ = 1;
};

}  // namespace hax
