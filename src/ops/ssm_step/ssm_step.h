// Fused decoding steps of the Mamba and Mamba-2 mixers: one token through the causal conv1d and
// the SSM recurrence, the recurrent states updated in place.
//
//   conv1d_step          window = [state[:, 0], .., state[:, W-2], x]        (W inputs, oldest first)
//                        out    = act(bias + Σ_k weight[:, k] window[k])      act = SiLU or identity
//                        state <- window[1:]
//
//   ssd_step (Mamba-2)   dt         = softplus(dt + dt_bias)                  (B, H)
//                        state[h,p] = exp(dt_h A_h) state[h,p] + dt_h x[h,p] B[g(h)]     (N each)
//                        y[h,p]     = state[h,p] · C[g(h)] + D_h x[h,p]
//
//   selective_scan_step  delta      = softplus(delta + delta_bias)            (B, D)
//   (Mamba)              state[d,n] = exp(delta_d A[d,n]) state[d,n] + delta_d x[d] B[g(d),n]
//                        y[d]       = Σ_n state[d,n] C[g(d),n] + D_d x[d]
//
// exactly the token-t slice of causal_conv1d, ssd and selective_scan (plus the layers' D skip), so
// that decoding token by token gives what the forward gives. A is passed as the decay rate itself
// (the layers pass -exp(A_log)); the dt / delta bias and the softplus are applied inside (each
// optional: an undefined bias is 0, softplus off passes dt + bias through). g(·) maps a head or
// channel to its group of B and C. The D skip is optional (undefined: none).
//
// No autograd (decoding): the outputs carry no gradient and the state is written through its data
// pointer, so it must be contiguous; clone it first to keep the old one. Inputs sliced out of a
// projection may have any row (batch) stride as long as each row is contiguous.
//
// dtypes: every input has x's dtype (float32/float64 on the CPU, float32/bfloat16 on CUDA); the
// conv state too; the SSM state has x's dtype or float32 (with bfloat16 inputs a float32 state
// accumulates without rounding). Arithmetic: x's dtype on the CPU, float32 on CUDA.
#pragma once
#include <ATen/ATen.h>

#include "ops/ssm_step/params.h"

namespace hax::ops {

// x (B, C), conv_state (B, W-1, C) updated in place, weight (C, W), bias (C) or undefined.
// Returns (B, C).
at::Tensor conv1d_step(const at::Tensor& x, const at::Tensor& conv_state, const at::Tensor& weight,
                       const at::Tensor& bias, bool silu);

// x (B, H, P), dt (B, H), A (H), B and C (B, G, N), D (H) or undefined, dt_bias (H) or undefined,
// state (B, H, P, N) updated in place. Returns y (B, H, P).
at::Tensor ssd_step(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                    const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias, bool dt_softplus,
                    const at::Tensor& state);

// x (B, D), delta (B, D), A (D, N), B and C (B, G, N), D (D) or undefined, delta_bias (D) or
// undefined, state (B, D, N) updated in place. Returns y (B, D).
at::Tensor selective_scan_step(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                               const at::Tensor& C, const at::Tensor& D, const at::Tensor& delta_bias,
                               bool delta_softplus, const at::Tensor& state);

// The same steps written with LibTorch ops (the layers' former step code): the test oracles. They
// update the state in place too (copying the new state into it), in any dtype.
at::Tensor conv1d_step_reference(const at::Tensor& x, const at::Tensor& conv_state, const at::Tensor& weight,
                                 const at::Tensor& bias, bool silu);
at::Tensor ssd_step_reference(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                              const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias, bool dt_softplus,
                              const at::Tensor& state);
at::Tensor selective_scan_step_reference(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& A,
                                         const at::Tensor& B, const at::Tensor& C, const at::Tensor& D,
                                         const at::Tensor& delta_bias, bool delta_softplus, const at::Tensor& state);

// CPU kernels (float or double inputs; the SSM state x's dtype or float32), parallel over batch rows
// and heads / channel blocks.
void conv1d_step_cpu(const Conv1dStepParams& p, at::ScalarType dtype);
void ssd_step_cpu(const SsdStepParams& p, at::ScalarType dtype, at::ScalarType state_dtype);
void selective_scan_step_cpu(const SelectiveScanStepParams& p, at::ScalarType dtype, at::ScalarType state_dtype);

}  // namespace hax::ops
