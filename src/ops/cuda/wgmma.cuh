// Warpgroup matrix products (wgmma.mma_async, sm_90) on tiles that TMA wrote with the 128-byte
// swizzle: rows of 64 bfloat16 (128 bytes), 1024-byte aligned tiles, both operands "K-major"
// (the reduction dimension contiguous in a row).
//
// A shared-memory matrix descriptor (64 bits): start address >> 4 in bits 0-13, leading byte
// offset >> 4 in bits 16-29 (unused for swizzled K-major operands), stride byte offset >> 4 in
// bits 32-45 (1024: the distance between groups of 8 rows), layout type in bits 62-63 (1: 128-byte
// swizzle). A k step of 16 entries (32 bytes) within a row advances the start address by 32 bytes;
// the hardware applies the swizzle from the address bits, hence the 1024-byte alignment.
//
// wgmma needs the sm_90a target (CMAKE_CUDA_ARCHITECTURES 90a): kHaveWgmma says whether this
// compilation has it; elsewhere the functions trap and callers take their mma.sync path.
//
// The accumulator of m64nNk16 (float32) gives warp w of the warpgroup rows 16w..16w+15 in the
// layout of mma.sync m16n8's C fragment, repeated over the N / 8 column tiles: d[j][0..3] holds
// (16w + g, 8j + 2t), (.., +1), (16w + g + 8, 8j + 2t), (.., +1) with g = lane / 4, t = lane % 4.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace hax::ops::cuda {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kHaveWgmma = true;
#define HAX_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#else
constexpr bool kHaveWgmma = false;
#define HAX_WGMMA_ASM(...) __trap()
#endif

__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* smem_tile) {
  const uint64_t addr = (uint64_t)(unsigned)__cvta_generic_to_shared(smem_tile);
  uint64_t d = 0;
  d |= (addr & 0x3FFFF) >> 4;          // start address
  d |= (uint64_t)1 << 16;              // leading byte offset (unused here)
  d |= (uint64_t)(1024 >> 4) << 32;    // stride byte offset: 8 rows of 128 bytes
  d |= (uint64_t)1 << 62;              // 128-byte swizzle
  return d;
}

// Makes this thread's generic-proxy writes to shared memory (plain stores, cp.async copies once
// waited for) visible to the async proxy that wgmma reads its operands through; before the
// barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async_shared() {
  HAX_WGMMA_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { HAX_WGMMA_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { HAX_WGMMA_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  HAX_WGMMA_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// d (64 x 64 float32, this thread's share) (+)= A (64 x 16) B (64 x 16)^T from descriptors;
// accumulate = false overwrites d. kTrans (both operands transposed): d (+)= X^T Y for swizzled
// tiles X (16 k rows by 64 m columns, read "M-major") and Y (16 k rows by 64 n columns, read
// "N-major"), with the same descriptors (see wgmma_m64n64k16_rs). kTransB alone (kTrans false):
// d (+)= A Y, A K-major as in the plain form and Y N-major (the SSD's C S_enter: C's rows of
// state entries times the state's rows of head-dim columns).
template <bool kTrans = false, bool kTransB = kTrans>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  HAX_WGMMA_ASM(
      "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(desc_a), "l"(desc_b), "r"((int)accumulate), "n"(kTrans ? 1 : 0), "n"(kTransB ? 1 : 0));
}

// The same with N = 32: d is 64 x 32.
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  HAX_WGMMA_ASM(
      "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(desc_a), "l"(desc_b), "r"((int)accumulate));
}

// The same with N = 128: d is 64 x 128.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  HAX_WGMMA_ASM(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
        "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(desc_a), "l"(desc_b), "r"((int)accumulate));
}

// d (64 x 8 NT) (+)= A (64 x 16) B (8 NT x 16)^T with A from registers (RS): each warp w of the
// warpgroup gives rows 16w..16w+15 of A as an mma.sync m16n8k16 A fragment (a[0]: row g, columns
// 2t, 2t+1; a[1]: row g + 8; a[2], a[3]: columns + 8; mma_bf16.cuh's c_to_a makes one from an
// accumulator), B from a descriptor as above. kTransB: B "N-major" instead, d (+)= A Y for a
// swizzled tile Y of 16 rows (k) by 64 columns (n) (a V-like operand, rows of 128 bytes): the
// same descriptor (the stride byte offset is then the distance between groups of 8 k rows, 1024
// bytes; the leading byte offset, the distance between 64-column blocks, is unused at N = 64).
template <bool kTransB = false>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b,
                                                   bool accumulate) {
  HAX_WGMMA_ASM(
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"((int)accumulate), "n"(kTransB ? 1 : 0));
}
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b,
                                                    bool accumulate) {
  HAX_WGMMA_ASM(
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
        "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"((int)accumulate));
}

template <int NT>
__device__ __forceinline__ void wgmma_k16(float (&d)[NT][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  static_assert(NT == 4 || NT == 8 || NT == 16, "wgmma_k16: N = 32, 64 or 128");
  if constexpr (NT == 16) wgmma_m64n128k16(d, desc_a, desc_b, accumulate);
  else if constexpr (NT == 8) wgmma_m64n64k16(d, desc_a, desc_b, accumulate);
  else wgmma_m64n32k16(d, desc_a, desc_b, accumulate);
}
template <int NT>
__device__ __forceinline__ void wgmma_k16_rs(float (&d)[NT][4], const uint32_t (&a)[4], uint64_t desc_b,
                                             bool accumulate) {
  static_assert(NT == 8 || NT == 16, "wgmma_k16_rs: N = 64 or 128");
  if constexpr (NT == 16) wgmma_m64n128k16_rs(d, a, desc_b, accumulate);
  else wgmma_m64n64k16_rs(d, a, desc_b, accumulate);
}

// s (64 x 8 NT) = X Y^T over k = 64 for a 64-row swizzled tile X and the 8 NT rows of a swizzled
// tile Y starting at Y (a multiple of 8 rows into it); with X2, Y2 also t = X2 Y2^T, both issued
// before either is waited for. Every warp of the warpgroup must call it.
template <int NT>
__device__ __forceinline__ void wgmma_dot(float (&s)[NT][4], const __nv_bfloat16* X, const __nv_bfloat16* Y) {
  const uint64_t da = wgmma_desc_sw128(X), db = wgmma_desc_sw128(Y);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) wgmma_k16<NT>(s, da + 2 * ks, db + 2 * ks, ks > 0);  // +32 bytes a step
  wgmma_commit();
  wgmma_wait<0>();
}
// Keeps the compiler from reading a wgmma's result before the wait: an empty asm that "modifies"
// each entry, placed after the wait. (Not between the issue and the wait: ptxas then takes it for
// an instruction defining the accumulator in flight, and serializes the products.)
template <int NT>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// s = X Y^T and t = X2 Y2^T as in wgmma_dot2, issued as one commit group and not waited for:
// the caller waits (wgmma_wait<N>) before it reads s or t.
template <int NT>
__device__ __forceinline__ void wgmma_issue2(float (&s)[NT][4], const __nv_bfloat16* X, const __nv_bfloat16* Y,
                                             float (&t)[NT][4], const __nv_bfloat16* X2, const __nv_bfloat16* Y2) {
  const uint64_t da = wgmma_desc_sw128(X), db = wgmma_desc_sw128(Y);
  const uint64_t da2 = wgmma_desc_sw128(X2), db2 = wgmma_desc_sw128(Y2);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) wgmma_k16<NT>(s, da + 2 * ks, db + 2 * ks, ks > 0);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) wgmma_k16<NT>(t, da2 + 2 * ks, db2 + 2 * ks, ks > 0);
  wgmma_commit();
}
template <int NT>
__device__ __forceinline__ void wgmma_dot2(float (&s)[NT][4], const __nv_bfloat16* X, const __nv_bfloat16* Y,
                                           float (&t)[NT][4], const __nv_bfloat16* X2, const __nv_bfloat16* Y2) {
  wgmma_issue2<NT>(s, X, Y, t, X2, Y2);
  wgmma_wait<0>();
}

// acc (64 x 64) += P Y issued as one commit group and not waited for (the caller waits, then
// fences acc, before it reads or rescales acc): P (64 x 16 KT) from registers, warp w's rows
// 16w..16w+15 as mma.sync accumulator fragments pc[0 .. 2 KT) (8 columns each, rounded to
// bfloat16 here), Y a swizzled tile of 16 KT rows by 64 columns (rows of 128 bytes, 1024-byte
// aligned), read N-major. The second product of attention on the warpgroup: O += P V, dQ += dS K,
// dV += P^T dO, dK += dS^T Q. Every warp of the warpgroup must call it (rows a warp does not
// use give zeros in pc).
template <int KT>
__device__ __forceinline__ void wgmma_accumulate_rs(float (&acc)[8][4], const float (&pc)[2 * KT][4],
                                                    const __nv_bfloat16* Y) {
  uint32_t a[KT][4];
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(pc[2 * kk + h][0], pc[2 * kk + h][1]);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(pc[2 * kk + h][2], pc[2 * kk + h][3]);
      a[kk][2 * h] = *reinterpret_cast<const uint32_t*>(&lo);
      a[kk][2 * h + 1] = *reinterpret_cast<const uint32_t*>(&hi);
    }
  }
  const uint64_t db = wgmma_desc_sw128(Y);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) wgmma_m64n64k16_rs<true>(acc, a[kk], db + kk * (2048 >> 4), true);  // 16 rows a step
  wgmma_commit();
}

// acc (64 x 64) += X^T Y issued as one commit group and not waited for: X and Y swizzled tiles
// of 16 KT rows (the reduction) by 64 columns, rows of 128 bytes, 1024-byte aligned. (dQ += dS K
// from a tile of dS^T, keys as rows, written by the warps that own the keys.)
template <int KT>
__device__ __forceinline__ void wgmma_accumulate_tn(float (&acc)[8][4], const __nv_bfloat16* X, const __nv_bfloat16* Y) {
  const uint64_t da = wgmma_desc_sw128(X), db = wgmma_desc_sw128(Y);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) wgmma_m64n64k16<true>(acc, da + kk * (2048 >> 4), db + kk * (2048 >> 4), true);
  wgmma_commit();
}

}  // namespace hax::ops::cuda

#undef HAX_WGMMA_ASM
