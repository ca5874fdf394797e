// Needle in a haystack (NIAH), in the spirit of RULER: key -> passkey needles hidden in random
// filler at a controlled depth, then a query for one or more of them. Four variants:
//   single      one needle, queried;
//   multikey    --niah-needles needles with distinct keys, one queried (the others distract);
//   multivalue  --niah-values needles with the same key and different passkeys; the query asks for
//               every passkey, in the order the needles appear in the haystack;
//   multiquery  --niah-needles needles with distinct keys, every one queried (in a random order).
//
// Token ids: bos=1; needle marker N=5, value marker V=6, query marker Q=7; passkey digits 10..19;
// key tokens 20..20+key_vocab-1; filler tokens after them (niah_vocab ids). With the defaults (16 key
// ids, 64 filler ids) the vocabulary is 100, the default model's.
//
// A needle is [N, key (key_len tokens), V, passkey (value_len digits)], Ln = key_len + value_len + 2
// tokens; keys are key_len random key tokens (distinct keys differ as sequences); every digit of a
// passkey is drawn uniformly. A sample has exactly seq_len + 1 tokens (inputs and targets of seq_len):
//   [bos] haystack (R tokens: filler with the needles inside) query section
// The query section asks for the queried needles one after another, each as
//   [Q, key, V, passkey]          (single, multikey, multiquery)
//   [Q, key, V, passkey_1 ... passkey_n]   (multivalue: the n passkeys in haystack order)
// Teacher forcing: the answers are in the sequence; the mask is 1 exactly on the answer digits.
// Filler tokens are i.i.d. uniform over the filler ids, fresh in every sample.
//
// Depth. The haystack occupies positions 1..R. The queried needles (the targets) form, with a fixed
// depth d in [0, 1] (--niah-depth), one block of B = targets * Ln tokens that starts at position
//   1 + round(d * (R - B))
// (depth 0: right after bos; depth 1: the block ends right before the query section); inside the
// block the targets are in a random order (multiquery) or in passkey order (multivalue). Distractors
// (multikey) go at uniformly random places in the filler before and after the block. With a
// negative depth (the training default) every needle goes to an independent uniformly random place:
// the arrangement of the needles among the filler tokens is uniform.
//
// Sample::params: "variant", "seq_len", "needle_positions" (the position of every needle's N
// marker, in haystack order), "queried" (indices into needle_positions, in query order) and
// "depth": the fixed depth, or with random depths the realized depth of the first queried needle,
// (position - 1) / (R - Ln) (0 when R = Ln).
#pragma once
#include "tasks/task.h"
#include "tasks/task_config.h"

namespace hax {

// NIAH marker and range ids (the reserved ids 1..4 are shared with joint recall).
constexpr int32_t kNiahNeedleId = 5;
constexpr int32_t kNiahValueId = 6;
constexpr int32_t kNiahQueryId = 7;
constexpr int32_t kNiahFirstDigitId = 10;
constexpr int32_t kNiahDigits = 10;
constexpr int32_t kNiahFirstKeyId = kNiahFirstDigitId + kNiahDigits;

// The token counts of one NIAH configuration, derived from its TaskConfig fields. TaskConfig::validate
// uses them for the length check, NiahTask for the layout.
struct NiahShape {
  int64_t needles = 1;      // needles in the haystack (m)
  int64_t targets = 1;      // needles the query section asks for
  int64_t needle_len = 0;   // tokens of one needle, Ln = key_len + value_len + 2
  int64_t query_len = 0;    // tokens of the query section
  int64_t min_filler = 0;   // filler tokens the haystack needs at least (so distractors fit at any depth)
  // Shortest valid --seq-len: all needles, the query section and min_filler filler tokens.
  int64_t min_seq_len() const { return needles * needle_len + query_len + min_filler; }
};
// `config` must name a known variant (its sizes need not be valid).
NiahShape niah_shape(const TaskConfig& config);

class NiahTask : public Task {
 public:
  // `config` must be valid (make_task validates).
  explicit NiahTask(const TaskConfig& config);

  std::string name() const override { return "niah"; }
  int64_t min_vocab() const override;
  int64_t max_length() const override { return config_.seq_len + 1; }
  Sample sample(uint64_t seed, int64_t index) const override;
  nlohmann::json describe() const override { return config_.describe(); }

  const NiahShape& shape() const { return shape_; }
  // Haystack length R (positions 1..R).
  int64_t haystack_len() const { return config_.seq_len - shape_.query_len; }
  // First filler id.
  int32_t first_filler_id() const { return (int32_t)(kNiahFirstKeyId + config_.niah_key_vocab); }

 private:
  TaskConfig config_;
  NiahShape shape_;
};

}  // namespace hax
