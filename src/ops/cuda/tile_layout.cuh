// Layouts of bfloat16 tiles in shared memory: where entry (row, col) of a tile X lives, for col a
// multiple of 8 (a 16-byte chunk; the chunk's entries follow it). The tensor-core fragments
// (mma_bf16.cuh) read through them and the cp.async copies (cp_async.cuh) write through them.
//   Padded<S>: row-major with row stride S (head dim + 8: rows 16-byte aligned, and the 8 rows of
//     an 8 x 8 matrix on 8 distinct 16-byte bank groups).
//   Swizzle128: rows of 64 entries (128 bytes) with chunk c of row r stored at chunk c ^ (r % 8),
//     the layout TMA's 128-byte swizzle writes (the tile 1024-byte aligned); the 8 rows of an
//     8 x 8 matrix again fall on 8 distinct 16-byte bank groups.
#pragma once
#include <cuda_bf16.h>

namespace hax::ops::cuda {

template <int S>
struct Padded {
  static __device__ __forceinline__ const __nv_bfloat16* at(const __nv_bfloat16* X, int row, int col) {
    return X + row * S + col;
  }
  static __device__ __forceinline__ __nv_bfloat16* at(__nv_bfloat16* X, int row, int col) { return X + row * S + col; }
};
struct Swizzle128 {
  static __device__ __forceinline__ int off(int row, int col) { return row * 64 + ((((col >> 3) ^ row) & 7) << 3); }
  static __device__ __forceinline__ const __nv_bfloat16* at(const __nv_bfloat16* X, int row, int col) {
    return X + off(row, col);
  }
  static __device__ __forceinline__ __nv_bfloat16* at(__nv_bfloat16* X, int row, int col) { return X + off(row, col); }
};

}  // namespace hax::ops::cuda
