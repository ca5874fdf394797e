// Dense reference of dilated attention (D, SW+D): the full L x L score matrix masked to
// U(i) = { j <= i : j > i - window } ∪ { the `keys` most recent j <= i with j mod r = r - 1 } and
// a softmax (test oracle; differentiable by autograd; float64 and small L). Rows with an empty set
// output 0 and lse -inf.
#include <torch/torch.h>

#include <limits>

#include "ops/dilated_attention/dilated_attention.h"

namespace hax::ops {

std::tuple<at::Tensor, at::Tensor> dilated_attention_reference(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, int64_t keys, int64_t stride,
                                                               int64_t window, double scale) {
  const int64_t L = q.size(1);
  const at::Tensor qh = q.permute({0, 2, 1, 3}), kh = k.permute({0, 2, 1, 3}), vh = v.permute({0, 2, 1, 3});
  const at::Tensor scores = at::matmul(qh, kh.transpose(-1, -2)) * scale;  // (B, H, L, L)
  const at::Tensor i = at::arange(L, at::kLong).view({L, 1}), j = at::arange(L, at::kLong).view({1, L});
  // Key j is dilated when j mod r = r - 1; query i keeps the `keys` most recent of those j <= i,
  // counted from the row's end: the number of dilated keys in [j, i] is at most `keys`.
  const at::Tensor dil = (j.remainder(stride) == stride - 1).to(at::kLong);
  const at::Tensor count_to_i = at::floor_divide(i + 1, stride), count_before_j = at::floor_divide(j, stride);
  const at::Tensor recent = (count_to_i - count_before_j) <= keys;  // dilated keys in [j, i], j itself included
  const at::Tensor in_d = dil.to(at::kBool).logical_and(recent);
  const at::Tensor in_w = window > 0 ? (j > i - window) : at::zeros_like(recent);
  const at::Tensor allowed = (j <= i).logical_and(in_d.logical_or(in_w)).view({1, 1, L, L});
  const at::Tensor masked = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  const at::Tensor lse = at::logsumexp(masked, -1);  // (B, H, L), -inf for empty rows
  const at::Tensor safe = at::where(at::isinf(lse), at::zeros_like(lse), lse);
  const at::Tensor out = at::matmul(at::exp(masked - safe.unsqueeze(-1)), vh);
  return {out.permute({0, 2, 1, 3}).contiguous(), lse};
}

}  // namespace hax::ops
