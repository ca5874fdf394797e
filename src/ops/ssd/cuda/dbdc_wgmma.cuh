// The SSD backward's dB and dC on warpgroup products (wgmma, sm_90a builds): the same output as
// dbdc.cuh's dbdc_kernel, for bfloat16 with P and N multiples of 64, N <= 128 and 16-byte
// aligned tensors (dbdc_wg_applies); other sizes keep the mma.sync kernel. Per block of one
// warpgroup, (row, group, sub-chunk, 64 columns of N, dB or dC) as dbdc_kernel:
//   dB(j, n) = Σ_heads w_j dt_j Σ_p x_j[p] dS[n][p] + Σ_i dCB_ij C_i[n]
//   dC(i, n) = Σ_heads re_i Σ_p dy_i[p] S[n][p]     + Σ_j dCB_ij B_j[n]
// 1. The stages are the group's (head, 64-slab of P) pairs in order; each stage's two raw tiles
//    (x or dy, K-major rows of steps; dS or S, K-major rows of state entries) come by cp.async into
//    a ring of kDbdcStages 128-byte-swizzled pairs, kDbdcStages - 1 stages ahead (dbdc_kernel
//    keeps one ahead); U (C or B, for the dCB term) is copied first, into its own tile, and the
//    dC blocks' C (for u) beside it. A ring of 3 (65 KB, 3 blocks an SM) ran dB/dC in 422 us at
//    L = 64K on the H200 (ncu), one of 4 (82 KB, 2 blocks) in 512.
// 2. Per stage, part (+)= v S^T is four wgmma instructions from shared memory; at a head's last
//    slab its rows are scaled by the head's factor (w dt, or re; computed a head ahead, as
//    dbdc_kernel does) and added to acc in head order. The dC blocks also give the head's
//    u_i = re_i Σ_n C_i[n] (dy_i S^T)[n] over their 64 columns of N (grad_rows.cuh kU, kU2: ddt
//    adds the parts), which dx_kernel<.., kY = false> then leaves out: u_i = dy_i . Y_i with
//    Y = re C S is the same sum, and its product was a third of dx's work.
// 3. acc += (dCB_hi + dCB_lo) U with dCB's A fragments built in registers from the float32 dcb
//    (transposed for dB) and U read N-major; out through a ring tile in 16-byte runs of its rows.
#pragma once
#include <cuda_bf16.h>

#include "ops/cuda/smem_align.cuh"
#include "ops/ssd/cuda/grad_rows.cuh"
#include "ops/ssd/cuda/wg_tiles.cuh"

namespace hax::ops::ssd_cuda {

#ifndef HAX_SSD_DBDC_STAGES
#define HAX_SSD_DBDC_STAGES 3
#endif
constexpr int kDbdcStages = HAX_SSD_DBDC_STAGES;  // ring depth of dbdc_wg's copies
#ifndef HAX_SSD_MB_DBDC_WG
#define HAX_SSD_MB_DBDC_WG 3
#endif
constexpr int kMinDbdcWg = HAX_SSD_MB_DBDC_WG;  // resident blocks an SM (__launch_bounds__)
// Dynamic shared memory of dbdc_wg: the ring's pairs of tiles, U's and C's tiles, 1024 bytes to
// align them.
constexpr size_t kDbdcWgSmem = (2 * kDbdcStages + 2) * kWgTile * sizeof(__nv_bfloat16) + 1024;

// Whether dbdc_wg_kernel takes this call (with bfloat16 and vectorized staging, ssd_vec): the
// switches, sizes its tiles cover whole, and 16-byte aligned dB, dC, states and state gradients.
inline bool dbdc_wg_applies(const SsdGradParams& gp, const void* states, const void* dstates) {
  return wg_forms_on(gp.fwd) && wg_sizes(gp.fwd) && cuda::aligned16(gp.dB) && cuda::aligned16(gp.dC) &&
         cuda::aligned16(states) && cuda::aligned16(dstates);
}

// The head's u_i over a block's 64 columns of N (grad_rows.cuh kU for n0 = 0, kU2 for n0 = 64),
// from part = dy S^T of the head (this thread's rows ir of the accumulator) and C's swizzled tile:
// u_i = re_i Σ_n C_i[n] part(i, n), with c0, c1 the factors re of rows ir. bhs = (b H + h) S + s.
__device__ __forceinline__ void put_head_u(const SsdParams& p, const SsdScratch& w, int64_t n0, int64_t bhs,
                                           const float (&part)[8][4], const __nv_bfloat16* sC, const int (&ir)[2],
                                           float c0, float c1) {
  const int tq = threadIdx.x & 3;
  float us[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t cw = *reinterpret_cast<const uint32_t*>(cuda::Swizzle128::at(sC, ir[r], 8 * j) + 2 * tq);
      us[r] += bf16_lo(cw) * part[j][2 * r] + bf16_hi(cw) * part[j][2 * r + 1];
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    us[r] += __shfl_xor_sync(0xffffffffu, us[r], 1);
    us[r] += __shfl_xor_sync(0xffffffffu, us[r], 2);
  }
  if (tq == 0) {
    float* row = row_terms(p, w, n0 == 0 ? kU : kU2, bhs);
    row[ir[0]] = c0 * us[0], row[ir[1]] = c1 * us[1];
  }
}

// dCB's A fragments of this thread's rows ir, split hi + lo: A(i, k) = dcb(i, k) (dC), or
// dcb(k, i) when transposed (dB); zero outside the sub-chunk (dcb_kernel writes the whole tile).
__device__ __forceinline__ void dcb_fragments(const float* dcb, bool transposed, const int (&ir)[2], uint32_t (&ahi)[4][4],
                                              uint32_t (&alo)[4][4]) {
  const int tq = threadIdx.x & 3;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = ir[r], k = 16 * kk + 2 * tq + 8 * half;
        float m0, m1;
        if (!transposed) {
          const float2 v = *reinterpret_cast<const float2*>(dcb + i * kT + k);
          m0 = v.x, m1 = v.y;
        } else {
          m0 = dcb[k * kT + i], m1 = dcb[(k + 1) * kT + i];
        }
        split_pair(m0, m1, ahi[kk][2 * half + r], alo[kk][2 * half + r]);
      }
}

__device__ __forceinline__ void dbdc_wg(const SsdGradParams& gp, const SsdScratch& w, const __nv_bfloat16* states) {
  using bf16 = __nv_bfloat16;
  const SsdParams& p = gp.fwd;
  extern __shared__ unsigned char dbdc_dyn[];
  bf16* const ring = cuda::align_up<bf16>(dbdc_dyn, 0, 1024);  // (still known as shared memory)
  bf16* const sU = ring + 2 * kDbdcStages * kWgTile;  // U_k[n0 + n], rows k (steps)
  bf16* const sC = sU + kWgTile;                       // dC blocks: C_i[n0 + n], rows i (for u)
  auto tileA = [&](int t) { return ring + (2 * (t % kDbdcStages)) * kWgTile; };  // v_i[k0 + k], rows i
  auto tileB = [&](int t) { return ring + (2 * (t % kDbdcStages) + 1) * kWgTile; };  // S[n0 + n][k0 + k], rows n
  __shared__ float coef[2][kT];  // the row factors of heads of even and odd index in the group
  const int64_t S = p.nsubs(), H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim, L = p.seqlen;
  const int64_t hpg = ssd_div(H, G), tiles_n = N / kT, pair = blockIdx.x / 2;
  const int64_t chunk = ssd_div(pair, tiles_n);  // (b G + g) S + s
  const int64_t bg = ssd_div(chunk, S), s = chunk - bg * S, b = ssd_div(bg, G), g = bg - b * G;
  const int64_t n0 = (pair - chunk * tiles_n) * kT;
  const bool is_dc = blockIdx.x % 2 == 1;
  const Sub u = sub_of(p, b, s);
  const int slabs = (int)(P / kT), stages = (int)hpg * slabs;
  // 1. U, then the first kDbdcStages - 1 stages (one commit group each, empty past the last).
  const bf16* U = (const bf16*)(is_dc ? p.Bm : p.Cm) + ((b * L + u.t0) * G + g) * N + n0;  // step k at U[k G N]
  copy_swizzled(sU, U, G * N, u.len);
  if (is_dc) copy_swizzled(sC, (const bf16*)p.Cm + ((b * L + u.t0) * G + g) * N + n0, G * N, u.len);
  cuda::cp_async_commit();
  const bf16* vsrc = (const bf16*)(is_dc ? gp.dy : p.x);
  const bf16* ssrc = is_dc ? states : (const bf16*)w.dstates;
  auto issue = [&](int t) {
    if (t < stages) {
      const int64_t h = g * hpg + t / slabs, k0 = (int64_t)(t % slabs) * kT;
      copy_swizzled(tileA(t), vsrc + ((b * L + u.t0) * H + h) * P + k0, H * P, u.len);
      copy_swizzled(tileB(t), ssrc + ((b * H + h) * S + s) * N * P + n0 * P + k0, P, kT);
    }
    cuda::cp_async_commit();
  };
#pragma unroll
  for (int t = 0; t < kDbdcStages - 1; ++t) issue(t);
  // A head's row factors (grad_rows.cuh): thread i < 64 loads step i's inputs a head ahead.
  auto coef_load = [&](int64_t h) { return RowFactorIn::load<bf16>(p, w, b, h, s, S, u); };
  RowFactorIn next;
  if (threadIdx.x < kT) next = coef_load(g * hpg);
  // 2. The stages.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2;
  const int ir[2] = {16 * warp + gq, 16 * warp + gq + 8};  // this thread's accumulator rows
  float acc[8][4], part[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll 1
  for (int t = 0; t < stages; ++t) {
    const int head = t / slabs;
    if (t % slabs == 0 && threadIdx.x < kT) {
      coef[head & 1][threadIdx.x] = next.value(u, is_dc);
      if (head + 1 < hpg) next = coef_load(g * hpg + head + 1);
    }
    cuda::cp_async_wait<kDbdcStages - 2>();  // stage t's group (U's with the first)
    cuda::fence_proxy_async_shared();
    __syncthreads();  // stage t and coef visible; every warp is done with stage t - 1's tiles
    issue(t + kDbdcStages - 1);
    const uint64_t da = cuda::wgmma_desc_sw128(tileA(t)), db = cuda::wgmma_desc_sw128(tileB(t));
    cuda::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)  // K-major both: +32 bytes a k step
      cuda::wgmma_m64n64k16<false, false>(part, da + 2 * kk, db + 2 * kk, t % slabs > 0 || kk > 0);
    cuda::wgmma_commit();
    cuda::wgmma_wait<0>();
    cuda::wgmma_fence_operands(part);
    if (t % slabs == slabs - 1) {
      const float c0 = coef[head & 1][ir[0]], c1 = coef[head & 1][ir[1]];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[j][0] += c0 * part[j][0], acc[j][1] += c0 * part[j][1];
        acc[j][2] += c1 * part[j][2], acc[j][3] += c1 * part[j][3];
      }
      if (is_dc) put_head_u(p, w, n0, (b * H + g * hpg + head) * S + s, part, sC, ir, c0, c1);
    }
  }
  // 3. dCB's fragments (A(i, k) = dcb(i, k) for dC, dcb(k, i) for dB; zero outside the sub-chunk,
  //    dcb_kernel writes the whole tile), hi + lo, then acc += dCB U.
  uint32_t ahi[4][4], alo[4][4];
  dcb_fragments(w.dcb + chunk * kT * kT, !is_dc, ir, ahi, alo);
  cuda::cp_async_wait<0>();  // (U's group completed with stage 0's; the ring's trailing groups are empty)
  __syncthreads();
  wg_split_product(acc, ahi, alo, sU);
  // Out through the ring's first tile (every warp is done with the ring after this barrier).
  __syncthreads();
  wg_store_tile(ring, acc);
  __syncthreads();
  wg_copy_out((bf16*)(is_dc ? gp.dC : gp.dB) + ((b * L + u.t0) * G + g) * N + n0, G * N, ring, u.len);
}

}  // namespace hax::ops::ssd_cuda
