// Shared pieces of the causal attention CUDA kernels: sizes as ints, the block -> (b, h, tile) map,
// the visible key range of a query (and query range of a key), global -> shared tile loads, and
// the head-dim bucket dispatch. No LibTorch here.
//
// Visibility (cpu.cpp has the same definition): query i sees keys j in [lo_i, i],
//   lo_i = max(start of i's packed sequence, i - window + 1);
// key j is seen by queries i in [j, hi_j],
//   hi_j = min(end of j's packed sequence, j + window - 1)     (window 0 = no limit).
// Both bounds are non-decreasing in the position, so a tile of queries [i0, i1] sees exactly the
// key tiles from lo_{i0} to i1, and a tile of keys [j0, j1] is seen by the query tiles from j0 to
// hi_{j1}; tiles outside are never visited, entries inside are masked one by one.
// With a band (params.h; LSH over bucket-sorted rows) the four bounds come from its arrays
// instead (Visibility); they are non-decreasing too, so the same tile ranges hold.
#pragma once
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "ops/causal_attention/params.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/mma_bf16.cuh"

namespace hax::ops::causal_cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The sizes the kernels index with (checked to fit an int by the launchers) and the grid map.
struct Dims {
  int L = 0, H = 0, D = 0, Dv = 0;  // sequence length, heads, q/k head dim, v head dim
  int W = 0;                        // window (0 = no limit; a window >= L is stored as 0)
  int BH = 0;                       // B * H
  int ntiles = 0;                   // tiles of the sequence per (b, h)
  int KR = 0;                       // backward: key rows with dK/dV blocks (causal_attention_key_rows)
  float scale2 = 0;                 // scale * log2(e): scores in base-2 units, for exp2f
};

inline Dims make_dims(const CausalAttentionParams& p, int tile) {
  if (p.seqlen >= INT_MAX / 2 || p.batch * p.nheads >= INT_MAX)
    throw std::runtime_error("causal_attention CUDA kernels: L = " + std::to_string(p.seqlen) +
                             " must be below 2^30 and B * H below 2^31");
  if (p.dim > kCausalAttentionCudaMaxDim || p.vdim > kCausalAttentionCudaMaxDim || p.dim < 1 || p.vdim < 1)
    throw std::runtime_error("causal_attention CUDA kernels: head dims D = " + std::to_string(p.dim) +
                             " and Dv = " + std::to_string(p.vdim) + " must be in [1, 128]");
  Dims d;
  d.L = (int)p.seqlen, d.H = (int)p.nheads, d.D = (int)p.dim, d.Dv = (int)p.vdim;
  d.W = p.window >= p.seqlen ? 0 : (int)p.window;
  d.BH = (int)(p.batch * p.nheads);
  d.ntiles = (int)((p.seqlen + tile - 1) / tile);
  d.scale2 = (float)(p.scale * 1.4426950408889634);
  return d;
}

// Blocks in the grid: one per (tile, b, h); blockIdx.x / BH is the tile's rank (see tile_of).
inline unsigned grid_size(const Dims& d) {
  const int64_t n = (int64_t)d.ntiles * d.BH;
  if (n >= INT_MAX) throw std::runtime_error("causal_attention CUDA kernels: too many tiles");
  return (unsigned)n;
}

// The (b * H + h) of this block.
__device__ __forceinline__ int bh_of(const Dims& d) { return (int)(blockIdx.x % (unsigned)d.BH); }
// The tile of this block. Blocks start in blockIdx order, so the costliest tiles go first: the
// last query tiles (`reversed`, they see the most keys) or the first key tiles.
__device__ __forceinline__ int tile_of(const Dims& d, bool reversed) {
  const int rank = (int)(blockIdx.x / (unsigned)d.BH);
  return reversed ? d.ntiles - 1 - rank : rank;
}

// First position of i's packed sequence: the smallest p <= i with seq[p] == seq[i] (seq is
// non-decreasing, so these p form one run ending at i).
__device__ __forceinline__ int seq_start(const int32_t* seq, int i) {
  const int32_t s = seq[i];
  int lo = 0, hi = i;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const int mid = lo + ((hi - lo) >> 1);
    if (seq[mid] < s) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Last position of j's packed sequence: the largest p >= j (p < L) with seq[p] == seq[j].
__device__ __forceinline__ int seq_end(const int32_t* seq, int L, int j) {
  const int32_t s = seq[j];
  int lo = j, hi = L - 1;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const int mid = lo + ((hi - lo + 1) >> 1);
    if (seq[mid] > s) hi = mid - 1;
    else lo = mid;
  }
  return lo;
}

// lo_i, the first key query i sees (0 <= i < L); seq is the batch row of seq_idx or null.
__device__ __forceinline__ int first_key(const int32_t* seq, int W, int i) {
  int lo = seq ? seq_start(seq, i) : 0;
  if (W > 0) lo = max(lo, i - W + 1);
  return lo;
}

// hi_j, the last query that sees key j (0 <= j < L).
__device__ __forceinline__ int last_query(const int32_t* seq, int L, int W, int j) {
  int hi = seq ? seq_end(seq, L, j) : L - 1;
  if (W > 0) hi = (int)min((int64_t)hi, (int64_t)j + W - 1);
  return hi;
}

// Who sees whom in one (b, h): the causal (window, packed) definition above, or the band of
// CausalAttentionParams::band. All four bounds are non-decreasing, so the smallest first bound of
// a tile of rows is its first row's and the largest last bound its last row's.
struct Visibility {
  const int32_t* band = nullptr;  // this (b, h)'s entries of part 0 of the band, or null
  int64_t part = 0;               // B·H·L: the distance between the band's parts
  const int32_t* seq = nullptr;   // the batch row of seq_idx, or null
  int W = 0, L = 0;
  __device__ __forceinline__ int first_key(int i) const {
    return band ? band[i] : causal_cuda::first_key(seq, W, i);
  }
  __device__ __forceinline__ int last_key(int i) const { return band ? band[part + i] : i; }
  __device__ __forceinline__ int first_query(int j) const { return band ? band[2 * part + j] : j; }
  __device__ __forceinline__ int last_query(int j) const {
    return band ? band[3 * part + j] : causal_cuda::last_query(seq, L, W, j);
  }
};

__device__ __forceinline__ Visibility visibility(const CausalAttentionParams& p, const Dims& dm, int b, int bh) {
  Visibility v;
  v.part = (int64_t)dm.BH * dm.L;
  v.band = p.band ? p.band + (int64_t)bh * dm.L : nullptr;
  v.seq = p.seq_idx ? p.seq_idx + (int64_t)b * dm.L : nullptr;
  v.W = dm.W, v.L = dm.L;
  return v;
}

// The column tiles [t0, t1] of width BN that a tile of rows visits, from the first column its
// first row sees (a) and the last its last row sees (z): at least one tile of [0, L), even where
// no row sees anything (a band's empty rows; every entry is then masked).
__device__ __forceinline__ void tile_span(int a, int z, int BN, int L, int& t0, int& t1) {
  const int last = (L - 1) / BN;
  t0 = min(max(a, 0) / BN, last);
  t1 = z < 0 ? t0 : max(t0, min(z / BN, last));
}

// Which 16-column groups of a column tile [c0, c0 + 16 NG) a warp needs: bit c is set iff some
// lane's row meets the group, row r of the lane seeing the columns [a[r], b[r]] (empty when
// a[r] > b[r]). The result is the same on every lane of the warp (all 32 lanes must call it).
template <int NG>
__device__ __forceinline__ unsigned live_groups(int c0, const int (&a)[2], const int (&b)[2]) {
  unsigned bits = 0;
#pragma unroll
  for (int c = 0; c < NG; ++c)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (a[r] <= c0 + 16 * c + 15 && b[r] >= c0 + 16 * c) bits |= 1u << c;
  return __reduce_or_sync(0xffffffffu, bits);
}

// Whether every row of the warp sees every column of [c0, c1] (so no entry needs masking); same
// row ranges as live_groups. All 32 lanes must call it.
__device__ __forceinline__ bool all_visible(int c0, int c1, const int (&a)[2], const int (&b)[2]) {
  return __all_sync(0xffffffffu, a[0] <= c0 && b[0] >= c1 && a[1] <= c0 && b[1] >= c1);
}

// dst[r * dst_stride + c] = src[(row0 + r) * src_stride + c] as float for r < nrows, c < ncols,
// zero where row0 + r >= L or c >= nvalid (so padded rows and columns add nothing).
template <class T>
__device__ __forceinline__ void load_rows_f32(float* dst, int dst_stride, const T* src, int64_t src_stride, int row0,
                                              int nrows, int L, int nvalid, int ncols) {
  for (int idx = threadIdx.x; idx < nrows * ncols; idx += blockDim.x) {
    const int r = idx / ncols, c = idx % ncols, i = row0 + r;
    dst[r * dst_stride + c] = (i < L && c < nvalid) ? cuda::to_f32(src[(int64_t)i * src_stride + c]) : 0.f;
  }
}

// The same tile stored transposed: dst[c * dst_stride + r] (global reads stay coalesced).
template <class T>
__device__ __forceinline__ void load_cols_f32(float* dst, int dst_stride, const T* src, int64_t src_stride, int row0,
                                              int nrows, int L, int nvalid, int ncols) {
  for (int idx = threadIdx.x; idx < nrows * ncols; idx += blockDim.x) {
    const int r = idx / ncols, c = idx % ncols, i = row0 + r;
    dst[c * dst_stride + r] = (i < L && c < nvalid) ? cuda::to_f32(src[(int64_t)i * src_stride + c]) : 0.f;
  }
}

// Row-major bfloat16 tile: dst[r * dst_stride + c] for r < nrows, c < ncols (ncols a multiple of
// 8, dst_stride too), zero outside the valid rows / columns. `vec`: nvalid % 8 == 0 and src is
// 16-byte aligned, so rows are copied 8 entries (16 bytes) at a time.
__device__ __forceinline__ void load_rows_bf16(__nv_bfloat16* dst, int dst_stride, const __nv_bfloat16* src,
                                               int64_t src_stride, int row0, int nrows, int L, int nvalid, int ncols,
                                               bool vec) {
  if (vec) {
    const int chunks = ncols / 8;
    for (int idx = threadIdx.x; idx < nrows * chunks; idx += blockDim.x) {
      const int r = idx / chunks, c = (idx % chunks) * 8, i = row0 + r;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (i < L && c < nvalid) val = *reinterpret_cast<const uint4*>(src + (int64_t)i * src_stride + c);
      *reinterpret_cast<uint4*>(dst + r * dst_stride + c) = val;
    }
  } else {
    const __nv_bfloat16 zero = __float2bfloat16(0.f);
    for (int idx = threadIdx.x; idx < nrows * ncols; idx += blockDim.x) {
      const int r = idx / ncols, c = idx % ncols, i = row0 + r;
      dst[r * dst_stride + c] = (i < L && c < nvalid) ? src[(int64_t)i * src_stride + c] : zero;
    }
  }
}

using cuda::allow_smem;

}  // namespace hax::ops::causal_cuda

// Runs `body` with `constexpr int DB` for the head dims (ops/cuda/mma_bf16.cuh).
#define HAX_CAUSAL_DISPATCH_HEAD_DIM(dmax, ...) HAX_DISPATCH_HEAD_DIM(dmax, __VA_ARGS__)
