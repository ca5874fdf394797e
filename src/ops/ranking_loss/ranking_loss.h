// Key Selection's ranking loss (HAX paper section 4.2) for given candidate positions, fused:
//
//   x[b,c,h] = scores[b, j, h]                          with j = cand[b, c]
//   y[b,c,h] = Σ_{l >= j, seq[l] == seq[j], valid[l]} sigmoid(q[b,l,h,:] · k[b,j,h,:])  (no gradient)
//   t_ac     = ([y_a > y_c] + [y_a >= y_c]) / 2,   z_ac = x_a - x_c
//   ℓ_bach   = max(z, 0) - z t + log1p(exp(-|z|))      (BCE with logits)
//   loss     = Σ_{b: rows[b]} Σ_{a, c, h} ℓ_bach / (R C C H),   R = the number of rows b with rows[b]
//   dloss / dx_a = 2 Σ_c (sigmoid(z_ac) - t_ac) / (R C C H) on a row with rows[b]; 0 on the others
//                  (t_ca = 1 - t_ac)
//
// rows marks the rows that count: a row with rows[b] false (a padding row, all padding, appended to
// give a step a fixed shape) adds nothing to the loss and gets exactly zero gradient. Undefined rows
// means every row counts (R = B: the mean over (b, a, c, h), bit for bit as with rows all true).
// R = 0 gives a loss of 0 and a zero gradient (not NaN). R is counted on the device: no host
// synchronization.
//
// Shapes: scores (B, L, H); q, k (B, L, H, N); seq_idx (B, L) integer (non-decreasing) or
// undefined; valid (B, L) bool or undefined; cand (B, C) int64, distinct positions per row, C >= 1;
// rows (B) bool or undefined.
// C == 1 gives log 2 (the pair (a, a) alone) and a zero gradient, as the reference does; callers
// that may have fewer than two candidates skip the loss (hax::ranking_loss returns 0 then).
#pragma once
#include <ATen/ATen.h>

namespace hax::ops {

// The loss (0-dim, scores' dtype), differentiable in scores only (q, k, seq_idx, valid, cand, rows
// get no gradient). On CUDA: the fused kernels (3 launches forward, a zero fill and 1 launch
// backward, no host synchronization: graph-capturable); on the CPU: ranking_loss_reference after
// the same argument checks.
at::Tensor ranking_loss_fused(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& seq_idx, const at::Tensor& valid, const at::Tensor& cand,
                              const at::Tensor& rows = {});

// The definition written with LibTorch ops, differentiated by autograd: the CPU path and the test
// oracle (no argument checks).
at::Tensor ranking_loss_reference(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& seq_idx, const at::Tensor& valid, const at::Tensor& cand,
                                  const at::Tensor& rows = {});

}  // namespace hax::ops
