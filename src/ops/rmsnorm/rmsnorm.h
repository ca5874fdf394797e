// RMSNorm with an optional SiLU gate, Mamba-2's gated variant (norm_before_gate = False):
//
//   u   = x * silu(z)            (u = x without z: plain RMSNorm)
//   out = u / sqrt(mean_group(u^2) + eps) * weight
//
// where the mean runs over groups of `group_size` consecutive entries of the last dim (Mamba-2
// normalizes each of its G groups of d_inner / G channels separately; the default is the whole
// last dim). Plain RMSNorm is every block's pre-norm and the final norm of the LM.
//
// Shapes: x (..., D) with any leading dims (M rows in all), z like x or absent, weight (D).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

#include "ops/rmsnorm/params.h"

namespace hax::ops {

// CPU kernels (float or double), parallel over fixed blocks of rows; deterministic (dweight is
// summed per row block, then over blocks in order, whatever the thread count).
void rmsnorm_forward_cpu(const RmsNormParams& p, at::ScalarType dtype);
void rmsnorm_backward_cpu(const RmsNormGradParams& p, at::ScalarType dtype);

// Tensor-level forward without autograd: returns (out (..., D), rstd (M, D / group_size)).
// z may be undefined; group_size 0 means the whole last dim.
std::tuple<at::Tensor, at::Tensor> rmsnorm_forward(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight,
                                                   double eps = 1e-5, int64_t group_size = 0);

// Differentiable (gated) RMSNorm (autograd through the hand-written backward) in x, z and
// weight. z may be undefined (plain RMSNorm); group_size 0 means the whole last dim.
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps = 1e-5,
                   int64_t group_size = 0);

// The definition written with LibTorch ops: the test oracle (differentiable by autograd).
at::Tensor rmsnorm_reference(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps = 1e-5,
                             int64_t group_size = 0);

}  // namespace hax::ops
