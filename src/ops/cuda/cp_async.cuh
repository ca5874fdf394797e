// Asynchronous global -> shared copies (cp.async, sm_80 and later): 16 bytes per instruction,
// zero-filled when the source lies outside the tensor, completing in commit groups, so that a
// kernel loads its next tile while it computes on the current one (double buffering).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/cuda/tile_layout.cuh"

namespace hax::ops::cuda {

// Copies 16 bytes from src to the shared address dst, or writes 16 zero bytes when !valid (src is
// then not read, but must still be a valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0));
}
// The same for 4 bytes (one float32; cached in L1, as cp.async allows only .ca below 16 bytes).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 4 : 0));
}
// The same for 8 bytes.
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight. The "memory"
// clobber keeps the compiler from sinking loads written before the wait (say a row's lse) past
// it, which would add their latency to the copies' instead of overlapping the two.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Issues the copies of rows pos(r), r < nrows, of a bfloat16 (positions, stride) array into the
// shared tile dst (nrows, S): columns < nvalid (a multiple of 8), zeros up to ncols (a multiple
// of 8); a row with pos(r) < 0 is all zeros. Every thread of the block takes part.
template <int S, class Pos>
__device__ __forceinline__ void async_rows(__nv_bfloat16* dst, const __nv_bfloat16* src, int64_t stride, Pos pos,
                                           int nrows, int nvalid, int ncols) {
  const int chunks = ncols / 8;
  for (int x = threadIdx.x; x < nrows * chunks; x += blockDim.x) {
    const int r = x / chunks, c = (x % chunks) * 8, i = pos(r);
    const bool ok = i >= 0 && c < nvalid;
    cp_async16(dst + r * S + c, ok ? src + (int64_t)i * stride + c : src, ok);
  }
}

// A (NROWS, NCOLS) bfloat16 tile copied by THREADS threads with the tile's shape known at compile
// time: each thread copies one fixed 16-byte column chunk, col(), of the rows row(k), k < kPer, so
// addresses are computed once and the copies are issued without a loop (about 5 instructions
// each, where async_rows spends ~30).
template <int NROWS, int NCOLS, int THREADS>
struct TileCopy {
  static constexpr int kChunks = NCOLS / 8, kRowStep = THREADS / kChunks, kPer = NROWS * kChunks / THREADS;
  static_assert(THREADS % kChunks == 0 && (NROWS * kChunks) % THREADS == 0, "TileCopy: the threads must tile the copy evenly");
  static __device__ __forceinline__ int row(int k) { return (int)(threadIdx.x / kChunks) + k * kRowStep; }
  static __device__ __forceinline__ int col() { return (int)(threadIdx.x % kChunks) * 8; }

  // dst rows row(k) = src rows pos[k] (pos < 0: zeros), columns < nvalid; dst laid out by Lay
  // (tile_layout.cuh).
  template <class Lay>
  static __device__ __forceinline__ void gather_to(__nv_bfloat16* dst, const __nv_bfloat16* src, int64_t stride,
                                                   const int32_t (&pos)[kPer], int nvalid) {
    const int c = col();
    const bool col_ok = c < nvalid;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const bool ok = col_ok && pos[k] >= 0;
      cp_async16(Lay::at(dst, row(k), c), ok ? src + (int64_t)pos[k] * stride + c : src, ok);
    }
  }
  // The same into a row-major tile of row stride S.
  template <int S>
  static __device__ __forceinline__ void gather(__nv_bfloat16* dst, const __nv_bfloat16* src, int64_t stride,
                                                const int32_t (&pos)[kPer], int nvalid) {
    gather_to<Padded<S>>(dst, src, stride, pos, nvalid);
  }

  // dst rows r = src rows row0 + r (zeros from row L on), columns < nvalid.
  template <int S>
  static __device__ __forceinline__ void rows(__nv_bfloat16* dst, const __nv_bfloat16* src, int64_t stride, int row0,
                                              int L, int nvalid) {
    const int c = col(), r = row(0);
    const bool col_ok = c < nvalid;
    const __nv_bfloat16* from = src + (int64_t)(row0 + r) * stride + c;
    __nv_bfloat16* to = dst + r * S + c;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const bool ok = col_ok && row0 + r + k * kRowStep < L;
      cp_async16(to + k * kRowStep * S, ok ? from + (int64_t)k * kRowStep * stride : src, ok);
    }
  }
};

// TileCopy<NROWS, NCOLS, THREADS>::rows<S>: the consecutive rows row0 .. row0 + NROWS - 1.
template <int S, int NROWS, int NCOLS, int THREADS>
__device__ __forceinline__ void async_tile(__nv_bfloat16* dst, const __nv_bfloat16* src, int64_t stride, int row0,
                                           int L, int nvalid) {
  TileCopy<NROWS, NCOLS, THREADS>::template rows<S>(dst, src, stride, row0, L, nvalid);
}

}  // namespace hax::ops::cuda
