#include "train/train_step.h"

#include <ATen/record_function.h>

#include <cmath>

#include "train/adamw.h"
#include "train/loss.h"
#include "train/precision.h"

namespace hax {

at::Tensor device_train_step(LanguageModel& model, const std::map<std::string, at::Tensor>& params, const Batch& batch,
                             ForwardContext& ctx, const StepSettings& settings,
                             const std::function<void(const at::Tensor& skip)>& update, bool nan_loss,
                             int64_t* samples) {
  ctx.training = true;
  LossResult r;
  {
    RECORD_USER_SCOPE("hax::forward_and_loss");
    AutocastScope autocast(settings.precision, model.device());
    r = masked_lm_loss(model, batch, ctx, /*read_accuracy=*/false);
  }
  if (nan_loss) r.loss = r.loss * std::nan("");
  if (samples) *samples = r.samples;
  const at::Tensor loss = r.loss.detach().to(at::kDouble);
  const at::Tensor ranking = r.ranking.defined() ? r.ranking.detach().to(at::kDouble) : at::zeros_like(loss);
  {
    RECORD_USER_SCOPE("hax::backward");
    // Backward runs whatever the loss; a non-finite step is skipped on the device.
    (r.ranking.defined() ? r.loss + settings.ranking_alpha * r.ranking : r.loss).backward();
  }
  RECORD_USER_SCOPE("hax::clip_metrics_optimizer");
  const at::Tensor gnorm = clip_grad_norm_async(params, settings.grad_clip);
  update(at::isfinite(loss + gnorm).logical_not());
  return at::stack({loss, ranking, gnorm, r.correct});
}

}  // namespace hax
