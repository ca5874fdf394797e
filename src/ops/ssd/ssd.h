// Mamba-2's SSD scan (state-space duality), per head h with scalar decay A_h < 0:
//
//   state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t B_t^T        state: (P, N)
//   y_t     = state_t C_t                                            y_t:   (P)
//
// computed by the chunked algorithm of the SSD paper: within a chunk of Q steps the quadratic
// ("attention") form y = (C B^T ∘ decay mask) (dt x), between chunks the state is passed on.
// A packed row of several sequences resets the state where seq_idx changes. The initial state
// applies to the first sequence of a row; the final state is the state after the last position.
//
// Shapes: B batch, L length, H heads, P head dim, G groups (H % G == 0, heads h use group
// h / (H/G) of B and C), N state size.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

#include "ops/ssd/params.h"

namespace hax::ops {

// Whether the CUDA SSD runs its warpgroup-product (wgmma) kernels where the build targets sm_90a
// and the sizes allow it (bfloat16, P and N multiples of 64, N <= 128): the forward's chunk_scan,
// the local states of both directions, and the backward's dB/dC (which then also gives dx's u
// term); process-wide, default on. Off: the mma.sync kernels for every size (the tests run both).
// HAX_SSD_WGMMA=0 in the environment keeps the mma.sync kernels whatever this says (for timing
// comparisons).
void set_ssd_wgmma(bool on);
bool ssd_wgmma();
// Whether the CUDA SSD (bfloat16, with its wgmma kernels, one sub-chunk per chunk in the forward)
// computes the states with one sweep of local states and pass (cuda/segment_scan_wgmma.cuh) instead
// of a local-state kernel and a state pass; process-wide. Default off: correct but slower (H200,
// L = 64K: fwd+bwd 2.06-2.09 against 1.90-1.92 ms, BENCHMARKS.md pass 37; the tests run both
// forms). HAX_SSD_SEGSCAN=1 or 0 in the environment chooses, whatever this says.
void set_ssd_sweep(bool on);
bool ssd_sweep();
// Whether the CUDA SSD backward (where its wgmma dB/dC runs) computes dB, dC and <dS, S> of a
// (row, group, sub-chunk, 64 columns of N) in one block (cuda/dbdc_joint_wgmma.cuh), so that dx
// reads no states; off: dB and dC blocks apart and <dS, S> in dx. Process-wide, default on
// (H100, L = 64K: fwd+bwd 2.11-2.14 against 2.14-2.18 ms; dx 538 -> 479 us, dB/dC 385 -> 417 us;
// BENCHMARKS.md pass 38; the tests run both forms). HAX_SSD_DBDC_JOINT=1 or 0 in the environment
// chooses, whatever this says.
void set_ssd_joint_dbdc(bool on);
bool ssd_joint_dbdc();

// CPU kernels (float or double), parallel over (batch, head).
void ssd_forward_cpu(const SsdParams& p, at::ScalarType dtype);
void ssd_backward_cpu(const SsdGradParams& p, at::ScalarType dtype);

// Tensor-level forward without autograd: returns (y, final_state, chunk_states); chunk_states
// (B, H, nchunks, N, P) is float32 on CUDA, x's dtype on the CPU.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ssd_forward(const at::Tensor& x, const at::Tensor& dt,
                                                           const at::Tensor& A, const at::Tensor& B,
                                                           const at::Tensor& C, const at::Tensor& init_state,
                                                           const at::Tensor& seq_idx, int64_t chunk);

// Differentiable SSD (autograd through the hand-written backward). init_state and seq_idx may
// be undefined tensors. Returns (y (B,L,H,P), final_state (B,H,P,N)).
std::tuple<at::Tensor, at::Tensor> ssd(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                                       const at::Tensor& B, const at::Tensor& C,
                                       const at::Tensor& init_state, const at::Tensor& seq_idx,
                                       int64_t chunk);

// The naive sequential recurrence written with LibTorch ops, one step per position: the test
// oracle (differentiable by autograd; use float64) and the benchmark's baseline.
std::tuple<at::Tensor, at::Tensor> ssd_reference(const at::Tensor& x, const at::Tensor& dt,
                                                 const at::Tensor& A, const at::Tensor& B,
                                                 const at::Tensor& C, const at::Tensor& init_state,
                                                 const at::Tensor& seq_idx);

}  // namespace hax::ops
