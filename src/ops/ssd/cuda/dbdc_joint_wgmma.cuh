// The SSD backward's dB and dC together with <dS, S> (wgmma, sm_90a builds; SsdParams::joint_dbdc):
// the same dB, dC and u as dbdc_wgmma.cuh's dbdc_wg, with one block per (row, group, sub-chunk,
// 64 columns of N) for both, where dbdc_wg has one for dB and one for dC. The block streams the
// dS tile (for dB) and the S tile (for dC) of the same head and 64 columns of P, so it also sums
// their entrywise product, g = <dS, S> over its columns of N, which dx_kernel<.., kDot = false>
// then leaves out: dx no longer reads S (a quarter of its bytes; 268 MB at L = 64K, H 16, P 64,
// N 128). Same sizes and conditions as dbdc_wg (ssd_backward.cu chooses it). H100, L = 64K, ncu
// (pass 38): dx 538 -> 479 us, dB/dC 385 -> 417 us; `hax bench ssm` fwd+bwd 2.14-2.18 -> 2.11-2.14
// ms. On by default.
//   dB(j, n) = Σ_heads w_j dt_j Σ_p x_j[p] dS[n][p] + Σ_i dCB_ij C_i[n]
//   dC(i, n) = Σ_heads re_i Σ_p dy_i[p] S[n][p]     + Σ_j dCB_ij B_j[n]
//   g part   = decay Σ_{n in the block's 64, p} dS[n][p] S[n][p]   (w.dg for n0 = 0, w.dg2 for n0 = 64)
// 1. Stages, as dbdc_wg: the group's (head, 64-slab of P) pairs in order; each stage's four raw
//    tiles (x, dS, dy, S; 32 KB) come by cp.async into a ring of kJointStages, kJointStages - 1
//    stages ahead; C's tile (for u and for dB's dCB term) is copied first, into its own tile.
// 2. Per stage: partB = x dS^T and partC = dy S^T (8 wgmma, one commit group), and while they run
//    the thread's four 16-byte chunks of dS and S (same swizzled places in both tiles) add to g.
//    At a head's last slab: accB += (w dt) partB, accC += re partC, u from partC and C, and g
//    reduced over the block (warps through shared memory, written at the next head's first stage).
// 3. B's tile into the ring (free by then); accC += (dCB_hi + dCB_lo) B, accB += (dCB^T) C; out
//    through two ring tiles in 16-byte runs of their rows.
#pragma once
#include <cuda_bf16.h>

#include "ops/ssd/cuda/dbdc_wgmma.cuh"

namespace hax::ops::ssd_cuda {

constexpr int kJointStages = 3;  // ring depth (stages of four tiles)
// Dynamic shared memory: the ring, C's tile, 1024 bytes to align them (105 KB: 2 blocks an SM).
constexpr size_t kJointSmem = (4 * kJointStages + 1) * kWgTile * sizeof(__nv_bfloat16) + 1024;

__device__ __forceinline__ void dbdc_joint_wg(const SsdGradParams& gp, const SsdScratch& w, const __nv_bfloat16* states) {
  using bf16 = __nv_bfloat16;
  const SsdParams& p = gp.fwd;
  extern __shared__ unsigned char joint_dyn[];
  bf16* const ring = cuda::align_up<bf16>(joint_dyn, 0, 1024);  // (still known as shared memory)
  bf16* const sC = ring + 4 * kJointStages * kWgTile;  // C_i[n0 + n], rows i
  // Stage t's tiles: x_j[k0 + k] and dy_i[k0 + k] (rows of steps), dS[n0 + n][k0 + k] and S[..] (rows n).
  auto tile = [&](int t, int which) { return ring + (4 * (t % kJointStages) + which) * kWgTile; };
  enum { kX = 0, kDs = 1, kDy = 2, kS = 3 };
  __shared__ float coef[2][2][kT];  // [head parity][dB's w dt, dC's re][step]
  __shared__ float red[2][kThreads / 32];  // g's warp sums, by head parity
  const int64_t S = p.nsubs(), H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim, L = p.seqlen;
  const int64_t hpg = ssd_div(H, G), tiles_n = N / kT;
  const int64_t chunk = ssd_div((int64_t)blockIdx.x, tiles_n);  // (b G + g) S + s
  const int64_t bg = ssd_div(chunk, S), s = chunk - bg * S, b = ssd_div(bg, G), g = bg - b * G;
  const int64_t n0 = ((int64_t)blockIdx.x - chunk * tiles_n) * kT;
  const Sub u = sub_of(p, b, s);
  const int slabs = (int)(P / kT), stages = (int)hpg * slabs;
  const bf16* Cg = (const bf16*)p.Cm + ((b * L + u.t0) * G + g) * N + n0;  // step i at Cg[i G N]
  const bf16* Bg = (const bf16*)p.Bm + ((b * L + u.t0) * G + g) * N + n0;
  copy_swizzled(sC, Cg, G * N, u.len);
  cuda::cp_async_commit();
  auto issue = [&](int t) {
    if (t < stages) {
      const int64_t h = g * hpg + t / slabs, k0 = (int64_t)(t % slabs) * kT;
      const int64_t rows = ((b * L + u.t0) * H + h) * P + k0, st = ((b * H + h) * S + s) * N * P + n0 * P + k0;
      copy_swizzled(tile(t, kX), (const bf16*)p.x + rows, H * P, u.len);
      copy_swizzled(tile(t, kDs), (const bf16*)w.dstates + st, P, kT);
      copy_swizzled(tile(t, kDy), (const bf16*)gp.dy + rows, H * P, u.len);
      copy_swizzled(tile(t, kS), states + st, P, kT);
    }
    cuda::cp_async_commit();
  };
#pragma unroll
  for (int t = 0; t < kJointStages - 1; ++t) issue(t);
  auto coef_load = [&](int64_t h) { return RowFactorIn::load<bf16>(p, w, b, h, s, S, u); };
  RowFactorIn next;
  if (threadIdx.x < kT) next = coef_load(g * hpg);
  // g of head `head` (its warp sums in red[head & 1]) times the sub-chunk's decay, by thread 0.
  float* const dg_out = n0 == 0 ? w.dg : w.dg2;
  auto put_g = [&](int head) {
    if (threadIdx.x == 0) {
      float tot = 0.f;
#pragma unroll
      for (int k = 0; k < kThreads / 32; ++k) tot += red[head & 1][k];
      const int64_t bhs = (b * H + g * hpg + head) * S + s;
      dg_out[bhs] = w.decay[bhs] * tot;
    }
  };
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2;
  const int ir[2] = {16 * warp + gq, 16 * warp + gq + 8};  // this thread's accumulator rows
  float accB[8][4], accC[8][4], partB[8][4], partC[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) accB[j][e] = 0.f, accC[j][e] = 0.f;
  float dot = 0.f;  // this thread's share of the current head's g
#pragma unroll 1
  for (int t = 0; t < stages; ++t) {
    const int head = t / slabs;
    if (t % slabs == 0 && threadIdx.x < kT) {
      coef[head & 1][0][threadIdx.x] = next.value(u, false);
      coef[head & 1][1][threadIdx.x] = next.value(u, true);
      if (head + 1 < hpg) next = coef_load(g * hpg + head + 1);
    }
    cuda::cp_async_wait<kJointStages - 2>();  // stage t's group (C's with the first)
    cuda::fence_proxy_async_shared();
    __syncthreads();  // stage t and coef visible; stage t - 1's tiles free; red of head - 1 written
    if (t % slabs == 0 && head > 0) put_g(head - 1);
    issue(t + kJointStages - 1);
    cuda::wgmma_fence();
    {
      const uint64_t dx = cuda::wgmma_desc_sw128(tile(t, kX)), dds = cuda::wgmma_desc_sw128(tile(t, kDs));
      const uint64_t ddy = cuda::wgmma_desc_sw128(tile(t, kDy)), dst = cuda::wgmma_desc_sw128(tile(t, kS));
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)  // K-major both: +32 bytes a k step
        cuda::wgmma_m64n64k16<false, false>(partB, dx + 2 * kk, dds + 2 * kk, t % slabs > 0 || kk > 0);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        cuda::wgmma_m64n64k16<false, false>(partC, ddy + 2 * kk, dst + 2 * kk, t % slabs > 0 || kk > 0);
    }
    cuda::wgmma_commit();
    {  // g: dS and S share the swizzle, so the same 16-byte places pair their entries
      const uint4* a = reinterpret_cast<const uint4*>(tile(t, kDs));
      const uint4* c = reinterpret_cast<const uint4*>(tile(t, kS));
#pragma unroll
      for (int k = 0; k < kWgTile / 8 / kThreads; ++k) dot_bf16x8(dot, a[threadIdx.x + k * kThreads], c[threadIdx.x + k * kThreads]);
    }
    cuda::wgmma_wait<0>();
    cuda::wgmma_fence_operands(partB);
    cuda::wgmma_fence_operands(partC);
    if (t % slabs == slabs - 1) {
      const float b0 = coef[head & 1][0][ir[0]], b1 = coef[head & 1][0][ir[1]];
      const float c0 = coef[head & 1][1][ir[0]], c1 = coef[head & 1][1][ir[1]];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        accB[j][0] += b0 * partB[j][0], accB[j][1] += b0 * partB[j][1];
        accB[j][2] += b1 * partB[j][2], accB[j][3] += b1 * partB[j][3];
        accC[j][0] += c0 * partC[j][0], accC[j][1] += c0 * partC[j][1];
        accC[j][2] += c1 * partC[j][2], accC[j][3] += c1 * partC[j][3];
      }
      put_head_u(p, w, n0, (b * H + g * hpg + head) * S + s, partC, sC, ir, c0, c1);  // the head's u
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (lane == 0) red[head & 1][warp] = dot;
      dot = 0.f;
    }
  }
  // 3. B's tile into the ring's first tile (every warp is done with the ring after this barrier).
  cuda::cp_async_wait<0>();  // (the ring's trailing groups are empty)
  __syncthreads();
  if (stages > 0) put_g((int)hpg - 1);
  bf16* const sB = ring;
  copy_swizzled(sB, Bg, G * N, u.len);
  cuda::cp_async_commit();
  // dCB's fragments (zero outside the sub-chunk: dcb_kernel writes the whole tile), hi + lo:
  // A(i, k) = dcb(i, k) for dC (then U = B), dcb(k, i) for dB (U = C).
  const float* dcb = w.dcb + chunk * kT * kT;
  uint32_t ahi[4][4], alo[4][4];
  dcb_fragments(dcb, true, ir, ahi, alo);
  wg_split_product(accB, ahi, alo, sC);  // dB += dCB^T C (C's tile was waited for with stage 0)
  dcb_fragments(dcb, false, ir, ahi, alo);
  cuda::cp_async_wait<0>();
  cuda::fence_proxy_async_shared();
  __syncthreads();  // B's tile landed for every thread
  wg_split_product(accC, ahi, alo, sB);  // dC += dCB B
  // Out through ring tiles 1 and 2 (not read by the products above).
  bf16* const oB = ring + kWgTile;
  bf16* const oC = ring + 2 * kWgTile;
  wg_store_tile(oB, accB);
  wg_store_tile(oC, accC);
  __syncthreads();
  const int64_t out = ((b * L + u.t0) * G + g) * N + n0;
  wg_copy_out((bf16*)gp.dB + out, G * N, oB, u.len);
  wg_copy_out((bf16*)gp.dC + out, G * N, oC, u.len);
}

}  // namespace hax::ops::ssd_cuda
