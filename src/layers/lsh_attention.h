// LSH attention in its fast form (DESIGN.md section 2): no key lists. Queries and keys of every
// (b, h) are sorted by (sequence, bucket, position) (patterns::lsh_band), which makes each query's
// keys one contiguous run of the sorted keys, ending where its bucket's keys pass its position; the
// runs' first and last keys are non-decreasing, so causal attention's tile kernels run the pattern
// as a band (ops::causal_attention with `band`) over the rows permuted into that order
// (ops::permute_rows), and the outputs are permuted back.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

#include "patterns/pattern.h"

namespace hax {

// q, k (B, L, H, D), v (B, L, H, Dv); band from patterns::lsh_band of the same q, k. Returns
// (out (B, L, H, Dv), lse (B, H, L), float32 on CUDA) in position order, as
// ops::sparse_attention with lsh()'s lists would (lse -inf and out 0 for a query without keys).
// Differentiable in q, k and v.
std::tuple<at::Tensor, at::Tensor> lsh_band_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const patterns::LshBand& band, double scale);

}  // namespace hax
