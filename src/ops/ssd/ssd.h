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

namespace hax::ops {

// Raw-pointer parameters of the SSD kernels (all tensors contiguous, one dtype).
struct SsdParams {
  int64_t batch = 0, seqlen = 0, nheads = 0, headdim = 0, ngroups = 0, dstate = 0;
  int64_t chunk = 64;           // chunk length Q of the chunked algorithm
  const void* x = nullptr;      // (B, L, H, P)
  const void* dt = nullptr;     // (B, L, H), positive step sizes (softplus already applied)
  const void* A = nullptr;      // (H), negative decay rates
  const void* Bm = nullptr;     // (B, L, G, N)
  const void* Cm = nullptr;     // (B, L, G, N)
  const void* init_state = nullptr;  // (B, H, P, N) or null (zeros)
  const int32_t* seq_idx = nullptr;  // (B, L) non-decreasing sequence numbers, or null
  void* y = nullptr;            // out (B, L, H, P)
  void* final_state = nullptr;  // out (B, H, P, N)
  void* chunk_states = nullptr; // out (B, H, nchunks, N, P): state entering each chunk (for backward)
  int64_t nchunks() const { return (seqlen + chunk - 1) / chunk; }
};

// Gradient parameters: inputs of SsdParams plus the saved chunk states, dy and dfinal.
struct SsdGradParams {
  SsdParams fwd;                      // the forward's inputs and chunk_states
  const void* dy = nullptr;           // (B, L, H, P)
  const void* dfinal = nullptr;       // (B, H, P, N) or null
  void* dx = nullptr;                 // out (B, L, H, P)
  void* ddt = nullptr;                // out (B, L, H)
  void* dA_part = nullptr;            // out (B, H): per-row partial dA, summed over B by the caller
  void* dB_head = nullptr;            // out (B, L, H, N): per-head dB, summed over a group's heads by the caller
  void* dC_head = nullptr;            // out (B, L, H, N)
  void* dinit = nullptr;              // out (B, H, P, N) or null
};

// CPU kernels (float or double), parallel over (batch, head).
void ssd_forward_cpu(const SsdParams& p, at::ScalarType dtype);
void ssd_backward_cpu(const SsdGradParams& p, at::ScalarType dtype);

// Tensor-level forward without autograd: returns (y, final_state, chunk_states).
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
