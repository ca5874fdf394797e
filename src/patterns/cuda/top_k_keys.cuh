// Key Selection's comparison keys and the search of its top-k lists, shared by the kernels that
// read them (top_k_prefix.cu, top_k_intervals.cu, merge_lists.cu). No LibTorch here.
//
// A candidate's key (TopKPrefixParams): the score (NaN as -inf, -0 as +0) in the high 32 bits as
// an order-preserving unsigned integer, the inverted position in the low 32 bits, so a larger key
// is a better candidate and equal scores rank the earlier position higher. Keys are > 0; 0 marks
// an empty slot of a list. A top-k list is k keys, descending, 0-padded.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace hax::patterns {

// The comparison key of a score at position pos (larger = better).
__device__ __forceinline__ uint64_t score_key(float v, int64_t pos) {
  if (isnan(v)) v = -INFINITY;
  if (v == 0.f) v = 0.f;  // -0 ties with +0
  uint32_t u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((uint64_t)u << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)pos);
}
// The position of a (non-zero) key.
__device__ __forceinline__ int32_t key_pos(uint64_t key) { return (int32_t)(0xFFFFFFFFu - (uint32_t)key); }

// Entries of the descending, 0-padded list a[0..k) greater than x.
__device__ __forceinline__ int64_t count_greater(const uint64_t* a, int64_t k, uint64_t x) {
  int64_t lo = 0, hi = k;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] > x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

}  // namespace hax::patterns
