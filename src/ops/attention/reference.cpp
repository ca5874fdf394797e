// Dense reference of sparse attention: an L x Lk score matrix per (b, h), a boolean mask per
// segment built from idx, a masked softmax and a weighted sum (test oracle; differentiable by
// autograd; float64 and small L).
#include <torch/torch.h>

#include <limits>

#include "ops/attention/attention.h"

namespace hax::ops {

std::tuple<at::Tensor, at::Tensor> sparse_attention_reference(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& idx,
                                                              const at::Tensor& bias, const at::Tensor& seg_w,
                                                              double scale) {
  const at::Tensor idx5 = idx.dim() == 4 ? idx.unsqueeze(3) : idx;  // (B, H, L, S, K)
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), Lk = k.size(1), Dv = v.size(3), S = idx5.size(3);
  const at::Tensor qh = q.permute({0, 2, 1, 3}), kh = k.permute({0, 2, 1, 3}), vh = v.permute({0, 2, 1, 3});
  at::Tensor scores = at::matmul(qh, kh.transpose(-1, -2)) * scale;  // (B, H, L, Lk)
  if (bias.defined()) scores = scores + bias.unsqueeze(2);
  const double inf = std::numeric_limits<double>::infinity();
  at::Tensor out = at::zeros({B, H, L, Dv}, q.options());
  std::vector<at::Tensor> lses;
  for (int64_t s = 0; s < S; ++s) {
    // mask[b, h, i, j] = j is listed in segment s of query i (-1 entries go to a dropped column Lk).
    at::Tensor li = idx5.select(3, s).to(at::kLong);
    li = at::where(li < 0, at::full_like(li, Lk), li);
    at::Tensor mask = at::zeros({B, H, L, Lk + 1}, q.options().dtype(at::kBool)).scatter_(3, li, true).narrow(3, 0, Lk);
    at::Tensor masked = scores.masked_fill(mask.logical_not(), -inf);
    at::Tensor lse = at::logsumexp(masked, -1);                       // (B, H, L), -inf for an empty segment
    at::Tensor safe = lse.masked_fill(at::isinf(lse), 0.0);           // keeps exp(masked - lse) at 0, not NaN
    at::Tensor a = at::exp(masked - safe.unsqueeze(-1));              // 0 off the list
    at::Tensor part = at::matmul(a, vh);                              // (B, H, L, Dv)
    if (seg_w.defined()) part = part * seg_w.select(3, s).unsqueeze(-1);
    out = out + part;
    lses.push_back(lse);
  }
  at::Tensor lse = S > 0 ? at::stack(lses, 3) : at::zeros({B, H, L, 0}, q.options());
  return {out.permute({0, 2, 1, 3}).contiguous(), lse};
}

}  // namespace hax::ops
