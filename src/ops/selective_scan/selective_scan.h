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
// Shapes: B batch, L length, D channels, G groups (D % G == 0), N state size.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace hax::ops {

// Channels per kernel work item: the kernels process the channels of a group in blocks of this
// many (the last block of a group may be narrower). The block decomposition fixes the order of
// every reduction over channels (dB, dC), so results do not depend on the thread count.
constexpr int64_t kSelectiveScanChannelBlock = 16;

// Raw-pointer parameters of the selective-scan kernels (all tensors contiguous, one dtype).
struct SelectiveScanParams {
  int64_t batch = 0;       // B
  int64_t seqlen = 0;      // L
  int64_t dim = 0;         // D, channels
  int64_t ngroups = 0;     // G, groups of channels sharing B and C (divides D)
  int64_t dstate = 0;      // N, state size per channel
  int64_t checkpoint = 64; // steps between saved states (segment length of the backward's recompute)
  const void* x = nullptr;           // (B, L, D) input
  const void* delta = nullptr;       // (B, L, D) positive step sizes (softplus already applied)
  const void* A = nullptr;           // (D, N) decay rates (negative in Mamba: A = -exp(A_log))
  const void* Bm = nullptr;          // (B, L, G, N) input projections
  const void* Cm = nullptr;          // (B, L, G, N) output projections
  const void* init_state = nullptr;  // (B, D, N) or null (zeros)
  const int32_t* seq_idx = nullptr;  // (B, L) non-decreasing sequence numbers, or null
  void* y = nullptr;                 // out (B, L, D)
  void* final_state = nullptr;       // out (B, D, N)
  void* checkpoints = nullptr;       // out (B, nsegments, D, N): state entering each segment, or
                                     // null when no backward will follow
  int64_t dim_per_group() const { return dim / ngroups; }
  int64_t nsegments() const { return (seqlen + checkpoint - 1) / checkpoint; }
  // Channel blocks per group, each at most kSelectiveScanChannelBlock wide.
  int64_t blocks_per_group() const {
    return (dim_per_group() + kSelectiveScanChannelBlock - 1) / kSelectiveScanChannelBlock;
  }
};

// Gradient parameters: the forward's inputs and checkpoints plus dy and dfinal.
struct SelectiveScanGradParams {
  SelectiveScanParams fwd;       // the forward's inputs and checkpoints
  const void* dy = nullptr;      // (B, L, D)
  const void* dfinal = nullptr;  // (B, D, N) or null (zeros)
  void* dx = nullptr;            // out (B, L, D)
  void* ddelta = nullptr;        // out (B, L, D)
  void* dA_part = nullptr;       // out (B, D, N): per-row partial dA, summed over B by the caller
  void* dB_part = nullptr;       // out (B, L, G, blocks_per_group, N): per-channel-block dB,
                                 // summed over a group's blocks by the caller
  void* dC_part = nullptr;       // out (B, L, G, blocks_per_group, N)
  void* dinit = nullptr;         // out (B, D, N) or null
};

// CPU kernels (float or double), parallel over (batch row, channel block); deterministic.
void selective_scan_forward_cpu(const SelectiveScanParams& p, at::ScalarType dtype);
void selective_scan_backward_cpu(const SelectiveScanGradParams& p, at::ScalarType dtype);

// Tensor-level forward without autograd: returns (y (B,L,D), final_state (B,D,N), checkpoints
// (B, nsegments, D, N)). init_state and seq_idx may be undefined. With save_checkpoints false the
// checkpoints tensor is undefined (inference).
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
