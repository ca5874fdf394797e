// What the SSD kernels' warpgroup (wgmma, sm_90a) forms share: when they apply, the copies of
// 64 x 64 bfloat16 tiles into the 128-byte swizzle that wgmma's descriptors read
// (ops/cuda/wgmma.cuh, ops/cuda/tile_layout.cuh Swizzle128), and the products and epilogues of
// one warpgroup. The forms keep a whole 64-slab of N per tile, so they take P and N multiples of
// 64 with N <= 128 (kWgSlabs slabs); other sizes run the mma.sync kernels. Landed: the forward's
// chunk_scan (chunk_scan_wgmma.cuh), the local states of both directions (local_state_wgmma.cuh),
// the sweep of local states and pass (segment_scan_wgmma.cuh) and the backward's dB/dC
// (dbdc_wgmma.cuh, dbdc_joint_wgmma.cuh). Tried and not kept: the backward's dx on the same
// pieces (experiments/ssd-dx-wgmma.patch: correct, slower).
#pragma once
#include <cuda_bf16.h>

#include "ops/cuda/common.cuh"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/tile_layout.cuh"
#include "ops/cuda/wgmma.cuh"
#include "ops/ssd/cuda/chunk.cuh"

namespace hax::ops::ssd_cuda {

constexpr int kWgSlabs = 2;    // 64-slabs of N a form holds at once: N <= 128
constexpr int kWgTile = kT * kT;  // entries of one 64 x 64 tile

// The process-wide switch (SsdParams::wgmma, set_ssd_wgmma) and HAX_SSD_WGMMA (unset or 1 on, 0
// off: the mma.sync kernels, for timing comparisons; read once).
inline bool wg_forms_on(const SsdParams& p) {
  static const int env = cuda::env_switch("HAX_SSD_WGMMA", 1, 1, "0 the SSD's mma.sync kernels, 1 wgmma where they apply");
  return p.wgmma && env == 1;
}
// Sizes whose tiles the forms cover whole (P > 0: with no columns, dB/dC's wgmma forms would
// leave u and g unwritten; the mma.sync forms write them as zeros).
inline bool wg_sizes(const SsdParams& p) {
  return p.headdim > 0 && p.headdim % kT == 0 && p.dstate % kT == 0 && p.dstate <= kWgSlabs * kT;
}

// The 64 x 64 tile of rows src + r ld (r < rows; zeros from row `rows` on), 64 entries each, into
// dst in the 128-byte swizzle: each thread copies one 16-byte chunk of 4 rows (cp.async; the
// caller commits).
__device__ __forceinline__ void copy_swizzled(__nv_bfloat16* dst, const __nv_bfloat16* src, int64_t ld, int rows) {
  using Copy = cuda::TileCopy<kT, kT, kThreads>;
  const int c = Copy::col();
#pragma unroll
  for (int k = 0; k < Copy::kPer; ++k) {
    const int r = Copy::row(k);
    const bool ok = r < rows;
    cuda::cp_async16(cuda::Swizzle128::at(dst, r, c), ok ? src + r * ld + c : src, ok);
  }
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// acc (64 x 64) = A S for a 64-row operand A of the swizzled tiles a[t] (rows of 64 state entries,
// K-major: C or B) and S of the tiles s[t] (rows of state entries by 64 columns, read N-major: a
// state or state gradient as stored), over the `slabs` 64-slabs of N; issued and waited for.
// Every warp of the warpgroup must call it.
__device__ __forceinline__ void wg_state_product(float (&acc)[8][4], const __nv_bfloat16* a, const __nv_bfloat16* s,
                                                 int slabs) {
  cuda::wgmma_fence();
#pragma unroll
  for (int t = 0; t < kWgSlabs; ++t)
    if (t < slabs) {
      const uint64_t da = cuda::wgmma_desc_sw128(a + t * kWgTile), db = cuda::wgmma_desc_sw128(s + t * kWgTile);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)  // A: +32 bytes a k step; B: +16 rows of 128 bytes
        cuda::wgmma_m64n64k16<false, true>(acc, da + 2 * kk, db + kk * (2048 >> 4), t > 0 || kk > 0);
    }
  cuda::wgmma_commit();
  cuda::wgmma_wait<0>();
  cuda::wgmma_fence_operands(acc);
}

// acc (64 x 64) += (Mhi + Mlo) Y: M from registers (warp w's rows 16w.. as mma.sync A fragments
// per k step of 16), Y a swizzled tile of 64 rows (the reduction) by 64 columns, read N-major;
// issued and waited for. Every warp must call it.
__device__ __forceinline__ void wg_split_product(float (&acc)[8][4], const uint32_t (&mhi)[4][4],
                                                 const uint32_t (&mlo)[4][4], const __nv_bfloat16* y) {
  const uint64_t dy = cuda::wgmma_desc_sw128(y);
  cuda::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) cuda::wgmma_m64n64k16_rs<true>(acc, mhi[kk], dy + kk * (2048 >> 4), true);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) cuda::wgmma_m64n64k16_rs<true>(acc, mlo[kk], dy + kk * (2048 >> 4), true);
  cuda::wgmma_commit();
  cuda::wgmma_wait<0>();
  cuda::wgmma_fence_operands(acc);
}

// acc[t] (+)= U[t]^T (Vhi + Vlo) over the kSlabs 64-slabs of N: U's tiles at u + t kWgTile (rows
// j = the reduction, read M-major: B or C as stored), Vhi and Vlo swizzled tiles of rows j read
// N-major (the local states: local_state_wgmma.cuh, segment_scan_wgmma.cuh); `accumulate` false:
// the first product of each slab overwrites acc[t]. Issued and waited for; every warp calls it.
template <int kSlabs>
__device__ __forceinline__ void wg_local_product(float (&acc)[kSlabs][8][4], const __nv_bfloat16* u,
                                                 const __nv_bfloat16* vhi, const __nv_bfloat16* vlo, bool accumulate) {
  const uint64_t dhi = cuda::wgmma_desc_sw128(vhi), dlo = cuda::wgmma_desc_sw128(vlo);
  cuda::wgmma_fence();
#pragma unroll
  for (int t = 0; t < kSlabs; ++t) {  // k steps of 16 rows: +2048 bytes on both operands
    const uint64_t du = cuda::wgmma_desc_sw128(u + t * kWgTile);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      cuda::wgmma_m64n64k16<true>(acc[t], du + kk * (2048 >> 4), dhi + kk * (2048 >> 4), accumulate || kk > 0);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) cuda::wgmma_m64n64k16<true>(acc[t], du + kk * (2048 >> 4), dlo + kk * (2048 >> 4), true);
  }
  cuda::wgmma_commit();
  cuda::wgmma_wait<0>();
#pragma unroll
  for (int t = 0; t < kSlabs; ++t) cuda::wgmma_fence_operands(acc[t]);
}

// Sets hi, lo to the bfloat16 pair of (m0, m1) and of its rounding errors (tile.cuh's split).
__device__ __forceinline__ void split_pair(float m0, float m1, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16(m0, m1);
  lo = pack_bf16(m0 - bf16_lo(hi), m1 - bf16_hi(hi));
}

// cf V for one octet of V (row j, columns c..c+7, raw bfloat16), split (split_pair), into the
// swizzled tiles hi and lo: one 16-byte store each.
__device__ __forceinline__ void store_split_octet(__nv_bfloat16* hi, __nv_bfloat16* lo, int j, int c, const uint4& raw,
                                                  float cf) {
  const uint32_t r[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t h[4], l[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) split_pair(bf16_lo(r[e]) * cf, bf16_hi(r[e]) * cf, h[e], l[e]);
  *reinterpret_cast<uint4*>(cuda::Swizzle128::at(hi, j, c)) = make_uint4(h[0], h[1], h[2], h[3]);
  *reinterpret_cast<uint4*>(cuda::Swizzle128::at(lo, j, c)) = make_uint4(l[0], l[1], l[2], l[3]);
}

// Writes the 64 x 64 accumulator, rounded, into a swizzled tile (each pair of adjacent columns one
// 32-bit store); the caller synchronizes before the tile is read. (Warp w of the warpgroup holds
// rows 16w + lane / 4 and + 8.)
__device__ __forceinline__ void wg_store_tile(__nv_bfloat16* tile, const float (&acc)[8][4]) {
  const int lane = threadIdx.x & 31, r0 = 16 * ((threadIdx.x >> 5) & 3) + (lane >> 2), c0 = 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<uint32_t*>(cuda::Swizzle128::at(tile, r0 + 8 * r, 8 * j) + c0) =
          pack_bf16(acc[j][2 * r], acc[j][2 * r + 1]);
}

// Copies rows r < rows of a swizzled tile to dst + r ld in 16-byte runs (dst 16-byte aligned rows),
// by the block's 128 threads (copy_swizzled likewise).
__device__ __forceinline__ void wg_copy_out(__nv_bfloat16* dst, int64_t ld, const __nv_bfloat16* tile, int rows) {
  using Copy = cuda::TileCopy<kT, kT, kThreads>;
  const int c = Copy::col();
#pragma unroll
  for (int k = 0; k < Copy::kPer; ++k) {
    const int r = Copy::row(k);
    if (r < rows) *reinterpret_cast<uint4*>(dst + r * ld + c) = *reinterpret_cast<const uint4*>(cuda::Swizzle128::at(tile, r, c));
  }
}

}  // namespace hax::ops::ssd_cuda
