// Turns samples into the tensors of one training or evaluation step.
//
// A sample of T tokens contributes T-1 positions: inputs = tokens[0..T-2], targets =
// tokens[1..T-1], loss_mask = mask[1..T-1]. Rows are right-padded to the longest row with the pad
// id (inputs and targets), loss_mask 0 and sample_id -1 there. All tensors are on the CPU.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "tasks/task.h"

namespace hax {

struct Batch {
  at::Tensor inputs;     // (B, T) int64 input tokens
  at::Tensor targets;    // (B, T) int64 next tokens
  at::Tensor loss_mask;  // (B, T) float 1 at supervised targets, else 0
  at::Tensor seq_idx;    // (B, T) int32 segment of each position within its row, numbered from 0;
                         // padding is one more segment after the last sample. Undefined unless packed.
  at::Tensor sample_id;  // (B, T) int32 index of the input sample of each position, -1 at padding
  int64_t num_samples = 0;  // number of input samples
  int64_t num_tokens = 0;   // non-padding input positions
  // Host-known facts about the supervision, filled by make_batch on the CPU so that a step on a
  // GPU needs no read-back of loss_mask (which would stall the host):
  at::Tensor supervised;    // (M) int64 flat indices into (B*T) of the positions with loss_mask 1,
                            // ascending (= loss_mask.reshape(-1).nonzero()); undefined if unknown
  int64_t supervised_samples = -1;  // samples with at least one supervised position; -1 if unknown
  at::Tensor supervised_weight;     // (M) float64 1 / (supervised positions of the position's sample),
                                    // so that Σ weight · correct is the sum of per-sample accuracies;
                                    // defined with `supervised`
  // Padded batches only (pad_batch): (M) float32, 1 at real supervised positions and 0 at the
  // padding entries appended to `supervised` (which point at position 0 with weight 0). The loss
  // is then Σ mask · CE / Σ mask instead of the mean over `supervised`.
  at::Tensor supervised_mask;

  // The same batch with its tensors on `device` (itself when they are there already). Copies to a
  // CUDA device go through pinned memory without waiting (stream-ordered with later work).
  Batch to(const at::Device& device) const;
};

// One sample per row, in the given order.
Batch make_batch(const std::vector<Sample>& samples, int32_t pad_id = 3);

// Samples packed into rows of at most `pack_len` input positions: first-fit in the given order (each
// sample goes to the first row with room, else a new row); a sample longer than `pack_len` gets a
// row of its own. Each sample's positions are contiguous within its row.
Batch make_packed_batch(const std::vector<Sample>& samples, int64_t pack_len, int32_t pad_id = 3);

// make_packed_batch(samples, pack_len, pad_id) when `pack`, else make_batch(samples, pad_id).
Batch make_batch(const std::vector<Sample>& samples, bool pack, int64_t pack_len, int32_t pad_id = 3);

// The same batch padded to a fixed shape: `rows` rows of `length` positions and `supervised`
// entries (each at least the batch's own). Appended positions and rows are padding (the pad id,
// loss_mask 0, sample_id -1; packed rows continue with the padding segment, appended rows are
// segment 0), and `supervised` gains entries marked 0 in `supervised_mask`. Every model in hax
// is causal within a row and independent across rows, so a padded batch gives the same loss and
// gradients (the CUDA-graph training steps need fixed shapes). CPU tensors in, CPU tensors out.
Batch pad_batch(const Batch& batch, int64_t rows, int64_t length, int64_t supervised, int32_t pad_id = 3);

// Per-sample accuracy: the mean of `correct` ((B, T) bool or float, e.g. argmax == targets) over
// each sample's supervised positions. Returns (num_samples) float64 on the CPU; NaN for a sample
// with no supervised position.
at::Tensor per_sample_accuracy(const Batch& batch, const at::Tensor& correct);

}  // namespace hax
