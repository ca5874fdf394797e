// Multi-query associative recall (MQAR), Zoology's layout, scaled to long sequences.
//
// A sample with kv key-value pairs has exactly seq_len + 1 tokens (inputs and targets of seq_len):
//   k_1 v_1 k_2 v_2 ... k_kv v_kv | query region of seq_len + 1 - 2*kv tokens
// Keys are distinct, drawn from [1, V/2); values distinct, from [V/2, V). In the query region,
// key k_i sits at offset 2*g_i, where the gaps g_1..g_kv are drawn without replacement from
// [0, space), space = (seq_len - 2*kv) / 2, with probability ∝ a * (g+1)^(a-1) (Zoology's power
// law: with a small a, most queries come soon after the context); k_1 gets the first gap drawn,
// k_2 the second, and so on, as in Zoology. Every other position of the query region holds a
// uniformly random token in [0, V) (Zoology's random non-queries).
//
// Teacher forcing: hax places the value v_i right after its query key, where Zoology leaves a
// random token. The target at that position is v_i in both; a causal model's prediction at the
// key position only sees earlier tokens and is therefore unaffected. The mask is 1 exactly at the
// kv query value positions.
//
// Sample i has kv = kv_min + i mod (kv_max - kv_min + 1) pairs, so every run of that many
// consecutive indices holds each pair count once (like joint recall's grid).
#pragma once
#include "tasks/task.h"
#include "tasks/task_config.h"

namespace hax {

class MqarTask : public Task {
 public:
  // `config` must be valid (make_task validates).
  explicit MqarTask(const TaskConfig& config);

  std::string name() const override { return "mqar"; }
  int64_t min_vocab() const override { return config_.vocab_size; }
  int64_t max_length() const override { return config_.seq_len + 1; }
  Sample sample(uint64_t seed, int64_t index) const override;
  nlohmann::json describe() const override { return config_.describe(); }
  int64_t grid_size() const override { return config_.kv_max - config_.kv_min + 1; }

  // Number of key-value pairs of sample `index`.
  int64_t num_kv_pairs(int64_t index) const;

 private:
  TaskConfig config_;
  // scale_[g] = (g+1)^(1-a): the Efraimidis–Spirakis key of gap g is Exp(1) * scale_[g]; the kv
  // smallest keys, ascending, are a weighted draw without replacement in draw order.
  std::vector<double> scale_;
};

}  // namespace hax
