// HSA's chunk retrieval on the GPU, equal to hsa_chunks.cpp's top_k_chunks: per query the k
// chunks of highest score q_ret[b, i] · landmarks[b, c] among c in [lo, hi) (ties: the earlier
// chunk; NaN ranks as -inf), ascending, -1 padded.
//
// One thread per query walks its chunks in order, scoring each in float32 with fused multiply-adds
// in order of d from 0 (as the CPU's small_gemm does where it vectorizes; its rounding then
// matches), four chunks at a time, and keeps the best k sorted by (score desc, chunk asc) in its
// slice of `best` (scores) and of the output (chunk indices): a chunk enters when fewer than k are
// kept or when it beats the last kept strictly (an equal score loses to the earlier chunk). The
// kept chunks are then sorted ascending. Neighbouring queries share [lo, hi) and read the same
// landmark rows together. Memory: the (B, L, k) workspace, never L x NC.
#include <cmath>

#include "patterns/cuda/list_utils.cuh"

namespace hax::patterns {
namespace {

using ops::cuda::to_f32;

constexpr int kChunksAtOnce = 4;

template <class T>
__global__ void top_k_chunks_kernel(TopKChunksParams p) {
  const int64_t n = p.B * p.L, D = p.D, k = p.k;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = e / p.L, lo = p.lo[e], hi = p.hi[e];
    const T* q = (const T*)p.q + e * D;
    const T* lm = (const T*)p.landmarks + b * p.NC * D;
    float* best = p.best + e * k;
    int32_t* idx = p.out + e * k;
    int64_t m = 0;  // chunks kept
    for (int64_t c0 = lo; c0 < hi; c0 += kChunksAtOnce) {
      float s[kChunksAtOnce];
      const T* row[kChunksAtOnce];
#pragma unroll
      for (int t = 0; t < kChunksAtOnce; ++t) {
        s[t] = 0.f;
        row[t] = lm + (c0 + t < hi ? c0 + t : c0) * D;
      }
      for (int64_t d = 0; d < D; ++d) {
        const float qd = to_f32(q[d]);
#pragma unroll
        for (int t = 0; t < kChunksAtOnce; ++t) s[t] = __fmaf_rn(qd, to_f32(row[t][d]), s[t]);
      }
      for (int t = 0; t < kChunksAtOnce && c0 + t < hi; ++t) {
        const float v = isnan(s[t]) ? -INFINITY : s[t];
        if (m == k && !(v > best[k - 1])) continue;
        int64_t at = m < k ? m++ : k - 1;  // the slot that frees up
        while (at > 0 && v > best[at - 1]) {
          best[at] = best[at - 1];
          idx[at] = idx[at - 1];
          --at;
        }
        best[at] = v;
        idx[at] = (int32_t)(c0 + t);
      }
    }
    for (int64_t t = 1; t < m; ++t) {  // ascending chunk order
      const int32_t c = idx[t];
      int64_t u = t;
      for (; u > 0 && idx[u - 1] > c; --u) idx[u] = idx[u - 1];
      idx[u] = c;
    }
    for (int64_t t = m; t < k; ++t) idx[t] = -1;
  }
}

}  // namespace

void top_k_chunks_cuda(const TopKChunksParams& p, DType dtype, void* stream) {
  const int64_t n = p.B * p.L;
  if (n == 0 || p.k == 0) return;
  HAX_DISPATCH_DTYPE(dtype, [&] {
    top_k_chunks_kernel<scalar_t><<<dev::grid_for(n, 128), 128, 0, (cudaStream_t)stream>>>(p);
  });
  ops::cuda::check_launch("top_k_chunks");
}

}  // namespace hax::patterns
