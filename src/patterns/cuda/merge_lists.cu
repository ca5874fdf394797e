// The union of two patterns' lists on the GPU, equal to merge.cpp's: per row (b, h, i) a two-way
// merge of the ascending lists a and b (each ending at its first -1) that drops repeats, then -1.
//
// One thread per row runs the CPU's merge. The rows of a block are staged through shared memory
// (coalesced loads of the a and b tiles, each thread merging its row into an output tile, a
// coalesced store), rows padded to an odd stride so that the threads' row accesses fall in
// distinct banks. Lists too long for a 32-row tile merge straight from global memory.
#include "patterns/cuda/list_utils.cuh"

namespace hax::patterns {
namespace {

constexpr int kMaxRows = 64;               // rows (threads) per block of the staged kernel
constexpr int64_t kStagedBytes = 48 * 1024;  // its shared memory budget

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

__host__ __device__ inline int odd_stride(int64_t n) { return (int)(n % 2 ? n : n + 1); }

__global__ void merge_staged_kernel(MergeListsParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int Ka = (int)p.Ka, Kb = (int)p.Kb, K = Ka + Kb;
  const int sa = odd_stride(Ka), sb = odd_stride(Kb), so = odd_stride(K);
  const int R = blockDim.x;  // rows per tile
  int32_t* ta = (int32_t*)smem;
  int32_t* tb = ta + R * sa;
  int32_t* to = tb + R * sb;
  for (int64_t r0 = (int64_t)blockIdx.x * R; r0 < p.rows; r0 += (int64_t)gridDim.x * R) {
    const int nr = (int)(p.rows - r0 < R ? p.rows - r0 : R);
    for (int e = threadIdx.x; e < nr * Ka; e += R) ta[(e / Ka) * sa + e % Ka] = p.a[r0 * Ka + e];
    for (int e = threadIdx.x; e < nr * Kb; e += R) tb[(e / Kb) * sb + e % Kb] = p.b[r0 * Kb + e];
    __syncthreads();
    if ((int)threadIdx.x < nr) merge_row(ta + threadIdx.x * sa, Ka, tb + threadIdx.x * sb, Kb, to + threadIdx.x * so);
    __syncthreads();
    for (int e = threadIdx.x; e < nr * K; e += R) p.out[r0 * K + e] = to[(e / K) * so + e % K];
    __syncthreads();
  }
}

}  // namespace

void merge_lists_cuda(const MergeListsParams& p, void* stream) {
  const int64_t K = p.Ka + p.Kb;
  if (p.rows == 0 || K == 0) return;
  cudaStream_t st = (cudaStream_t)stream;
  const int64_t row_bytes = 4 * ((int64_t)odd_stride(p.Ka) + odd_stride(p.Kb) + odd_stride(K));
  int rows = kMaxRows;
  while (rows > 32 && rows * row_bytes > kStagedBytes) rows /= 2;
  if (p.Ka >= 1 && p.Kb >= 1 && rows * row_bytes <= kStagedBytes) {
    merge_staged_kernel<<<dev::grid_for(p.rows, rows), rows, rows * row_bytes, st>>>(p);
  } else {
    merge_direct_kernel<<<dev::grid_for(p.rows, 128), 128, 0, st>>>(p);
  }
  ops::cuda::check_launch("merge");
}

}  // namespace hax::patterns
