// LSH lists on the GPU, equal to lsh.cpp's. The keys of every (b, h) row are sorted by one radix
// sort of all rows at once (the row in the keys' high part, see LshSortKeysParams; LibTorch's
// per-row sort where that does not fit 64 bits), and these kernels read the lists off the sort.
//
// keys_kernel   thread per (b, h, i): key = r·row_stride + nb·s + bucket·n + (i - s) for position
//               i of the sequence [s, e), n = e - s, r = b·H + h (see LshSortKeysParams: sorting by
//               it sorts by (row, sequence, bucket, position), and sequence [s, e) lands at sorted
//               indices [s, e) of its row), and the position i as the sort's value. Rows of one
//               sequence each take the short key r·nb + bucket instead (LshSortKeysParams::short_keys).
// lsh_sort_cuda CUB's radix sort of the (key, position) pairs over the keys' significant bits.
// full_keys_kernel  after a sort of short keys: the full keys, short·L + position.
// (Short keys of at most kBucketSortMaxBuckets buckets skip these three: lsh_bucket_sort.cu's
// counting sort gives the sorted positions and full keys directly.)
// lists_kernel  block per (b, h, run of kListWarps·kListQueries queries), warp per kListQueries
//               queries, 32 at a time: the keys of i's sequence in its query bucket c with
//               position <= i are the sorted entries with key in [first = key(c, s), x = key(c, i)]
//               (one slice of [s, e)), so the slice is [lo, hi) with hi = the row's keys <= x and lo
//               = those < first. Each lane counts for its own query: a binary search in the block's
//               table of every S-th sorted key (shared memory), then one in the window of S - 1
//               keys it leaves. Then the warp writes the lists, lane t slot t (t + 32, ... past 32):
//               the slice's last min(K, slice) positions, ascending, then -1. No workspace.
#include <cub/device/device_radix_sort.cuh>

#include "patterns/cuda/list_utils.cuh"

namespace hax::patterns {
namespace {

constexpr int kListWarps = 8;       // warps per lists_kernel block
constexpr int kListQueries = 64;    // queries per warp
constexpr int64_t kSplitters = 2048;  // the most table entries per block

template <class Key>
__global__ void keys_kernel(LshSortKeysParams p) {
  const int64_t n = p.B * p.H * p.L;
  Key* keys = (Key*)p.keys;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = e % p.L, r = e / p.L, h = r % p.H, b = r / p.H;  // e = (b·H + h)·L + i
    const int64_t c = p.bucket[(b * p.L + i) * p.H + h];
    if (p.short_keys) {
      keys[e] = (Key)(r * p.num_buckets + c);
    } else {
      const int64_t s = p.start[b * p.L + i], len = p.end[b * p.L + i] - s;
      keys[e] = (Key)((uint64_t)r * p.row_stride + (uint64_t)(p.num_buckets * s + c * len + (i - s)));
    }
    if (p.pos) p.pos[e] = (int32_t)i;
  }
}

template <class Key>
__global__ void full_keys_kernel(LshFullKeysParams p) {
  Key* keys = (Key*)p.keys;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < p.n; e += (int64_t)gridDim.x * blockDim.x)
    keys[e] = (Key)((uint64_t)p.short_keys[e] * (uint64_t)p.L + (uint64_t)p.pos[e]);
}

// The table stride S: a power of two >= 32 with at most kSplitters entries of a row.
inline int64_t splitter_stride(int64_t L) {
  int64_t S = 32;
  while ((L + S - 1) / S > kSplitters) S *= 2;
  return S;
}

// The number of the row's sorted keys <= x (keys[0..L) ascending, table[t] = keys[t·S]): a
// binary search in the table, then one in the window of S - 1 keys it leaves.
template <class Key>
__device__ __forceinline__ int64_t count_le(const Key* keys, const Key* table, int64_t T, int64_t S, int64_t L, Key x) {
  int64_t lo = 0, hi = T;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (table[mid] <= x) lo = mid + 1;
    else hi = mid;
  }
  if (lo == 0) return 0;  // keys[0] > x
  // keys[(lo - 1)·S] <= x < keys[lo·S] (or lo·S >= L): the count is in ((lo - 1)·S, min(lo·S, L)].
  int64_t a = (lo - 1) * S + 1, z = lo * S < L ? lo * S : L;
  while (a < z) {
    const int64_t mid = (a + z) / 2;
    if (keys[mid] <= x) a = mid + 1;
    else z = mid;
  }
  return a;
}

constexpr int kListAhead = 8;  // queries whose slots a warp loads at once (K <= 32)

template <class Key>
__global__ void lists_kernel(LshListsParams p, int64_t S) {
  extern __shared__ __align__(16) unsigned char smem[];
  Key* table = (Key*)smem;  // (T) every S-th sorted key of the row
  const int64_t T = (p.L + S - 1) / S, per_block = (int64_t)kListWarps * kListQueries;
  const int64_t runs = (p.L + per_block - 1) / per_block;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t blk = blockIdx.x; blk < p.B * p.H * runs; blk += gridDim.x) {
    const int64_t r = blk / runs, run = blk % runs, b = r / p.H, h = r % p.H;  // r = b·H + h
    const Key* keys = (const Key*)p.sorted_keys + r * p.L;
    const int32_t* pos = p.sorted_pos + r * p.L;
    const uint64_t base = (uint64_t)r * p.row_stride;
    __syncthreads();  // the previous row's table is no longer read
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x) table[t] = keys[t * S];
    __syncthreads();
    const int64_t w0 = run * per_block + (int64_t)warp * kListQueries;
    const int64_t w1 = w0 + kListQueries < p.L ? w0 + kListQueries : p.L;
    for (int64_t q0 = w0; q0 < w1; q0 += 32) {
      // Lane l finds query i = q0 + l's slice [lo, hi): its keys are in [first = key(c, s), x = key(c, i)].
      int64_t hi = 0, m = 0;
      if (q0 + lane < w1) {
        const int64_t i = q0 + lane, s = p.start[b * p.L + i], e = p.end[b * p.L + i];
        const int64_t c = p.q_bucket[(b * p.L + i) * p.H + h];
        const uint64_t first = base + (uint64_t)(p.num_buckets * s + c * (e - s));
        hi = count_le(keys, table, T, S, p.L, (Key)(first + (uint64_t)(i - s)));
        const int64_t lo = first == 0 ? 0 : count_le(keys, table, T, S, p.L, (Key)(first - 1));
        m = hi - lo < p.K ? hi - lo : p.K;  // the slice's last m entries are the list
      }
      const int nq = (int)(w1 - q0 < 32 ? w1 - q0 : 32);
      if (p.K <= 32) {  // lane t writes slot t; the slots of kListAhead queries load at once
        for (int u0 = 0; u0 < nq; u0 += kListAhead) {
          int32_t v[kListAhead];
#pragma unroll
          for (int d = 0; d < kListAhead; ++d) {
            const int u = u0 + d;
            const int64_t hu = __shfl_sync(dev::kFullMask, hi, u % 32), mu = __shfl_sync(dev::kFullMask, m, u % 32);
            v[d] = u < nq && lane < mu ? pos[hu - mu + lane] : -1;
          }
#pragma unroll
          for (int d = 0; d < kListAhead; ++d)
            if (u0 + d < nq && lane < p.K) p.out[(r * p.L + q0 + u0 + d) * p.K + lane] = v[d];
        }
      } else {
        for (int u = 0; u < nq; ++u) {
          const int64_t hu = __shfl_sync(dev::kFullMask, hi, u), mu = __shfl_sync(dev::kFullMask, m, u);
          int32_t* dst = p.out + (r * p.L + q0 + u) * p.K;
          for (int64_t t = lane; t < p.K; t += 32) dst[t] = t < mu ? pos[hu - mu + t] : -1;
        }
      }
    }
  }
}

// Block per (b, h, run of kBandQueries sorted queries), a thread per query: band[0..1] of the
// slice that lists_kernel finds for it (the same table and count_le).
constexpr int kBandThreads = 256;
constexpr int64_t kBandQueries = 2048;

template <class Key>
__global__ void band_queries_kernel(LshBandParams bp, int64_t S) {
  extern __shared__ __align__(16) unsigned char smem[];
  const LshListsParams& p = bp.lists;
  Key* table = (Key*)smem;  // (T) every S-th sorted key of the row
  const int64_t T = (p.L + S - 1) / S, runs = (p.L + kBandQueries - 1) / kBandQueries;
  const int64_t r = blockIdx.x / runs, run = blockIdx.x % runs, b = r / p.H, h = r % p.H;  // r = b·H + h
  const Key* keys = (const Key*)p.sorted_keys + r * p.L;
  const uint64_t base = (uint64_t)r * p.row_stride;
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) table[t] = keys[t * S];
  __syncthreads();
  const int64_t n = p.B * p.H * p.L;
  const int64_t t1 = (run + 1) * kBandQueries < p.L ? (run + 1) * kBandQueries : p.L;
  for (int64_t t = run * kBandQueries + threadIdx.x; t < t1; t += blockDim.x) {
    const int64_t i = bp.q_order[r * p.L + t], s = p.start[b * p.L + i], e = p.end[b * p.L + i];
    const int64_t c = p.q_bucket[(b * p.L + i) * p.H + h];
    const uint64_t first = base + (uint64_t)(p.num_buckets * s + c * (e - s));
    const int64_t hi = count_le(keys, table, T, S, p.L, (Key)(first + (uint64_t)(i - s)));
    const int64_t lo = first == 0 ? 0 : count_le(keys, table, T, S, p.L, (Key)(first - 1));
    const int64_t m = hi - lo < p.K ? hi - lo : p.K;
    bp.band[r * p.L + t] = (int32_t)(hi - m);
    bp.band[n + r * p.L + t] = (int32_t)(hi - 1);
  }
}

// Thread per (b, h, sorted key s): band[2] and band[3] by binary searches in the row's band[1]
// and band[0].
__global__ void band_keys_kernel(LshBandParams bp) {
  const LshListsParams& p = bp.lists;
  const int64_t n = p.B * p.H * p.L;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = e / p.L, s = e % p.L;
    const int32_t* first = bp.band + r * p.L;      // band[0] of the row
    const int32_t* last = bp.band + n + r * p.L;   // band[1] of the row
    int64_t a = 0, z = p.L;  // the first t with last[t] >= s
    while (a < z) {
      const int64_t mid = (a + z) / 2;
      if (last[mid] >= s) z = mid;
      else a = mid + 1;
    }
    bp.band[2 * n + e] = (int32_t)a;
    a = 0, z = p.L;  // the first t with first[t] > s; the last with first[t] <= s is one before
    while (a < z) {
      const int64_t mid = (a + z) / 2;
      if (first[mid] > s) z = mid;
      else a = mid + 1;
    }
    bp.band[3 * n + e] = (int32_t)(a - 1);
  }
}

}  // namespace

void lsh_band_cuda(const LshBandParams& bp, void* stream) {
  const LshListsParams& p = bp.lists;
  const int64_t rows = p.B * p.H * p.L;
  if (rows == 0) return;
  const int64_t S = splitter_stride(p.L), T = (p.L + S - 1) / S;
  const unsigned blocks = dev::grid_for(p.B * p.H * ((p.L + kBandQueries - 1) / kBandQueries), 1);
  const auto st = (cudaStream_t)stream;
  if (p.keys64)
    band_queries_kernel<uint64_t><<<blocks, kBandThreads, T * sizeof(uint64_t), st>>>(bp, S);
  else
    band_queries_kernel<uint32_t><<<blocks, kBandThreads, T * sizeof(uint32_t), st>>>(bp, S);
  ops::cuda::check_launch("lsh band (queries)");
  if (!bp.key_side) return;
  band_keys_kernel<<<dev::grid_for(rows, dev::kThreads), dev::kThreads, 0, st>>>(bp);
  ops::cuda::check_launch("lsh band (keys)");
}

void lsh_sort_keys_cuda(const LshSortKeysParams& p, void* stream) {
  const int64_t n = p.B * p.H * p.L;
  if (n == 0) return;
  const unsigned blocks = dev::grid_for(n, dev::kThreads);
  if (p.keys64 && !p.short_keys)
    keys_kernel<uint64_t><<<blocks, dev::kThreads, 0, (cudaStream_t)stream>>>(p);
  else
    keys_kernel<uint32_t><<<blocks, dev::kThreads, 0, (cudaStream_t)stream>>>(p);
  ops::cuda::check_launch("lsh (sort keys)");
}

void lsh_full_keys_cuda(const LshFullKeysParams& p, void* stream) {
  if (p.n == 0) return;
  const unsigned blocks = dev::grid_for(p.n, dev::kThreads);
  if (p.keys64)
    full_keys_kernel<uint64_t><<<blocks, dev::kThreads, 0, (cudaStream_t)stream>>>(p);
  else
    full_keys_kernel<uint32_t><<<blocks, dev::kThreads, 0, (cudaStream_t)stream>>>(p);
  ops::cuda::check_launch("lsh (full keys)");
}

namespace {
template <class Key>
cudaError_t radix_sort(const LshSortParams& p, void* temp, size_t& bytes, cudaStream_t st) {
  return cub::DeviceRadixSort::SortPairs(temp, bytes, (const Key*)p.keys_in, (Key*)p.keys_out, p.pos_in, p.pos_out,
                                         p.n, 0, p.bits, st);
}
}  // namespace

size_t lsh_sort_temp_bytes(int64_t n, bool keys64, int bits) {
  LshSortParams p;
  p.n = n, p.keys64 = keys64, p.bits = bits;
  size_t bytes = 0;
  const cudaError_t e = keys64 ? radix_sort<uint64_t>(p, nullptr, bytes, nullptr)
                               : radix_sort<uint32_t>(p, nullptr, bytes, nullptr);
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("lsh (sort): cannot size the sort: ") + cudaGetErrorString(e));
  return bytes;
}

void lsh_sort_cuda(const LshSortParams& p, void* stream) {
  if (p.n == 0) return;
  size_t bytes = p.temp_bytes;
  const cudaError_t e = p.keys64 ? radix_sort<uint64_t>(p, p.temp, bytes, (cudaStream_t)stream)
                                 : radix_sort<uint32_t>(p, p.temp, bytes, (cudaStream_t)stream);
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("lsh (sort): the radix sort failed: ") + cudaGetErrorString(e));
  ops::cuda::check_launch("lsh (sort)");
}

void lsh_lists_cuda(const LshListsParams& p, void* stream) {
  const int64_t rows = p.B * p.H * p.L;
  if (rows == 0 || p.K == 0) return;
  const int64_t S = splitter_stride(p.L), T = (p.L + S - 1) / S;
  const int64_t per_block = (int64_t)kListWarps * kListQueries;
  const unsigned blocks = dev::grid_for(p.B * p.H * ((p.L + per_block - 1) / per_block), 1);
  const unsigned threads = kListWarps * 32;
  if (p.keys64)
    lists_kernel<uint64_t><<<blocks, threads, T * sizeof(uint64_t), (cudaStream_t)stream>>>(p, S);
  else
    lists_kernel<uint32_t><<<blocks, threads, T * sizeof(uint32_t), (cudaStream_t)stream>>>(p, S);
  ops::cuda::check_launch("lsh (lists)");
}

}  // namespace hax::patterns
