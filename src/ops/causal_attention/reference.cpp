// Dense reference of causal (sliding-window, packed) attention: the full L x L score matrix with a
// mask and a softmax (test oracle; differentiable by autograd; float64 and small L).
#include <torch/torch.h>

#include <limits>

#include "ops/causal_attention/causal_attention.h"

namespace hax::ops {

std::tuple<at::Tensor, at::Tensor> causal_attention_reference(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& seq_idx,
                                                              int64_t window, double scale,
                                                              const at::Tensor& band) {
  const int64_t B = q.size(0), L = q.size(1);
  const at::Tensor qh = q.permute({0, 2, 1, 3}), kh = k.permute({0, 2, 1, 3}), vh = v.permute({0, 2, 1, 3});
  at::Tensor scores = at::matmul(qh, kh.transpose(-1, -2)) * scale;  // (B, H, L, L)
  const at::Tensor i = at::arange(L, at::kLong).view({L, 1}), j = at::arange(L, at::kLong).view({1, L});
  at::Tensor allowed = (j <= i).view({1, 1, L, L});
  if (band.defined()) {  // (4, B, H, L): query i sees keys [band[0], band[1]]
    const at::Tensor lo = band[0].to(at::kLong).unsqueeze(-1), hi = band[1].to(at::kLong).unsqueeze(-1);
    allowed = (j.view({1, 1, 1, L}) >= lo).logical_and(j.view({1, 1, 1, L}) <= hi);
  } else if (window > 0) allowed = allowed.logical_and((j > i - window).view({1, 1, L, L}));
  if (seq_idx.defined() && !band.defined()) {
    const at::Tensor s = seq_idx.to(at::kLong);
    allowed = allowed.logical_and((s.view({B, L, 1}) == s.view({B, 1, L})).unsqueeze(1));
  }
  at::Tensor masked = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  // A band's query may see no key: its row of scores is all -inf, its output 0 and its lse -inf.
  // Its lse is taken over zeros instead (then replaced), so that no NaN enters the gradients.
  const at::Tensor seen = allowed.expand_as(scores).any(-1, true);  // (B, H, L, 1)
  const at::Tensor lse_f = at::logsumexp(at::where(seen, masked, at::zeros_like(masked)), -1);
  at::Tensor out = at::matmul(at::exp(masked - lse_f.unsqueeze(-1)), vh);
  at::Tensor lse = at::where(seen.squeeze(-1), lse_f, at::full_like(lse_f, -std::numeric_limits<double>::infinity()));
  return {out.permute({0, 2, 1, 3}).contiguous(), lse};
}

}  // namespace hax::ops
