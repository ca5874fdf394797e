// The recall objective: cross-entropy at supervised positions only, and per-sample accuracy.
#pragma once
#include <torch/torch.h>

#include "models/lm.h"
#include "tasks/batch.h"

namespace hax {

struct LossResult {
  at::Tensor loss;           // scalar: mean cross-entropy over the batch's supervised positions
  double correct_sum = 0;    // Σ over samples of that sample's accuracy (mean over its positions)
  int64_t samples = 0;       // samples with at least one supervised position
  int64_t positions = 0;     // supervised positions
};

// Runs the model on the batch (logits only at supervised positions) and scores it.
LossResult masked_lm_loss(LanguageModel& model, const Batch& batch);

}  // namespace hax
