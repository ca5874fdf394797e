// The element type a GPU kernel reads and writes (it accumulates in float32 either way). Plain C++:
// the .cu files include this, never LibTorch.
#pragma once

namespace hax::ops {

enum class DType {
  kF32,   // float
  kBF16,  // __nv_bfloat16
};

}  // namespace hax::ops

// Marks params-struct helpers that kernels call too.
#if defined(__CUDACC__)
#define HAX_HOST_DEVICE __host__ __device__
#else
#define HAX_HOST_DEVICE
#endif
