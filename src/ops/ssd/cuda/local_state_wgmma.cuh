// The sub-chunks' local states on warpgroup products (wgmma, sm_90a builds): the same output as
// chunk.cuh's local_state_kernel, for bfloat16 with P and N multiples of 64, N <= 128 and 16-byte
// aligned tensors (local_state_wg_applies); other sizes keep the mma.sync kernel. Both directions:
//   forward (kGrad false): out(n, q) = Σ_j coef_j B_j[n] x_j[p0 + q],   coef_j = w_j dt_j
//   backward (kGrad true): out(n, q) = Σ_i coef_i C_i[n] dy_i[p0 + q],  coef_i = re_i
// (notation: chunk.cuh). Per (row, head, sub-chunk) block of one warpgroup and 64 columns of P:
// 1. U (B or C) comes by cp.async into one 128-byte-swizzled tile per 64-slab of N, rows j as
//    stored; V's octets are loaded into registers at the same time;
// 2. coef V goes into two swizzled tiles, hi and lo (tile.cuh's split, about 16 significant bits);
// 3. per slab t (N = 64 kSlabs, kSlabs 1 or 2, a template argument): acc[t] = U[t]^T (Vhi + Vlo), U read M-major and V N-major (wgmma_m64n64k16<true>,
//    both as stored), all slabs' products in one commit group;
// 4. the slabs go out, rounded once, through their U tiles in 16-byte runs of their rows.
// The mma.sync form (local_state_kn) loads the same operands by ldmatrix.trans per 16 x 16 piece
// and double-buffers U across slabs; here every copy is issued at the start and each slab is 8
// instructions.
#pragma once
#include <cuda_bf16.h>

#include "ops/ssd/cuda/wg_tiles.cuh"

namespace hax::ops::ssd_cuda {

#ifndef HAX_SSD_MB_LOCAL_WG
#define HAX_SSD_MB_LOCAL_WG 4
#endif
constexpr int kMinLocalWg = HAX_SSD_MB_LOCAL_WG;  // resident blocks an SM (__launch_bounds__)

// Whether local_state_wg_kernel takes this call (bfloat16 with vectorized staging, ssd_vec, given):
// the switches, sizes its tiles cover whole, and a 16-byte aligned `out`.
inline bool local_state_wg_applies(const SsdParams& p, const void* out) {
  return wg_forms_on(p) && wg_sizes(p) && cuda::aligned16(out);
}

template <bool kGrad, int kSlabs>
__device__ __forceinline__ void local_state_wg(const SsdParams& p, const SsdScratch& w, const __nv_bfloat16* v_src,
                                               __nv_bfloat16* out) {
  using bf16 = __nv_bfloat16;
  using Copy = cuda::TileCopy<kT, kT, kThreads>;
  __shared__ __align__(1024) bf16 sU[kSlabs][kWgTile];  // U_j[64 t + n], rows j (N = 64 kSlabs)
  __shared__ __align__(1024) bf16 sV[2][kWgTile];         // coef_j V_j[p0 + q], rows j: hi, lo
  __shared__ float coef[kT];
  const int64_t S = p.nsubs(), H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim, L = p.seqlen;
  const HeadSub place = head_sub_of_block(H, S, G);
  const int64_t b = place.b, h = place.h, s = place.s, bh = place.bh, g = place.g;
  const int64_t p0 = (int64_t)blockIdx.y * kT;
  const Sub u = sub_of(p, b, s);
  // 1. U's slabs by cp.async; V's octets (rows Copy::row(k), columns c..c+7) into registers.
  const bf16* U = (const bf16*)(kGrad ? p.Cm : p.Bm) + ((b * L + u.t0) * G + g) * N;  // step j at U[j G N]
#pragma unroll
  for (int t = 0; t < kSlabs; ++t) copy_swizzled(sU[t], U + t * kT, G * N, u.len);
  cuda::cp_async_commit();
  const bf16* V = v_src + ((b * L + u.t0) * H + h) * P + p0;  // step j at V[j H P]
  const int c = Copy::col();
  uint4 raw[Copy::kPer];
#pragma unroll
  for (int k = 0; k < Copy::kPer; ++k) {
    const int j = Copy::row(k);
    raw[k] = j < u.len ? __ldg(reinterpret_cast<const uint4*>(V + j * H * P + c)) : make_uint4(0u, 0u, 0u, 0u);
  }
  if (threadIdx.x < kT) coef[threadIdx.x] = local_coef<kGrad>(p, w, b, h, bh * S + s, u, threadIdx.x);
  __syncthreads();
  // 2. coef V, split, into the swizzled hi and lo tiles (one 16-byte store each per octet).
#pragma unroll
  for (int k = 0; k < Copy::kPer; ++k) store_split_octet(sV[0], sV[1], Copy::row(k), c, raw[k], coef[Copy::row(k)]);
  cuda::cp_async_wait<0>();
  cuda::fence_proxy_async_shared();
  __syncthreads();
  // 3. acc[t] = U[t]^T Vhi + U[t]^T Vlo.
  float acc[kSlabs][8][4];
  wg_local_product<kSlabs>(acc, sU[0], sV[0], sV[1], false);
  // 4. Out through the U tiles (every warp's products are done once all have passed the barrier).
  __syncthreads();
#pragma unroll
  for (int t = 0; t < kSlabs; ++t) wg_store_tile(sU[t], acc[t]);
  __syncthreads();
  bf16* o = out + (bh * S + s) * N * P + p0;  // entry (n, q) at o[n P + q]
#pragma unroll
  for (int t = 0; t < kSlabs; ++t) wg_copy_out(o + t * kT * P, P, sU[t], kT);
}

// The wgmma form where this binary has wgmma; the mma.sync form (local_state_kn) in builds for
// other GPUs.
template <bool kGrad, int kSlabs>
__global__ void __launch_bounds__(kThreads, kMinLocalWg)
    local_state_wg_kernel(SsdParams p, SsdScratch w, const __nv_bfloat16* v_src, __nv_bfloat16* out) {
  if constexpr (cuda::kHaveWgmma) local_state_wg<kGrad, kSlabs>(p, w, v_src, out);
  else local_state_kn<kGrad>(p, w, v_src, out);
}

// Launches the local states (kGrad: their gradients) of every sub-chunk into `out`, grid
// (B S H, ceil(P / 64)): the wgmma form where it applies, else local_state_kernel (vec: ssd_vec).
template <class T, bool kGrad>
void launch_local_state(const SsdParams& p, const SsdScratch& w, const T* v_src, T* out, bool vec, cudaStream_t stream) {
  const dim3 grid((unsigned)(p.batch * p.nsubs() * p.nheads), (unsigned)((p.headdim + kT - 1) / kT));
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (vec && local_state_wg_applies(p, out)) {
      if (p.dstate == kT) local_state_wg_kernel<kGrad, 1><<<grid, kThreads, 0, stream>>>(p, w, v_src, out);
      else local_state_wg_kernel<kGrad, 2><<<grid, kThreads, 0, stream>>>(p, w, v_src, out);
      return;
    }
  }
  if (vec) local_state_kernel<T, kGrad, true><<<grid, kThreads, 0, stream>>>(p, w, v_src, out);
  else local_state_kernel<T, kGrad, false><<<grid, kThreads, 0, stream>>>(p, w, v_src, out);
}

}  // namespace hax::ops::ssd_cuda
