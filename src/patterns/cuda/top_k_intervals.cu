// Key Selection as intervals on the GPU, equal to top_k_prefix.cpp's top_k_prefix_intervals: the
// keys that ever enter their sequence's top k, ascending, each with its leave (the first query
// whose top k no longer holds it, or its sequence's end), plus the extras merge_overflow_rows
// reads (patterns::KeyIntervals). Candidates compare by top_k_keys.cuh's 64-bit keys, so every
// test below is exact (position tie-break included) with no arithmetic on scores.
//
// The scans of top_k_prefix.cu run first, up to block_prefix (TopKPrefixParams::scans_only):
// prefix[blk] = the top k of query t0 - 1 (t0 = 64 blk, the block's first position) in its
// sequence, descending keys, 0-padded. Then, with s, e the bounds of j's sequence:
//   leave_kernel    warp per (b, h, block of 64 positions), positions t0 + lane and t0 + lane + 32.
//                   Key j enters iff fewer than k keys of [s, j) beat it: the beaters in
//                   [max(t0, s), j) (by shuffles over the block's keys: an earlier position beats
//                   j iff its key's high word, the score's, is >= j's) plus, when s < t0, the
//                   entries of prefix[blk] that beat it (the list holds every beater of [s, t0)
//                   when there are fewer than k). For k <= 64 the warp holds that list (entries
//                   lane and lane + 32, read once) and each lane binary-searches it by shuffles;
//                   else each lane binary-searches it in global memory.
//                   An entering key is still held at query t0' - 1 of a later block blk' of its
//                   sequence (t0' <= e - 1) iff prefix[blk'][k - 1] <= key_j (the k-th best of
//                   that prefix does not beat it; 0-padding never does), which is monotone in
//                   blk': B* is the last block of [blk, block of e - 1] at whose start j is held
//                   (B* = blk: from j itself). Each lane probes blocks blk + 1 and blk + 2 itself;
//                   for a key held at both the warp searches the rest, one such key at a time,
//                   32 blocks a round of probes (2 rounds up to ~1000 blocks).
//                   Then B*'s positions up to min(block end, e) - 1: the beaters count up from
//                   their number at the walk's start and the position where they reach k is the
//                   leave, e if none. In j's own block (B* = blk), from j + 1 on, by shuffles,
//                   every lane at once, counting from j's own count. In a later block, one such
//                   key at a time: the warp reads B*'s keys (two a lane, kept for the next key
//                   with the same B*) and finds the (k - cnt)-th beater by ballots and popcounts,
//                   cnt = the entries of prefix[B*] that beat j (by ballots over the list the
//                   warp holds for k <= 64, else each lane's binary search in global memory).
//                   Writes leave_at (the leave, or j itself when j does not enter) and the
//                   block's number of entering keys.
//   offsets_kernel  block of 1024 threads per (b, h): tiles of 4096 of the row's block counts, 4
//                   contiguous ones a thread, scanned by the thread, its warp (shuffles) and the
//                   warps' totals (shared memory); writes the exclusive scan along the row in
//                   place (each block's first slot) and the row's count.
//   write_kernel    warp per (b, h, block): the block's entering keys (leave_at[j] > j), compacted
//                   by ballots at the block's slots in position order, with their leaves; -1 in
//                   the slots [64 blk, 64 blk + 64) from the row's count on (so every slot of
//                   key and leave is written exactly once over the blocks).
// Work: the scans, then one warp step per position and, per entering key, two probes and (held at
// both) a search of the warp over the blocks, and a walk of its own block or a few ballots over
// B*'s. No shared memory beyond the scans' but offsets_kernel's 32 totals.
#include <climits>

#include "patterns/cuda/list_utils.cuh"
#include "patterns/cuda/top_k_keys.cuh"

namespace hax::patterns {
namespace {

using ops::cuda::to_f32;
static_assert(kTopKBlock == 64, "leave_kernel holds two positions per lane");

constexpr int kWarps = 4;           // warps per block of leave_kernel and write_kernel
constexpr int64_t kWarpListK = 64;  // k up to which a warp holds a prefix list (entries lane, lane + 32)
constexpr int kScanThreads = 1024;  // threads per block of offsets_kernel: a warp total per lane
constexpr int kScanPer = 4;         // block counts per thread and tile of offsets_kernel
static_assert(kScanThreads == 32 * 32, "offsets_kernel scans its warps' totals in one warp");

template <class T>
__device__ __forceinline__ uint64_t key_of(const TopKPrefixParams& p, int64_t b, int64_t h, int64_t pos) {
  return score_key(to_f32(((const T*)p.scores)[(b * p.L + pos) * p.H + h]), pos);
}

// Entries greater than x of a descending list of 32 whose entry i lane i holds (v; v31 = entry
// 31): a binary search by shuffles, each lane with its own x. Every lane calls it.
__device__ __forceinline__ int count_greater_lanes(uint64_t v, uint64_t v31, uint64_t x) {
  int c = 0;
#pragma unroll
  for (int s = 16; s >= 1; s /= 2)
    if (__shfl_sync(dev::kFullMask, v, c + s - 1) > x) c += s;
  return c + (c == 31 && v31 > x);  // c = min(entries greater, 31) before
}

// Entries greater than x of a descending list of k <= 64 that the warp holds (entry lane in l0,
// lane + 32 in l1, 0 past k), each lane with its own x. Every lane calls it.
__device__ __forceinline__ int count_greater_warp(uint64_t l0, uint64_t l1, int64_t k, uint64_t x) {
  int c = count_greater_lanes(l0, __shfl_sync(dev::kFullMask, l0, 31), x);
  if (k > 32) {
    const int c1 = count_greater_lanes(l1, __shfl_sync(dev::kFullMask, l1, 31), x);
    if (c == 32) c += c1;
  }
  return c;
}

// The first index of [a, z) where gone (monotone: false ... false, true ... true) holds, z if
// none, found by the warp together: 32 indices a round (evenly spaced while z - a > 32), the
// range narrowed to the gap between the last probe not gone and the first gone. a, z and gone
// are the same on every lane, and every lane calls it. Indices are blocks, below 2^25 (positions
// are int32), so (lane + 1) (z - a) fits an int.
template <class Gone>
__device__ __forceinline__ int warp_first(int a, int z, Gone gone) {
  const int lane = threadIdx.x % 32;
  while (a < z) {
    const int n = z - a;
    if (n <= 32) {
      const unsigned g = __ballot_sync(dev::kFullMask, lane < n && gone(a + lane));
      return g ? a + __ffs(g) - 1 : z;
    }
    // Probe i at a + (i + 1) n / 33 (strictly increasing in i, below z).
    const unsigned g = __ballot_sync(dev::kFullMask, gone(a + (lane + 1) * n / 33));
    const int f = g ? __ffs(g) - 1 : 32;  // the first probe gone, 32 if none (z stands for probe 32)
    const int z1 = a + (f + 1) * n / 33;
    if (f > 0) a += f * n / 33 + 1;  // past probe f - 1, not gone
    z = z1;
  }
  return a;
}

template <class T>
__global__ void leave_kernel(TopKIntervalsParams q) {
  const TopKPrefixParams& p = q.scan;
  const int lane = threadIdx.x % 32;
  const unsigned upto = dev::kFullMask >> (31 - lane);  // lanes 0 .. lane
  const int64_t nblk = top_k_blocks(p.L), warps = (int64_t)gridDim.x * kWarps, k = p.k;
  for (int64_t w = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32; w < p.B * p.H * nblk; w += warps) {
    const int64_t blk = w % nblk, bh = w / nblk, b = bh / p.H, h = bh % p.H;
    const int64_t t0 = blk * kTopKBlock, t1 = t0 + kTopKBlock < p.L ? t0 + kTopKBlock : p.L;
    const int32_t* start = p.start + b * p.L;
    const int32_t* end = q.end + b * p.L;
    const uint64_t* prefixes = p.block_prefix + bh * nblk * k;  // (nblk, k)
    // Register r of a lane: position pos[r] = t0 + lane + 32 r (valid below t1), its key and the
    // key's high word, its sequence's bounds, the offset in the block where its beaters here begin.
    int64_t pos[2];
    int s[2], e[2];
    uint64_t key[2];
    uint32_t hi[2];
    int from[2];
    bool valid[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      pos[r] = t0 + lane + 32 * r;
      valid[r] = pos[r] < t1;
      s[r] = valid[r] ? start[pos[r]] : (int)t0;
      from[r] = s[r] > t0 ? (int)(s[r] - t0) : 0;
      e[r] = valid[r] ? end[pos[r]] : 0;
      key[r] = valid[r] ? key_of<T>(p, b, h, pos[r]) : 0;
      hi[r] = (uint32_t)(key[r] >> 32);
    }
    // The block's prefix list for k <= 64, read with the keys (used when a sequence began before t0).
    const uint64_t* prefix = prefixes + blk * k;
    uint64_t l0 = 0, l1 = 0;
    if (k <= kWarpListK && blk > 0) l0 = lane < k ? prefix[lane] : 0, l1 = lane + 32 < k ? prefix[lane + 32] : 0;
    // Beaters of each key among the block's positions [max(t0, s), pos): earlier positions, so
    // those whose high word is >= the key's (an invalid lane's position is never among them).
    int c[2] = {0, 0};
#pragma unroll 8
    for (int src = 0; src < 32; ++src) {
      const uint32_t o0 = __shfl_sync(dev::kFullMask, hi[0], src), o1 = __shfl_sync(dev::kFullMask, hi[1], src);
      c[0] += src < lane && src >= from[0] && o0 >= hi[0];
      c[1] += (src >= from[1] && o0 >= hi[1]) + (src < lane && src + 32 >= from[1] && o1 >= hi[1]);
    }
    // The sequence began before the block: its beaters there, from the prefix list.
    bool before[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) before[r] = valid[r] && s[r] < t0;
    if (k <= kWarpListK) {
      if (__any_sync(dev::kFullMask, before[0] || before[1])) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int n = count_greater_warp(l0, l1, k, key[r]);
          if (before[r]) c[r] += n;
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (before[r]) c[r] += (int)count_greater(prefix, k, key[r]);
    }
    bool enters[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) enters[r] = valid[r] && c[r] < k;
    // first = B* + 1: the first block of [blk + 1, z) where the key is gone (prefix[.][k - 1] >
    // key), z = the block of e - 1 plus one if none. Each lane probes blk + 1 and blk + 2 itself.
    int first[2];
    bool search[2];  // held at both probes, blocks left: a search of the warp is due
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int a = (int)blk + 1, z = (e[r] - 1) / (int)kTopKBlock + 1;
      uint64_t g0 = 0, g1 = 0;  // the k-th keys of the probed prefixes (read together)
      if (enters[r] && a < z) g0 = prefixes[a * k + k - 1];
      if (enters[r] && a + 1 < z) g1 = prefixes[(a + 1) * k + k - 1];
      const bool held0 = enters[r] && a < z && g0 <= key[r], held1 = held0 && a + 1 < z && g1 <= key[r];
      first[r] = a + held0 + held1;
      search[r] = held1 && first[r] < z;
    }
    // The searches of the warp, one key at a time, over [first, z).
#pragma unroll
    for (int r = 0; r < 2; ++r)
      for (unsigned todo = __ballot_sync(dev::kFullMask, search[r]); todo; todo &= todo - 1) {
        const int src = __ffs(todo) - 1;
        const uint64_t x = __shfl_sync(dev::kFullMask, key[r], src);
        const int a = __shfl_sync(dev::kFullMask, first[r], src);
        const int z = (__shfl_sync(dev::kFullMask, e[r], src) - 1) / (int)kTopKBlock + 1;
        const int f = warp_first(a, z, [&](int m) { return prefixes[m * k + k - 1] > x; });
        if (lane == src) first[r] = f;
      }
    int leave[2] = {e[0], e[1]};
    bool own[2];  // B* = blk: a walk of the own block is due
#pragma unroll
    for (int r = 0; r < 2; ++r) own[r] = enters[r] && first[r] == blk + 1;
    // Walks of the own block: its keys by shuffles, positions (pos, min(t1, e)); later positions,
    // so those whose high word is > the key's beat it.
    if (__any_sync(dev::kFullMask, own[0] || own[1])) {
#pragma unroll
      for (int half = 0; half < 2; ++half)
        for (int src = 0; src < 32; ++src) {
          const uint32_t o = __shfl_sync(dev::kFullMask, hi[half], src);
          const int d = 32 * half + src;  // offset of the position in the block
#pragma unroll
          for (int r = 0; r < 2; ++r)
            if (own[r] && d > lane + 32 * r && t0 + d < e[r] && o > hi[r] && ++c[r] == k)
              leave[r] = (int)t0 + d, own[r] = false;
        }
    }
    // leave_at but for the walks below, and the block's count of entering keys.
    int32_t* leave_at = q.leave_at + bh * p.L;
    bool later[2];  // B* > blk: a walk of a later block is due
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      later[r] = enters[r] && first[r] > blk + 1;
      if (valid[r] && !later[r]) leave_at[pos[r]] = enters[r] ? leave[r] : (int32_t)pos[r];
    }
    const int n = __popc(__ballot_sync(dev::kFullMask, enters[0])) + __popc(__ballot_sync(dev::kFullMask, enters[1]));
    if (lane == 0) q.block_count[w] = n;
    // Walks of a later block B*, one key at a time: the warp's keys of B* (positions u0 + lane and
    // u0 + 32 + lane, 0 past L; kept while B* repeats) and, for k <= 64, its prefix list. For k >
    // 64, the entries of prefix[B*] that beat the key, by each lane's binary search.
    int greater[2] = {0, 0};
    if (k > kWarpListK) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (later[r]) greater[r] = (int)count_greater(prefixes + (int64_t)(first[r] - 1) * k, k, key[r]);
    }
    int kept = -1;
    uint64_t o0 = 0, o1 = 0, pl0 = 0, pl1 = 0;
#pragma unroll
    for (int r = 0; r < 2; ++r)
      for (unsigned todo = __ballot_sync(dev::kFullMask, later[r]); todo; todo &= todo - 1) {
        const int src = __ffs(todo) - 1;
        const uint64_t x = __shfl_sync(dev::kFullMask, key[r], src);
        const int bs = __shfl_sync(dev::kFullMask, first[r], src) - 1, es = __shfl_sync(dev::kFullMask, e[r], src);
        const int64_t u0 = bs * kTopKBlock;
        if (bs != kept) {
          kept = bs;
          o0 = u0 + lane < p.L ? key_of<T>(p, b, h, u0 + lane) : 0;
          o1 = u0 + 32 + lane < p.L ? key_of<T>(p, b, h, u0 + 32 + lane) : 0;
          const uint64_t* list = prefixes + bs * k;
          if (k <= kWarpListK) pl0 = lane < k ? list[lane] : 0, pl1 = lane + 32 < k ? list[lane + 32] : 0;
        }
        // cnt: the beaters of [s, u0), the entries of prefix[B*] above x (fewer than k: held there).
        int cnt;
        if (k <= kWarpListK)
          cnt = __popc(__ballot_sync(dev::kFullMask, pl0 > x)) + __popc(__ballot_sync(dev::kFullMask, pl1 > x));
        else
          cnt = __shfl_sync(dev::kFullMask, greater[r], src);
        // The beaters in [u0, min(u0 + 64, es)) in position order; the (k - cnt)-th is the leave.
        const bool beats0 = u0 + lane < es && o0 > x, beats1 = u0 + 32 + lane < es && o1 > x;
        const unsigned m0 = __ballot_sync(dev::kFullMask, beats0), m1 = __ballot_sync(dev::kFullMask, beats1);
        const int need = (int)k - cnt;
        const unsigned at0 = __ballot_sync(dev::kFullMask, beats0 && __popc(m0 & upto) == need);
        const unsigned at1 = __ballot_sync(dev::kFullMask, beats1 && __popc(m0) + __popc(m1 & upto) == need);
        if (lane == src) leave_at[t0 + 32 * r + src] = (int32_t)(at0 ? u0 + __ffs(at0) - 1 : at1 ? u0 + 32 + __ffs(at1) - 1 : es);
      }
  }
}

__global__ void __launch_bounds__(kScanThreads) offsets_kernel(TopKIntervalsParams q) {
  __shared__ int32_t warp_total[kScanThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t nblk = top_k_blocks(q.scan.L), BH = q.scan.B * q.scan.H;
  for (int64_t bh = blockIdx.x; bh < BH; bh += gridDim.x) {
    int32_t* counts = q.block_count + bh * nblk;
    int32_t run = 0;  // the row's counts before the tile
    for (int64_t c0 = 0; c0 < nblk; c0 += kScanThreads * kScanPer) {
      const int64_t c = c0 + (int64_t)threadIdx.x * kScanPer;  // the thread's first count
      int32_t v[kScanPer], sum = 0;
#pragma unroll
      for (int i = 0; i < kScanPer; ++i) v[i] = c + i < nblk ? counts[c + i] : 0;
#pragma unroll
      for (int i = 0; i < kScanPer; ++i) sum += v[i];
      int32_t incl = sum;  // the sums of the warp's threads up to this one
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t u = __shfl_up_sync(dev::kFullMask, incl, o);
        if (lane >= o) incl += u;
      }
      if (lane == 31) warp_total[warp] = incl;
      __syncthreads();
      const int32_t t = warp_total[lane];
      int32_t tincl = t;  // every warp scans the warps' totals
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t u = __shfl_up_sync(dev::kFullMask, tincl, o);
        if (lane >= o) tincl += u;
      }
      const int32_t below = __shfl_sync(dev::kFullMask, tincl - t, warp), tile = __shfl_sync(dev::kFullMask, tincl, 31);
      __syncthreads();  // the next tile rewrites warp_total
      int32_t x = run + below + incl - sum;
#pragma unroll
      for (int i = 0; i < kScanPer; ++i) {
        if (c + i < nblk) counts[c + i] = x;
        x += v[i];
      }
      run += tile;
    }
    if (threadIdx.x == 0) q.count[bh] = run;
  }
}

__global__ void write_kernel(TopKIntervalsParams q) {
  const int lane = threadIdx.x % 32;
  const unsigned lanes_below = (1u << lane) - 1;
  const int64_t L = q.scan.L, nblk = top_k_blocks(L), warps = (int64_t)gridDim.x * kWarps;
  for (int64_t w = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32; w < q.scan.B * q.scan.H * nblk; w += warps) {
    const int64_t blk = w % nblk, bh = w / nblk;
    const int64_t t0 = blk * kTopKBlock, t1 = t0 + kTopKBlock < L ? t0 + kTopKBlock : L;
    const int32_t* leave_at = q.leave_at + bh * L;
    int32_t* key = q.key + bh * L;
    int32_t* leave = q.leave + bh * L;
    int64_t slot = q.block_count[w];  // the block's first slot
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t j = t0 + lane + 32 * r;
      const int32_t lv = j < t1 ? leave_at[j] : 0;
      const bool on = j < t1 && lv > j;
      const unsigned m = __ballot_sync(dev::kFullMask, on);
      if (on) {
        const int64_t at = slot + __popc(m & lanes_below);
        key[at] = (int32_t)j, leave[at] = lv;
      }
      slot += __popc(m);
    }
    const int32_t count = q.count[bh];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t t = t0 + lane + 32 * r;
      if (t < t1 && t >= count) key[t] = -1, leave[t] = -1;
    }
  }
}

}  // namespace

void top_k_intervals_cuda(const TopKIntervalsParams& p0, DType dtype, void* stream) {
  TopKIntervalsParams p = p0;
  const int64_t B = p.scan.B, H = p.scan.H, L = p.scan.L, BH = B * H;
  if (BH * L == 0) return;
  if (!p.end || !p.block_count || !p.leave_at || !p.count || !p.key || !p.leave || !p.scan.block_prefix)
    throw std::runtime_error("top_k_intervals_cuda: needs end, block_count, leave_at, count, key, leave, block_prefix");
  p.scan.out = nullptr, p.scan.plan_count = nullptr, p.scan.ex_rank = nullptr;
  p.scan.scans_only = true;
  top_k_prefix_cuda(p.scan, dtype, stream);  // (checks 1 <= k < L, k <= kTopKMaxK)
  cudaStream_t st = (cudaStream_t)stream;
  const int64_t nblk = top_k_blocks(L);
  const unsigned threads = kWarps * 32;
  HAX_DISPATCH_DTYPE(dtype, [&] {
    leave_kernel<scalar_t><<<dev::grid_for(BH * nblk, kWarps), threads, 0, st>>>(p);
  });
  ops::cuda::check_launch("top_k_intervals (leaves)");
  offsets_kernel<<<dev::grid_for(BH, 1), kScanThreads, 0, st>>>(p);
  ops::cuda::check_launch("top_k_intervals (offsets)");
  write_kernel<<<dev::grid_for(BH * nblk, kWarps), threads, 0, st>>>(p);
  ops::cuda::check_launch("top_k_intervals (entries)");
}

}  // namespace hax::patterns
