// Plain parameters of permute_rows (permute_rows.h) and its CUDA launcher (no LibTorch: the .cu
// file includes this).
#pragma once
#include <cstdint>

#include "ops/kernel_dtype.h"

namespace hax::ops {

struct PermuteRowsParams {
  int64_t batch = 0, seqlen = 0, nheads = 0, dim = 0;  // B, L, H, D
  const void* src = nullptr;        // (B, L, H, D)
  void* dst = nullptr;              // out (B, L, H, D)
  const int32_t* order = nullptr;   // (B, H, L): a permutation of [0, L) per (b, h)
  bool scatter = false;             // false: dst[b, t, h] = src[b, order[b, h, t], h]
                                    // true:  dst[b, order[b, h, t], h] = src[b, t, h]
};

// CUDA: one row of D elements per group of lanes, 16 bytes a lane where D·size % 16 == 0 and
// both tensors are 16-byte aligned. `stream` is a cudaStream_t.
void permute_rows_cuda(const PermuteRowsParams& p, DType dtype, void* stream);

}  // namespace hax::ops
