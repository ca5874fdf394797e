// Plain parameters of the (gated) RMSNorm kernels and the CUDA launchers (no LibTorch: the .cu
// files include this). See rmsnorm.h for the definition.
#pragma once
#include <cstdint>

#include "ops/kernel_dtype.h"

namespace hax::ops {

// Raw-pointer parameters of the RMSNorm kernels (all tensors contiguous, one dtype).
struct RmsNormParams {
  int64_t rows = 0;        // M, the product of x's leading dims
  int64_t dim = 0;         // D, x's last dim
  int64_t group_size = 0;  // entries per normalized group (divides D)
  double eps = 1e-5;       // added to the mean square
  const void* x = nullptr;       // (M, D)
  const void* z = nullptr;       // (M, D) gate, or null (no gate)
  const void* weight = nullptr;  // (D)
  void* out = nullptr;           // out (M, D)
  void* rstd = nullptr;          // out (M, D / group_size): 1 / sqrt(mean(u^2) + eps), or null
  HAX_HOST_DEVICE int64_t ngroups() const { return group_size > 0 ? dim / group_size : 0; }
};

// Gradient parameters: the forward's inputs and saved rstd plus dout.
struct RmsNormGradParams {
  RmsNormParams fwd;             // the forward's inputs and rstd
  const void* dout = nullptr;    // (M, D)
  void* dx = nullptr;            // out (M, D)
  void* dz = nullptr;            // out (M, D), or null (no gate)
  void* dweight = nullptr;       // out (D): reduced over rows inside, in a fixed order
  void* workspace = nullptr;     // CUDA only: float32 scratch of rmsnorm_cuda_workspace(fwd) entries
};

// Float32 entries of scratch the CUDA backward needs (the per-row-block dweight partials).
inline int64_t rmsnorm_cuda_workspace(const RmsNormParams& p) { return (p.rows + 63) / 64 * p.dim; }

// CUDA kernels (float32 or bfloat16 storage, float32 math); `stream` is a cudaStream_t. rstd is
// always float32. dweight (float32, D) is reduced over row blocks in a fixed order (deterministic).
void rmsnorm_forward_cuda(const RmsNormParams& p, DType dtype, void* stream);
void rmsnorm_backward_cuda(const RmsNormGradParams& p, DType dtype, void* stream);

}  // namespace hax::ops
