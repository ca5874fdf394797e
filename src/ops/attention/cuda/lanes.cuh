// Device helpers of the sparse attention kernels: lane groups (G lanes of a warp working on one
// query or key), and the 4-element row slices each lane loads, stores and adds atomically.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "ops/attention/params.h"
#include "ops/cuda/common.cuh"

namespace hax::ops::attn {

// A list entry as the kernels read it: a key position in [0, Lk), else -1 (none). The binding
// checks the range only while ops::check_device_values() is on (the check reads device values);
// this keeps an unchecked bad entry from reading outside k and v.
__device__ __forceinline__ int32_t listed_key(int32_t j, int64_t Lk) { return j >= 0 && j < Lk ? j : -1; }

using cuda::from_f32;
using cuda::to_f32;

constexpr int kThreads = kAttentionCudaThreads;  // threads per CTA
constexpr int kChunk = 4;                        // listed keys (or entries) whose rows are loaded together
constexpr float kLog2e = 1.4426950408889634f;    // scores are kept in base 2: exp(x) = exp2(x log2 e)
constexpr float kLn2 = 0.6931471805599453f;

// G consecutive lanes of a warp (G in 4, 8, 16, 32, aligned to G). The groups of one warp may take
// different paths: every collective below names only the group's own lanes.
template <int G>
struct Group {
  static_assert(G == 4 || G == 8 || G == 16 || G == 32, "group size");
  unsigned mask;  // the group's lanes within its warp
  int lane;       // 0 .. G-1
  __device__ __forceinline__ Group() {
    const int l = threadIdx.x & 31;
    lane = l & (G - 1);
    mask = G == 32 ? 0xffffffffu : ((1u << G) - 1) << (l & ~(G - 1));
  }
  // Value `v` of group lane `src` (0 .. G-1).
  template <class V>
  __device__ __forceinline__ V from(V v, int src) const {
    return __shfl_sync(mask, v, src, G);
  }
  __device__ __forceinline__ bool any(bool b) const { return __any_sync(mask, b); }
  // Sums n values over the group's lanes; each lane gets the sums (a butterfly: fixed order).
  template <int n>
  __device__ __forceinline__ void sum(float (&x)[n]) const {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1)
#pragma unroll
      for (int u = 0; u < n; ++u) x[u] += __shfl_xor_sync(mask, x[u], o, G);
  }
  __device__ __forceinline__ float sum(float x) const {
    float a[1] = {x};
    sum(a);
    return a[0];
  }
};

// The work items of a per-query kernel beside the tile path (AttentionParams::tile_count), where
// most items belong to blocks the tile kernels compute. Item w holds kQueries consecutive ranks of
// q_order of one (b, h) (nblk items per (b, h), kQueries dividing kAttentionTileQueries, so one
// tile block). Each round, thread t of a CTA checks item base + t·gridDim.x, and the CTA then runs
// `run(item)` for the items whose block overflows (tile_count < 0) only, in ascending order. So a
// CTA checks kThreads items with one load each instead of taking them one by one (at 64K x 16
// heads, 65536 items that one CTA each only checked cost ~100 us a kernel). Every thread of the
// CTA must call it; `run` must not hold a CTA-wide barrier. With `overflow` (AttentionParams::
// tile_overflow) at 0, no block overflows, and it returns at once.
constexpr size_t kOverflowItemSmem = sizeof(uint32_t) * (kThreads / 32);  // its static shared memory
template <int kQueries, class F>
__device__ __forceinline__ void for_each_overflow_item(const int32_t* tile_count, const int32_t* overflow, int64_t L,
                                                       int64_t nblk, int64_t items, F&& run) {
  static_assert(kAttentionTileQueries % kQueries == 0 && kThreads % 32 == 0, "items of one tile block");
  __shared__ uint32_t hits[kOverflowItemSmem / sizeof(uint32_t)];  // bit t % 32 of word t / 32: item base + t·gridDim.x overflows
  if (overflow && *overflow == 0) return;  // (the same value in every thread: written by an earlier kernel)
  const int64_t stride = gridDim.x, tiles = attention_tile_blocks(L);
  for (int64_t base = blockIdx.x; base < items; base += stride * kThreads) {
    const int64_t w = base + (int64_t)threadIdx.x * stride;
    bool hit = false;
    if (w < items) hit = tile_count[(w / nblk) * tiles + (w % nblk) * kQueries / kAttentionTileQueries] < 0;
    const uint32_t word = __ballot_sync(0xffffffffu, hit);
    if (threadIdx.x % 32 == 0) hits[threadIdx.x / 32] = word;
    __syncthreads();
    for (int u = 0; u < kThreads / 32; ++u)
      for (uint32_t bits = hits[u]; bits; bits &= bits - 1) run(base + (int64_t)(u * 32 + __ffs(bits) - 1) * stride);
    __syncthreads();  // the next round rewrites hits
  }
}

// 4 elements of T as one aligned vector access.
template <class T>
struct Vec4;
template <>
struct Vec4<float> {
  using type = float4;
  __device__ __forceinline__ static void unpack(const float4& v, float (&x)[4]) {
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  }
  __device__ __forceinline__ static float4 pack(const float (&x)[4]) { return make_float4(x[0], x[1], x[2], x[3]); }
};
template <>
struct Vec4<__nv_bfloat16> {
  using type = uint2;
  __device__ __forceinline__ static void unpack(const uint2& v, float (&x)[4]) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.y));
    x[0] = a.x, x[1] = a.y, x[2] = b.x, x[3] = b.y;
  }
  __device__ __forceinline__ static uint2 pack(const float (&x)[4]) {
    const __nv_bfloat162 a = __floats2bfloat162_rn(x[0], x[1]), b = __floats2bfloat162_rn(x[2], x[3]);
    uint2 v;
    v.x = *reinterpret_cast<const unsigned*>(&a);
    v.y = *reinterpret_cast<const unsigned*>(&b);
    return v;
  }
};

// Elements d0 .. d0+3 of a row of n elements as float32 (0 past n). kVec: n % 4 == 0 and the row is
// aligned to 4 elements, so the 4 are all in the row or all past it, and one vector load reads them.
template <bool kVec, class T>
__device__ __forceinline__ void load4(const T* row, int d0, int n, float (&x)[4]) {
  if constexpr (kVec) {
    if (d0 < n) {
      Vec4<T>::unpack(*reinterpret_cast<const typename Vec4<T>::type*>(row + d0), x);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] = 0.f;
    }
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = d0 + e < n ? to_f32(row[d0 + e]) : 0.f;
  }
}

// Stores elements d0 .. d0+3 (those below n) of a row.
template <bool kVec, class T>
__device__ __forceinline__ void store4(T* row, int d0, int n, const float (&x)[4]) {
  if constexpr (kVec) {
    if (d0 < n) *reinterpret_cast<typename Vec4<T>::type*>(row + d0) = Vec4<T>::pack(x);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (d0 + e < n) row[d0 + e] = from_f32<T>(x[e]);
  }
}

// row[d0 + e] += x[e] atomically for the elements below n (a float32 row; kVec as in load4, the
// row then being 16-byte aligned: one vector atomic on Hopper).
template <bool kVec>
__device__ __forceinline__ void atomic_add4(float* row, int d0, int n, const float (&x)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kVecAtomic = kVec;
#else
  constexpr bool kVecAtomic = false;
#endif
  if constexpr (kVecAtomic) {
    if (d0 < n) atomicAdd(reinterpret_cast<float4*>(row + d0), make_float4(x[0], x[1], x[2], x[3]));
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (d0 + e < n) atomicAdd(row + d0 + e, x[e]);
  }
}

__device__ __forceinline__ float dot4(const float (&a)[4], const float (&b)[4]) {
  return a[0] * b[0] + a[1] * b[1] + a[2] * b[2] + a[3] * b[3];
}

// Row offsets in the contiguous layouts of params.h (elements).
struct Layout {
  int64_t L, Lk, H, D, Dv, S, K;
  __device__ __forceinline__ int64_t q(int64_t b, int64_t i, int64_t h) const { return ((b * L + i) * H + h) * D; }
  __device__ __forceinline__ int64_t k(int64_t b, int64_t j, int64_t h) const { return ((b * Lk + j) * H + h) * D; }
  __device__ __forceinline__ int64_t v(int64_t b, int64_t j, int64_t h) const { return ((b * Lk + j) * H + h) * Dv; }
  __device__ __forceinline__ int64_t o(int64_t b, int64_t i, int64_t h) const { return ((b * L + i) * H + h) * Dv; }
  __device__ __forceinline__ int64_t seg(int64_t bh, int64_t i) const { return (bh * L + i) * S; }       // (B, H, L, S)
  __device__ __forceinline__ int64_t list(int64_t bh, int64_t i) const { return (bh * L + i) * S * K; }  // (B, H, L, S, K)
};

inline Layout layout_of(const AttentionParams& p) {
  return {p.seqlen, p.keylen, p.nheads, p.dim, p.vdim, p.nseg, p.maxkeys};
}

// Whether every row of a tensor with `n`-element rows at `ptr` is 4-element aligned (or ptr null).
inline bool rows_aligned(const void* ptr, int64_t n, int elem_bytes) {
  return n % 4 == 0 && reinterpret_cast<uintptr_t>(ptr) % (4 * elem_bytes) == 0;
}

// Calls f(std::integral_constant<int, G>) for the runtime group size G.
template <class F>
void dispatch_group(int G, F&& f) {
  switch (G) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 16: return f(std::integral_constant<int, 16>{});
    default: return f(std::integral_constant<int, 32>{});
  }
}

// Calls f(std::integral_constant<bool, b>) for the runtime flag b.
template <class F>
void dispatch_bool(bool b, F&& f) {
  if (b) return f(std::integral_constant<bool, true>{});
  return f(std::integral_constant<bool, false>{});
}

}  // namespace hax::ops::attn
