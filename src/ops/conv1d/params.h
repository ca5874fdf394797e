// Plain parameters of the causal conv1d kernels and the CUDA launchers (no LibTorch: the .cu
// files include this). See conv1d.h for the definition.
#pragma once
#include <cstdint>

#include "ops/kernel_dtype.h"

namespace hax::ops {

// Raw-pointer parameters of the conv1d kernels (all tensors contiguous, one dtype).
struct Conv1dParams {
  int64_t batch = 0;     // B
  int64_t seqlen = 0;    // L
  int64_t channels = 0;  // C
  int64_t width = 0;     // W, kernel width (>= 1)
  bool silu = false;     // apply SiLU to the output
  const void* x = nullptr;           // (B, L, C)
  const void* weight = nullptr;      // (C, W)
  const void* bias = nullptr;        // (C) or null (zeros)
  const void* init_state = nullptr;  // (B, W-1, C) or null (zeros)
  const int32_t* seq_idx = nullptr;  // (B, L) non-decreasing sequence numbers, or null
  void* out = nullptr;               // out (B, L, C)
  void* final_state = nullptr;       // out (B, W-1, C) or null
};

// Gradient parameters: the forward's inputs plus dout.
struct Conv1dGradParams {
  Conv1dParams fwd;                 // the forward's inputs (out and final_state unused)
  const void* dout = nullptr;       // (B, L, C)
  void* dx = nullptr;               // out (B, L, C)
  void* dweight_part = nullptr;     // CPU: out (B, C, W) per-row partial dweight, summed over B by the caller
  void* dbias_part = nullptr;       // CPU: out (B, C) per-row partial dbias, or null (no bias)
  void* dinit = nullptr;            // out (B, W-1, C) or null
  void* dweight = nullptr;          // CUDA: out (C, W), reduced over every row inside (fixed order)
  void* dbias = nullptr;            // CUDA: out (C), likewise, or null (no bias)
  void* workspace = nullptr;        // CUDA: float32 scratch of conv1d_cuda_workspace(fwd) entries
};

// CUDA tiling: a thread owns one channel and a run of kConv1dCudaRun consecutive positions (its
// W-1 preceding inputs slide through registers); a block is 32 channels x kConv1dCudaRunsPerBlock
// runs. Kernel widths up to kConv1dCudaMaxWidth.
constexpr int64_t kConv1dCudaRun = 16;
constexpr int64_t kConv1dCudaRunsPerBlock = 8;
constexpr int64_t kConv1dCudaPositionsPerBlock = kConv1dCudaRun * kConv1dCudaRunsPerBlock;
constexpr int64_t kConv1dCudaMaxWidth = 16;

// Float32 entries of scratch the CUDA backward needs: one (W+1, C) partial of (dweight, dbias)
// per (batch row, block of positions).
inline int64_t conv1d_cuda_workspace(const Conv1dParams& p) {
  const int64_t pos_blocks = (p.seqlen + kConv1dCudaPositionsPerBlock - 1) / kConv1dCudaPositionsPerBlock;
  return p.batch * pos_blocks * (p.width + 1) * p.channels;
}

// CUDA kernels (float32 or bfloat16 storage, float32 math); `stream` is a cudaStream_t. Widths
// up to kConv1dCudaMaxWidth. dweight and dbias are written in the input's dtype, reduced in
// float32 over partials in a fixed order (deterministic, no atomics).
void conv1d_forward_cuda(const Conv1dParams& p, DType dtype, void* stream);
void conv1d_backward_cuda(const Conv1dGradParams& p, DType dtype, void* stream);

}  // namespace hax::ops
