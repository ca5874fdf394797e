// Plain parameters of the selective-scan kernels and the CUDA launchers (no LibTorch: the .cu
// files include this). See selective_scan.h for the definition.
#pragma once
#include <cstdint>

#include "ops/kernel_dtype.h"

namespace hax::ops {

// Channels per CPU work item: the CPU kernels process the channels of a group in blocks of this
// many (the last block of a group may be narrower). The block decomposition fixes the order of
// every reduction over channels (dB, dC), so results do not depend on the thread count.
constexpr int64_t kSelectiveScanChannelBlock = 16;

// Raw-pointer parameters of the selective-scan kernels (all tensors contiguous, one dtype but for
// the CUDA checkpoints).
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
  void* checkpoints = nullptr;       // out (B, nsegments, D, N): state entering each segment (after a
                                     // reset at its first step), or null when no backward will
                                     // follow. The input's dtype on the CPU, float32 on CUDA.
  void* workspace = nullptr;         // CUDA: float32 scratch of selective_scan_cuda_forward_workspace
  HAX_HOST_DEVICE int64_t dim_per_group() const { return dim / ngroups; }
  HAX_HOST_DEVICE int64_t nsegments() const { return (seqlen + checkpoint - 1) / checkpoint; }
  // Channel blocks per group, each at most kSelectiveScanChannelBlock wide (CPU).
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
  void* dA_part = nullptr;       // CPU: out (B, D, N) per-row partial dA, summed over B by the caller
  void* dB_part = nullptr;       // CPU: out (B, L, G, blocks_per_group, N): per-channel-block dB,
                                 // summed over a group's blocks by the caller
  void* dC_part = nullptr;       // CPU: out (B, L, G, blocks_per_group, N)
  void* dinit = nullptr;         // out (B, D, N) or null
  void* dA = nullptr;            // CUDA: out (D, N), reduced inside (fixed order)
  void* dB = nullptr;            // CUDA: out (B, L, G, N), reduced over the group's channels inside
  void* dC = nullptr;            // CUDA: out (B, L, G, N)
  void* workspace = nullptr;     // CUDA: float32 scratch of selective_scan_cuda_backward_workspace
};

// CUDA decomposition (see cuda/selective_scan.cu). The forward splits L into segments of
// kSelectiveScanCudaSegment steps, the backward into sub-segments of kSelectiveScanCudaSub steps
// (both independent of the checkpoint interval). A thread holds up to 16 state entries of one
// channel in registers; channels with N > 16 use several lanes (a power of two), N <= 256.
constexpr int64_t kSelectiveScanCudaSegment = 64;
constexpr int64_t kSelectiveScanCudaSub = 16;
constexpr int64_t kSelectiveScanCudaMaxState = 256;

// Lanes (threads) per channel for state size N: 1 up to 16, then N / 16 rounded up to a power of two.
inline HAX_HOST_DEVICE int64_t selective_scan_cuda_lanes(int64_t N) {
  int64_t lanes = 1;
  while (lanes * 16 < N) lanes *= 2;
  return lanes;
}

// The backward's warps hold 32 / lanes channels of one group: chunks of that many per group.
inline HAX_HOST_DEVICE int64_t selective_scan_cuda_chunks(const SelectiveScanParams& p) {
  const int64_t per_warp = 32 / selective_scan_cuda_lanes(p.dstate);
  return (p.dim_per_group() + per_warp - 1) / per_warp;
}

// Float32 entries of the forward's scratch: per (row, segment) the local state (D, N) and Σ delta (D).
inline int64_t selective_scan_cuda_forward_workspace(const SelectiveScanParams& p) {
  const int64_t segs = (p.seqlen + kSelectiveScanCudaSegment - 1) / kSelectiveScanCudaSegment;
  return p.batch * segs * p.dim * (p.dstate + 1);
}

// Float32 entries of the backward's scratch: per (row, sub-segment) the entering state and the
// adjoint (D, N) each and Σ delta (D); per (row, position, group, chunk) the dB and dC partials (N).
inline int64_t selective_scan_cuda_backward_workspace(const SelectiveScanParams& p) {
  const int64_t subs = (p.seqlen + kSelectiveScanCudaSub - 1) / kSelectiveScanCudaSub;
  return p.batch * subs * p.dim * (2 * p.dstate + 1) +
         2 * p.batch * p.seqlen * p.ngroups * selective_scan_cuda_chunks(p) * p.dstate;
}

// CUDA kernels (float32 or bfloat16 storage, float32 math); `stream` is a cudaStream_t. N <= 256.
// The forward writes float32 checkpoints; the backward reduces dA, dB and dC in float32 in a fixed
// order (deterministic, no atomics) and writes them in the input's dtype.
void selective_scan_forward_cuda(const SelectiveScanParams& p, DType dtype, void* stream);
void selective_scan_backward_cuda(const SelectiveScanGradParams& p, DType dtype, void* stream);

}  // namespace hax::ops
