// Rows of a (B, L, H, D) tensor reordered along L by a permutation of its own per (b, h):
//
//   gather:  out[b, t, h, :] = x[b, order[b, h, t], h, :]
//   scatter: out[b, order[b, h, t], h, :] = x[b, t, h, :]     (the inverse: scatter(gather(x)) = x)
//
// LSH attention (patterns/lsh_band.h) sorts queries and keys by bucket with it, runs a band of
// attention over the sorted rows and puts the outputs back. Differentiable in x (the gradient of
// a gather is the scatter of the gradient, and vice versa).
#pragma once
#include <ATen/ATen.h>

#include "ops/permute_rows/params.h"

namespace hax::ops {

void permute_rows_cpu(const PermuteRowsParams& p, at::ScalarType dtype);

// x (B, L, H, D) float32, bfloat16 or float64 (CPU); order (B, H, L) int32 on x's device, each
// (b, h) row a permutation of [0, L) (checked on the CPU; on CUDA only while
// check_device_values() is on, since the check synchronizes: a repeated entry there leaves rows of
// a scatter unwritten).
at::Tensor permute_rows(const at::Tensor& x, const at::Tensor& order, bool scatter);

}  // namespace hax::ops
