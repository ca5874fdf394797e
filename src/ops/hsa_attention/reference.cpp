// Dense reference of HSA attention: every (query, slot) pair's C keys and values gathered from
// the chunk's start, one softmax per pair, and the slots summed with their weights (test oracle;
// differentiable by autograd in q, k, v and w; float64 and small sizes). Invalid slots gather
// position 0 and are multiplied by 0, so no softmax row is empty and no gradient is NaN.
#include <torch/torch.h>

#include "ops/hsa_attention/hsa_attention.h"

namespace hax::ops {

at::Tensor hsa_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& chunks, const at::Tensor& start, const at::Tensor& w,
                                   int64_t chunk, double scale) {
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3), Dv = v.size(3);
  const int64_t S = chunks.size(2), NC = start.size(1), C = chunk, P = L * S * C;
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(q.device());
  // First key of each slot's chunk (B, L, S), -1 for invalid slots: chunk numbers outside
  // [0, NC) read an extra column of -1.
  const at::Tensor c = chunks.to(at::kLong);
  const at::Tensor c_or_none = at::where(c.ge(0).logical_and(c.lt(NC)), c, at::full_like(c, NC));
  const at::Tensor starts = at::cat({start.to(at::kLong), at::full({B, 1}, -1, i64)}, 1);
  const at::Tensor first = at::gather(starts, 1, c_or_none.view({B, L * S})).view({B, L, S});
  const at::Tensor valid = first.ge(0);
  // Key positions t_j = first + j (B, L, S, C); position 0 for invalid slots.
  const at::Tensor pos = (first.unsqueeze(-1) + at::arange(C, i64)) * valid.unsqueeze(-1);
  const at::Tensor kg = at::gather(k, 1, pos.view({B, P, 1, 1}).expand({B, P, H, D})).view({B, L, S, C, H, D});
  const at::Tensor vg = at::gather(v, 1, pos.view({B, P, 1, 1}).expand({B, P, H, Dv})).view({B, L, S, C, H, Dv});
  const at::Tensor p = at::softmax(at::einsum("bihd,bisjhd->bihsj", {q, kg}) * scale, -1);  // (B, L, H, S, C)
  const at::Tensor o = at::einsum("bihsj,bisjhe->bihse", {p, vg});                          // (B, L, H, S, Dv)
  return at::einsum("bihse,bis->bihe", {o, w * valid.to(w.scalar_type())});                 // (B, L, H, Dv)
}

}  // namespace hax::ops
