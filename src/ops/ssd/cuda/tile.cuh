// Block-level 64 x 64 matrix tiles, the building block of every SSD kernel.
//
// A thread block of kThreads = 128 threads (4 warps) computes one 64 x 64 float32 tile
//   acc(m, n) += Σ_k A(m, k) B(n, k)
// from operands staged in shared memory slab by slab (kSlab = 64 values of k at a time), both
// stored "k-major": A as [m][k] and B as [n][k], rows kLd elements apart. The warps form a 2 x 2
// grid, each owning a 32 x 32 quarter as 2 x 4 mma tiles of 16 x 8, and each thread holds the
// elements of those tiles that the PTX m16n8 accumulator layout gives it:
//   row = 32 wm + 16 mi + lane / 4 + 8 (r / 2),   col = 32 wn + 8 ni + 2 (lane % 4) + r % 2
// for mi < 2, ni < 4, r < 4. Both engines use this ownership, so epilogues and row/column
// reductions are written once:
//   - bfloat16 storage: operands are bfloat16 in shared memory and the products run on tensor
//     cores (mma.sync m16n8k16, float32 accumulation);
//   - float32 storage: operands are float32 and each thread runs its 32 dot products with FMAs
//     (exact float32, matching the CPU reference to rounding).
// Staging zero-fills everything outside the valid ranges, so padded rows and k's add nothing.
// Staging is what the kernels' speed depends on (the products are small): with the head dim and
// state size multiples of 8 (and aligned inputs), each thread loads 4 octets of 8 neighbours in
// global memory with 16-byte loads, all issued before any is stored (stage_op, kVec); otherwise
// element by element, full slabs in batches of pairs whose loads are issued together.
//
// Precision of the bfloat16 path: the raw inputs (x, B, C, dy) enter the products exactly, and
// per-row factors are applied to the float32 accumulators. The states and state gradients are
// stored in x's dtype (rounded once from float32, as chunk_states on the CPU and mamba_ssm's
// kernels) and enter as stored. An operand computed in the kernel in float32 (a decayed mask, a
// dCB tile, per-step coefficients times B or C, or times x or dy in local_state's vectorized
// path) is staged as two bfloat16 halves, hi = bf16(v) and lo = bf16(v - hi), and multiplied
// twice (stage_split, mma_split_a/b, mma_slab_tt_split_b, mma_slab_tt once per half): about 16
// significant bits instead of 8.
#pragma once
#include <type_traits>
#include "ops/cuda/common.cuh"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/mma_bf16.cuh"

namespace hax::ops::ssd_cuda {

using cuda::from_f32;
using cuda::to_f32;

constexpr int kT = 64;         // tile rows and columns (= kSsdSubChunk)
constexpr int kThreads = 128;  // threads of a tile block: 4 warps, 2 x 2
constexpr int kSlab = 64;      // k values staged per step
// Resident blocks per SM that each kernel's register budget aims at (__launch_bounds__), chosen
// on an H100 at L = 64K, bf16: 4 blocks (<= 128 registers) for the tile kernels, 6 for
// local_state (its smaller tile). The macros let a timing driver try others.
#ifndef HAX_SSD_MIN_BLOCKS
#define HAX_SSD_MIN_BLOCKS 4
#endif
#ifndef HAX_SSD_MB_LOCAL
#define HAX_SSD_MB_LOCAL 6
#endif
#ifndef HAX_SSD_MB_SCAN
#define HAX_SSD_MB_SCAN HAX_SSD_MIN_BLOCKS
#endif
#ifndef HAX_SSD_MB_DX
#define HAX_SSD_MB_DX HAX_SSD_MIN_BLOCKS
#endif
#ifndef HAX_SSD_MB_DBDC
#define HAX_SSD_MB_DBDC HAX_SSD_MIN_BLOCKS
#endif
#ifndef HAX_SSD_MB_DCB
#define HAX_SSD_MB_DCB HAX_SSD_MIN_BLOCKS
#endif
constexpr int kMinBlocks = HAX_SSD_MIN_BLOCKS;
constexpr int kMinLocal = HAX_SSD_MB_LOCAL, kMinScan = HAX_SSD_MB_SCAN, kMinDx = HAX_SSD_MB_DX,
              kMinDbdc = HAX_SSD_MB_DBDC, kMinDcb = HAX_SSD_MB_DCB;

// Shared-memory operand type and row stride per storage type. The strides keep the fragment
// loads free of bank conflicts (bfloat16: 36 words a row; float32: 68 words).
template <class T>
struct Operand;
template <>
struct Operand<float> {
  using S = float;
  static constexpr int kLd = kSlab + 4;
  static constexpr bool kSplit = false;  // float32 operands are staged whole
};
template <>
struct Operand<__nv_bfloat16> {
  using S = __nv_bfloat16;
  static constexpr int kLd = kSlab + 8;
  static constexpr bool kSplit = true;  // computed operands are staged as hi + lo
};
// Shared entries of one operand slab, and of the lo half of a split one (1 when unused).
template <class T>
constexpr int kSlabSize = kT * Operand<T>::kLd;
template <class T>
constexpr int kLoSize = Operand<T>::kSplit ? kSlabSize<T> : 1;

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_m() { return (threadIdx.x >> 5) >> 1; }
__device__ __forceinline__ int warp_n() { return (threadIdx.x >> 5) & 1; }

// The thread's share of a 64 x 64 float32 tile (see the top of the file for the layout).
struct Acc {
  float v[2][4][4];  // [mi][ni][r]
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int r = 0; r < 4; ++r) v[mi][ni][r] = 0.f;
  }
};

__device__ __forceinline__ int acc_row(int mi, int r) {
  return warp_m() * 32 + mi * 16 + (lane_id() >> 2) + (r >> 1) * 8;
}
__device__ __forceinline__ int acc_col(int ni, int r) { return warp_n() * 32 + ni * 8 + (lane_id() & 3) * 2 + (r & 1); }

// Calls f(mi, ni, rp, row, col) for each of the thread's 16 pairs of horizontally adjacent
// elements: acc.v[mi][ni][2 rp] at (row, col) and acc.v[mi][ni][2 rp + 1] at (row, col + 1), col even.
template <class F>
__device__ __forceinline__ void for_each_pair(F&& f) {
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int rp = 0; rp < 2; ++rp) f(mi, ni, rp, acc_row(mi, 2 * rp), acc_col(ni, 2 * rp));
}

// Calls f(mi, ni, r, row, col, rslot, cslot) for each of the thread's 32 elements (the pairs of
// for_each_pair, in the same order); rslot (0..3) numbers the thread's 4 rows and cslot (0..7)
// its 8 columns (for per-thread row/column sums).
template <class F>
__device__ __forceinline__ void for_each(F&& f) {
  for_each_pair([&](int mi, int ni, int rp, int row, int col) {
#pragma unroll
    for (int e = 0; e < 2; ++e) f(mi, ni, 2 * rp + e, row, col + e, mi * 2 + rp, ni * 2 + e);
  });
}

// Stores a pair of adjacent entries dst[0] = a (if ok0), dst[1] = b (if ok1). `wide`: both are
// in range and dst is aligned to the pair, so one 8-byte (float32) or 4-byte (bfloat16) store
// writes both: a warp's store then covers whole 32-byte sectors of its rows (float32), where
// element stores used half of each.
template <class T>
__device__ __forceinline__ void store_pair(T* dst, float a, float b, bool ok0, bool ok1, bool wide) {
  if (wide) {
    if constexpr (std::is_same_v<T, float>) {
      *reinterpret_cast<float2*>(dst) = make_float2(a, b);
    } else {
      *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
    }
    return;
  }
  if (ok0) dst[0] = from_f32<T>(a);
  if (ok1) dst[1] = from_f32<T>(b);
}

__device__ __forceinline__ uint32_t load_pair(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// d += a b for one m16n8k16 tile (bfloat16 inputs, float32 accumulation), PTX fragment layouts.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// acc += A B^T over k < ks (a multiple of 16): tensor cores.
__device__ __forceinline__ void mma_slab(Acc& acc, const __nv_bfloat16* A, const __nv_bfloat16* B, int ks) {
  constexpr int ld = Operand<__nv_bfloat16>::kLd;
  const int g = lane_id() >> 2, t2 = (lane_id() & 3) * 2;
  const __nv_bfloat16* Aw = A + (warp_m() * 32 + g) * ld + t2;
  const __nv_bfloat16* Bw = B + (warp_n() * 32 + g) * ld + t2;
  for (int k = 0; k < ks; k += 16) {
    uint32_t a[2][4], b[4][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const __nv_bfloat16* p = Aw + mi * 16 * ld + k;
      a[mi][0] = load_pair(p);               // row g,     k 2t, 2t+1
      a[mi][1] = load_pair(p + 8 * ld);      // row g + 8, k 2t, 2t+1
      a[mi][2] = load_pair(p + 8);           // row g,     k 2t+8, 2t+9
      a[mi][3] = load_pair(p + 8 * ld + 8);  // row g + 8, k 2t+8, 2t+9
    }
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const __nv_bfloat16* p = Bw + ni * 8 * ld + k;
      b[ni][0] = load_pair(p);      // column g, k 2t, 2t+1
      b[ni][1] = load_pair(p + 8);  // column g, k 2t+8, 2t+9
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) mma_16816(acc.v[mi][ni], a[mi], b[ni]);
  }
}

// acc += A B over k < ks (a multiple of 16) with B stored [k][n] (rows kLd apart), as a raw
// operand copies in from global memory contiguous along n: its fragments come by
// ldmatrix.x4.trans, each instruction the k16 x n16 block of two 8-column mma tiles.
__device__ __forceinline__ void mma_slab_kn(Acc& acc, const __nv_bfloat16* A, const __nv_bfloat16* B, int ks) {
  constexpr int ld = Operand<__nv_bfloat16>::kLd;
  const int lane = lane_id(), g = lane >> 2, t2 = (lane & 3) * 2;
  const __nv_bfloat16* Aw = A + (warp_m() * 32 + g) * ld + t2;
  // Lane l addresses row (l % 8) of matrix l / 8: k + 8 ((l / 8) % 2) + l % 8, columns n + 8 (l / 16).
  const __nv_bfloat16* Bl = B + (((lane >> 3) & 1) * 8 + (lane & 7)) * ld + warp_n() * 32 + (lane >> 4) * 8;
  for (int k = 0; k < ks; k += 16) {
    uint32_t a[2][4], b[4][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const __nv_bfloat16* p = Aw + mi * 16 * ld + k;
      a[mi][0] = load_pair(p);
      a[mi][1] = load_pair(p + 8 * ld);
      a[mi][2] = load_pair(p + 8);
      a[mi][3] = load_pair(p + 8 * ld + 8);
    }
#pragma unroll
    for (int nj = 0; nj < 2; ++nj) {
      uint32_t r[4];
      cuda::mma::ldsm_x4<true>(r, Bl + k * ld + nj * 16);
      b[2 * nj][0] = r[0], b[2 * nj][1] = r[1], b[2 * nj + 1][0] = r[2], b[2 * nj + 1][1] = r[3];
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) mma_16816(acc.v[mi][ni], a[mi], b[ni]);
  }
}

// cuda::mma::ldsm_x4<true> from a 32-bit shared address.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Fragments of the products whose A is stored [k][m] (a raw operand copied in contiguous along m,
// or a computed one staged along m) and whose B is stored [k][n], rows kLd apart, every fragment
// read by ldmatrix.x4.trans from a 32-bit shared address (ldsm_x4_trans). frag_a_km: A's
// instruction reads the k16 x m16 block of one mma tile: lane l addresses row k + l % 8 +
// 8 (l / 16), columns m + 8 ((l / 8) % 2), so its matrices are (k +0, m +0), (+0, +8), (+8, +0),
// (+8, +8), whose transposes are a0 (m 0-7, k 0-7), a1 (m 8-15, k 0-7), a2 (m 0-7, k 8-15),
// a3 (m 8-15, k 8-15) (as load_a_trans in mma_bf16.cuh). frag_b_kn: B's are read as in
// mma_slab_kn. a_km_lane and b_kn_lane are the lanes' byte offsets at k = 0 in the warp's quarter.
__device__ __forceinline__ uint32_t a_km_lane() {
  constexpr int ld = Operand<__nv_bfloat16>::kLd;
  const int lane = lane_id();
  return 2 * (((lane & 7) + (lane >> 4) * 8) * ld + warp_m() * 32 + ((lane >> 3) & 1) * 8);
}
__device__ __forceinline__ uint32_t b_kn_lane() {
  constexpr int ld = Operand<__nv_bfloat16>::kLd;
  const int lane = lane_id();
  return 2 * ((((lane >> 3) & 1) * 8 + (lane & 7)) * ld + warp_n() * 32 + (lane >> 4) * 8);
}
// a[mi] = the A fragment of rows 16 mi.. of the warp's quarter, k .. k + 15 (Al: a_km_lane added).
__device__ __forceinline__ void frag_a_km(uint32_t (&a)[2][4], uint32_t Al, int k) {
  constexpr int ld = Operand<__nv_bfloat16>::kLd;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) ldsm_x4_trans(a[mi], Al + 2 * (k * ld + mi * 16));
}
// b[ni] = the B fragment of columns 8 ni.. of the warp's quarter, k .. k + 15 (Bl: b_kn_lane added).
__device__ __forceinline__ void frag_b_kn(uint32_t (&b)[4][2], uint32_t Bl, int k) {
  constexpr int ld = Operand<__nv_bfloat16>::kLd;
#pragma unroll
  for (int nj = 0; nj < 2; ++nj) {
    uint32_t r[4];
    ldsm_x4_trans(r, Bl + 2 * (k * ld + nj * 16));
    b[2 * nj][0] = r[0], b[2 * nj][1] = r[1], b[2 * nj + 1][0] = r[2], b[2 * nj + 1][1] = r[3];
  }
}
__device__ __forceinline__ void mma_frags(Acc& acc, const uint32_t (&a)[2][4], const uint32_t (&b)[4][2]) {
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) mma_16816(acc.v[mi][ni], a[mi], b[ni]);
}

// acc += A (Bhi + Blo) over k < ks (a multiple of 16) with A stored [k][m] and B [k][n]: A a raw
// operand, B a computed one split in two halves. The lo fragments are loaded after the hi
// products: with generic pointers, or all of a k step's fragments loaded first, local_state
// spilled at 80 registers.
__device__ __forceinline__ void mma_slab_tt_split_b(Acc& acc, const __nv_bfloat16* A, const __nv_bfloat16* Bhi,
                                                    const __nv_bfloat16* Blo, int ks) {
  const uint32_t Al = (uint32_t)__cvta_generic_to_shared(A) + a_km_lane(), bl = b_kn_lane();
  const uint32_t Bh = (uint32_t)__cvta_generic_to_shared(Bhi) + bl, Bo = (uint32_t)__cvta_generic_to_shared(Blo) + bl;
  for (int k = 0; k < ks; k += 16) {
    uint32_t a[2][4];
    frag_a_km(a, Al, k);
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // hi, then lo
      uint32_t b[4][2];
      frag_b_kn(b, half ? Bo : Bh, k);
      mma_frags(acc, a, b);
    }
  }
}

// acc += A B over k < ks (a multiple of 16) with A stored [k][m] and B [k][n] (dx_kernel's intra
// product: A the decayed mask staged along m, once per half of a split operand; B the raw dy tile).
__device__ __forceinline__ void mma_slab_tt(Acc& acc, const __nv_bfloat16* A, const __nv_bfloat16* B, int ks) {
  const uint32_t Al = (uint32_t)__cvta_generic_to_shared(A) + a_km_lane();
  const uint32_t Bl = (uint32_t)__cvta_generic_to_shared(B) + b_kn_lane();
  for (int k = 0; k < ks; k += 16) {
    uint32_t a[2][4], b[4][2];
    frag_a_km(a, Al, k);
    frag_b_kn(b, Bl, k);
    mma_frags(acc, a, b);
  }
}

// acc += A B^T over k < ks: float32 FMAs, same element ownership as the tensor-core path.
__device__ __forceinline__ void mma_slab(Acc& acc, const float* A, const float* B, int ks) {
  constexpr int ld = Operand<float>::kLd;
  const float* Aw = A + (warp_m() * 32 + (lane_id() >> 2)) * ld;
  const float* Bw = B + (warp_n() * 32 + (lane_id() & 3) * 2) * ld;
  for (int k = 0; k < ks; ++k) {
    float a[2][2], b[4][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) a[mi][h] = Aw[(mi * 16 + h * 8) * ld + k];
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 2; ++e) b[ni][e] = Bw[(ni * 8 + e) * ld + k];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc.v[mi][ni][r] = fmaf(a[mi][r >> 1], b[ni][r & 1], acc.v[mi][ni][r]);
  }
}

__device__ __forceinline__ int round16(int k) { return (k + 15) & ~15; }

// Full-slab staging (ks = kSlab): the 64 x 64 slab is covered by 2048 pairs of neighbouring
// elements (r, k), (r, k + 1), k even, 16 per thread; pair e of a thread is
//   KFast:  r = q, k = 2 lane                                    (a warp: one row, 64 k)
//   else:   r = 8 (q % 8) + lane % 8, k = 2 (4 (q / 8) + lane / 8)  (a warp: 8 rows x 4 k pairs)
// with q = warp + 4 e. A pair is one 32-bit (bfloat16) or 64-bit (float32) shared store, and both
// mappings keep a warp's bfloat16 stores free of bank conflicts. The values of kStageBatch pairs
// are computed (their global loads issued together) before any is stored: loads in flight, not
// one load per thread at a time, is what the staging's speed depends on.
constexpr int kStagePairs = kT * kSlab / 2 / kThreads;  // 16
#ifndef HAX_SSD_STAGE_BATCH
#define HAX_SSD_STAGE_BATCH 4
#endif
constexpr int kStageBatch = HAX_SSD_STAGE_BATCH;

template <bool KFast>
__device__ __forceinline__ void pair_pos(int e, int& r, int& k) {
  const int lane = lane_id(), q = (threadIdx.x >> 5) + e * (kThreads / 32);
  if (KFast) {
    r = q;
    k = 2 * lane;
  } else {
    r = (q & 7) * 8 + (lane & 7);
    k = 2 * ((q >> 3) * 4 + (lane >> 3));
  }
}

__device__ __forceinline__ void store_pair(float* d, float a, float b) {
  *reinterpret_cast<float2*>(d) = make_float2(a, b);
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* d, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(d) = __floats2bfloat162_rn(a, b);
}
// Stores hi = (a, b) rounded and, for bfloat16, lo = the rounding errors rounded.
__device__ __forceinline__ void store_split_pair(float* hi, float*, float a, float b) { store_pair(hi, a, b); }
__device__ __forceinline__ void store_split_pair(__nv_bfloat16* hi, __nv_bfloat16* lo, float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  *reinterpret_cast<__nv_bfloat162*>(hi) = h;
  *reinterpret_cast<__nv_bfloat162*>(lo) = __floats2bfloat162_rn(a - __low2float(h), b - __high2float(h));
}

// Fills a shared operand slab: dst[r][k] = f(r, k) for r < 64, k < ks (a multiple of 16); f
// returns float32 and must give 0 outside the valid ranges. KFast: global memory is contiguous
// along k (consecutive threads take consecutive k); otherwise along r.
template <bool KFast, class S, class F>
__device__ __forceinline__ void stage(S* dst, int ks, F&& f) {
  constexpr int ld = Operand<S>::kLd;
  if (ks == kSlab) {
#pragma unroll
    for (int e0 = 0; e0 < kStagePairs; e0 += kStageBatch) {
      float a[kStageBatch], b[kStageBatch];
#pragma unroll
      for (int e = 0; e < kStageBatch; ++e) {
        int r, k;
        pair_pos<KFast>(e0 + e, r, k);
        a[e] = f(r, k);
        b[e] = f(r, k + 1);
      }
#pragma unroll
      for (int e = 0; e < kStageBatch; ++e) {
        int r, k;
        pair_pos<KFast>(e0 + e, r, k);
        store_pair(dst + r * ld + k, a[e], b[e]);
      }
    }
    return;
  }
  const int n = kT * ks;
  for (int idx = threadIdx.x; idx < n; idx += kThreads) {
    int r, k;
    if (KFast) {
      r = idx / ks;
      k = idx - r * ks;
    } else {
      k = idx / kT;
      r = idx - k * kT;
    }
    dst[r * ld + k] = from_f32<S>(f(r, k));
  }
}

// Stages an operand computed in float32: hi[r][k] = f(r, k) rounded to S and, for bfloat16,
// lo[r][k] = the rounding error, rounded (float32: lo is not touched).
template <bool KFast, class S, class F>
__device__ __forceinline__ void stage_split(S* hi, S* lo, int ks, F&& f) {
  constexpr int ld = Operand<S>::kLd;
  if (ks == kSlab) {
#pragma unroll
    for (int e0 = 0; e0 < kStagePairs; e0 += kStageBatch) {
      float a[kStageBatch], b[kStageBatch];
#pragma unroll
      for (int e = 0; e < kStageBatch; ++e) {
        int r, k;
        pair_pos<KFast>(e0 + e, r, k);
        a[e] = f(r, k);
        b[e] = f(r, k + 1);
      }
#pragma unroll
      for (int e = 0; e < kStageBatch; ++e) {
        int r, k;
        pair_pos<KFast>(e0 + e, r, k);
        store_split_pair(hi + r * ld + k, lo + r * ld + k, a[e], b[e]);
      }
    }
    return;
  }
  const int n = kT * ks;
  for (int idx = threadIdx.x; idx < n; idx += kThreads) {
    int r, k;
    if (KFast) {
      r = idx / ks;
      k = idx - r * ks;
    } else {
      k = idx / kT;
      r = idx - k * kT;
    }
    const float v = f(r, k);
    const S h = from_f32<S>(v);
    hi[r * ld + k] = h;
    if (Operand<S>::kSplit) lo[r * ld + k] = from_f32<S>(v - to_f32(h));
  }
}

// Vectorized staging of a whole 64 x 64 slab (used when the head dim and state size are
// multiples of 8, so that every run of 8 elements along global memory's contiguous direction is
// 16-byte aligned). The slab is 512 octets, 4 per thread; octet e of a thread is
//   KFast: row r, k .. k + 7         (one 16-byte shared store)
//   else:  rows r .. r + 7, column k (8 2-byte stores; a warp covers 32 consecutive k: no bank
//                                     conflicts)
// g(r, k, v) fills v[0..7] with the operand's values along the contiguous direction (zeros
// outside the valid ranges; k beyond the product's ks is staged too but not read). All four
// octets are computed (their global loads in flight together) before any is stored.
template <bool KFast>
__device__ __forceinline__ void oct_pos(int e, int& r, int& k) {
  const int o = threadIdx.x + e * kThreads;
  if (KFast) {
    r = o >> 3;
    k = (o & 7) * 8;
  } else {
    k = o & 63;
    r = (o >> 6) * 8;
  }
}

// v[0..7] = p[0..7] as float32 (zeros when !valid); p 16-byte aligned. Read-only data only.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, bool valid, float (&v)[8]) {
  uint4 u = make_uint4(0u, 0u, 0u, 0u);
  if (valid) u = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    v[2 * e] = __uint_as_float(w[e] << 16);              // low half: element 2e
    v[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);  // high half: element 2e + 1
  }
}
__device__ __forceinline__ void load8(const float* p, bool valid, float (&v)[8]) {
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
  if (valid) a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// acc += Σ_m a[m] d[m] over two octets of raw bfloat16 (8 pairs), in element order.
__device__ __forceinline__ void dot_bf16x8(float& acc, const uint4& a8, const uint4& d8) {
  const uint32_t a[4] = {a8.x, a8.y, a8.z, a8.w}, d[4] = {d8.x, d8.y, d8.z, d8.w};
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    acc += __uint_as_float(a[m] << 16) * __uint_as_float(d[m] << 16);
    acc += __uint_as_float(a[m] & 0xffff0000u) * __uint_as_float(d[m] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Stores octet v at (r, k) of hi (and, for a split bfloat16 operand, the rounding errors in lo).
template <bool KFast, bool kSplit>
__device__ __forceinline__ void store8(__nv_bfloat16* hi, __nv_bfloat16* lo, int r, int k, const float (&v)[8]) {
  constexpr int ld = Operand<__nv_bfloat16>::kLd;
  if (KFast) {
    uint4 h;
    h.x = pack_bf16(v[0], v[1]), h.y = pack_bf16(v[2], v[3]), h.z = pack_bf16(v[4], v[5]), h.w = pack_bf16(v[6], v[7]);
    *reinterpret_cast<uint4*>(hi + r * ld + k) = h;
    if (kSplit) {
      const uint32_t w[4] = {h.x, h.y, h.z, h.w};
      uint32_t l[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        l[e] = pack_bf16(v[2 * e] - __uint_as_float(w[e] << 16), v[2 * e + 1] - __uint_as_float(w[e] & 0xffff0000u));
      *reinterpret_cast<uint4*>(lo + r * ld + k) = make_uint4(l[0], l[1], l[2], l[3]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const __nv_bfloat16 h = __float2bfloat16(v[e]);
      hi[(r + e) * ld + k] = h;
      if (kSplit) lo[(r + e) * ld + k] = __float2bfloat16(v[e] - __bfloat162float(h));
    }
  }
}
template <bool KFast, bool kSplit>
__device__ __forceinline__ void store8(float* hi, float*, int r, int k, const float (&v)[8]) {
  constexpr int ld = Operand<float>::kLd;
  if (KFast) {
    float4* d = reinterpret_cast<float4*>(hi + r * ld + k);
    d[0] = make_float4(v[0], v[1], v[2], v[3]);
    d[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) hi[(r + e) * ld + k] = v[e];
  }
}

// The staging entry point of the kernels: kVec picks the vectorized whole-slab path (g, octets)
// or the element path (f, the first ks columns); kSplit stages hi + lo (lo unused for float32).
template <bool kVec, bool KFast, bool kSplit, class S, class F, class G>
__device__ __forceinline__ void stage_op(S* hi, S* lo, int ks, F&& f, G&& g) {
  if constexpr (kVec) {
    float v[4][8];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int r, k;
      oct_pos<KFast>(e, r, k);
      g(r, k, v[e]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int r, k;
      oct_pos<KFast>(e, r, k);
      store8<KFast, kSplit && Operand<S>::kSplit>(hi, lo, r, k, v[e]);
    }
  } else if constexpr (kSplit) {
    stage_split<KFast>(hi, lo, ks, f);
  } else {
    stage<KFast>(hi, ks, f);
  }
}

// acc += (Ahi + Alo) B^T and acc += A (Bhi + Blo)^T (the lo product only where operands split).
template <class S>
__device__ __forceinline__ void mma_split_a(Acc& acc, const S* Ahi, const S* Alo, const S* B, int ks) {
  mma_slab(acc, Ahi, B, ks);
  if (Operand<S>::kSplit) mma_slab(acc, Alo, B, ks);
}
template <class S>
__device__ __forceinline__ void mma_split_b(Acc& acc, const S* A, const S* Bhi, const S* Blo, int ks) {
  mma_slab(acc, A, Bhi, ks);
  if (Operand<S>::kSplit) mma_slab(acc, A, Blo, ks);
}

// Row and column sums of the tile in a fixed order, behind one barrier of the caller's for any
// number of sets. put_rows(part, at): part[rslot] holds the thread's sum over its columns for each
// of its rows; the warp's quads add them and write the set's row partials at `at` (2 kT shared
// floats, one half a warp column). put_cols(part, at): part[cslot] holds the thread's sum over
// its rows for each of its columns, likewise. After the caller's __syncthreads, thread i < kT
// reads the set's total for row (column) i as total(at, i). Between two uses of the same floats
// the block must pass another barrier (readers done before writers start). (Row and column sums
// used to take two barriers each: four a head in dcb, eight in dx's tail.)
__device__ __forceinline__ void put_rows(const float (&part)[4], float* at) {
#pragma unroll
  for (int rs = 0; rs < 4; ++rs) {
    float v = part[rs];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    if ((lane_id() & 3) == 0) at[warp_n() * kT + acc_row(rs >> 1, (rs & 1) * 2)] = v;
  }
}
__device__ __forceinline__ void put_cols(const float (&part)[8], float* at) {
#pragma unroll
  for (int cs = 0; cs < 8; ++cs) {
    float v = part[cs];
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    if (lane_id() < 4) at[warp_m() * kT + acc_col(cs >> 1, cs & 1)] = v;
  }
}
__device__ __forceinline__ float total(const float* at, int i) { return at[i] + at[kT + i]; }
// The block sum's partials (one a warp; 4 floats at `at`), read after the caller's barrier by
// block_total: the four warps' totals added in a fixed order.
__device__ __forceinline__ void put_block(float v, float* at) {
  v = cuda::warp_sum(v);
  if (lane_id() == 0) at[threadIdx.x >> 5] = v;
}
__device__ __forceinline__ float block_total(const float* at) { return (at[0] + at[1]) + (at[2] + at[3]); }

// acc += A B^T over k < P, 64 at a time, staged through registers: A(r, k) = a[r lda + k] for
// r < ra and B(r, k) = b[r ldb + k] for r < rb, both raw and contiguous along k (zeros elsewhere).
template <bool kVec, class S, class T>
__device__ __forceinline__ void product_over_k(Acc& acc, S* sA, S* sB, const T* a, int64_t lda, int ra, const T* b,
                                               int64_t ldb, int rb, int64_t P) {
#pragma unroll 1
  for (int64_t k0 = 0; k0 < P; k0 += kSlab) {
    const int kp = (int)(P - k0 < kSlab ? P - k0 : kSlab), kk = round16(kp);
    stage_op<kVec, true, false>(
        sA, sA, kk, [&](int r, int k) { return r < ra && k < kp ? to_f32(a[r * lda + k0 + k]) : 0.f; },
        [&](int r, int k, float(&v)[8]) { load8(a + r * lda + k0 + k, r < ra && k < kp, v); });
    stage_op<kVec, true, false>(
        sB, sB, kk, [&](int r, int k) { return r < rb && k < kp ? to_f32(b[r * ldb + k0 + k]) : 0.f; },
        [&](int r, int k, float(&v)[8]) { load8(b + r * ldb + k0 + k, r < rb && k < kp, v); });
    __syncthreads();
    mma_slab(acc, sA, sB, kk);
    __syncthreads();
  }
}

// A block's double-buffered pipeline of `stages` stages: issue(t) makes stage t's cp.async
// copies into buffers t % 2 and commits them as one group; begin(t) runs before stage t's wait
// (per-stage setup, overlapping the copies), compute(t) after the barrier that makes stage t's
// tiles visible, and a barrier ends each stage, so that issue(t + 2) may reuse its buffers.
template <class Issue, class Begin, class Compute>
__device__ __forceinline__ void run_pipeline(int stages, Issue&& issue, Begin&& begin, Compute&& compute) {
  issue(0);
#pragma unroll 1
  for (int t = 0; t < stages; ++t) {
    begin(t);
    if (t + 1 < stages) {
      issue(t + 1);
      cuda::cp_async_wait<1>();
    } else {
      cuda::cp_async_wait<0>();
    }
    __syncthreads();
    compute(t);
    __syncthreads();
  }
}

// The stages of a per-head loop over the 64-slabs of P, for run_pipeline: stage t is slab
// t % slabs of the group's head t / slabs, with its A and B tiles in buffers t % 2, copied by
// copy(dst, src, ld, rows, kp) (cp.async of the first `rows` rows and kp columns, zeros beyond).
template <class S>
struct HeadSlabs {
  S *a0, *a1, *b0, *b1;  // the two buffers of each operand
  int slabs;             // ceil(P / 64)
  int64_t P;             // head dim

  __device__ __forceinline__ S* A(int t) const { return t & 1 ? a1 : a0; }
  __device__ __forceinline__ S* B(int t) const { return t & 1 ? b1 : b0; }
  __device__ __forceinline__ int head(int t) const { return t / slabs; }
  __device__ __forceinline__ bool first(int t) const { return t % slabs == 0; }
  __device__ __forceinline__ bool last(int t) const { return t % slabs == slabs - 1; }
  __device__ __forceinline__ int64_t k0(int t) const { return (int64_t)(t % slabs) * kSlab; }
  __device__ __forceinline__ int kp(int t) const { return (int)(P - k0(t) < kSlab ? P - k0(t) : kSlab); }
  // Copies raw rows (contiguous along k) into a tile of the 64 x 64 tile layout.
  static __device__ __forceinline__ void copy(S* dst, const S* src, int64_t ld, int rows, int kp) {
    cuda::TileCopy<kT, kT, kThreads>::template rows<Operand<S>::kLd>(dst, src, ld, 0, rows, kp);
  }
};

}  // namespace hax::ops::ssd_cuda
