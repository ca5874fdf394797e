#include "train/loss.h"

namespace hax {

LossResult masked_lm_loss(LanguageModel& model, const Batch& batch, ForwardContext& ctx) {
  ctx.valid = batch.sample_id >= 0;
  ctx.ranking_losses.clear();
  at::Tensor h = model.hidden(batch.inputs, batch.seq_idx, nullptr, &ctx);  // (B, T, d)
  at::Tensor sel = batch.loss_mask.reshape({-1}).nonzero().squeeze(1);
  LossResult r;
  for (auto& l : ctx.ranking_losses) r.ranking = r.ranking.defined() ? r.ranking + l : l;
  r.positions = sel.numel();
  if (r.positions == 0) {
    r.loss = (h.sum() * 0.0);
    return r;
  }
  at::Tensor hs = h.reshape({-1, h.size(-1)}).index_select(0, sel);  // (M, d)
  at::Tensor logits = model.logits(hs);                               // (M, V)
  at::Tensor tg = batch.targets.reshape({-1}).index_select(0, sel);
  r.loss = at::cross_entropy_loss(logits, tg);
  torch::NoGradGuard ng;
  at::Tensor correct = (logits.argmax(-1) == tg).to(at::kDouble);
  at::Tensor sid = batch.sample_id.reshape({-1}).index_select(0, sel).to(at::kLong);
  const int64_t n = batch.num_samples;
  at::Tensor hits = at::zeros({n}, at::kDouble).index_add_(0, sid, correct);
  at::Tensor count = at::zeros({n}, at::kDouble).index_add_(0, sid, at::ones_like(correct));
  at::Tensor has = count > 0;
  r.samples = has.sum().item<int64_t>();
  r.correct_sum = (hits.masked_select(has) / count.masked_select(has)).sum().item<double>();
  return r;
}

}  // namespace hax
