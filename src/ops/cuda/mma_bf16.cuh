// bfloat16 tensor-core fragments for flash-style attention tiles (mma.sync m16n8k16, float32
// accumulation), shared by the causal attention kernels and the sparse attention tile kernels.
//
// Operand tiles sit in shared memory row-major with a row stride S (bfloat16 entries; S = head
// dim + 8: rows are 16-byte aligned and the 8 rows of an 8 x 8 matrix fall on 8 distinct 16-byte
// bank groups), or in TMA's 128-byte swizzle (Swizzle128; both layouts in tile_layout.cuh); the
// functions take the layout as a type, and their overloads with an int S mean Padded<S>.
// Fragments (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
//   A (16 x 16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16 x 8, k x n):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16 x 8, float):      c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
// Each fragment register is one 8 x 8 matrix of ldmatrix (row r = lane / 4, columns 2 (lane % 4),
// +1), so fragments are read 4 matrices per instruction (ldmatrix.x4): an A fragment, or the B
// fragments of two adjacent 8-column tiles. A B operand stored with k contiguous (K for
// S = Q K^T) is read as is; one stored with n contiguous (V for O = P V) is read transposed
// (ldmatrix.trans). The C fragments of two adjacent 8-column tiles are exactly the A fragment of
// a 16-wide k step, so P (resp. dS) goes from the first product to the second in registers.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/cuda/tile_layout.cuh"

namespace hax::ops::cuda::mma {

using bf16 = __nv_bfloat16;

// The 4 matrices of ldmatrix.x4 from shared memory: lane l gives the address of row l % 8 of
// matrix l / 8 (16 bytes, 16-byte aligned); r[m] receives matrix m's entries (l / 4, 2 (l % 4)..+1),
// or with kTrans those of its transpose.
template <bool kTrans>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* row) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(row);
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ int lane_of() { return (int)(threadIdx.x & 31); }

// Two floats rounded to bfloat16 in one register, `lo` in the low half (the lower k index), by one
// cvt.rn.bf16x2.f32 instead of two cvt.rn.bf16.f32 and a pack (same rounding).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 2^x with the MUFU unit alone (ex2.approx.ftz: relative error about 2^-22, results below 2^-126
// flushed to 0; 2^-inf = 0). exp2f adds a range check and two multiplies around it for denormal
// results, which cost as many instructions as the rest of a softmax step.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// c += A B for one m16n8k16 tile. Not volatile: a pure function of its registers, so the compiler
// may move it among the fragment loads (which stay volatile: they read shared memory).
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Tile layouts in shared memory (Padded<S>, Swizzle128): tile_layout.cuh.
using cuda::Padded;
using cuda::Swizzle128;

// A fragment of rows r0..r0+15, columns k0..k0+15 of the tile X (layout Lay):
// matrices (rows +0, cols +0), (+8, +0), (+0, +8), (+8, +8).
template <class Lay>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* X, int r0, int k0) {
  const int l = lane_of(), m = l / 8;
  ldsm_x4<false>(a, Lay::at(X, r0 + l % 8 + (m & 1) * 8, k0 + (m >> 1) * 8));
}

// B fragments (k0..k0+15) x (n0..n0+7) and x (n0+8..n0+15) of B = Y^T, Y (n, k) laid out by
// Lay: b = {b0, b1 of columns n0.., b0, b1 of columns n0+8..}; matrices (n +0, k +0),
// (+0, +8), (+8, +0), (+8, +8).
template <class Lay>
__device__ __forceinline__ void load_b_nk2(uint32_t (&b)[4], const bf16* Y, int n0, int k0) {
  const int l = lane_of(), m = l / 8;
  ldsm_x4<false>(b, Lay::at(Y, n0 + l % 8 + (m >> 1) * 8, k0 + (m & 1) * 8));
}

// The same two B fragments of B = Y, Y (k, n) laid out by Lay: the transposes of the
// matrices (k +0, n +0), (+8, +0), (+0, +8), (+8, +8).
template <class Lay>
__device__ __forceinline__ void load_b_kn2(uint32_t (&b)[4], const bf16* Y, int k0, int n0) {
  const int l = lane_of(), m = l / 8;
  ldsm_x4<true>(b, Lay::at(Y, k0 + l % 8 + (m & 1) * 8, n0 + (m >> 1) * 8));
}

// The A fragment of rows r0..r0+15, columns k0..k0+15 of A = X^T, X (k, m) laid out by Lay: the
// transposes of the matrices (k +0, m +0), (+0, +8), (+8, +0), (+8, +8).
template <class Lay>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const bf16* X, int r0, int k0) {
  const int l = lane_of(), m = l / 8;
  ldsm_x4<true>(a, Lay::at(X, k0 + l % 8 + (m >> 1) * 8, r0 + (m & 1) * 8));
}

// The A fragment of k step kk (columns 16kk..16kk+15) from the C fragments of a (16, 8 NT) tile.
template <int NT>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c)[NT][4], int kk) {
  a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// s (16, 8 NT) += X[r0.., :DB] Y[0.., :DB]^T: rows of X against rows of Y (both laid out by Lay;
// NT even). `live` bit c off: the 16 columns 16c..16c+15 are skipped (their s entries are left as
// they are; the caller masks them). kSkip false: every column is computed (no branches between
// the loads and products, so the compiler can interleave them).
template <int DB, int NT, class Lay, bool kSkip>
__device__ __forceinline__ void warp_dot_cols(float (&s)[NT][4], const bf16* X, int r0, const bf16* Y, unsigned live) {
  static_assert(NT % 2 == 0, "warp_dot reads B fragments two 8-column tiles at a time");
#pragma unroll
  for (int ks = 0; ks < DB / 16; ++ks) {
    uint32_t a[4];
    load_a<Lay>(a, X, r0, ks * 16);
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      if (kSkip && !((live >> (nt / 2)) & 1u)) continue;
      uint32_t b[4];
      load_b_nk2<Lay>(b, Y, nt * 8, ks * 16);
      mma(s[nt], a, b[0], b[1]);
      mma(s[nt + 1], a, b[2], b[3]);
    }
  }
}
template <int DB, int NT, class Lay>
__device__ __forceinline__ void warp_dot(float (&s)[NT][4], const bf16* X, int r0, const bf16* Y,
                                         unsigned live = ~0u) {
  constexpr unsigned all = (1u << (NT / 2)) - 1;
  if ((live & all) == all) warp_dot_cols<DB, NT, Lay, false>(s, X, r0, Y, live);
  else warp_dot_cols<DB, NT, Lay, true>(s, X, r0, Y, live);
}
template <int DB, int NT, int S>
__device__ __forceinline__ void warp_dot(float (&s)[NT][4], const bf16* X, int r0, const bf16* Y,
                                         unsigned live = ~0u) {
  warp_dot<DB, NT, Padded<S>>(s, X, r0, Y, live);
}

// acc (16, DB) += A Y[k0..k0+15, :DB]: one 16-wide k step, A in an A fragment, Y (k, n) laid out
// by Lay.
template <int DB, class Lay>
__device__ __forceinline__ void mma_row_kn(float (&acc)[DB / 8][4], const uint32_t (&a)[4], const bf16* Y, int k0) {
#pragma unroll
  for (int nt = 0; nt < DB / 8; nt += 2) {
    uint32_t b[4];
    load_b_kn2<Lay>(b, Y, k0, nt * 8);
    mma(acc[nt], a, b[0], b[1]);
    mma(acc[nt + 1], a, b[2], b[3]);
  }
}

// acc (16, DB) += P (16, 16 KT, in C fragments) Y[0..16 KT, :DB] (Y laid out by Lay). `live`
// bit kk off: P's columns 16kk..16kk+15 are zero and skipped.
template <int DB, int NT, class Lay, bool kSkip>
__device__ __forceinline__ void warp_accumulate_cols(float (&acc)[DB / 8][4], const float (&pc)[NT][4], const bf16* Y,
                                                     unsigned live) {
  static_assert(DB % 16 == 0, "warp_accumulate reads B fragments two 8-column tiles at a time");
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    if (kSkip && !((live >> kk) & 1u)) continue;
    uint32_t a[4];
    c_to_a<NT>(a, pc, kk);
    mma_row_kn<DB, Lay>(acc, a, Y, kk * 16);
  }
}
template <int DB, int NT, class Lay>
__device__ __forceinline__ void warp_accumulate(float (&acc)[DB / 8][4], const float (&pc)[NT][4], const bf16* Y,
                                                unsigned live = ~0u) {
  constexpr unsigned all = (1u << (NT / 2)) - 1;
  if ((live & all) == all) warp_accumulate_cols<DB, NT, Lay, false>(acc, pc, Y, live);
  else warp_accumulate_cols<DB, NT, Lay, true>(acc, pc, Y, live);
}
template <int DB, int NT, int S>
__device__ __forceinline__ void warp_accumulate(float (&acc)[DB / 8][4], const float (&pc)[NT][4], const bf16* Y,
                                                unsigned live = ~0u) {
  warp_accumulate<DB, NT, Padded<S>>(acc, pc, Y, live);
}

// acc (16, DB) += X[0..16 KT, r0..r0+15]^T Y[0..16 KT, :DB]: the A operand is columns r0.. of X
// (k, m), laid out by LayX and read transposed; Y (k, n) is laid out by LayY. (For a product whose
// A operand another warp computed, such as dQ = dS K from dS^T tiles written by the warps that own
// its keys.)
template <int DB, int KT, class LayX, class LayY>
__device__ __forceinline__ void warp_accumulate_tn(float (&acc)[DB / 8][4], const bf16* X, int r0, const bf16* Y) {
  static_assert(DB % 16 == 0, "warp_accumulate_tn reads B fragments two 8-column tiles at a time");
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    uint32_t a[4];
    load_a_trans<LayX>(a, X, r0, kk * 16);
    mma_row_kn<DB, LayY>(acc, a, Y, kk * 16);
  }
}

// Max and sum over the 4 lanes of a fragment row (lanes 4g..4g+3).
__device__ __forceinline__ float max4(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float sum4(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// One online-softmax step over a tile for the thread's two rows (r = 0, 1: fragment rows g, g+8):
// s holds the tile's scores, which times `scale` (> 0) are in log2 units (masked entries -inf),
// and mx the thread's per-row max of s. Updates the running max m (in log2 units) and sum l (the
// thread's partial sum, reduced over the row's 4 lanes at the end), rescales the accumulator o,
// and turns s into exp2(scale s - max), one FFMA and one MUFU an entry.
template <int NT, int DT>
__device__ __forceinline__ void online_softmax_step(float (&s)[NT][4], const float (&mx)[2], float (&m)[2],
                                                    float (&l)[2], float (&o)[DT][4], float scale = 1.f) {
  float m_use[2], alpha[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(m[r], max4(mx[r]) * scale);
    m_use[r] = m_new == -INFINITY ? 0.f : m_new;  // no visible key yet
    alpha[r] = fast_exp2(m[r] - m_use[r]);
    m[r] = m_new;
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = fast_exp2(fmaf(s[nt][e], scale, -m_use[e / 2]));
      l[e / 2] += s[nt][e];
    }
#pragma unroll
  for (int nt = 0; nt < DT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nt][e] *= alpha[e / 2];
}

// Writes the thread's two rows of a (16, DB) accumulator (fragment rows r0+g and r0+g+8, going
// to rows row[0] and row[1] of dst) times mul[r], columns < ncols, into dst (row stride
// `stride`); a row outside [0, nrows) is skipped.
template <int DB>
__device__ __forceinline__ void store_rows(bf16* dst, int64_t stride, const float (&acc)[DB / 8][4],
                                           const int (&row)[2], const float (&mul)[2], int nrows, int ncols, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] < 0 || row[r] >= nrows) continue;
    bf16* out = dst + (int64_t)row[r] * stride;
#pragma unroll
    for (int nt = 0; nt < DB / 8; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int d = nt * 8 + 2 * t + c;
        if (d < ncols) out[d] = __float2bfloat16(acc[nt][2 * r + c] * mul[r]);
      }
  }
}

// The same rows written through shared memory, so that global stores are whole 16-byte chunks
// (store_rows' 2-byte stores use a quarter of each 32-byte sector they touch). `stage` is the
// warp's own (16, DB) region of a shared tile laid out by Lay (no other warp may read or
// write it meanwhile; it is overwritten). Needs ncols % 8 == 0 and 16-byte aligned dst rows
// (stride % 8 == 0). All 32 lanes must call it.
template <int DB, class Lay>
__device__ __forceinline__ void store_rows_staged(bf16* stage, bf16* dst, int64_t stride,
                                                  const float (&acc)[DB / 8][4], const int (&row)[2],
                                                  const float (&mul)[2], int nrows, int ncols, int t) {
  constexpr int kChunks = DB / 8;  // 16-byte chunks in a row
  const int lane = lane_of(), g = lane / 4;
  __syncwarp();  // the warp's earlier reads of `stage` are done
#pragma unroll
  for (int nt = 0; nt < DB / 8; ++nt) {
    *reinterpret_cast<uint32_t*>(Lay::at(stage, g, nt * 8) + 2 * t) = pack_bf16(acc[nt][0] * mul[0], acc[nt][1] * mul[0]);
    *reinterpret_cast<uint32_t*>(Lay::at(stage, g + 8, nt * 8) + 2 * t) = pack_bf16(acc[nt][2] * mul[1], acc[nt][3] * mul[1]);
  }
  __syncwarp();
  // Lane l copies chunks l, l + 32, ...: 16 rows x kChunks, consecutive lanes along a row.
#pragma unroll
  for (int x = lane; x < 16 * kChunks; x += 32) {
    const int rr = x / kChunks, c = (x % kChunks) * 8;
    // Row rr's destination is row[rr / 8] of lanes 4 (rr % 8) .. 4 (rr % 8) + 3.
    const int r_lo = __shfl_sync(0xffffffffu, row[0], (rr % 8) * 4);
    const int r_hi = __shfl_sync(0xffffffffu, row[1], (rr % 8) * 4);
    const int r = rr < 8 ? r_lo : r_hi;
    if (r >= 0 && r < nrows && c < ncols)
      *reinterpret_cast<uint4*>(dst + (int64_t)r * stride + c) = *reinterpret_cast<const uint4*>(Lay::at(stage, rr, c));
  }
}
template <int DB, int S>
__device__ __forceinline__ void store_rows_staged(bf16* stage, bf16* dst, int64_t stride,
                                                  const float (&acc)[DB / 8][4], const int (&row)[2],
                                                  const float (&mul)[2], int nrows, int ncols, int t) {
  store_rows_staged<DB, Padded<S>>(stage, dst, stride, acc, row, mul, nrows, ncols, t);
}

}  // namespace hax::ops::cuda::mma

// Runs `body` with `constexpr int DB` = the smallest of 16, 32, 64, 128 that holds both head dims
// (the kernels pad D and Dv to DB with zeros).
#define HAX_DISPATCH_HEAD_DIM(dmax, ...) \
  do {                                          \
    if ((dmax) <= 16) {                         \
      constexpr int DB = 16;                    \
      __VA_ARGS__();                            \
    } else if ((dmax) <= 32) {                  \
      constexpr int DB = 32;                    \
      __VA_ARGS__();                            \
    } else if ((dmax) <= 64) {                  \
      constexpr int DB = 64;                    \
      __VA_ARGS__();                            \
    } else {                                    \
      constexpr int DB = 128;                   \
      __VA_ARGS__();                            \
    }                                           \
  } while (0)
