// LSH's sort of every (b, h) row's positions by (bucket, position), for rows of one sequence each
// and at most kBucketSortMaxBuckets buckets (cuda_params.h, LshBucketSortParams): a counting sort
// in three launches instead of keys, two radix passes and the full keys (lsh_lists.cu), which took
// ~75 us a tensor at L = 64K x 16 heads, 256 buckets, on the H100.
//   hist_kernel     block per (row, tile of kBucketSortTile positions): the tile's count of each
//                   bucket (shared-memory atomics), into counts[row][bucket][tile];
//   scan_kernel     warp per (row, bucket): the exclusive prefix of its counts over the tiles
//                   (pre[row][bucket][tile]) and its total (tot[row][bucket]);
//   scatter_kernel  block per (row, tile): first the tile's positions in sorted order in shared
//                   memory, a chunk of 256 at a time (a thread each), each at its bucket's start
//                   within the tile (a block scan of the tile's counts) plus its rank among the
//                   bucket's earlier entries (the earlier chunks', then the chunk's: warps by
//                   __match_any_sync, then the earlier warps' counts); then every entry to its
//                   row slot, Σ tot of the lower buckets + pre + its place in the bucket's run, so
//                   that each bucket's entries go out as one run of consecutive slots. Stable:
//                   positions of one bucket keep their order, as the radix sort of
//                   position-ordered keys keeps it.
#include <stdexcept>
#include <string>

#include "patterns/cuda/list_utils.cuh"

namespace hax::patterns {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = (int)kBucketSortTile;
constexpr int kScanThreads = 256;
static_assert(kBucketSortMaxBuckets % kThreads == 0 && kBucketSortMaxBuckets <= 4 * kThreads, "block_exclusive_scan");
static_assert(kBucketSortMaxBuckets <= 32768, "buckets fit int16 in shared memory");

__device__ __forceinline__ int64_t tiles_of(int64_t L) { return (L + kTile - 1) / kTile; }

// The bucket of position i of row r = b·H + h.
__device__ __forceinline__ int32_t bucket_at(const LshBucketSortParams& p, int64_t r, int64_t i) {
  return p.bucket[((r / p.H) * p.L + i) * p.H + r % p.H];
}

// The workspace after the counts: pre (rows, nb, T), then tot (rows, nb).
__device__ __forceinline__ int32_t* pre_of(const LshBucketSortParams& p) {
  return p.counts + p.B * p.H * p.num_buckets * tiles_of(p.L);
}
__device__ __forceinline__ int32_t* tot_of(const LshBucketSortParams& p) {
  return pre_of(p) + p.B * p.H * p.num_buckets * tiles_of(p.L);
}

__global__ void __launch_bounds__(kThreads) hist_kernel(LshBucketSortParams p) {
  extern __shared__ int32_t cnt[];  // (nb)
  const int nb = (int)p.num_buckets;
  const int64_t T = tiles_of(p.L), r = blockIdx.x / T, tile = blockIdx.x % T;
  for (int c = threadIdx.x; c < nb; c += kThreads) cnt[c] = 0;
  __syncthreads();
  const int64_t i1 = (tile + 1) * kTile < p.L ? (tile + 1) * kTile : p.L;
  for (int64_t i = tile * kTile + threadIdx.x; i < i1; i += kThreads) atomicAdd(&cnt[bucket_at(p, r, i)], 1);
  __syncthreads();
  for (int c = threadIdx.x; c < nb; c += kThreads) p.counts[(r * nb + c) * T + tile] = cnt[c];
}

// Warp per (row, bucket) over the tiles, kScanThreads / 32 warps a block.
__global__ void __launch_bounds__(kScanThreads) scan_kernel(LshBucketSortParams p) {
  const int64_t T = tiles_of(p.L), nb = p.num_buckets;
  const int64_t w = (int64_t)blockIdx.x * (kScanThreads / 32) + threadIdx.x / 32;  // r·nb + c
  if (w >= p.B * p.H * nb) return;
  const int lane = threadIdx.x % 32;
  const int32_t* cnt = p.counts + w * T;
  int32_t* pre = pre_of(p) + w * T;
  int32_t run = 0;
  for (int64_t t0 = 0; t0 < T; t0 += 32) {
    const int32_t x = t0 + lane < T ? cnt[t0 + lane] : 0;
    int32_t incl = x;
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(dev::kFullMask, incl, o);
      if (lane >= o) incl += y;
    }
    if (t0 + lane < T) pre[t0 + lane] = run + incl - x;
    run += __shfl_sync(dev::kFullMask, incl, 31);
  }
  if (lane == 0) tot_of(p)[w] = run;
}

// Block-wide exclusive scan of v[0..n) in shared memory (n <= 4 kThreads), in place; returns the total.
__device__ __forceinline__ int32_t block_exclusive_scan(int32_t* v, int n, int32_t* warp_sum) {
  constexpr int kPer = (int)kBucketSortMaxBuckets / kThreads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, a = threadIdx.x * kPer;
  int32_t x[kPer], mine = 0;
#pragma unroll
  for (int e = 0; e < kPer; ++e) x[e] = a + e < n ? v[a + e] : 0, mine += x[e];
  int32_t incl = mine;
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t y = __shfl_up_sync(dev::kFullMask, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) warp_sum[warp] = incl;
  __syncthreads();
  int32_t run = incl - mine, total = 0;
  for (int w = 0; w < kWarps; ++w) run += w < warp ? warp_sum[w] : 0, total += warp_sum[w];
#pragma unroll
  for (int e = 0; e < kPer; ++e)
    if (a + e < n) v[a + e] = run, run += x[e];
  __syncthreads();
  return total;
}

template <class Key>
__global__ void __launch_bounds__(kThreads) scatter_kernel(LshBucketSortParams p) {
  extern __shared__ int32_t smem[];
  const int nb = (int)p.num_buckets;
  int32_t* local = smem;              // (nb) each bucket's next place in the tile's sorted order
  int32_t* row_at = local + nb;       // (nb) the row slot of the bucket's first entry of the tile
  int32_t* first = row_at + nb;       // (nb) each bucket's start in the tile's sorted order
  int32_t* wcnt = first + nb;         // (kWarps, nb) the chunk's count of each bucket per warp
  int32_t* s_pos = wcnt + kWarps * nb;  // (kTile) the tile's positions in sorted order
  int16_t* s_bkt = reinterpret_cast<int16_t*>(s_pos + kTile);  // (kTile) and their buckets
  __shared__ int32_t warp_sum[kWarps];
  const int64_t T = tiles_of(p.L), r = blockIdx.x / T, tile = blockIdx.x % T;
  for (int c = threadIdx.x; c < nb; c += kThreads) {
    first[c] = p.counts[(r * nb + c) * T + tile];
    row_at[c] = tot_of(p)[r * nb + c];
  }
  for (int c = threadIdx.x; c < kWarps * nb; c += kThreads) wcnt[c] = 0;
  __syncthreads();
  block_exclusive_scan(first, nb, warp_sum);   // the tile's bucket starts
  block_exclusive_scan(row_at, nb, warp_sum);  // the row's bucket starts
  for (int c = threadIdx.x; c < nb; c += kThreads) {
    local[c] = first[c];
    row_at[c] += pre_of(p)[(r * nb + c) * T + tile];
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned below = (1u << lane) - 1u;
  const int64_t t0 = tile * kTile, i1 = t0 + kTile < p.L ? t0 + kTile : p.L;
  for (int64_t i0 = t0; i0 < i1; i0 += kThreads) {
    const int64_t i = i0 + threadIdx.x;
    const int32_t c = i < i1 ? bucket_at(p, r, i) : -1;
    const unsigned peers = __match_any_sync(dev::kFullMask, c);
    const int rank = __popc(peers & below), leader = __ffs(peers) - 1;
    if (c >= 0 && lane == leader) wcnt[warp * nb + c] = __popc(peers);
    __syncthreads();
    int before = 0, after = 0;  // the chunk's entries of bucket c in earlier and in later warps
    if (c >= 0) {
      for (int w = 0; w < kWarps; ++w) {
        const int x = wcnt[w * nb + c];
        before += w < warp ? x : 0;
        after += w > warp ? x : 0;
      }
      const int at = local[c] + before + rank;
      s_pos[at] = (int32_t)i;
      s_bkt[at] = (int16_t)c;
    }
    __syncthreads();  // every thread has read the counts and places
    if (c >= 0) {
      // The chunk's last entry of bucket c moves the bucket's next place past the chunk's entries.
      if (after == 0 && rank == __popc(peers) - 1) local[c] += before + rank + 1;
      if (lane == leader) wcnt[warp * nb + c] = 0;
    }
    __syncthreads();
  }
  // Each bucket's entries of the tile go to consecutive row slots.
  for (int at = threadIdx.x; at < (int)(i1 - t0); at += kThreads) {
    const int c = s_bkt[at];
    const int64_t slot = r * p.L + row_at[c] + (at - first[c]);
    const int32_t i = s_pos[at];
    p.pos[slot] = i;
    if (p.keys) ((Key*)p.keys)[slot] = (Key)(((uint64_t)r * nb + c) * (uint64_t)p.L + (uint64_t)i);
  }
}

}  // namespace

void lsh_bucket_sort_cuda(const LshBucketSortParams& p, void* stream) {
  const int64_t rows = p.B * p.H, T = (p.L + kTile - 1) / kTile;
  if (rows * p.L == 0) return;
  if (p.num_buckets < 1 || p.num_buckets > kBucketSortMaxBuckets)
    throw std::runtime_error("lsh_bucket_sort: " + std::to_string(p.num_buckets) + " buckets, not within [1, " +
                             std::to_string(kBucketSortMaxBuckets) + "]");
  const auto st = (cudaStream_t)stream;
  const size_t nb = (size_t)p.num_buckets;
  hist_kernel<<<(unsigned)(rows * T), kThreads, nb * sizeof(int32_t), st>>>(p);
  ops::cuda::check_launch("lsh_bucket_sort (counts)");
  const int64_t warps = rows * p.num_buckets, per = kScanThreads / 32;
  scan_kernel<<<(unsigned)((warps + per - 1) / per), kScanThreads, 0, st>>>(p);
  ops::cuda::check_launch("lsh_bucket_sort (scan)");
  const size_t smem = (3 + kWarps) * nb * sizeof(int32_t) + kTile * (sizeof(int32_t) + sizeof(int16_t));
  if (p.keys64) {
    ops::cuda::allow_smem(scatter_kernel<uint64_t>, smem, "lsh_bucket_sort (scatter)");
    scatter_kernel<uint64_t><<<(unsigned)(rows * T), kThreads, smem, st>>>(p);
  } else {
    ops::cuda::allow_smem(scatter_kernel<uint32_t>, smem, "lsh_bucket_sort (scatter)");
    scatter_kernel<uint32_t><<<(unsigned)(rows * T), kThreads, smem, st>>>(p);
  }
  ops::cuda::check_launch("lsh_bucket_sort (scatter)");
}

}  // namespace hax::patterns
