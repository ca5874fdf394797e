// The synthetic recall tasks: what a sample is and what every task provides.
//
// A sample is a token sequence plus a mask of supervised positions. mask[t] = 1 means token t is
// a target: the model's output at position t-1 (having seen tokens[0..t-1]) is scored against
// tokens[t]. Training feeds inputs = tokens[0..T-2] and targets = tokens[1..T-1].
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace hax {

struct Sample {
  std::vector<int32_t> tokens;  // (T) token ids
  std::vector<uint8_t> mask;    // (T) 1 where tokens[t] is a supervised target
  nlohmann::json params;        // this sample's task parameters, e.g. {"n_c": 7, "n_k": 12}
};

class Task {
 public:
  virtual ~Task() = default;
  // Registry name, e.g. "joint_recall".
  virtual std::string name() const = 0;
  // Smallest vocabulary that holds every token id the task emits (max id + 1).
  virtual int64_t min_vocab() const = 0;
  // Longest sequence (in tokens) the task can produce.
  virtual int64_t max_length() const = 0;
  // The sample with this index of the stream seeded by `seed`: a pure function of (seed, index).
  // Tasks with a discrete parameter grid (joint recall's (n_c, n_k) pairs) cycle through it by
  // index, so every contiguous run of indices is balanced over the grid, as in the reference.
  virtual Sample sample(uint64_t seed, int64_t index) const = 0;
  // Number of cells of the task's discrete parameter grid: sample `index` falls in cell
  // index mod grid_size() (joint recall's (n_c, n_k) pairs, MQAR's pair counts); 1 for none.
  virtual int64_t grid_size() const { return 1; }
  // The task's configuration as JSON (written into run directories and `hax data` output).
  virtual nlohmann::json describe() const = 0;
};

}  // namespace hax
