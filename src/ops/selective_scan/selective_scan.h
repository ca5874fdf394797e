// Mamba's selective scan (S6), per channel d with a diagonal state matrix A (D, N):
//
//   h_t[d, n] = exp(delta_t[d] A[d, n]) h_{t-1}[d, n] + delta_t[d] B_t[g(d), n] x_t[d]
//   y_t[d]    = Σ_n C_t[g(d), n] h_t[d, n]
//
// with g(d) = d / (D/G): channels share B and C in G groups (G = 1 is standard Mamba). delta is
// the step size after softplus; the D skip connection and the z gate are not part of the op (the
// layer applies them). A packed row of several sequences resets the state where seq_idx changes;
// the initial state applies to the first sequence of a row and the final state is the state after
// the last position (exactly as ssd).
//
// The backward is a reverse-time adjoint scan. The forward stores the state only at checkpoints,
// every `checkpoint` steps (the state entering each segment); the backward recomputes the states
// of one segment at a time from its checkpoint, so memory is O(B·D·N·L/checkpoint), not
// O(B·D·N·L).
//
// Backends: CPU (float32/float64, cpu.cpp, the reference) and CUDA (float32/bfloat16 storage,
// float32 math, N <= kSelectiveScanCudaMaxState, cuda/selective_scan.cu), which also splits L into
// segments scanned in parallel and combined. On CUDA the checkpoints are float32, and dA, dB, dC
// are reduced in float32 in a fixed order (deterministic) and cast.
//
// Shapes: B batch, L length, D channels, G groups (D % G == 0), N state size.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

#include "ops/selective_scan/params.h"

namespace hax::ops {

// CPU kernels (float or double), parallel over (batch row, channel block); deterministic.
void selective_scan_forward_cpu(const SelectiveScanParams& p, at::ScalarType dtype);
void selective_scan_backward_cpu(const SelectiveScanGradParams& p, at::ScalarType dtype);

// Tensor-level forward without autograd: returns (y (B,L,D), final_state (B,D,N), checkpoints
// (B, nsegments, D, N); x's dtype on the CPU, float32 on CUDA). init_state and seq_idx may be
// undefined. With save_checkpoints false the checkpoints tensor is undefined (inference).
std::tuple<at::Tensor, at::Tensor, at::Tensor> selective_scan_forward(
    const at::Tensor& x, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
    const at::Tensor& init_state, const at::Tensor& seq_idx, int64_t checkpoint = 64,
    bool save_checkpoints = true);

// Differentiable selective scan (autograd through the hand-written backward) in x, delta, A, B,
// C and init_state. init_state and seq_idx may be undefined tensors. Returns (y (B,L,D),
// final_state (B,D,N)).
std::tuple<at::Tensor, at::Tensor> selective_scan(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& A,
                                                  const at::Tensor& B, const at::Tensor& C,
                                                  const at::Tensor& init_state, const at::Tensor& seq_idx,
                                                  int64_t checkpoint = 64);

// The naive recurrence written with LibTorch ops, one step per position: the test oracle
// (differentiable by autograd; use float64) and the benchmark's baseline.
std::tuple<at::Tensor, at::Tensor> selective_scan_reference(const at::Tensor& x, const at::Tensor& delta,
                                                            const at::Tensor& A, const at::Tensor& B,
                                                            const at::Tensor& C, const at::Tensor& init_state,
                                                            const at::Tensor& seq_idx);

}  // namespace hax::ops
