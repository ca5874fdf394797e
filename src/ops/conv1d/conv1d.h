// Depthwise causal conv1d over channels-last input (Mamba's short convolution), with an optional
// fused SiLU:
//
//   out[b, t, c] = act(bias[c] + Σ_{k=0}^{W-1} weight[c, k] in[b, t - (W-1) + k, c])
//
// where in[b, s, c] is x[b, s, c] for s >= 0 and, for s < 0 (before the row starts), the initial
// conv state init_state[b, (W-1) + s, c] (zeros if absent). In a packed row (seq_idx) a position
// never reads across a sequence boundary: taps on an earlier sequence read 0, and the initial
// state feeds only the row's first sequence.
//
// The final conv state (B, W-1, C) holds the last W-1 inputs of the row (s = L-(W-1) .. L-1,
// taken from the initial state where s < 0, i.e. when L < W-1), so that a later call with it as
// init_state (or a decoding step) continues the row's last sequence exactly. In a packed row
// the entries that belong to an earlier sequence than the last one are 0. The final state is
// not differentiable (it is a copy of inputs, for decoding).
//
// Backends: CPU (float32/float64, cpu.cpp, the reference) and CUDA (float32/bfloat16 storage,
// float32 math, widths up to kConv1dCudaMaxWidth, cuda/conv1d.cu). Both reduce dweight and dbias
// in a fixed order (deterministic); on CUDA they are reduced in float32 and cast.
//
// Shapes: B batch, L length, C channels, W kernel width (4 in Mamba).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

#include "ops/conv1d/params.h"

namespace hax::ops {

// CPU kernels (float or double), parallel over (batch row, channel block); deterministic.
void conv1d_forward_cpu(const Conv1dParams& p, at::ScalarType dtype);
void conv1d_backward_cpu(const Conv1dGradParams& p, at::ScalarType dtype);

// Tensor-level forward without autograd: returns (out (B,L,C), final_state (B,W-1,C)). bias,
// init_state and seq_idx may be undefined.
std::tuple<at::Tensor, at::Tensor> causal_conv1d_forward(const at::Tensor& x, const at::Tensor& weight,
                                                         const at::Tensor& bias, const at::Tensor& init_state,
                                                         const at::Tensor& seq_idx, bool silu);

// Differentiable causal conv1d (autograd through the hand-written backward) in x, weight, bias
// and init_state; the final state carries no gradient. bias, init_state and seq_idx may be
// undefined. Returns (out (B,L,C), final_state (B,W-1,C)).
std::tuple<at::Tensor, at::Tensor> causal_conv1d(const at::Tensor& x, const at::Tensor& weight,
                                                 const at::Tensor& bias, const at::Tensor& init_state,
                                                 const at::Tensor& seq_idx, bool silu);

// The definition written with LibTorch ops (shifted slices and masks): the test oracle
// (differentiable by autograd; use float64). Returns (out, final_state).
std::tuple<at::Tensor, at::Tensor> causal_conv1d_reference(const at::Tensor& x, const at::Tensor& weight,
                                                           const at::Tensor& bias, const at::Tensor& init_state,
                                                           const at::Tensor& seq_idx, bool silu);

}  // namespace hax::ops
