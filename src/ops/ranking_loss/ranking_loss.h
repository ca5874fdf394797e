// Key Selection's ranking loss (HAX paper section 4.2) for given candidate positions, fused:
//
//   x[b,c,h] = scores[b, j, h]                          with j = cand[b, c]
//   y[b,c,h] = Σ_{l >= j, seq[l] == seq[j], valid[l]} sigmoid(q[b,l,h,:] · k[b,j,h,:])  (no gradient)
//   t_ac     = ([y_a > y_c] + [y_a >= y_c]) / 2,   z_ac = x_a - x_c
//   loss     = mean over (b, a, c, h) of max(z, 0) - z t + log1p(exp(-|z|))   (BCE with logits)
//   dloss / dx_a = 2 Σ_c (sigmoid(z_ac) - t_ac) / (B C C H)   (t_ca = 1 - t_ac)
//
// Shapes: scores (B, L, H); q, k (B, L, H, N); seq_idx (B, L) integer (non-decreasing) or
// undefined; valid (B, L) bool or undefined; cand (B, C) int64, distinct positions per row, C >= 1.
// C == 1 gives log 2 (the pair (a, a) alone) and a zero gradient, as the reference does; callers
// that may have fewer than two candidates skip the loss (hax::ranking_loss returns 0 then).
#pragma once
#include <ATen/ATen.h>

namespace hax::ops {

// The loss (0-dim, scores' dtype), differentiable in scores only (q, k, seq_idx, valid, cand get no
// gradient). On CUDA: the fused kernels (3 launches forward, a zero fill and 1 launch backward,
// no host synchronization); on the CPU: ranking_loss_reference after the same argument checks.
at::Tensor ranking_loss_fused(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& seq_idx, const at::Tensor& valid, const at::Tensor& cand);

// The definition written with LibTorch ops, differentiated by autograd: the CPU path and the test
// oracle (no argument checks).
at::Tensor ranking_loss_reference(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& seq_idx, const at::Tensor& valid, const at::Tensor& cand);

}  // namespace hax::ops
