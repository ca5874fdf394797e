// Plain parameters of the decoding-step kernels and their CUDA launchers (no LibTorch: the .cu
// files include this). See ssm_step.h for the definitions.
//
// Inputs that the layers slice out of a projection ((B, ·) rows of a wider tensor) are passed with
// their row stride: within a row (the dims after the batch) they must be contiguous. States and
// outputs are contiguous.
#pragma once
#include <cstdint>

#include "ops/kernel_dtype.h"

namespace hax::ops {

// One step of the depthwise causal conv1d with its rolling window of past inputs.
struct Conv1dStepParams {
  int64_t batch = 0;     // B
  int64_t channels = 0;  // C
  int64_t width = 0;     // W, kernel width (>= 1)
  bool silu = false;     // apply SiLU to the output
  const void* x = nullptr;       // (B, C) this step's input, rows x_stride apart
  int64_t x_stride = 0;          // elements between rows of x
  const void* weight = nullptr;  // (C, W)
  const void* bias = nullptr;    // (C) or null (zeros)
  void* state = nullptr;         // in/out (B, W-1, C): the last W-1 inputs, oldest first
  void* out = nullptr;           // out (B, C)
};

// One step of Mamba-2's SSD recurrence (scalar decay per head).
struct SsdStepParams {
  int64_t batch = 0;     // B
  int64_t nheads = 0;    // H
  int64_t headdim = 0;   // P
  int64_t ngroups = 0;   // G (divides H; head h uses group h / (H/G))
  int64_t dstate = 0;    // N
  bool dt_softplus = false;       // dt = softplus(dt + dt_bias), else dt + dt_bias
  const void* x = nullptr;        // (B, H, P), rows x_stride apart
  int64_t x_stride = 0;
  const void* dt = nullptr;       // (B, H) raw step sizes, rows dt_stride apart
  int64_t dt_stride = 0;
  const void* dt_bias = nullptr;  // (H) or null (zeros)
  const void* A = nullptr;        // (H) decay rates (negative: -exp(A_log))
  const void* Bm = nullptr;       // (B, G, N), rows B_stride apart
  int64_t B_stride = 0;
  const void* Cm = nullptr;       // (B, G, N), rows C_stride apart
  int64_t C_stride = 0;
  const void* skip = nullptr;     // (H) the D skip connection, or null (none)
  void* state = nullptr;          // in/out (B, H, P, N): x's dtype or float32
  void* y = nullptr;              // out (B, H, P)
  HAX_HOST_DEVICE int64_t heads_per_group() const { return nheads / ngroups; }
};

// One step of Mamba's selective scan (diagonal A per channel).
struct SelectiveScanStepParams {
  int64_t batch = 0;     // B
  int64_t dim = 0;       // D, channels
  int64_t ngroups = 0;   // G (divides D; channel d uses group d / (D/G))
  int64_t dstate = 0;    // N
  bool delta_softplus = false;       // delta = softplus(delta + delta_bias), else delta + delta_bias
  const void* x = nullptr;           // (B, D), rows x_stride apart
  int64_t x_stride = 0;
  const void* delta = nullptr;       // (B, D) raw step sizes, rows delta_stride apart
  int64_t delta_stride = 0;
  const void* delta_bias = nullptr;  // (D) or null (zeros)
  const void* A = nullptr;           // (D, N) decay rates (negative: -exp(A_log))
  const void* Bm = nullptr;          // (B, G, N), rows B_stride apart
  int64_t B_stride = 0;
  const void* Cm = nullptr;          // (B, G, N), rows C_stride apart
  int64_t C_stride = 0;
  const void* skip = nullptr;        // (D) the D skip connection, or null (none)
  void* state = nullptr;             // in/out (B, D, N): x's dtype or float32
  void* y = nullptr;                 // out (B, D)
  HAX_HOST_DEVICE int64_t dim_per_group() const { return dim / ngroups; }
};

// CUDA kernels, one thread per state row ((b, c), (b, h, p), (b, d)); float32 or bfloat16 storage
// (the SSM states also float32 with bfloat16 inputs), float32 math; `stream` is a cudaStream_t.
void conv1d_step_cuda(const Conv1dStepParams& p, DType dtype, void* stream);
void ssd_step_cuda(const SsdStepParams& p, DType dtype, DType state_dtype, void* stream);
void selective_scan_step_cuda(const SelectiveScanStepParams& p, DType dtype, DType state_dtype, void* stream);

}  // namespace hax::ops
