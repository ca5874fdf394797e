// One training step queued on the model's device without waiting for it: forward and loss
// (under autocast for bf16), backward of loss + α · Σ ranking losses, gradient clipping, and the
// optimizer update, which the device skips when the loss or the gradient norm is not finite.
// The trainer, hax bench train and the CUDA-graph steps (step_graph.h, which captures exactly
// this) share it.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>

#include "layers/forward_context.h"
#include "models/lm.h"
#include "tasks/batch.h"

namespace hax {

struct StepSettings {
  std::string precision = "fp32";  // "fp32", or "bf16" (autocast on CUDA)
  double ranking_alpha = 0.1;      // weight α of the summed Key Selection ranking losses
  double grad_clip = 1.0;          // global gradient-norm bound (0: no clipping)
};

// The step's metrics: (4) float64 on the device: loss, ranking loss (0 without Key Selection),
// gradient norm before clipping, Σ over samples of each sample's accuracy. Call opt.zero_grad()
// first. `update(skip)` applies the optimizer; skip is a device scalar, non-zero for a non-finite
// step. nan_loss makes the loss NaN (the trainer's test hook). *samples (if given) receives the
// samples with a supervised position (host-known).
at::Tensor device_train_step(LanguageModel& model, const std::map<std::string, at::Tensor>& params, const Batch& batch,
                             ForwardContext& ctx, const StepSettings& settings,
                             const std::function<void(const at::Tensor& skip)>& update, bool nan_loss = false,
                             int64_t* samples = nullptr);

}  // namespace hax
