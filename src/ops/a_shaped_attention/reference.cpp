// Dense reference of A-shaped attention: the full L x L score matrix masked to
// { j <= i : j > i - window or j < sink } and a softmax (test oracle; differentiable by autograd;
// float64 and small L). Every query sees itself, so no row is empty.
#include <torch/torch.h>

#include <limits>

#include "ops/a_shaped_attention/a_shaped_attention.h"

namespace hax::ops {

std::tuple<at::Tensor, at::Tensor> a_shaped_attention_reference(const at::Tensor& q, const at::Tensor& k,
                                                                const at::Tensor& v, int64_t window, int64_t sink,
                                                                double scale) {
  const int64_t L = q.size(1);
  const at::Tensor qh = q.permute({0, 2, 1, 3}), kh = k.permute({0, 2, 1, 3}), vh = v.permute({0, 2, 1, 3});
  const at::Tensor scores = at::matmul(qh, kh.transpose(-1, -2)) * scale;  // (B, H, L, L)
  const at::Tensor i = at::arange(L, at::kLong).view({L, 1}), j = at::arange(L, at::kLong).view({1, L});
  const at::Tensor allowed = (j <= i).logical_and((j > i - window).logical_or(j < sink)).view({1, 1, L, L});
  const at::Tensor masked = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  const at::Tensor lse = at::logsumexp(masked, -1);  // (B, H, L)
  const at::Tensor out = at::matmul(at::exp(masked - lse.unsqueeze(-1)), vh);
  return {out.permute({0, 2, 1, 3}).contiguous(), lse};
}

}  // namespace hax::ops
