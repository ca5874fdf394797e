// LSH lists on the GPU, equal to lsh.cpp's. The binding sorts every (b, h) row of sort keys
// (LibTorch's sort on the device); these kernels build the keys and read the lists off the sort.
//
// keys_kernel   thread per (b, h, i): key = nb·s + bucket·n + (i - s) for position i of the
//               sequence [s, e), n = e - s (see LshSortKeysParams: sorting by it sorts by
//               (sequence, bucket, position), and sequence [s, e) lands at sorted indices [s, e)).
// lists_kernel  a group of G lanes (G = the power of two >= min(K, 32)) per query (b, h, i): the
//               keys of i's sequence in its query bucket c with position <= i are the sorted
//               entries with key in [nb·s + c·n, nb·s + c·n + (i - s)], one slice of [s, e) found
//               by two binary searches (every lane searches alike, reading the same entries); the
//               last min(K, slice) entries' positions, ascending, then -1. No workspace.
#include "patterns/cuda/list_utils.cuh"

namespace hax::patterns {
namespace {

template <class Key>
__global__ void keys_kernel(LshSortKeysParams p) {
  const int64_t n = p.B * p.H * p.L;
  Key* keys = (Key*)p.keys;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = e % p.L, h = (e / p.L) % p.H, b = e / (p.H * p.L);  // e = (b·H + h)·L + i
    const int64_t s = p.start[b * p.L + i], len = p.end[b * p.L + i] - s;
    const int64_t c = p.bucket[(b * p.L + i) * p.H + h];
    keys[e] = (Key)(p.num_buckets * s + c * len + (i - s));
  }
}

template <class Key>
__global__ void lists_kernel(LshListsParams p, int G) {
  const int64_t rows = p.B * p.H * p.L;
  const int64_t groups_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G;
  for (int64_t r = (int64_t)blockIdx.x * groups_per_block + threadIdx.x / G; r < rows;
       r += (int64_t)gridDim.x * groups_per_block) {
    const int64_t i = r % p.L, h = (r / p.L) % p.H, b = r / (p.H * p.L);  // r = (b·H + h)·L + i
    const int64_t s = p.start[b * p.L + i], e = p.end[b * p.L + i];
    const int64_t c = p.q_bucket[(b * p.L + i) * p.H + h];
    const int64_t first_key = p.num_buckets * s + c * (e - s);  // bucket c's key of position s
    const Key* keys = (const Key*)p.sorted_keys + (r - i);      // this (b, h) row
    const int64_t lo = dev::lower_bound(keys, s, e, (Key)first_key);
    const int64_t hi = dev::upper_bound(keys, lo, e, (Key)(first_key + (i - s)));
    const int64_t m = hi - lo < p.K ? hi - lo : p.K;
    const int64_t* pos = p.sorted_pos + (r - i) + (hi - m);
    int32_t* dst = p.out + r * p.K;
    for (int64_t t = lane; t < p.K; t += G) dst[t] = t < m ? (int32_t)pos[t] : -1;
  }
}

}  // namespace

void lsh_sort_keys_cuda(const LshSortKeysParams& p, void* stream) {
  const int64_t n = p.B * p.H * p.L;
  if (n == 0) return;
  const unsigned blocks = dev::grid_for(n, dev::kThreads);
  if (p.keys64)
    keys_kernel<int64_t><<<blocks, dev::kThreads, 0, (cudaStream_t)stream>>>(p);
  else
    keys_kernel<int32_t><<<blocks, dev::kThreads, 0, (cudaStream_t)stream>>>(p);
  ops::cuda::check_launch("lsh (sort keys)");
}

void lsh_lists_cuda(const LshListsParams& p, void* stream) {
  const int64_t rows = p.B * p.H * p.L;
  if (rows == 0) return;
  const int G = dev::lanes_per_list(p.K);
  const unsigned blocks = dev::grid_for(rows, dev::kThreads / G);
  if (p.keys64)
    lists_kernel<int64_t><<<blocks, dev::kThreads, 0, (cudaStream_t)stream>>>(p, G);
  else
    lists_kernel<int32_t><<<blocks, dev::kThreads, 0, (cudaStream_t)stream>>>(p, G);
  ops::cuda::check_launch("lsh (lists)");
}

}  // namespace hax::patterns
