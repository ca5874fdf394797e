// The union of two patterns' lists on the GPU, equal to merge.cpp's: per row (b, h, i) a two-way
// merge of the ascending lists a and b (each ending at its first -1) that drops repeats, then -1.
//
// merge_warp_kernel: a warp per row. The rows of a and b are loaded (coalesced) into the warp's
// shared memory; their lengths na, nb are the first negative entries (ballots). The CPU's merge
// takes a's entry on ties, so a[t] lands at t + #{b < a[t]} of the merged list and b[u] at
// u + #{a <= b[u]} (binary searches in shared memory): the merged list (repeats kept) is written
// to shared memory, and an entry is kept iff it differs from the one before it (the CPU's
// `v != last`), compacted by ballots into the output row (coalesced), -1 after.
// merge_small_kernel does the same for Ka, Kb <= 32 with a row's entries one per lane in
// registers, the next row's loads in flight during the merge. Rows too long for the warps' shared
// memory merge straight from global memory, thread per row (merge_direct_kernel, the CPU's loop).
// merge_overflow_kernel merges only the rows of the tile plan's overflowing blocks; its a may be an
// LSH band and its b Key Selection's intervals (interval_row: the row's list computed from them).
#include <climits>

#include "patterns/cuda/list_utils.cuh"
#include "patterns/cuda/top_k_keys.cuh"

namespace hax::patterns {
namespace {

constexpr int kMergeWarps = 4;               // warps (rows at once) per merge_warp_kernel block
constexpr int64_t kMergeBytes = 48 * 1024;  // its shared memory budget

// The CPU's merge of one row: x[0..Ka), y[0..Kb) into dst[0..Ka + Kb).
__device__ __forceinline__ void merge_row(const int32_t* x, int64_t Ka, const int32_t* y, int64_t Kb, int32_t* dst) {
  const int32_t *xe = x + Ka, *ye = y + Kb, *de = dst + Ka + Kb;
  int32_t last = -1;
  while (true) {
    const bool has_x = x != xe && *x >= 0, has_y = y != ye && *y >= 0;
    if (!has_x && !has_y) break;
    int32_t v;
    if (has_x && (!has_y || *x <= *y)) v = *x++;
    else v = *y++;
    if (v != last) *dst++ = last = v;
  }
  while (dst != de) *dst++ = -1;
}

__global__ void merge_direct_kernel(MergeListsParams p) {
  const int64_t K = p.Ka + p.Kb;
  for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < p.rows; r += (int64_t)gridDim.x * blockDim.x)
    merge_row(p.a + r * p.Ka, p.Ka, p.b + r * p.Kb, p.Kb, p.out + r * K);
}

// The first index t < n of row x with x[t] < 0 (n if none), by the warp.
__device__ __forceinline__ int list_length(const int32_t* x, int n, int lane) {
  for (int t0 = 0; t0 < n; t0 += 32) {
    const unsigned neg = __ballot_sync(dev::kFullMask, t0 + lane < n && x[t0 + lane] < 0);
    if (neg) return t0 + __ffs(neg) - 1;
  }
  return n;
}

// Entries of ascending x[0..n) less than v (strict) or, with `or_equal`, <= v.
__device__ __forceinline__ int count_below(const int32_t* x, int n, int32_t v, bool or_equal) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (x[mid] < v || (or_equal && x[mid] == v)) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// A warp writes the sorted entries tm[0..n) to dst without repeats, then -1 up to K slots.
__device__ __forceinline__ void write_distinct(const int32_t* tm, int n, int32_t* dst, int K, int lane) {
  int filled = 0;
  for (int t0 = 0; t0 < n; t0 += 32) {
    const int t = t0 + lane;
    const int32_t v = t < n ? tm[t] : -1;
    const bool keep = t < n && (t == 0 || tm[t - 1] != v);
    const unsigned m = __ballot_sync(dev::kFullMask, keep);
    if (keep) dst[filled + __popc(m & ((1u << lane) - 1))] = v;
    filled += __popc(m);
  }
  for (int t = filled + lane; t < K; t += 32) dst[t] = -1;
}

__global__ void merge_warp_kernel(MergeListsParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int Ka = (int)p.Ka, Kb = (int)p.Kb, K = Ka + Kb;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t* ta = (int32_t*)smem + (int64_t)warp * 2 * K;  // (Ka) a's row, (Kb) b's row, (K) the merged list
  int32_t* tb = ta + Ka;
  int32_t* tm = tb + Kb;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  for (int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + warp; r < p.rows; r += warps) {
    const int32_t* a = p.a + r * Ka;
    const int32_t* b = p.b + r * Kb;
    for (int t = lane; t < Ka; t += 32) ta[t] = a[t];
    for (int t = lane; t < Kb; t += 32) tb[t] = b[t];
    __syncwarp();
    const int na = list_length(ta, Ka, lane), nb = list_length(tb, Kb, lane), n = na + nb;
    for (int t = lane; t < na; t += 32) tm[t + count_below(tb, nb, ta[t], false)] = ta[t];
    for (int t = lane; t < nb; t += 32) tm[t + count_below(ta, na, tb[t], true)] = tb[t];
    __syncwarp();
    write_distinct(tm, n, p.out + r * K, K, lane);
    __syncwarp();  // the warp's shared rows are read before the next row's loads
  }
}

// The row that rank r stands for in merge_overflow_kernel, or -1 (not to merge): the row of rank
// r's query if its block's count is negative.
__device__ __forceinline__ int64_t overflow_row_of(const MergeListsParams& p, int64_t r) {
  if (r >= p.rows) return -1;
  const int64_t bh = r / p.L, t = r - bh * p.L, nblk = (p.L + p.block - 1) / p.block;
  if (p.block_count[bh * nblk + t / p.block] >= 0) return -1;
  const int64_t i = p.q_order ? p.q_order[r] : t;
  return i >= 0 && i < p.L ? bh * p.L + i : -1;
}

// One row's merge for Ka, Kb <= 32 by a warp: lane t holds a[t] (ca) and b[t] (cb); ta, tb, tm
// are the warp's shared rows (Ka, Kb, Ka + Kb); the union goes to dst (Ka + Kb, -1 after).
__device__ __forceinline__ void merge_small_row(int32_t ca, int32_t cb, int Ka, int Kb, int32_t* ta, int32_t* tb,
                                                int32_t* tm, int32_t* dst, int lane) {
  const int K = Ka + Kb;
  const unsigned neg_a = __ballot_sync(dev::kFullMask, ca < 0), neg_b = __ballot_sync(dev::kFullMask, cb < 0);
  const int na = neg_a ? __ffs(neg_a) - 1 : 32, nb = neg_b ? __ffs(neg_b) - 1 : 32, n = na + nb;
  if (lane < Ka) ta[lane] = ca;
  if (lane < Kb) tb[lane] = cb;
  __syncwarp();
  if (lane < na) tm[lane + count_below(tb, nb, ca, false)] = ca;
  if (lane < nb) tm[lane + count_below(ta, na, cb, true)] = cb;
  __syncwarp();
  write_distinct(tm, n, dst, K, lane);
  __syncwarp();  // the warp's shared rows are read before the next row's stores
}

// merge_warp_kernel for Ka, Kb <= 32: lane t holds a[t] and b[t] in registers, and the next
// row's entries load while this row merges (the lengths by ballots on the registers).
__global__ void merge_small_kernel(MergeListsParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int Ka = (int)p.Ka, Kb = (int)p.Kb, K = Ka + Kb;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t* ta = (int32_t*)smem + (int64_t)warp * 2 * K;  // (Ka) a's row, (Kb) b's row, (K) the merged list
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + warp;
  int32_t xa = r < p.rows && lane < Ka ? p.a[r * Ka + lane] : -1;
  int32_t xb = r < p.rows && lane < Kb ? p.b[r * Kb + lane] : -1;
  for (; r < p.rows; r += warps) {
    const int32_t ca = xa, cb = xb;
    const int64_t rn = r + warps;  // the next row's entries, in flight during this one
    xa = rn < p.rows && lane < Ka ? p.a[rn * Ka + lane] : -1;
    xb = rn < p.rows && lane < Kb ? p.b[rn * Kb + lane] : -1;
    merge_small_row(ca, cb, Ka, Kb, ta, ta + Ka, ta + K, p.out + r * K, lane);
  }
}

// Row `row` (= bh·L + i) of b when b is Key Selection's intervals (MergeListsParams::iv_leave_at),
// for merge_small_row: lane t's return is the t-th key of i's list (ascending, -1 from its length
// on). The list: the keys of i's block prefix (the top k of query t0 - 1, t0 = i's block start,
// when i's sequence starts before t0) still held at i (leave_at > i), sorted by position (lane t
// holds prefix entry t and counts the held entries of smaller position by shuffles), then the
// positions j of [max(t0, start), i] with leave_at[j] > i (two per lane, compacted by ballots),
// which are larger. It is built in tb (the warp's Kb slots for b's row; at most Kb = k keys).
__device__ __forceinline__ int32_t interval_row(const MergeListsParams& p, int64_t row, int32_t* tb, int lane) {
  const int Kb = (int)p.Kb;
  const int64_t bh = row / p.L, i = row - bh * p.L, b = bh / p.H;
  const int64_t blk = i / kTopKBlock, t0 = blk * kTopKBlock, nblk = top_k_blocks(p.L);
  const int64_t s = p.iv_start[b * p.L + i];
  const int32_t* leave_at = p.iv_leave_at + bh * p.L;
  int32_t pp = INT_MAX;
  bool held = false;
  if (s < t0 && lane < Kb) {  // (warp-uniform condition)
    const uint64_t e = p.iv_prefix[(bh * nblk + blk) * Kb + lane];
    if (e != 0) pp = key_pos(e), held = leave_at[pp] > i;
  }
  int rank = 0;  // held prefix entries of smaller position
  for (int src = 0; src < 32; ++src) {
    const int32_t o = __shfl_sync(dev::kFullMask, held ? pp : INT_MAX, src);
    rank += o < pp;
  }
  int n = __popc(__ballot_sync(dev::kFullMask, held));
  if (held && rank < Kb) tb[rank] = pp;
  const int64_t lo = s > t0 ? s : t0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = lo + lane + 32 * r;
    const bool on = j <= i && leave_at[j] > i;
    const unsigned m = __ballot_sync(dev::kFullMask, on);
    const int at = n + __popc(m & ((1u << lane) - 1));
    if (on && at < Kb) tb[at] = (int32_t)j;
    n += __popc(m);
  }
  __syncwarp();
  const int32_t v = lane < n && lane < Kb ? tb[lane] : -1;
  __syncwarp();  // every lane has read tb before merge_small_row stores b's row there
  return v;
}

// merge_small_kernel over the rows of the overflowing blocks only (p.block_count set): a warp
// takes 32 ranks at a time, each lane finds its rank's row (one coalesced load of the counts and
// of q_order for the 32), and the warp merges the rows its ballot marks, one after another. Where
// a block fits, its 32 ranks cost one step (the earlier form walked them row by row, each step
// waiting on a count load and a q_order load: 271 us for HAX at 64K).
__global__ void merge_overflow_kernel(MergeListsParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int Ka = (int)p.Ka, Kb = (int)p.Kb, K = Ka + Kb;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t* ta = (int32_t*)smem + (int64_t)warp * 2 * K;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  for (int64_t r0 = ((int64_t)blockIdx.x * (blockDim.x / 32) + warp) * 32; r0 < p.rows; r0 += warps * 32) {
    const int64_t row = overflow_row_of(p, r0 + lane);
    for (unsigned todo = __ballot_sync(dev::kFullMask, row >= 0); todo; todo &= todo - 1) {
      const int src = __ffs(todo) - 1;
      const int64_t cur = __shfl_sync(dev::kFullMask, row, src);
      int32_t ca = -1;
      if (p.band) {  // rank r0 + src's band of sorted keys
        const int64_t rk = r0 + src, first = p.band[rk], n = p.band[p.rows + rk] - first + 1;
        if (lane < n && lane < Ka) ca = p.band_pos[rk - rk % p.L + first + lane];
      } else if (lane < Ka) {
        ca = p.a[cur * Ka + lane];
      }
      int32_t cb = -1;
      if (p.iv_leave_at) cb = interval_row(p, cur, ta + Ka, lane);
      else if (lane < Kb) cb = p.b[cur * Kb + lane];
      merge_small_row(ca, cb, Ka, Kb, ta, ta + Ka, ta + K, p.out + cur * K, lane);
    }
  }
}

}  // namespace

void merge_lists_cuda(const MergeListsParams& p, void* stream) {
  const int64_t K = p.Ka + p.Kb;
  if (p.rows == 0 || K == 0) return;
  cudaStream_t st = (cudaStream_t)stream;
  const int64_t warp_bytes = 2 * K * 4;
  if (p.block_count && (p.Ka > 32 || p.Kb > 32 || p.L <= 0 || p.block <= 0))
    throw std::runtime_error("merge: the merge of the overflowing blocks' rows needs Ka, Kb <= 32, L and block > 0");
  if (p.band && (!p.block_count || !p.q_order || !p.band_pos))
    throw std::runtime_error("merge: a band needs block_count, q_order and band_pos (the overflowing rows' merge)");
  if (p.iv_leave_at && (!p.block_count || !p.q_order || !p.iv_prefix || !p.iv_start || p.H <= 0 || p.Kb < 1))
    throw std::runtime_error(
        "merge: intervals need block_count, q_order, iv_prefix, iv_start, H > 0 and Kb >= 1 (the overflowing rows' "
        "merge)");
  if (p.block_count) {
    const int64_t chunks = (p.rows + 31) / 32;
    merge_overflow_kernel<<<dev::grid_for(chunks, kMergeWarps), kMergeWarps * 32, kMergeWarps * warp_bytes, st>>>(p);
  } else if (p.Ka <= 32 && p.Kb <= 32) {
    merge_small_kernel<<<dev::grid_for(p.rows, 4 * kMergeWarps), kMergeWarps * 32, kMergeWarps * warp_bytes, st>>>(p);
  } else if (kMergeWarps * warp_bytes <= kMergeBytes) {
    merge_warp_kernel<<<dev::grid_for(p.rows, kMergeWarps), kMergeWarps * 32, kMergeWarps * warp_bytes, st>>>(p);
  } else {
    merge_direct_kernel<<<dev::grid_for(p.rows, 128), 128, 0, st>>>(p);
  }
  ops::cuda::check_launch("merge");
}

}  // namespace hax::patterns
