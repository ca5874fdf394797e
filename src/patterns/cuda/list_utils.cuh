// Device helpers shared by the pattern kernels: grid sizes, lane groups that write one list
// together, and binary searches. No LibTorch here.
#pragma once
#include <cstdint>

#include "ops/cuda/common.cuh"
#include "patterns/cuda_params.h"

namespace hax::patterns::dev {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = 256;  // threads per block of the element-wise kernels

// Blocks for n work items of `per_block` each; kernels loop grid-stride past the cap.
inline unsigned grid_for(int64_t n, int64_t per_block) {
  const int64_t g = (n + per_block - 1) / per_block;
  return (unsigned)(g < 1 ? 1 : (g > (int64_t)1 << 30 ? (int64_t)1 << 30 : g));
}

// Lanes that write one list of K slots together: the smallest power of two >= min(K, 32), so a
// group never straddles a warp.
inline int lanes_per_list(int64_t K) {
  int g = 1;
  while (g < 32 && g < K) g *= 2;
  return g;
}

// The mask of the G-lane group (G a power of two <= 32) of this lane, for group-wide shuffles.
__device__ __forceinline__ unsigned group_mask(int G) {
  if (G == 32) return kFullMask;
  const unsigned lane = threadIdx.x % 32;
  return ((1u << G) - 1) << (lane & ~(unsigned)(G - 1));
}

// First index in [lo, hi) of ascending a with a[idx] >= x (hi if none).
template <class T>
__device__ __forceinline__ int64_t lower_bound(const T* a, int64_t lo, int64_t hi, T x) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// First index in [lo, hi) of ascending a with a[idx] > x (hi if none).
template <class T>
__device__ __forceinline__ int64_t upper_bound(const T* a, int64_t lo, int64_t hi, T x) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] <= x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

}  // namespace hax::patterns::dev
