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
//
// With k <= kWarpMaxK (HSA's usual top-k) a warp takes one query instead (top_k_chunks_warp_kernel):
// lane l scores the chunks lo + l, lo + l + 32, ... with the same arithmetic (one chain of fused
// multiply-adds in order of d, so every score is bitwise the one above) and keeps its own best k
// by the same order; k rounds of a warp-wide arg-max over the lanes' heads then give the query's
// best k, the same set (the order (score desc, chunk asc) is total). One thread per query walked
// ~NC / 2 chunks x D products in one dependent chain: 4.2 ms for HSA's retrieval at L = 64K
// (NC = 1024, D = 64) on the H100.
#include <climits>
#include <cmath>
#include <type_traits>

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

constexpr int kWarpMaxK = 16;  // the largest k of the warp kernel (each lane keeps k in registers / local memory)
constexpr int kWarpsPerBlock = 8;

// Score of one chunk row against the query: fused multiply-adds in order of d from 0, as the
// one-thread kernel above. The query is qr (registers) when its length DC is a compile-time
// constant (16, 32, 64 or 128: the loops unroll), else qs (float32 in shared memory).
template <class T, int DC>
__device__ __forceinline__ float chunk_score(const float* qs, const float (&qr)[DC > 0 ? DC : 1], const T* row,
                                             int64_t D) {
  auto q = [&](int64_t d) {
    if constexpr (DC > 0) return qr[d];
    else return qs[d];
  };
  const int64_t n = DC > 0 ? DC : D;
  float s = 0.f;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (n % 8 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
#pragma unroll
      for (int64_t d = 0; d < n; d += 8) {
        const uint4 raw = *reinterpret_cast<const uint4*>(row + d);
        const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
        for (int j = 0; j < 8; ++j) s = __fmaf_rn(q(d + j), __bfloat162float(e[j]), s);
      }
      return s;
    }
  } else {
    if (n % 4 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
#pragma unroll
      for (int64_t d = 0; d < n; d += 4) {
        const float4 v = *reinterpret_cast<const float4*>(row + d);
        s = __fmaf_rn(q(d), v.x, s);
        s = __fmaf_rn(q(d + 1), v.y, s);
        s = __fmaf_rn(q(d + 2), v.z, s);
        s = __fmaf_rn(q(d + 3), v.w, s);
      }
      return s;
    }
  }
#pragma unroll
  for (int64_t d = 0; d < n; ++d) s = __fmaf_rn(q(d), to_f32(row[d]), s);
  return s;
}

// Whether (sa, ca) ranks before (sb, cb): higher score, then the earlier chunk.
__device__ __forceinline__ bool ranks_before(float sa, int ca, float sb, int cb) {
  return sa > sb || (sa == sb && ca < cb);
}

// Landmark rows staged in shared memory: kStageRows rows a tile, each row D entries padded to a
// multiple of 16 bytes plus 16 (so that the 32 rows a warp reads at one column fall in distinct
// banks). The block's warps (consecutive queries, mostly of the same [lo, hi)) score against the
// staged rows: each landmark row is read from global memory once per block instead of once per
// query (4.3 GB of L2 traffic at L = 64K, NC = 1024, D = 64, and 1.65 ms).
constexpr int kStageRows = 128;
template <class T>
__host__ __device__ constexpr int64_t stage_ld(int64_t D) {  // entries of T between staged rows
  return ((D * (int64_t)sizeof(T) + 15) / 16 * 16 + 16) / (int64_t)sizeof(T);
}

// One warp per query, kWarpsPerBlock consecutive queries a block; dynamic shared memory:
// kWarpsPerBlock x D float32 (the queries), then the staged landmark rows (kStageRows x stage_ld).
// DC: the query length D when it is 16, 32, 64 or 128 (the query then sits in registers), else 0.
template <class T, int DC>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) top_k_chunks_warp_kernel(TopKChunksParams p) {
  extern __shared__ float sq_all[];
  __shared__ int64_t block_lo, block_hi, block_b;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, k = (int)p.k;
  const int64_t e0 = (int64_t)blockIdx.x * kWarpsPerBlock, e = e0 + warp, D = p.D, n = p.B * p.L;
  const int64_t ld = stage_ld<T>(D);
  T* rows = reinterpret_cast<T*>(sq_all + kWarpsPerBlock * D);
  const bool active = e < n;
  float* sq = sq_all + warp * D;
  const T* q = (const T*)p.q + (active ? e : 0) * D;
  for (int64_t d = lane; d < D; d += 32) sq[d] = active ? to_f32(q[d]) : 0.f;
  const int64_t b = (active ? e : e0) / p.L, lo = active ? p.lo[e] : 0, hi = active ? p.hi[e] : 0;
  float qr[DC > 0 ? DC : 1];
  if (threadIdx.x == 0) block_lo = INT64_MAX, block_hi = INT64_MIN, block_b = e0 / p.L;
  __syncthreads();
  if constexpr (DC > 0) {
#pragma unroll
    for (int d = 0; d < DC; ++d) qr[d] = sq[d];
  }
  // The block stages the chunks its queries may retrieve; a query of another row than the block's
  // first (a row boundary inside the block) reads its own row's landmarks from global memory.
  const bool staged = b == block_b;
  if (lane == 0 && active && staged && hi > lo) {
    atomicMin((long long*)&block_lo, (long long)lo);
    atomicMax((long long*)&block_hi, (long long)hi);
  }
  __syncthreads();
  const T* lm = (const T*)p.landmarks + b * p.NC * D;
  float best[kWarpMaxK] = {};
  int idx[kWarpMaxK] = {};
  int m = 0;  // the lane's kept chunks, sorted by (score desc, chunk asc)
  auto keep = [&](float s, int64_t c) {
    const float v = isnan(s) ? -INFINITY : s;
    if (m == k && !(v > best[k - 1])) return;  // (the lane's chunks come in ascending order)
    int at = m < k ? m++ : k - 1;
    while (at > 0 && v > best[at - 1]) {
      best[at] = best[at - 1];
      idx[at] = idx[at - 1];
      --at;
    }
    best[at] = v;
    idx[at] = (int)c;
  };
  if (!staged)
    for (int64_t c = lo + lane; c < hi; c += 32) keep(chunk_score<T, DC>(sq, qr, lm + c * D, D), c);
  const int64_t blo = block_lo, bhi = block_hi;
  const T* blm = (const T*)p.landmarks + block_b * p.NC * D;
  const bool vec = (D * (int64_t)sizeof(T)) % 16 == 0 && reinterpret_cast<uintptr_t>(blm) % 16 == 0;
  for (int64_t t0 = blo; t0 < bhi; t0 += kStageRows) {  // (block-uniform)
    const int64_t nr = bhi - t0 < kStageRows ? bhi - t0 : kStageRows;
    __syncthreads();  // the previous tile is read
    if (vec) {
      const int64_t per = D * (int64_t)sizeof(T) / 16;  // 16-byte pieces a row
      for (int64_t x = threadIdx.x; x < nr * per; x += blockDim.x) {
        const int64_t r = x / per, c = x % per;
        reinterpret_cast<uint4*>(rows + r * ld)[c] = reinterpret_cast<const uint4*>(blm + (t0 + r) * D)[c];
      }
    } else {
      for (int64_t x = threadIdx.x; x < nr * D; x += blockDim.x) rows[(x / D) * ld + x % D] = blm[t0 * D + x];
    }
    __syncthreads();
    if (!staged) continue;
    const int64_t c_lo = lo > t0 ? lo : t0, c_hi = hi < t0 + nr ? hi : t0 + nr;
    for (int64_t c = c_lo + lane; c < c_hi; c += 32) keep(chunk_score<T, DC>(sq, qr, rows + (c - t0) * ld, D), c);
  }
  if (!active) return;  // (no block barrier below)
  // k rounds: the best head over the lanes goes out, its lane moves to its next.
  int head = 0, got = 0;
  int32_t* out = p.out + e * k;
  int chosen[kWarpMaxK];
  for (int r = 0; r < k; ++r) {
    const bool has = head < m;
    float s = has ? best[head] : 0.f;
    int c = has ? idx[head] : INT_MAX, h = has;
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) {
      const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
      const int c2 = __shfl_xor_sync(0xffffffffu, c, off), h2 = __shfl_xor_sync(0xffffffffu, h, off);
      if (h2 && (!h || ranks_before(s2, c2, s, c))) s = s2, c = c2, h = h2;
    }
    if (!h) break;  // (warp-uniform) fewer than k chunks
    if (has && idx[head] == c) ++head;
    chosen[got++] = c;
  }
  if (lane == 0) {
    for (int t = 1; t < got; ++t) {  // ascending chunk order
      const int c = chosen[t];
      int u = t;
      for (; u > 0 && chosen[u - 1] > c; --u) chosen[u] = chosen[u - 1];
      chosen[u] = c;
    }
    for (int t = 0; t < k; ++t) out[t] = t < got ? chosen[t] : -1;
  }
}

}  // namespace

void top_k_chunks_cuda(const TopKChunksParams& p, DType dtype, void* stream) {
  const int64_t n = p.B * p.L;
  if (n == 0 || p.k == 0) return;
  HAX_DISPATCH_DTYPE(dtype, [&] {
    const size_t smem = sizeof(float) * kWarpsPerBlock * p.D + sizeof(scalar_t) * kStageRows * stage_ld<scalar_t>(p.D);
    if (p.k <= kWarpMaxK && smem <= 48 * 1024) {
      const int64_t blocks = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
      auto launch = [&](auto kernel) { kernel<<<(unsigned)blocks, 32 * kWarpsPerBlock, smem, (cudaStream_t)stream>>>(p); };
      if (p.D == 16) launch(top_k_chunks_warp_kernel<scalar_t, 16>);
      else if (p.D == 32) launch(top_k_chunks_warp_kernel<scalar_t, 32>);
      else if (p.D == 64) launch(top_k_chunks_warp_kernel<scalar_t, 64>);
      else if (p.D == 128) launch(top_k_chunks_warp_kernel<scalar_t, 128>);
      else launch(top_k_chunks_warp_kernel<scalar_t, 0>);
    } else {
      top_k_chunks_kernel<scalar_t><<<dev::grid_for(n, 128), 128, 0, (cudaStream_t)stream>>>(p);
    }
  });
  ops::cuda::check_launch("top_k_chunks");
}

}  // namespace hax::patterns
