// Key Selection on the GPU, equal to top_k_prefix.cpp's: query i gets the k best keys among the
// positions start..i of its sequence (best: higher score, then the earlier position; NaN ranks as
// -inf), ascending. Candidates compare by one 64-bit key (see TopKPrefixParams), so "top k" is
// exact, with no arithmetic on scores.
//
// Positions are cut into blocks of kTopKBlock = 64 queries. A top-k list is k keys, descending,
// 0-padded. Two lists of disjoint positions combine into the top k of their union by a merge:
// each entry's rank in the union is its own index plus the number of the other list's entries
// above it (a binary search), and it is written there if that rank is < k. With sequence starts:
// (flag, list) pairs, where the flag says the range's last sequence starts inside it, combine as
// (fa | fb, fb ? list_b : merge(list_a, list_b)), an associative scan operator.
//   block_top_kernel     warp per (b, h, block): the block's own list (its positions from the
//                        start of the block's last sequence), by ranking its <= 64 keys by shuffles.
//   super_fold_kernel    warp per (b, h, super block of kTopKSuper blocks): its blocks' lists combined.
//   super_prefix_kernel  warp per (b, h): exclusive scan over the super blocks.
//   block_prefix_kernel  warp per (b, h, super block): exclusive scan over its blocks from the super
//                        block's prefix. block_prefix[blk] = the list of query (first of blk) - 1.
//   query_kernel         warp per (b, h, block): the block's candidates U = the prefix's positions
//                        (when the block's first query continues a sequence; sorted ascending by a
//                        bitonic sort) followed by the block's own positions, with their keys, in
//                        shared memory. The queries run in order as on the CPU, the selection a flag
//                        per candidate: query i adds itself, and when k + 1 are selected drops the
//                        least key (a warp min); a sequence start clears the selection. The list is
//                        the selected candidates in U order (= ascending positions), compacted by
//                        ballots; -1 after.
// With TopKPrefixParams::scans_only the kernels stop after block_prefix (no lists, no block form):
// the scans that top_k_intervals.cu's Key Selection intervals read.
// The scans merge in shared memory (three k-lists per warp); for k <= 64 the scans and the query
// kernel keep their lists in registers instead (one or two per lane: the *_small kernels).
// Block form (TopKPrefixParams::plan_count set; ops/attention/blocks.h): the query kernels keep
// each query's selection as a ballot word per 32 candidates instead of writing its list, and
// emit_block then writes the block's plan directly: the union is the candidates some query
// selects (in U order, so ascending), each query's bits those of its selection. This is exactly
// the plan the tile plan kernel would build from the lists, without the lists or a hash set.
// With ex_rank set, a query's selection drops the keys of its LSH band (HAX's Key Selection part
// beside the band) before its words are kept: exclude_band's lists, in the block form.
#include <climits>
#include <cmath>
#include <type_traits>

#include "ops/attention/params.h"
#include "patterns/cuda/list_utils.cuh"
#include "patterns/cuda/top_k_keys.cuh"

namespace hax::patterns {
namespace {

using ops::cuda::to_f32;
static_assert(kTopKBlock == 64, "block_top ranks two candidates per lane");
static_assert(kTopKBlock == ops::kAttentionTileQueries, "a top-k block is a block of the attention plan");
static_assert(kTopKPlanMaxK + kTopKBlock == ops::kAttentionTileMaxKeys, "the block form's union must fit the plan");

template <class T>
__device__ __forceinline__ uint64_t key_at(const TopKPrefixParams& p, int64_t b, int64_t h, int64_t pos) {
  return score_key(to_f32(((const T*)p.scores)[(b * p.L + pos) * p.H + h]), pos);
}

// Positions [t0, t1) of block blk.
__device__ __forceinline__ void block_range(const TopKPrefixParams& p, int64_t blk, int64_t& t0, int64_t& t1) {
  t0 = blk * kTopKBlock;
  t1 = t0 + kTopKBlock < p.L ? t0 + kTopKBlock : p.L;
}
// Whether the last sequence of positions [t0, t1) starts inside them.
__device__ __forceinline__ bool range_resets(const int32_t* start_row, int64_t t0, int64_t t1) {
  return start_row[t1 - 1] >= t0;
}
__device__ __forceinline__ bool block_resets(const TopKPrefixParams& p, int64_t b, int64_t blk) {
  int64_t t0, t1;
  block_range(p, blk, t0, t1);
  return range_resets(p.start + b * p.L, t0, t1);
}
__device__ __forceinline__ bool super_resets(const TopKPrefixParams& p, int64_t b, int64_t sb) {
  const int64_t nblk = top_k_blocks(p.L);
  const int64_t b0 = sb * kTopKSuper, b1 = b0 + kTopKSuper < nblk ? b0 + kTopKSuper : nblk;
  int64_t t0, t1, u0, u1;
  block_range(p, b0, t0, t1);
  block_range(p, b1 - 1, u0, u1);
  return range_resets(p.start + b * p.L, t0, u1);
}

// out = the top k of lists a and b (disjoint positions), all three of k entries, out apart from
// both. A valid entry's rank is its index plus the other list's entries above it (unique keys).
// A 0 at index t >= n_a of a lands at t + n_b >= n_a + n_b (likewise for b), past every valid
// rank, and those zeros cover every slot in [n_a + n_b, k): the whole of out is written.
__device__ void merge_top(const uint64_t* a, const uint64_t* b, uint64_t* out, int64_t k, int lane) {
  for (int64_t t = lane; t < k; t += 32) {
    const uint64_t x = a[t], y = b[t];
    const int64_t rx = t + count_greater(b, k, x), ry = t + count_greater(a, k, y);
    if (rx < k) out[rx] = x;
    if (ry < k) out[ry] = y;
  }
  __syncwarp();
}

__device__ void copy_list(const uint64_t* src, uint64_t* dst, int64_t k, int lane) {
  for (int64_t t = lane; t < k; t += 32) dst[t] = src[t];
  __syncwarp();
}

// The warp's three k-lists in shared memory: an accumulator, an incoming list, a merge target.
struct Lists {
  uint64_t* buf[3];
  int acc = 0, in = 1, out = 2;
  __device__ Lists(uint64_t* base, int64_t k) {
    for (int t = 0; t < 3; ++t) buf[t] = base + t * k;
  }
  // acc = combine(acc, (resets, incoming)); the incoming list was loaded into buf[in].
  __device__ void combine(bool resets, int64_t k, int lane) {
    if (resets) {
      const int t = acc;
      acc = in, in = t;
    } else {
      merge_top(buf[acc], buf[in], buf[out], k, lane);
      const int t = acc;
      acc = out, out = t;
    }
  }
};

template <class T>
__global__ void block_top_kernel(TopKPrefixParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t nblk = top_k_blocks(p.L), warps = (int64_t)gridDim.x * blockDim.x / 32;
  for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < p.B * p.H * nblk; w += warps) {
    const int64_t blk = w % nblk, bh = w / nblk, b = bh / p.H, h = bh % p.H;
    int64_t t0, t1;
    block_range(p, blk, t0, t1);
    const int64_t s_last = p.start[b * p.L + t1 - 1];
    const int64_t lo = s_last > t0 ? s_last : t0;
    const int n = (int)(t1 - lo);  // candidates lo..t1-1, at most 64
    const uint64_t k0 = lane < n ? key_at<T>(p, b, h, lo + lane) : 0;
    const uint64_t k1 = lane + 32 < n ? key_at<T>(p, b, h, lo + lane + 32) : 0;
    int r0 = 0, r1 = 0;  // ranks: candidates with a greater key
    for (int src = 0; src < 32; ++src) {
      const uint64_t o0 = __shfl_sync(dev::kFullMask, k0, src), o1 = __shfl_sync(dev::kFullMask, k1, src);
      r0 += (o0 > k0) + (o1 > k0);
      r1 += (o0 > k1) + (o1 > k1);
    }
    uint64_t* out = p.block_top + w * p.k;
    if (lane < n && r0 < p.k) out[r0] = k0;
    if (lane + 32 < n && r1 < p.k) out[r1] = k1;
    for (int64_t t = n + lane; t < p.k; t += 32) out[t] = 0;
  }
}

__global__ void super_fold_kernel(TopKPrefixParams p, int64_t smem_per_warp) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x % 32;
  const int64_t nblk = top_k_blocks(p.L), nsup = top_k_supers(p.L), warps = (int64_t)gridDim.x * blockDim.x / 32;
  Lists lists((uint64_t*)(smem + (threadIdx.x / 32) * smem_per_warp), p.k);
  for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < p.B * p.H * nsup; w += warps) {
    const int64_t sb = w % nsup, bh = w / nsup, b = bh / p.H;
    const int64_t b0 = sb * kTopKSuper, b1 = b0 + kTopKSuper < nblk ? b0 + kTopKSuper : nblk;
    const uint64_t* tops = p.block_top + bh * nblk * p.k;
    copy_list(tops + b0 * p.k, lists.buf[lists.acc], p.k, lane);
    for (int64_t blk = b0 + 1; blk < b1; ++blk) {
      copy_list(tops + blk * p.k, lists.buf[lists.in], p.k, lane);
      lists.combine(block_resets(p, b, blk), p.k, lane);
    }
    copy_list(lists.buf[lists.acc], p.super_top + w * p.k, p.k, lane);
  }
}

__global__ void super_prefix_kernel(TopKPrefixParams p, int64_t smem_per_warp) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x % 32;
  const int64_t nsup = top_k_supers(p.L), warps = (int64_t)gridDim.x * blockDim.x / 32;
  Lists lists((uint64_t*)(smem + (threadIdx.x / 32) * smem_per_warp), p.k);
  for (int64_t bh = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; bh < p.B * p.H; bh += warps) {
    const int64_t b = bh / p.H;
    uint64_t* prefix = p.super_prefix + bh * nsup * p.k;
    const uint64_t* tops = p.super_top + bh * nsup * p.k;
    for (int64_t t = lane; t < p.k; t += 32) lists.buf[lists.acc][t] = 0;  // nothing before the row
    __syncwarp();
    copy_list(lists.buf[lists.acc], prefix, p.k, lane);
    for (int64_t sb = 1; sb < nsup; ++sb) {
      copy_list(tops + (sb - 1) * p.k, lists.buf[lists.in], p.k, lane);
      lists.combine(super_resets(p, b, sb - 1), p.k, lane);
      copy_list(lists.buf[lists.acc], prefix + sb * p.k, p.k, lane);
    }
  }
}

__global__ void block_prefix_kernel(TopKPrefixParams p, int64_t smem_per_warp) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x % 32;
  const int64_t nblk = top_k_blocks(p.L), nsup = top_k_supers(p.L), warps = (int64_t)gridDim.x * blockDim.x / 32;
  Lists lists((uint64_t*)(smem + (threadIdx.x / 32) * smem_per_warp), p.k);
  for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < p.B * p.H * nsup; w += warps) {
    const int64_t sb = w % nsup, bh = w / nsup, b = bh / p.H;
    const int64_t b0 = sb * kTopKSuper, b1 = b0 + kTopKSuper < nblk ? b0 + kTopKSuper : nblk;
    const uint64_t* tops = p.block_top + bh * nblk * p.k;
    uint64_t* prefix = p.block_prefix + bh * nblk * p.k;
    copy_list(p.super_prefix + w * p.k, lists.buf[lists.acc], p.k, lane);
    copy_list(lists.buf[lists.acc], prefix + b0 * p.k, p.k, lane);
    for (int64_t blk = b0 + 1; blk < b1; ++blk) {
      copy_list(tops + (blk - 1) * p.k, lists.buf[lists.in], p.k, lane);
      lists.combine(block_resets(p, b, blk - 1), p.k, lane);
      copy_list(lists.buf[lists.acc], prefix + blk * p.k, p.k, lane);
    }
  }
}

// The scans for k <= 32 R (R = 1, 2): a list is R registers per lane (lane t, register r: entry
// 32 r + t, 0 from k on).
// merge_top_regs: the top k of lists a and b (disjoint positions): a and the reversed b give a
// bitonic sequence whose entry-wise maxima are the top 32 R of the union, sorted descending by a
// bitonic merge (R = 2: one exchange between the registers, then five shuffle steps in each); the
// entries from k on are cleared.
template <int R>
__device__ __forceinline__ void merge_top_regs(uint64_t (&a)[R], const uint64_t (&b)[R], int k, int lane) {
  uint64_t v[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {  // entry 32 r + lane meets b's entry 32 R - 1 - (32 r + lane)
    const uint64_t o = __shfl_sync(dev::kFullMask, b[R - 1 - r], 31 - lane);
    v[r] = a[r] > o ? a[r] : o;
  }
  if constexpr (R == 2) {
    const uint64_t hi = v[0] > v[1] ? v[0] : v[1], lo = v[0] > v[1] ? v[1] : v[0];
    v[0] = hi, v[1] = lo;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    for (int j = 16; j > 0; j >>= 1) {
      const uint64_t o = __shfl_xor_sync(dev::kFullMask, v[r], j);
      v[r] = (lane & j) == 0 ? (v[r] > o ? v[r] : o) : (v[r] < o ? v[r] : o);
    }
    a[r] = 32 * r + lane < k ? v[r] : 0;
  }
}
template <int R>
__device__ __forceinline__ void load_list_regs(uint64_t (&v)[R], const uint64_t* list, int k, int lane) {
#pragma unroll
  for (int r = 0; r < R; ++r) v[r] = 32 * r + lane < k ? list[32 * r + lane] : 0;
}
template <int R>
__device__ __forceinline__ void store_list_regs(uint64_t* list, const uint64_t (&v)[R], int k, int lane) {
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (32 * r + lane < k) list[32 * r + lane] = v[r];
}
template <int R>
__device__ __forceinline__ void copy_regs(uint64_t (&dst)[R], const uint64_t (&src)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) dst[r] = src[r];
}

// The scans' common loop, for lists of R registers: for i in [i0, i1), in order,
//   acc = resets(i) ? list(i) : merge_top_regs(acc, list(i)),  then visit(i, acc).
// Each list and its reset flag load kFoldAhead steps before their merge (a ring of registers,
// the loop unrolled by the ring's length so that every index is known at compile time). Loading
// 4 steps ahead instead of 1 changed nothing (H100, L = 64K x 16 heads, k = 32: 21.8-22.5 us for
// each of the three scans, 21.2-22.3 before; pass 36): their time is not the loads' latency.
constexpr int kFoldAhead = 4;
template <int R, class List, class Resets, class Visit>
__device__ __forceinline__ void fold_lists(uint64_t (&acc)[R], int64_t i0, int64_t i1, int k, int lane, List list,
                                           Resets resets, Visit visit) {
  uint64_t ring[kFoldAhead][R] = {};
  bool flag[kFoldAhead] = {};
#pragma unroll
  for (int d = 0; d < kFoldAhead; ++d)
    if (i0 + d < i1) load_list_regs<R>(ring[d], list(i0 + d), k, lane), flag[d] = resets(i0 + d);
  for (int64_t i = i0; i < i1; i += kFoldAhead) {
#pragma unroll
    for (int d = 0; d < kFoldAhead; ++d) {
      if (i + d >= i1) break;
      uint64_t in[R];
      copy_regs<R>(in, ring[d]);
      const bool reset = flag[d];
      if (i + d + kFoldAhead < i1)
        load_list_regs<R>(ring[d], list(i + d + kFoldAhead), k, lane), flag[d] = resets(i + d + kFoldAhead);
      if (reset) copy_regs<R>(acc, in);
      else merge_top_regs<R>(acc, in, k, lane);
      visit(i + d, acc);
    }
  }
}

// As super_fold_kernel, a warp per (b, h, super block).
template <int R>
__global__ void super_fold_small_kernel(TopKPrefixParams p) {
  const int lane = threadIdx.x % 32, k = (int)p.k;
  const int64_t nblk = top_k_blocks(p.L), nsup = top_k_supers(p.L), warps = (int64_t)gridDim.x * blockDim.x / 32;
  for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < p.B * p.H * nsup; w += warps) {
    const int64_t sb = w % nsup, bh = w / nsup, b = bh / p.H;
    const int64_t b0 = sb * kTopKSuper, b1 = b0 + kTopKSuper < nblk ? b0 + kTopKSuper : nblk;
    const uint64_t* tops = p.block_top + bh * nblk * p.k;
    uint64_t acc[R];
    load_list_regs<R>(acc, tops + b0 * p.k, k, lane);
    fold_lists<R>(
        acc, b0 + 1, b1, k, lane, [&](int64_t blk) { return tops + blk * p.k; },
        [&](int64_t blk) { return block_resets(p, b, blk); }, [](int64_t, const uint64_t(&)[R]) {});
    store_list_regs<R>(p.super_top + w * p.k, acc, k, lane);
  }
}

// As super_prefix_kernel, a warp per (b, h).
template <int R>
__global__ void super_prefix_small_kernel(TopKPrefixParams p) {
  const int lane = threadIdx.x % 32, k = (int)p.k;
  const int64_t nsup = top_k_supers(p.L), warps = (int64_t)gridDim.x * blockDim.x / 32;
  for (int64_t bh = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; bh < p.B * p.H; bh += warps) {
    const int64_t b = bh / p.H;
    uint64_t* prefix = p.super_prefix + bh * nsup * p.k;
    const uint64_t* tops = p.super_top + bh * nsup * p.k;
    uint64_t acc[R] = {};  // nothing before the row
    store_list_regs<R>(prefix, acc, k, lane);
    fold_lists<R>(
        acc, 1, nsup, k, lane, [&](int64_t sb) { return tops + (sb - 1) * p.k; },
        [&](int64_t sb) { return super_resets(p, b, sb - 1); },
        [&](int64_t sb, const uint64_t(&a)[R]) { store_list_regs<R>(prefix + sb * p.k, a, k, lane); });
  }
}

// As block_prefix_kernel, a warp per (b, h, super block).
template <int R>
__global__ void block_prefix_small_kernel(TopKPrefixParams p) {
  const int lane = threadIdx.x % 32, k = (int)p.k;
  const int64_t nblk = top_k_blocks(p.L), nsup = top_k_supers(p.L), warps = (int64_t)gridDim.x * blockDim.x / 32;
  for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < p.B * p.H * nsup; w += warps) {
    const int64_t sb = w % nsup, bh = w / nsup, b = bh / p.H;
    const int64_t b0 = sb * kTopKSuper, b1 = b0 + kTopKSuper < nblk ? b0 + kTopKSuper : nblk;
    const uint64_t* tops = p.block_top + bh * nblk * p.k;
    uint64_t* prefix = p.block_prefix + bh * nblk * p.k;
    uint64_t acc[R];
    load_list_regs<R>(acc, p.super_prefix + w * p.k, k, lane);
    store_list_regs<R>(prefix + b0 * p.k, acc, k, lane);
    fold_lists<R>(
        acc, b0 + 1, b1, k, lane, [&](int64_t blk) { return tops + (blk - 1) * p.k; },
        [&](int64_t blk) { return block_resets(p, b, blk - 1); },
        [&](int64_t blk, const uint64_t(&a)[R]) { store_list_regs<R>(prefix + blk * p.k, a, k, lane); });
  }
}

// Ascending bitonic sort of a[0..n), n a power of two, by one warp.
__device__ void warp_bitonic_sort(int32_t* a, int64_t n, int lane) {
  for (int64_t size = 2; size <= n; size <<= 1)
    for (int64_t stride = size / 2; stride > 0; stride >>= 1) {
      for (int64_t t = lane; t < n / 2; t += 32) {
        const int64_t i = 2 * t - (t & (stride - 1)), j = i + stride;  // i has bit `stride` clear
        const bool ascending = (i & size) == 0;
        const int32_t x = a[i], y = a[j];
        if ((x > y) == ascending) a[i] = y, a[j] = x;
      }
      __syncwarp();
    }
}

// Writes the plan of block w (nq queries, candidates U = upos[0..nU), ascending) from the queries'
// selections: bit l of selm[q * ws + c] says query q selects U entry 32 c + l. The union is the
// entries some query selects; lane c first finds chunk c's (`used`) and where they start in the
// union (`base`, a warp scan). Each lane then writes the mask rows of queries lane and lane + 32,
// walking their selected entries in union order and storing each 64-key tile's word once.
__device__ void emit_block(const TopKPrefixParams& p, int64_t w, const uint32_t* selm, int ws, const int32_t* upos,
                           int nU, int nq, int lane) {
  constexpr int kQ = (int)ops::kAttentionTileQueries, kU = (int)ops::kAttentionTileMaxKeys;
  constexpr int kTiles = (int)ops::kAttentionTilesPerBlock;
  const unsigned lanes_below = (1u << lane) - 1;
  const int W = (nU + 31) / 32;  // <= 512 / 32
  uint32_t used = 0;
  if (lane < W)
    for (int q = 0; q < nq; ++q) used |= selm[q * ws + lane];
  const int n = __popc(used);
  int incl = n;
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(dev::kFullMask, incl, o);
    if (lane >= o) incl += v;
  }
  const int base = incl - n, total = __shfl_sync(dev::kFullMask, incl, 31);
  int32_t* keys = p.plan_keys + w * kU;
  for (int c = 0; c < W; ++c) {
    const uint32_t uc = __shfl_sync(dev::kFullMask, used, c);
    const int bc = __shfl_sync(dev::kFullMask, base, c);
    if ((uc >> lane) & 1u) keys[bc + __popc(uc & lanes_below)] = upos[32 * c + lane];
  }
  for (int t = total + lane; t < kU; t += 32) keys[t] = -1;
  if (lane == 0) p.plan_count[w] = total;
  const int ntiles = (total + 63) / 64;
  uint64_t* mout = p.plan_mask + w * kTiles * kQ;
  for (int q = lane; q < kQ; q += 32) {  // two rounds, every lane in both (the shuffles below)
    int tile = 0;
    uint64_t cur = 0;
    for (int c = 0; c < W; ++c) {
      const uint32_t uc = __shfl_sync(dev::kFullMask, used, c);
      const int bc = __shfl_sync(dev::kFullMask, base, c);
      uint32_t m = q < nq ? selm[q * ws + c] : 0u;  // a subset of uc
      while (m) {
        const int l = __ffs(m) - 1;
        m &= m - 1;
        const int x = bc + __popc(uc & ((1u << l) - 1u));  // the entry's place in the union
        for (; tile < x / 64; ++tile, cur = 0) mout[tile * kQ + q] = cur;
        cur |= 1ull << (x % 64);
      }
    }
    for (; tile < ntiles; ++tile, cur = 0) mout[tile * kQ + q] = cur;
  }
}

// The shared memory layout of one query_kernel warp.
struct QueryShared {
  uint64_t* key;   // (k + 64): candidate keys, in U order
  int32_t* pos;    // (pow2 >= k) + 64: candidate positions, U order (the prefix part sorted in place)
  uint32_t* selm;  // block form: (64, ws) each query's selection words, ws = plan_words(k)
  uint8_t* sel;    // (k + 64): selected flags
};
// Selection words of a query in the block form: one per 32 of the k + 64 candidates (else 0).
HAX_HOST_DEVICE inline int64_t plan_words(int64_t k, bool plan) { return plan ? (k + kTopKBlock + 31) / 32 : 0; }
__device__ __forceinline__ QueryShared query_shared(unsigned char* base, int64_t k, int64_t sort_len, int64_t ws) {
  QueryShared s;
  s.key = (uint64_t*)base;
  s.pos = (int32_t*)(s.key + k + kTopKBlock);
  s.selm = (uint32_t*)(s.pos + sort_len + kTopKBlock);
  s.sel = (uint8_t*)(s.selm + kTopKBlock * ws);
  return s;
}

template <class T, bool kPlan>
__global__ void query_kernel(TopKPrefixParams p, int64_t sort_len, int64_t smem_per_warp) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x % 32;
  const unsigned lanes_below = (1u << lane) - 1;
  const int64_t nblk = top_k_blocks(p.L), warps = (int64_t)gridDim.x * blockDim.x / 32;
  const int ws = (int)plan_words(p.k, kPlan);
  const QueryShared sh = query_shared(smem + (threadIdx.x / 32) * smem_per_warp, p.k, sort_len, ws);
  for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < p.B * p.H * nblk; w += warps) {
    const int64_t blk = w % nblk, bh = w / nblk, b = bh / p.H, h = bh % p.H;
    const int32_t* start = p.start + b * p.L;
    int64_t t0, t1;
    block_range(p, blk, t0, t1);
    // U = [the prefix's positions, ascending] ++ [t0, t1).
    int64_t nP = 0;
    if (start[t0] < t0) {  // the block's first query continues a sequence: its prefix list counts
      const uint64_t* prefix = p.block_prefix + w * p.k;
      for (int64_t t = lane; t < sort_len; t += 32) sh.pos[t] = t < p.k && prefix[t] ? key_pos(prefix[t]) : INT_MAX;
      __syncwarp();
      warp_bitonic_sort(sh.pos, sort_len, lane);
      nP = count_greater(prefix, p.k, 0);
    }
    const int64_t nU = nP + (t1 - t0);
    for (int64_t t = lane; t < t1 - t0; t += 32) sh.pos[nP + t] = (int32_t)(t0 + t);
    __syncwarp();
    for (int64_t u = lane; u < nU; u += 32) {
      sh.key[u] = key_at<T>(p, b, h, sh.pos[u]);
      sh.sel[u] = u < nP;  // the prefix list: the selection of query t0 - 1
    }
    __syncwarp();
    int64_t a = 0, count = nP;  // the eligible window U[a..]; the number selected
    for (int64_t i = t0; i < t1; ++i) {
      const int64_t ui = nP + (i - t0);  // i's index in U
      if (start[i] == i) {  // a sequence starts: nothing before i is eligible
        for (int64_t u = a + lane; u < ui; u += 32) sh.sel[u] = 0;
        a = ui, count = 0;
      }
      if (lane == 0) sh.sel[ui] = 1;
      ++count;
      __syncwarp();
      if (count > p.k) {  // drop the selected candidate of least key (possibly i itself)
        uint64_t least = ~0ull;
        int64_t lu = -1;
        for (int64_t u = a + lane; u <= ui; u += 32)
          if (sh.sel[u] && sh.key[u] < least) least = sh.key[u], lu = u;
        for (int o = 16; o > 0; o >>= 1) {
          const uint64_t ol = __shfl_xor_sync(dev::kFullMask, least, o);
          const int64_t ou = __shfl_xor_sync(dev::kFullMask, lu, o);
          if (ol < least) least = ol, lu = ou;
        }
        __syncwarp();  // every lane has read sel before lane 0 clears an entry (racecheck)
        if (lane == 0) sh.sel[lu] = 0;
        --count;
        __syncwarp();
      }
      if constexpr (kPlan) {  // the selection's words (the entries past ui are not selected yet)
        const int32_t lo = p.ex_rank ? p.ex_lo[bh * p.L + i] : 1, hi = p.ex_rank ? p.ex_hi[bh * p.L + i] : 0;
        for (int64_t c = 0; c < ws; ++c) {
          const int64_t u = 32 * c + lane;
          bool on = u <= ui && sh.sel[u];
          if (on && lo <= hi) {  // left out: the key is in the query's band
            const int32_t r = p.ex_rank[bh * p.L + sh.pos[u]];
            on = r < lo || r > hi;
          }
          const unsigned m = __ballot_sync(dev::kFullMask, on);
          if (lane == 0) sh.selm[(i - t0) * ws + c] = m;
        }
        __syncwarp();
        continue;
      }
      // The list: the selected candidates of U[a..ui] in U order, compacted by ballots.
      int32_t* dst = p.out + (bh * p.L + i) * p.k;
      int64_t filled = 0;
      for (int64_t u0 = a; u0 <= ui; u0 += 32) {
        const int64_t u = u0 + lane;
        const bool on = u <= ui && sh.sel[u];
        const unsigned m = __ballot_sync(dev::kFullMask, on);
        if (on) dst[filled + __popc(m & lanes_below)] = sh.pos[u];
        filled += __popc(m);
      }
      for (int64_t t = filled + lane; t < p.k; t += 32) dst[t] = -1;
      __syncwarp();
    }
    if constexpr (kPlan) emit_block(p, w, sh.selm, ws, sh.pos, (int)nU, (int)(t1 - t0), lane);
    __syncwarp();  // the next block's writes come after every lane's reads
  }
}

// query_kernel for k <= 32 R, R = 1 or 2 (kQueryWarps warps per block): the selection lives in
// registers. Entry e = 32 r + lane (register r) holds the e-th best selected key and its U index
// (key 0: none), kept sorted as query i inserts its key (ballots count the better ones, the worse
// shift up an entry, the k-th falls out); each lane holds the U entries lane + 32 c, c < R + 2
// (position, key, selected flag). The lists are the same as the general kernel's: the selection
// after query i is the top k of its eligible keys.
constexpr int kQueryWarps = 4;
template <int R>
__device__ __forceinline__ uint64_t pick(const uint64_t (&v)[R], int r) {  // v[r], r warp-uniform
  uint64_t x = v[0];
#pragma unroll
  for (int t = 1; t < R; ++t) x = r == t ? v[t] : x;
  return x;
}
template <int R>
__device__ __forceinline__ int pick(const int (&v)[R], int r) {
  int x = v[0];
#pragma unroll
  for (int t = 1; t < R; ++t) x = r == t ? v[t] : x;
  return x;
}
template <class T, bool kPlan, int R>
__global__ void query_small_kernel(TopKPrefixParams p) {
  constexpr int C = R + 2;  // U chunks of 32: k + 64 <= 32 (R + 2) entries
  __shared__ int32_t upos_s[kQueryWarps][C * 32];
  __shared__ uint32_t selm_s[kPlan ? kQueryWarps : 1][kTopKBlock * C];  // block form: (64, C) words
  const int lane = threadIdx.x % 32, K = (int)p.k;
  const unsigned lanes_below = (1u << lane) - 1;
  int32_t* upos = upos_s[threadIdx.x / 32];
  const int64_t nblk = top_k_blocks(p.L), warps = (int64_t)gridDim.x * kQueryWarps;
  for (int64_t w = (int64_t)blockIdx.x * kQueryWarps + threadIdx.x / 32; w < p.B * p.H * nblk; w += warps) {
    const int64_t blk = w % nblk, bh = w / nblk, b = bh / p.H, h = bh % p.H;
    const int32_t* start = p.start + b * p.L;
    int64_t t0, t1;
    block_range(p, blk, t0, t1);
    const int n_own = (int)(t1 - t0);
    // The sorted selection starts as the prefix list (descending keys, 0 padded) when the block's
    // first query continues a sequence; its U index is the rank of its position among the prefix's.
    uint64_t skey[R] = {};
    int su[R] = {}, nP = 0;
    if (start[t0] < t0) {
      load_list_regs<R>(skey, p.block_prefix + w * p.k, K, lane);
      int32_t pp[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        nP += __popc(__ballot_sync(dev::kFullMask, skey[r] != 0));
        pp[r] = skey[r] ? key_pos(skey[r]) : INT_MAX;
      }
#pragma unroll
      for (int r2 = 0; r2 < R; ++r2)
        for (int src = 0; src < 32; ++src) {
          const int32_t o = __shfl_sync(dev::kFullMask, pp[r2], src);
#pragma unroll
          for (int r = 0; r < R; ++r) su[r] += o < pp[r];
        }
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (skey[r]) upos[su[r]] = pp[r];
    }
    for (int t = lane; t < n_own; t += 32) upos[nP + t] = (int32_t)(t0 + t);
    __syncwarp();
    const int nU = nP + n_own;
    int32_t pos_c[C];
    uint64_t key_c[C];
    bool sel_c[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int u = lane + 32 * c;
      pos_c[c] = u < nU ? upos[u] : 0;
      key_c[c] = u < nU ? key_at<T>(p, b, h, pos_c[c]) : 0;
      sel_c[c] = u < nP;
    }
    const int32_t s_lo = lane < n_own ? start[t0 + lane] : 0, s_hi = lane + 32 < n_own ? start[t0 + lane + 32] : 0;
    // Left-out keys (block form with ex_rank): each candidate's rank, each own query's bounds.
    const bool ex = kPlan && p.ex_rank != nullptr;
    int32_t rank_c[C] = {}, elo[2] = {1, 1}, ehi[2] = {0, 0};
    if (ex) {
#pragma unroll
      for (int c = 0; c < C; ++c) rank_c[c] = lane + 32 * c < nU ? p.ex_rank[bh * p.L + pos_c[c]] : 0;
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (lane + 32 * r < n_own) elo[r] = p.ex_lo[bh * p.L + t0 + lane + 32 * r], ehi[r] = p.ex_hi[bh * p.L + t0 + lane + 32 * r];
    }
    __syncwarp();  // upos is read before the next block's writes
    auto set_sel = [&](int u, bool v) {
#pragma unroll
      for (int c = 0; c < C; ++c)
        if (u == lane + 32 * c) sel_c[c] = v;
    };
    for (int q = 0; q < n_own; ++q) {
      const int64_t i = t0 + q;
      const int ui = nP + q;  // i's index in U
      const int32_t si = __shfl_sync(dev::kFullMask, q < 32 ? s_lo : s_hi, q % 32);
      if (si == i) {  // a sequence starts: nothing before i is eligible
#pragma unroll
        for (int r = 0; r < R; ++r) skey[r] = 0;
#pragma unroll
        for (int c = 0; c < C; ++c) sel_c[c] = false;
      }
      const uint64_t x = __shfl_sync(dev::kFullMask, pick<C>(key_c, ui / 32), ui % 32);
      int rank = 0;
#pragma unroll
      for (int r = 0; r < R; ++r) rank += __popc(__ballot_sync(dev::kFullMask, 32 * r + lane < K && skey[r] > x));
      if (rank < K) {  // i enters at rank; the k-th selected (if any) drops out
        const uint64_t last_key = __shfl_sync(dev::kFullMask, pick<R>(skey, (K - 1) / 32), (K - 1) % 32);
        const int last_u = __shfl_sync(dev::kFullMask, pick<R>(su, (K - 1) / 32), (K - 1) % 32);
        uint64_t up_key[R];
        int up_u[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {  // entry e - 1 for every entry e: lane - 1, or lane 31 of r - 1
          up_key[r] = __shfl_up_sync(dev::kFullMask, skey[r], 1);
          up_u[r] = __shfl_up_sync(dev::kFullMask, su[r], 1);
          const uint64_t wrap_key = __shfl_sync(dev::kFullMask, r > 0 ? skey[r > 0 ? r - 1 : 0] : 0ull, 31);
          const int wrap_u = __shfl_sync(dev::kFullMask, r > 0 ? su[r > 0 ? r - 1 : 0] : 0, 31);
          if (lane == 0) up_key[r] = wrap_key, up_u[r] = wrap_u;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int e = 32 * r + lane;
          if (e > rank && e < K) skey[r] = up_key[r], su[r] = up_u[r];
          if (e == rank) skey[r] = x, su[r] = ui;
        }
        set_sel(ui, true);
        if (last_key != 0) set_sel(last_u, false);
      }
      if constexpr (kPlan) {
        int32_t lo = 1, hi = 0;  // the query's band (empty when lo > hi)
        if (ex) {
          lo = __shfl_sync(dev::kFullMask, q < 32 ? elo[0] : elo[1], q % 32);
          hi = __shfl_sync(dev::kFullMask, q < 32 ? ehi[0] : ehi[1], q % 32);
        }
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const unsigned m = __ballot_sync(dev::kFullMask, sel_c[c] && !(lo <= rank_c[c] && rank_c[c] <= hi));
          if (lane == 0) selm_s[threadIdx.x / 32][q * C + c] = m;
        }
        continue;
      }
      // The list: the selected candidates in U order, compacted by ballots.
      int32_t* dst = p.out + (bh * p.L + i) * p.k;
      int filled = 0;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const unsigned m = __ballot_sync(dev::kFullMask, sel_c[c]);
        if (sel_c[c]) dst[filled + __popc(m & lanes_below)] = pos_c[c];
        filled += __popc(m);
      }
      for (int t = filled + lane; t < K; t += 32) dst[t] = -1;
    }
    if constexpr (kPlan) {
      __syncwarp();
      emit_block(p, w, selm_s[threadIdx.x / 32], C, upos, nU, n_own, lane);
      __syncwarp();  // upos and the words are read before the next block's writes
    }
  }
}

// Shared memory per warp (bytes, a multiple of 16) of the scan kernels and of query_kernel.
int64_t scan_smem_per_warp(int64_t k) { return (3 * k * 8 + 15) / 16 * 16; }
int64_t sort_len_for(int64_t k) {
  int64_t n = 1;
  while (n < k) n *= 2;
  return n;
}
int64_t query_smem_per_warp(int64_t k, bool plan) {
  return ((k + kTopKBlock) * 8 + (sort_len_for(k) + kTopKBlock) * 4 + kTopKBlock * plan_words(k, plan) * 4 +
          (k + kTopKBlock) + 15) / 16 * 16;
}

// Warps per block for `per_warp` bytes of shared memory each: up to 4 within the default 48 KiB,
// else one (the kernel is then allowed the larger dynamic size).
template <class Kernel>
int warps_for(Kernel kernel, int64_t per_warp) {
  int warps = 4;
  while (warps > 1 && warps * per_warp > 48 * 1024) warps /= 2;
  if (warps * per_warp > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)per_warp);
    if (e != cudaSuccess)
      throw std::runtime_error(std::string("top_k_prefix: cannot give a kernel ") + std::to_string(per_warp) +
                               " bytes of shared memory: " + cudaGetErrorString(e));
  }
  return warps;
}

template <class T, bool kPlan>
void launch(const TopKPrefixParams& p, cudaStream_t st) {
  const int64_t nblk = top_k_blocks(p.L), nsup = top_k_supers(p.L), BH = p.B * p.H;
  block_top_kernel<T><<<dev::grid_for(BH * nblk * 32, dev::kThreads), dev::kThreads, 0, st>>>(p);
  ops::cuda::check_launch("top_k_prefix (block top)");

  auto small = [&](auto regs) {  // k <= 32 R: lists in R registers per lane
    constexpr int R = decltype(regs)::value;
    const unsigned t = 4 * 32;
    super_fold_small_kernel<R><<<dev::grid_for(BH * nsup, 4), t, 0, st>>>(p);
    ops::cuda::check_launch("top_k_prefix (super fold)");
    super_prefix_small_kernel<R><<<dev::grid_for(BH, 1), 32, 0, st>>>(p);
    ops::cuda::check_launch("top_k_prefix (super prefix)");
    block_prefix_small_kernel<R><<<dev::grid_for(BH * nsup, 4), t, 0, st>>>(p);
    ops::cuda::check_launch("top_k_prefix (block prefix)");
    if (p.scans_only) return;
    query_small_kernel<T, kPlan, R><<<dev::grid_for(BH * nblk, kQueryWarps), kQueryWarps * 32, 0, st>>>(p);
    ops::cuda::check_launch("top_k_prefix (queries)");
  };
  if (p.k <= 32) return small(std::integral_constant<int, 1>{});
  if (p.k <= 64) return small(std::integral_constant<int, 2>{});
  const int64_t scan_smem = scan_smem_per_warp(p.k);
  int warps = warps_for(super_fold_kernel, scan_smem);
  super_fold_kernel<<<dev::grid_for(BH * nsup, warps), warps * 32, warps * scan_smem, st>>>(p, scan_smem);
  ops::cuda::check_launch("top_k_prefix (super fold)");
  warps = warps_for(super_prefix_kernel, scan_smem);
  super_prefix_kernel<<<dev::grid_for(BH, warps), warps * 32, warps * scan_smem, st>>>(p, scan_smem);
  ops::cuda::check_launch("top_k_prefix (super prefix)");
  warps = warps_for(block_prefix_kernel, scan_smem);
  block_prefix_kernel<<<dev::grid_for(BH * nsup, warps), warps * 32, warps * scan_smem, st>>>(p, scan_smem);
  ops::cuda::check_launch("top_k_prefix (block prefix)");
  if (p.scans_only) return;

  const int64_t query_smem = query_smem_per_warp(p.k, kPlan);
  warps = warps_for(query_kernel<T, kPlan>, query_smem);
  query_kernel<T, kPlan><<<dev::grid_for(BH * nblk, warps), warps * 32, warps * query_smem, st>>>(
      p, sort_len_for(p.k), query_smem);
  ops::cuda::check_launch("top_k_prefix (queries)");
}

}  // namespace

void top_k_prefix_cuda(const TopKPrefixParams& p, DType dtype, void* stream) {
  if (p.B * p.H * p.L == 0) return;
  if (p.k < 1 || p.k >= p.L || p.k > kTopKMaxK)
    throw std::runtime_error("top_k_prefix_cuda: k = " + std::to_string(p.k) + " must be in [1, min(L - 1, " +
                             std::to_string(kTopKMaxK) + ")]");
  if (p.plan_count && p.k > kTopKPlanMaxK)
    throw std::runtime_error("top_k_prefix_cuda: k = " + std::to_string(p.k) + " must be at most " +
                             std::to_string(kTopKPlanMaxK) + " for the block form");
  if (!p.scans_only && !p.out && !p.plan_count)
    throw std::runtime_error("top_k_prefix_cuda: needs out (lists), plan_count (the block form) or scans_only");
  HAX_DISPATCH_DTYPE(dtype, [&] {
    if (p.plan_count && !p.scans_only) launch<scalar_t, true>(p, (cudaStream_t)stream);
    else launch<scalar_t, false>(p, (cudaStream_t)stream);
  });
}

}  // namespace hax::patterns
