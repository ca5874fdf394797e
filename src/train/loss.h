// The recall objective: cross-entropy at supervised positions only, and per-sample accuracy.
#pragma once
#include <torch/torch.h>

#include "layers/forward_context.h"
#include "models/lm.h"
#include "tasks/batch.h"

namespace hax {

struct LossResult {
  at::Tensor loss;           // scalar: mean cross-entropy over the batch's supervised positions
  double correct_sum = 0;    // Σ over samples of that sample's accuracy (mean over its positions)
  int64_t samples = 0;       // samples with at least one supervised position
  int64_t positions = 0;     // supervised positions
  at::Tensor ranking;        // scalar: Σ over layers of the Key Selection ranking losses (training), or undefined
};

// Runs the model on the batch (logits only at supervised positions) and scores it. ctx gives
// the training flag and seed; its valid mask is set from the batch.
LossResult masked_lm_loss(LanguageModel& model, const Batch& batch, ForwardContext& ctx);

}  // namespace hax
