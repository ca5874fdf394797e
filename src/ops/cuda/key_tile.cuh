// The key side of a backward over one 64-key tile that many query tiles see (A-shaped attention's
// sink, HSA's chunks): each query tile's P (or w P) and dS, computed by the warps that own its
// query rows, go to shared memory as bfloat16 (64 queries x 64 keys, rows kSP apart), and after a
// block barrier every warp adds its share of dV += P^T dO and dK += dS^T Q for the tile's keys.
// KG: 16-key groups with keys (1, 2 or 4); warp w takes key group w % KG and column part w / KG
// of kParts<DB, KG> parts of DB / kParts columns (warps past KG kParts idle in the products).
#pragma once
#include "ops/cuda/mma_bf16.cuh"

namespace hax::ops::cuda::key_tile {

using bf16 = __nv_bfloat16;
constexpr int kSP = 64 + 8;  // row stride of the shared P and dS tiles (bfloat16 entries)

template <int DB, int KG>
constexpr int kParts = (4 / KG < DB / 16) ? 4 / KG : DB / 16;

// Writes the warp's rows r0 .. r0 + 15 of P and dS (C fragments of 16 x 64; g = lane / 4,
// t = lane % 4) into sP and sdS; with zero, zeros instead (a warp without query rows).
template <bool kZero = false>
__device__ __forceinline__ void store_p_ds(bf16* sP, bf16* sdS, const float (&ps)[8][4], const float (&ds)[8][4],
                                           int r0, int g, int t) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int off = (r0 + g + 8 * r) * kSP + nt * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(sP + off) = kZero ? 0u : mma::pack_bf16(ps[nt][2 * r], ps[nt][2 * r + 1]);
      *reinterpret_cast<uint32_t*>(sdS + off) = kZero ? 0u : mma::pack_bf16(ds[nt][2 * r], ds[nt][2 * r + 1]);
    }
}

// accV (16 keys, DW) += P[:, keys]^T dO[:, cols] and accK += dS[:, keys]^T Q[:, cols] over the
// tile's 64 query rows, for the calling warp's key group and column part (sQ, sdO: (64, S) tiles).
template <int DB, int KG, int S>
__device__ __forceinline__ void accumulate(float (&accK)[DB / kParts<DB, KG> / 8][4],
                                           float (&accV)[DB / kParts<DB, KG> / 8][4], const bf16* sP,
                                           const bf16* sdS, const bf16* sQ, const bf16* sdO, int warp) {
  constexpr int CS = kParts<DB, KG>, DW = DB / CS;
  const int kg = warp % KG, cp = warp / KG;
  if (cp >= CS) return;
  mma::warp_accumulate_tn<DW, 4, Padded<kSP>, Padded<S>>(accV, sP, 16 * kg, sdO + cp * DW);
  mma::warp_accumulate_tn<DW, 4, Padded<kSP>, Padded<S>>(accK, sdS, 16 * kg, sQ + cp * DW);
}

}  // namespace hax::ops::cuda::key_tile
