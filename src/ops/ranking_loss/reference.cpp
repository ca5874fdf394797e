// The ranking loss written with LibTorch ops (the CPU path and the test oracle).
#include <torch/torch.h>

#include "ops/ranking_loss/ranking_loss.h"

namespace hax::ops {

at::Tensor ranking_loss_reference(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& seq_idx, const at::Tensor& valid, const at::Tensor& cand,
                                  const at::Tensor& rows) {
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), N = q.size(3), C = cand.size(1);
  at::Tensor x = scores.gather(1, cand.unsqueeze(-1).expand({B, C, H}));  // (B, C, H) predicted
  at::Tensor y;
  {
    torch::NoGradGuard ng;
    at::Tensor kc = k.gather(1, cand.view({B, C, 1, 1}).expand({B, C, H, N}));  // (B, C, H, N)
    at::Tensor s = at::einsum("blhn,bchn->bhlc", {q, kc}).sigmoid();            // (B, H, L, C)
    at::Tensor pos = at::arange(L, cand.options()).view({1, 1, L, 1});
    at::Tensor keep = pos >= cand.view({B, 1, 1, C});
    if (seq_idx.defined()) {
      at::Tensor sq = seq_idx.to(at::kLong).to(cand.device());
      at::Tensor sc = sq.gather(1, cand);
      keep = keep & (sq.view({B, 1, L, 1}) == sc.view({B, 1, 1, C}));
    }
    if (valid.defined()) keep = keep & valid.to(at::kBool).view({B, 1, L, 1});
    y = (s * keep.to(s.scalar_type())).sum(2).transpose(1, 2);  // (B, C, H)
  }
  at::Tensor logits = x.unsqueeze(2) - x.unsqueeze(1);  // (B, C, C, H): x_a - x_b
  at::Tensor ya = y.unsqueeze(2), yb = y.unsqueeze(1);
  at::Tensor target = ((ya > yb).to(x.scalar_type()) + (ya >= yb).to(x.scalar_type())) / 2;
  if (!rows.defined()) return at::binary_cross_entropy_with_logits(logits, target);  // mean over (B, C, C, H)
  // With rows: each term weighted by B / R on a true row and 0 on a false one, R = max(number of
  // true rows, 1); the mean over (B, C, C, H) of the weighted terms is then
  // Σ_{b: rows[b]} Σ_{a, c, h} ℓ / (R C C H), and 0 (zero gradient) when no row is true. With
  // every row true the weights are exactly 1 (B / B): the unweighted mean, bit for bit.
  const at::Tensor r = rows.to(x.device(), at::kBool);
  const at::Tensor count = r.sum().clamp_min(1).to(x.scalar_type());           // () R, at least 1
  const at::Tensor weight = (r.to(x.scalar_type()) * (double)B / count).view({B, 1, 1, 1});  // (B, 1, 1, 1)
  return at::binary_cross_entropy_with_logits(logits, target, weight);
}

}  // namespace hax::ops
