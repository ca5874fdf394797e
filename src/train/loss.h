// The recall objective: cross-entropy at supervised positions only, and per-sample accuracy.
#pragma once
#include <torch/torch.h>

#include "layers/forward_context.h"
#include "models/lm.h"
#include "tasks/batch.h"

namespace hax {

struct LossResult {
  at::Tensor loss;           // scalar: mean cross-entropy over the batch's supervised positions
  at::Tensor correct;        // scalar float64 on the model's device: Σ over samples of that sample's
                             // accuracy (mean over its positions); read it when the numbers are needed
  double correct_sum = 0;    // `correct` read back (only when masked_lm_loss was asked to read it)
  int64_t samples = 0;       // samples with at least one supervised position
  int64_t positions = 0;     // supervised positions (-1 for a padded batch: see pad_batch)
  at::Tensor ranking;        // scalar: Σ over layers of the Key Selection ranking losses (training), or undefined
};

// Runs the model on the batch (logits only at supervised positions) and scores it. ctx gives
// the training flag and seed; its valid mask is set from the batch. With read_accuracy the
// accuracy is read back into correct_sum (a GPU run waits for the step then); without it, nothing
// waits on the device when the batch came from make_batch (its supervised positions are known on
// the host), so a training loop can queue further work and read the metrics later.
LossResult masked_lm_loss(LanguageModel& model, const Batch& batch, ForwardContext& ctx, bool read_accuracy = true);

}  // namespace hax
