// exclude_band on the GPU (ExcludeBandParams in cuda_params.h): the inverse orders, then a warp
// per list (a thread per list read its 128 bytes alone: 1.8 ms at 64K x 16 heads on the H100).
#include "patterns/cuda/list_utils.cuh"

namespace hax::patterns {
namespace {

__global__ void ranks_kernel(ExcludeBandParams p) {
  const int64_t n = p.B * p.H * p.L;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = e / p.L * p.L, t = e % p.L;
    p.q_rank[row + p.q_order[e]] = (int32_t)t;
    p.k_rank[row + p.k_order[e]] = (int32_t)t;
  }
}

// A warp per list: lane c takes entry c (then c + 32, ...), the kept ones are packed in order by a
// ballot and a prefix count, the rest of the list is filled with -1.
__global__ void exclude_kernel(ExcludeBandParams p) {
  const int64_t n = p.B * p.H * p.L, warps = (int64_t)gridDim.x * blockDim.x / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t e = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; e < n; e += warps) {
    const int64_t row = e / p.L * p.L, t = p.q_rank[e];
    const int32_t first = p.band[row + t], last = p.band[n + row + t];
    const int32_t* src = p.idx + e * p.K;
    int32_t* dst = p.out + e * p.K;
    int64_t m = 0;  // kept so far
    for (int64_t c0 = 0; c0 < p.K; c0 += 32) {
      const int64_t c = c0 + lane;
      const int32_t j = c < p.K ? src[c] : -1;
      bool keep = false;
      if (j >= 0) {
        const int32_t s = p.k_rank[row + j];
        keep = s < first || s > last;
      }
      const unsigned ball = __ballot_sync(dev::kFullMask, keep);
      if (keep) dst[m + __popc(ball & ((1u << lane) - 1u))] = j;
      m += __popc(ball);
    }
    for (int64_t c = m + lane; c < p.K; c += 32) dst[c] = -1;
  }
}

}  // namespace

void exclude_band_cuda(const ExcludeBandParams& p, void* stream) {
  const int64_t n = p.B * p.H * p.L;
  if (n == 0) return;
  const auto st = (cudaStream_t)stream;
  ranks_kernel<<<dev::grid_for(n, dev::kThreads), dev::kThreads, 0, st>>>(p);
  ops::cuda::check_launch("exclude_band (ranks)");
  exclude_kernel<<<dev::grid_for(n * 32, dev::kThreads), dev::kThreads, 0, st>>>(p);
  ops::cuda::check_launch("exclude_band");
}

}  // namespace hax::patterns
