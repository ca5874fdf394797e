// The SSD forward's chunk_scan on warpgroup products (wgmma, sm_90a builds): the same output as
// ssd_forward.cu's chunk_scan_mma, for bfloat16 with P and N multiples of 64, N <= 128 and
// 16-byte aligned tensors (chunk_scan_wg_applies); other sizes keep the mma.sync kernel.
//
// Per (row, head, sub-chunk) block of one warpgroup (128 threads) and 64 columns p of the head dim:
//   y(i, p) = re_i Σ_n C_i[n] S_enter[n][p]  +  Σ_j M(i, j) x_j[p],
//   M(i, j) = [j <= i][s_i = s_j] cb(i, j) exp(cs_i - cs_j) dt_j             (notation: chunk.cuh)
// 1. cp.async copies, all issued first, into 64 x 64 tiles in the 128-byte swizzle that wgmma's
//    descriptors read (ops/cuda/tile_layout.cuh Swizzle128, 1024-byte aligned): C's rows per
//    64-slab of N and S_enter's rows (one commit group), then x's rows (a second group);
// 2. while they fly, each warp computes its 16 rows of M straight into wgmma A fragments in
//    registers (cb from the forward's C B^T, 8-byte loads), split hi + lo as the mma.sync form
//    stages it (tile.cuh: about 16 significant bits); warp w's rows see only the k steps
//    kk <= w, the others are zeros;
// 3. acc = C S_enter: both operands from shared memory, C K-major, S_enter read N-major (rows of
//    state entries, as stored); acc *= re_i;
// 4. acc += M_hi x + M_lo x with M from registers and x read N-major (rows of steps);
// 5. y goes out through C's first tile (free once step 3 is waited for by every warp) in 16-byte
//    runs of its rows.
// Where the mma.sync form stages M through shared memory (a 64 x 64 float32 bracket split into two
// bfloat16 tiles and read back by every warp as fragments) and loads each product's fragments by
// ldmatrix, this form has no shared-memory round trip for M and one instruction per 64 x 64 x 16
// product.
#pragma once
#include <cuda_bf16.h>

#include "ops/ssd/cuda/wg_tiles.cuh"

namespace hax::ops::ssd_cuda {

// Resident blocks an SM that the wgmma form's register budget aims at (__launch_bounds__).
#ifndef HAX_SSD_MB_SCAN_WG
#define HAX_SSD_MB_SCAN_WG 4
#endif
constexpr int kMinScanWg = HAX_SSD_MB_SCAN_WG;

// Whether chunk_scan_wg_kernel takes this call (with bfloat16 and vectorized staging, ssd_vec):
// the switches (wg_forms_on), sizes its tiles cover whole, and 16-byte aligned y and states.
inline bool chunk_scan_wg_applies(const SsdParams& p, const void* states) {
  return wg_forms_on(p) && wg_sizes(p) && cuda::aligned16(p.y) && cuda::aligned16(states);
}

__device__ __forceinline__ void chunk_scan_wg(const SsdParams& p, const SsdScratch& w, const __nv_bfloat16* states) {
  using bf16 = __nv_bfloat16;
  __shared__ __align__(1024) bf16 sC[kWgSlabs][kT * kT];  // C_i[64 t + n], rows i
  __shared__ __align__(1024) bf16 sS[kWgSlabs][kT * kT];  // S_enter[64 t + n][p0 + q], rows n
  __shared__ __align__(1024) bf16 sX[kT * kT];                // x_j[p0 + q], rows j
  __shared__ float cs[kT], dt[kT], re[kT];
  __shared__ int32_t seq[kT];
  const int64_t S = p.nsubs(), H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim, L = p.seqlen;
  const HeadSub place = head_sub_of_block(H, S, G);
  const int64_t b = place.b, h = place.h, s = place.s, bh = place.bh, g = place.g;
  const int64_t p0 = (int64_t)blockIdx.y * kT;
  const Sub u = sub_of(p, b, s);
  const int slabs = (int)(N / kT);
  // 1. The copies.
  const bf16* C = (const bf16*)p.Cm + ((b * L + u.t0) * G + g) * N;  // step i at C[i G N]
  const bf16* st = states + (bh * S + s) * N * P + p0;                // entry (n, q) at st[n P + q]
  const bf16* x = (const bf16*)p.x + ((b * L + u.t0) * H + h) * P + p0;  // step j at x[j H P]
#pragma unroll
  for (int t = 0; t < kWgSlabs; ++t)
    if (t < slabs) {
      copy_swizzled(sC[t], C + t * kT, G * N, u.len);
      copy_swizzled(sS[t], st + t * kT * P, P, kT);
    }
  cuda::cp_async_commit();
  copy_swizzled(sX, x, H * P, u.len);
  cuda::cp_async_commit();
  // The steps' values (as load_steps) and re_i.
  if (threadIdx.x < kT) {
    const int i = threadIdx.x;
    const bool in = i < u.len;
    const float c = w.cs[((b * H + h) * S + s) * kT + i];
    const int32_t q = in && p.seq_idx ? p.seq_idx[b * L + u.t0 + i] : 0;
    cs[i] = c, seq[i] = q;
    dt[i] = in ? cuda::to_f32(((const bf16*)p.dt)[(b * L + u.t0 + i) * H + h]) : 0.f;
    re[i] = in && q == u.s_prev ? expf(c) : 0.f;
  }
  __syncthreads();
  // 2. M's fragments: warp w's rows i0 = 16 w + gq and i0 + 8; k step kk's columns
  //    j = 16 kk + 2 tq (+1), and + 8 (+9): a[kk][2 half + r] holds row r's pair of half `half`.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  const int ir[2] = {16 * warp + gq, 16 * warp + gq + 8};
  const float* cb = w.cb + ((b * G + g) * S + s) * kT * kT;
  uint32_t ahi[4][4], alo[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int e = 0; e < 4; ++e) ahi[kk][e] = 0u, alo[kk][e] = 0u;
    if (kk > warp) continue;  // (warp-uniform) every j > every i of the warp
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = ir[r];
      const bool row = i < u.len;
      const float ci = cs[i];
      const int32_t si = seq[i];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = 16 * kk + 2 * tq + 8 * half;
        const float2 v = __ldg(reinterpret_cast<const float2*>(cb + i * kT + j));
        const float m0 = row && j <= i && si == seq[j] ? v.x * expf(ci - cs[j]) * dt[j] : 0.f;
        const float m1 = row && j + 1 <= i && si == seq[j + 1] ? v.y * expf(ci - cs[j + 1]) * dt[j + 1] : 0.f;
        split_pair(m0, m1, ahi[kk][2 * half + r], alo[kk][2 * half + r]);
      }
    }
  }
  // 3. acc = C S_enter, then the rows scaled by re.
  cuda::cp_async_wait<1>();
  cuda::fence_proxy_async_shared();
  __syncthreads();
  float acc[8][4];
  wg_state_product(acc, sC[0], sS[0], slabs);
  const float re0 = re[ir[0]], re1 = re[ir[1]];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] *= re0, acc[j][1] *= re0, acc[j][2] *= re1, acc[j][3] *= re1;
  // 4. acc += M x (hi, then lo).
  cuda::cp_async_wait<0>();
  cuda::fence_proxy_async_shared();
  __syncthreads();
  wg_split_product(acc, ahi, alo, sX);
  // 5. y through sC[0] (every warp waited for step 3 before the last barrier), 16-byte runs out.
  wg_store_tile(sC[0], acc);
  __syncthreads();
  wg_copy_out((bf16*)p.y + ((b * L + u.t0) * H + h) * P + p0, H * P, sC[0], u.len);
}

}  // namespace hax::ops::ssd_cuda
