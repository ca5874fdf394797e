#include "train/loss.h"

namespace hax {

LossResult masked_lm_loss(LanguageModel& model, const Batch& batch0, ForwardContext& ctx, bool read_accuracy) {
  const Batch batch = batch0.to(model.device());
  ctx.valid = batch.sample_id >= 0;
  // A batch already on the device keeps the caller's valid_host (the CUDA-graph steps set it).
  if (batch0.sample_id.is_cpu()) ctx.valid_host = !batch.sample_id.is_cpu() ? batch0.sample_id >= 0 : at::Tensor();
  ctx.ranking_losses.clear();
  at::Tensor h = model.hidden(batch.inputs, batch.seq_idx, nullptr, &ctx);  // (B, T, d)
  // Supervised positions: known on the host for batches from make_batch (no device read-back).
  const at::Tensor sel =
      batch.supervised.defined() ? batch.supervised : batch.loss_mask.reshape({-1}).nonzero().squeeze(1);
  LossResult r;
  for (auto& l : ctx.ranking_losses) r.ranking = r.ranking.defined() ? r.ranking + l : l;
  const bool padded = batch.supervised_mask.defined();
  r.positions = padded ? -1 : sel.numel();  // a padded batch's count lies on the device
  if (sel.numel() == 0) {
    r.loss = (h.sum() * 0.0);
    r.correct = at::zeros({}, h.options().dtype(at::kDouble));
    return r;
  }
  at::Tensor hs = h.reshape({-1, h.size(-1)}).index_select(0, sel);  // (M, d)
  at::Tensor logits = model.logits(hs);                               // (M, V)
  at::Tensor tg = batch.targets.reshape({-1}).index_select(0, sel);
  if (padded) {
    // Σ mask · CE / Σ mask: the mean over the real supervised positions (the padding entries have
    // mask 0), computed without reading the count back.
    const at::Tensor& mask = batch.supervised_mask;
    at::Tensor ce = at::cross_entropy_loss(logits, tg, {}, at::Reduction::None);  // (M)
    r.loss = (ce * mask.to(ce.scalar_type())).sum() / mask.sum().clamp_min(1).to(ce.scalar_type());
  } else {
    r.loss = at::cross_entropy_loss(logits, tg);
  }
  torch::NoGradGuard ng;
  if (batch.supervised.defined() && batch.supervised_weight.defined() && batch.supervised_samples >= 0) {
    // Σ over samples of each one's accuracy, from host-known weights (4 launches, no read-back).
    r.correct = ((logits.argmax(-1) == tg) * batch.supervised_weight).sum();
    r.samples = batch.supervised_samples;
    if (read_accuracy) r.correct_sum = r.correct.item<double>();
    return r;
  }
  at::Tensor correct = (logits.argmax(-1) == tg).to(at::kDouble);
  at::Tensor sid = batch.sample_id.reshape({-1}).index_select(0, sel).to(at::kLong);
  const int64_t n = batch.num_samples;
  const auto f64 = correct.options();
  at::Tensor hits = at::zeros({n}, f64).index_add_(0, sid, correct);
  at::Tensor count = at::zeros({n}, f64).index_add_(0, sid, at::ones_like(correct));
  at::Tensor has = count > 0;
  r.correct = (hits / count.clamp_min(1)).masked_fill(~has, 0).sum();
  if (batch.supervised_samples >= 0) {
    r.samples = batch.supervised_samples;
    if (read_accuracy) r.correct_sum = r.correct.item<double>();
  } else {
    // One transfer for both numbers (a GPU run synchronizes once); samples is needed on the host.
    at::Tensor both = at::stack({has.sum().to(at::kDouble), r.correct}).cpu();
    r.samples = (int64_t)both[0].item<double>();
    r.correct_sum = both[1].item<double>();
  }
  return r;
}

}  // namespace hax
