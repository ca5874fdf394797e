// The sparse attention tile path on tensor cores (bfloat16; params.h has when it applies): one
// CTA of 4 warps per (b, h, block of 64 queries in q_order) walks the block's key union from the
// plan (tile_plan.cu) in tiles of 64 keys, gathered row by row into shared memory, and runs the
// flash-style tile products of ops/cuda/mma_bf16.cuh on them. A (query, key) pair of a tile
// counts only if its plan bit is set; every other pair is masked. Scores:
//   s_ij = q_i·k_j · scale + bias_j   (log2 units inside: s·log2e),
// and with P_ij = exp(s_ij - lse_i), Δ_i = dO_i·O_i - dlse_i (computed per block from the
// forward's output), dS_ij = P_ij (dO_i·v_j - Δ_i):
// forward   O_i = Σ_j P_ij v_j, lse_i (online softmax over the tiles; an empty list gives
//           O_i = 0, lse_i = -inf),
// backward  one kernel: per tile, with the tile's keys as rows, dv_j += Σ_i P_ij dO_i, dk_j +=
//           scale Σ_i dS_ij q_i, dbias_j += Σ_i dS_ij, added to float32 accumulators with atomics
//           (a key appears in the unions of several blocks; with a plan's key_uses, a key of one
//           block is stored and a key of two added to bfloat16 rows instead, params.h);
//           dq_i = scale Σ_j dS_ij k_j from the tile's dS through shared memory, in registers over
//           the tiles (one writer per query).
// P and dS enter the second product of each step rounded to bfloat16, as in FlashAttention-2
// and the causal attention kernel; everything else is float32. At head dim 64 with 16-byte rows
// the tiles sit in the 128-byte swizzle, 1024-byte aligned, and on sm_90a builds every product
// runs on wgmma (WgForm below; p.wgmma_products off keeps mma.sync). BENCHMARKS.md,
// twenty-seventh pass: HAX at 64K, tile forward 457 -> 406 us, backward 1352 -> 1334.
#include "ops/attention/params.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/mma_bf16.cuh"
#include "ops/cuda/smem_align.cuh"
#include "ops/cuda/wgmma.cuh"

#include <stdexcept>
#include <type_traits>

namespace hax::ops {
namespace {

using namespace ::hax::ops::cuda::mma;
using cuda::to_f32;

constexpr int kThreads = 128;  // 4 warps of 16 rows
constexpr int kQ = (int)kAttentionTileQueries;
constexpr int kTK = (int)kAttentionTileKeys;
constexpr int kU = (int)kAttentionTileMaxKeys;
constexpr int kTiles = (int)kAttentionTilesPerBlock;
constexpr int NT = kTK / 8;  // 8-column mma tiles across a key (or query) tile
constexpr size_t kStaticSmem = 4096;  // a bound on the kernels' static shared memory (BlockShared and
                                      // the per-query arrays, under 3 KB), for cuda::allow_smem
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Sizes as ints (the launcher checks they fit) and flags of the launch.
struct Sizes {
  int L = 0, Lk = 0, H = 0, D = 0, Dv = 0;
  int64_t nblk = 0;      // query blocks per (b, h)
  float scale = 1.f;     // score scale
  float scale2 = 1.f;    // scale · log2e
  bool vec_qk = false;   // q, k rows can be copied 16 bytes at a time
  bool vec_v = false;    // v, dout rows too
  bool quads_k = false;  // the backward adds dK rows 4 entries at a time (quad_rows)
  bool quads_v = false;  // and dV rows
};

// Copies rows pos[r] (r < nrows; pos < 0 gives zeros) of a (positions, stride) bfloat16 array,
// columns < nvalid, into the shared (nrows, S) tile, zero-filled up to ncols.
template <int S>
__device__ __forceinline__ void gather_rows(bf16* dst, const bf16* src, int64_t stride, const int32_t* pos,
                                            int nrows, int nvalid, int ncols, bool vec) {
  if (vec) {
    // kBatch chunks a thread loaded before any is stored (shared stores through a generic pointer
    // would otherwise keep the compiler from hoisting the next load above them).
    constexpr int kBatch = 4;
    const int chunks = ncols / 8, total = nrows * chunks;
    for (int x0 = threadIdx.x; x0 < total; x0 += kBatch * kThreads) {
      uint4 val[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int x = x0 + u * kThreads, r = x / chunks, c = (x % chunks) * 8;
        const int i = x < total ? pos[r] : -1;
        val[u] = i >= 0 && c < nvalid ? *reinterpret_cast<const uint4*>(src + (int64_t)i * stride + c)
                                      : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int x = x0 + u * kThreads, r = x / chunks, c = (x % chunks) * 8;
        if (x < total) *reinterpret_cast<uint4*>(dst + r * S + c) = val[u];
      }
    }
  } else {
    const bf16 zero = __float2bfloat16(0.f);
    for (int x = threadIdx.x; x < nrows * ncols; x += kThreads) {
      const int r = x / ncols, c = x % ncols, i = pos[r];
      dst[r * S + c] = (i >= 0 && c < nvalid) ? src[(int64_t)i * stride + c] : zero;
    }
  }
}

// The positions of the block's queries (-1 past L), in q_order.
__device__ __forceinline__ void block_queries(int32_t* rows, const AttentionParams& p, const Sizes& z, int64_t bh,
                                              int64_t blk) {
  for (int r = threadIdx.x; r < kQ; r += kThreads) {
    const int64_t rank = blk * kQ + r;
    const int32_t i = rank < z.L ? (p.q_order ? p.q_order[bh * z.L + rank] : (int32_t)rank) : -1;
    rows[r] = i >= 0 && i < z.L ? i : -1;  // (an out-of-range q_order entry, unchecked input: no row)
  }
}

// How add_row adds a key's sums: to its float32 row with atomics; to its bfloat16 row with
// atomics; or stored into its bfloat16 row (the key's only block). AttentionGradParams::key_uses.
enum RowSum : int { kSumF32 = 0, kSumBf16 = 1, kStoreBf16 = 2 };

// acc[nt][2r..2r+1] (columns nt*8 + 2t, +1 of the thread's row r) times mul, into the float32 row
// f32 or the bfloat16 row b16 as `how` says (the bfloat16 forms round each sum once), two entries
// at a time where ncols is even. One loop for all forms, so that the unrolled stores exist once
// (two unrolled copies kept both rows' addresses live: ptxas spilled 1.4 KB a thread).
// quads (after quad_rows): 4 entries at a time, one 16-byte float32 reduction, one 8-byte
// bfloat16 reduction or store where there were two.
template <int DB>
__device__ __forceinline__ void add_row(float* f32, bf16* b16, int how, const float (&acc)[DB / 8][4], int r,
                                        float mul, int ncols, int t, bool pairs, bool quads) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (quads) {  // ncols % 4 == 0, rows 16-byte (float32) and 8-byte (bfloat16) aligned
    // Without branches on `how`: a warp's 16 rows mix the three forms, and with a branch per form
    // the warp ran each taken form in turn (H100 ncu, pass 36: 16% of the backward's instructions
    // were add_row's, with its BSSY/BSYNC pairs). Each access is predicated instead, its address a
    // constant offset from the thread's first column.
    const int c0 = 8 * (t & 1) + 2 * (t & ~1);  // the thread's 4 columns of each 16: c0 .. c0 + 3
    float* f = f32 + c0;
    bf16* w = b16 + c0;
#pragma unroll
    for (int m = 0; m < DB / 16; ++m) {
      const int form = 16 * m + c0 < ncols ? how : -1;  // -1: columns past the row, nothing to add
      const float x0 = acc[2 * m][2 * r] * mul, x1 = acc[2 * m][2 * r + 1] * mul;
      const float x2 = acc[2 * m + 1][2 * r] * mul, x3 = acc[2 * m + 1][2 * r + 1] * mul;
      const __nv_bfloat162 lo = __floats2bfloat162_rn(x0, x1), hi = __floats2bfloat162_rn(x2, x3);
      const uint32_t a = *reinterpret_cast<const uint32_t*>(&lo), b = *reinterpret_cast<const uint32_t*>(&hi);
      static_assert(kSumF32 == 0 && kSumBf16 == 1 && kStoreBf16 == 2, "the predicates below");
      asm volatile(
          "{\n .reg .pred pf, ps, pw;\n"
          " setp.eq.s32 pf, %8, 0;\n"
          " setp.eq.s32 ps, %8, 1;\n"
          " setp.eq.s32 pw, %8, 2;\n"
          " @pf red.global.add.v4.f32 [%0], {%2, %3, %4, %5};\n"
          " @ps red.global.add.noftz.v2.bf16x2 [%1], {%6, %7};\n"
          " @pw st.global.v2.b32 [%1], {%6, %7};\n}"
          ::"l"(f + 16 * m), "l"(w + 16 * m), "f"(x0), "f"(x1), "f"(x2), "f"(x3), "r"(a), "r"(b), "r"(form)
          : "memory");
    }
    return;
  }
  if (pairs) {  // ncols even: reductions (without a returned value) or stores of two entries
    const uint64_t base = how ? reinterpret_cast<uint64_t>(b16 + 2 * t) : reinterpret_cast<uint64_t>(f32 + 2 * t);
    const int step = how ? 16 : 32;  // bytes of 8 entries
#pragma unroll
    for (int nt = 0; nt < DB / 8; ++nt) {
      if (nt * 8 + 2 * t >= ncols) continue;
      const float a = acc[nt][2 * r] * mul, b = acc[nt][2 * r + 1] * mul;
      const uint64_t at = base + (uint64_t)(nt * step);
      if (how == kSumF32) {
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(at), "f"(a), "f"(b) : "memory");
      } else {
        const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
        const uint32_t w = *reinterpret_cast<const uint32_t*>(&v);
        if (how == kSumBf16)
          asm volatile("red.global.add.noftz.bf16x2 [%0], %1;" ::"l"(at), "r"(w) : "memory");
        else
          asm volatile("st.global.b32 [%0], %1;" ::"l"(at), "r"(w) : "memory");
      }
    }
    return;
  }
#endif
#pragma unroll
  for (int nt = 0; nt < DB / 8; ++nt) {
    const int d = nt * 8 + 2 * t;
    if (d >= ncols) continue;
    const float a = acc[nt][2 * r] * mul, b = acc[nt][2 * r + 1] * mul;
    const bool second = d + 1 < ncols;
    if (how == kSumF32) {
      atomicAdd(f32 + d, a);
      if (second) atomicAdd(f32 + d + 1, b);
    } else if (how == kSumBf16) {
      atomicAdd(b16 + d, __float2bfloat16_rn(a));
      if (second) atomicAdd(b16 + d + 1, __float2bfloat16_rn(b));
    } else {
      b16[d] = __float2bfloat16_rn(a);
      if (second) b16[d + 1] = __float2bfloat16_rn(b);
    }
  }
}

// Rearranges a warp's (16 rows, DB columns) fragment acc so that each thread holds 4 consecutive
// columns of each 16 where it held 2 of each 8: threads t and t ^ 1 (of a row's quad) swap the
// pairs of columns 16m + 8 + 2t (even t) and 16m + 2(t - 1) (odd t). Then entries
// (acc[2m][2r], acc[2m][2r + 1], acc[2m + 1][2r], acc[2m + 1][2r + 1]) are columns
// 16m + 8 (t & 1) + 2 (t & ~1) .. + 3 of row r. Every lane of the warp takes part.
template <int DB>
__device__ __forceinline__ void quad_rows(float (&acc)[DB / 8][4], int t) {
  static_assert(DB % 16 == 0, "pairs of 8-column groups");
  const bool odd = t & 1;
#pragma unroll
  for (int m = 0; m < DB / 16; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float got = __shfl_xor_sync(0xffffffffu, odd ? acc[2 * m][e] : acc[2 * m + 1][e], 1);
      if (odd)
        acc[2 * m][e] = got;
      else
        acc[2 * m + 1][e] = got;
    }
}

// Δ_i = dO_i·O_i - dlse_i of the block's queries into dl[0..kQ) (0 for rows without a query), two
// threads per row, each over half of the head dim (16-byte loads where Dv % 16 == 0 and the rows
// are aligned, all of a thread's loads issued before its sums); O is the forward's output
// (gp.fwd.out). A warp per row, 16 rows one after another, was the longest part of a block with one
// or two key tiles: each row waited for its loads and a warp reduction.
__device__ __forceinline__ void block_delta(float* dl, const AttentionGradParams& gp, const Sizes& z,
                                            const int32_t* rows, int64_t b, int64_t h, int64_t bh) {
  static_assert(kThreads == 2 * kQ, "two threads per row");
  const int64_t sv = (int64_t)z.H * z.Dv, off = ((int64_t)b * z.L * z.H + h) * z.Dv;
  const bf16* dout = (const bf16*)gp.dout + off;
  const bf16* out = (const bf16*)gp.fwd.out + off;
  const int r = threadIdx.x / 2, half = threadIdx.x % 2, i = rows[r];
  float acc = 0.f;
  if (i >= 0) {
    const bf16* g = dout + i * sv;
    const bf16* o = out + i * sv;
    if (z.vec_v && z.Dv % 16 == 0 && cuda::aligned16(gp.fwd.out)) {
      constexpr int kBatch = 4;  // 16-byte chunks loaded at once (a half row at Dv = 128 is 4)
      const int n = z.Dv / 16;     // chunks of a half row
      for (int u0 = 0; u0 < n; u0 += kBatch) {
        uint4 a[kBatch], c[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          if (u0 + u < n) {
            a[u] = __ldg(reinterpret_cast<const uint4*>(g) + half * n + u0 + u);
            c[u] = __ldg(reinterpret_cast<const uint4*>(o) + half * n + u0 + u);
          }
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          if (u0 + u < n) {
            const bf16* x = reinterpret_cast<const bf16*>(&a[u]);
            const bf16* y = reinterpret_cast<const bf16*>(&c[u]);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc += to_f32(x[e]) * to_f32(y[e]);
          }
      }
    } else {
      for (int d = half; d < z.Dv; d += 2) acc += to_f32(g[d]) * to_f32(o[d]);
    }
  }
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  if (half == 0) dl[r] = i >= 0 ? acc - (gp.dlse ? ((const float*)gp.dlse)[bh * z.L + i] : 0.f) : 0.f;
}

// A block without key tiles completes its asynchronous q (and dout) copies before its epilogue
// (which writes through sQ); ntiles is the same in the whole block.
template <bool kAsync>
__device__ __forceinline__ void wait_block_q_do(int ntiles) {
  if constexpr (kAsync) {
    if (ntiles == 0) {
      cuda::cp_async_wait<0>();
      __syncthreads();
    }
  }
}

template <int DB, bool kAsync>
struct Cfg {
  // Head dim 64 on the cp.async path: tiles of 128-byte rows in the 128-byte swizzle (no padding:
  // the backward's 48 KB of tiles, where the padded 55 KB left room for 3 blocks an SM, fit 4).
  // Otherwise rows padded by 8 entries.
  static constexpr bool kSwizzle = kAsync && DB == 64;
  static constexpr int S = kSwizzle ? DB : DB + 8;  // shared row stride (bfloat16 entries)
  using Lay = std::conditional_t<kSwizzle, Swizzle128, Padded<S>>;
  static constexpr int DT = DB / 8;
  static constexpr int NB = kAsync ? 2 : 1;  // key-tile buffers
  // Swizzled tiles start 1024-byte aligned (wgmma applies the swizzle from the address bits):
  // room to align the dynamic shared memory's start.
  static constexpr size_t kSlack = kSwizzle ? 1024 : 0;
  static constexpr size_t fwd_smem = kSlack + sizeof(bf16) * (kQ + 2 * NB * kTK) * S;  // sQ, sK[NB], sV[NB]
  static constexpr size_t bwd_smem =  // sQ, sdO, sK[NB], sV[NB], then sdS (kTK x kQ, Swizzle128)
      kSlack + sizeof(bf16) * ((2 * kQ + 2 * NB * kTK) * S + kTK * kQ);
  // The first tile in the dynamic shared memory (cuda::align_up: still known as shared memory).
  static __device__ __forceinline__ bf16* tiles(uint4* smem) {
    if constexpr (!kSwizzle) return reinterpret_cast<bf16*>(smem);
    return cuda::align_up<bf16>(smem, 0, 1024);
  }
};

// Which tile products run on wgmma (kWgmma: 0 none, on mma.sync; 1 the products of two shared
// tiles, S = Q K^T in the forward, S^T = K Q^T and dP^T = V dO^T in the backward; 2 all of them,
// also those with P or dS^T from registers (O += P V, dV = P^T dO, dK = dS^T Q:
// wgmma_accumulate_rs) or from the shared dS^T tile (dQ += dS K: wgmma_accumulate_tn)). wgmma
// reads the swizzled tiles from shared memory (sm_90a builds; ops/cuda/wgmma.cuh); all four warps
// take part in each product.
template <int DB, bool kAsync, int kWgmma>
struct WgForm {
  static constexpr bool kFirst = kWgmma >= 1 && Cfg<DB, kAsync>::kSwizzle && cuda::kHaveWgmma;
  static constexpr bool kAll = kWgmma == 2 && kFirst;
};

// Per-CTA shared state of a block: query positions; per buffer, the tile's keys, their biases in
// log2 units and (dk/dv kernel) the block's mask words of the tile.
struct BlockShared {
  int32_t rows[kQ];
  int32_t keys[2][kTK];
  float bias2[2][kTK];
  unsigned long long mask[2][kQ];
};
static_assert(sizeof(BlockShared) + 2 * kQ * sizeof(float) <= kStaticSmem, "kStaticSmem must bound the static shared memory");

// The block's key tiles one after the other, in shared memory. kAsync (16-byte rows): the next
// tile's rows are copied with cp.async into the other buffer while the current one is computed
// on; otherwise each tile is loaded, then computed on. Use:
//   ts.start(); for (tt...) { const int b = ts.begin(tt); ...K(b), V(b), bs.keys[b]...; ts.end(); }
template <int DB, bool kAsync, int kWgmma = 0>
struct TileStream {
  static constexpr int S = Cfg<DB, kAsync>::S;
  using Lay = typename Cfg<DB, kAsync>::Lay;
  bf16* sK;                  // (NB, kTK, S)
  bf16* sV;                  // (NB, kTK, S)
  BlockShared& bs;
  const int32_t* keys;       // the block's union (kU), -1 padded
  const unsigned long long* mask;  // the block's mask words (kTiles, kQ)
  const bf16* k;             // (Lk, sqk) rows of this (b, h)
  const bf16* v;             // (Lk, sv)
  const bf16* bias;          // (Lk) or null
  int64_t sqk, sv;
  int D, Dv, ntiles;
  bool vec_qk, vec_v, with_mask;

  __device__ bf16* K(int b) const { return sK + b * kTK * S; }
  __device__ bf16* V(int b) const { return sV + b * kTK * S; }

  // kAsync: the positions of this thread's rows of the next tile to stage, loaded one stage ahead
  // (a tile's copies need them in registers; loaded one stage ahead, their latency is spent while
  // the current tile is computed on).
  using Copy = cuda::TileCopy<kTK, DB, kThreads>;
  int32_t next_pos[Copy::kPer] = {};

  // Tile tt's keys, biases and mask words into buffer b, and its rows. kAsync: keys, mask words
  // and rows are copied asynchronously (issued and committed here); biases (if any) are plain loads.
  __device__ void stage(int tt, int b) {
    if constexpr (kAsync) {
      const int32_t* kt = keys + tt * kTK;
      int32_t pos[Copy::kPer];
#pragma unroll
      for (int e = 0; e < Copy::kPer; ++e) pos[e] = tt == 0 ? kt[Copy::row(e)] : next_pos[e];
      if (tt + 1 < ntiles)
#pragma unroll
        for (int e = 0; e < Copy::kPer; ++e) next_pos[e] = kt[kTK + Copy::row(e)];
      for (int c = threadIdx.x; c < kTK; c += kThreads) cuda::cp_async4(&bs.keys[b][c], kt + c, true);
      if (with_mask)
        for (int c = threadIdx.x; c < kQ; c += kThreads) cuda::cp_async8(&bs.mask[b][c], mask + tt * kQ + c, true);
      Copy::template gather_to<Lay>(K(b), k, sqk, pos, D);
      Copy::template gather_to<Lay>(V(b), v, sv, pos, Dv);
      for (int c = threadIdx.x; c < kTK; c += kThreads) {
        const int32_t j = bias ? kt[c] : -1;
        bs.bias2[b][c] = j >= 0 ? to_f32(bias[j]) * kLog2e : 0.f;
      }
      cuda::cp_async_commit();
    } else {
      for (int c = threadIdx.x; c < kTK; c += kThreads) {
        const int32_t j = keys[tt * kTK + c];
        bs.keys[b][c] = j;
        bs.bias2[b][c] = bias && j >= 0 ? to_f32(bias[j]) * kLog2e : 0.f;
      }
      if (with_mask)
        for (int c = threadIdx.x; c < kQ; c += kThreads) bs.mask[b][c] = mask[tt * kQ + c];
    }
  }
  __device__ void start() {
    if constexpr (kAsync) stage(0, 0);
  }
  // Makes tile tt ready in shared memory for every thread; returns its buffer.
  __device__ int begin(int tt) {
    if constexpr (kAsync) {
      // Tile tt has landed (this thread's copies: the wait; everyone's: the barrier), and every
      // warp is done with tile tt - 1, so its buffer takes tile tt + 1: one barrier a tile.
      const int b = tt & 1;
      cuda::cp_async_wait<0>();
      if constexpr (WgForm<DB, kAsync, kWgmma>::kFirst) cuda::fence_proxy_async_shared();  // wgmma reads the tiles
      __syncthreads();
      if (tt + 1 < ntiles) stage(tt + 1, b ^ 1);
      return b;
    } else {
      __syncthreads();  // the previous tile is read
      stage(tt, 0);
      __syncthreads();
      gather_rows<S>(K(0), k, sqk, bs.keys[0], kTK, D, DB, vec_qk);
      gather_rows<S>(V(0), v, sv, bs.keys[0], kTK, Dv, DB, vec_v);
      __syncthreads();
      return 0;
    }
  }
  __device__ void end() {}  // (the next begin()'s barrier protects the buffer it refills)
};

template <int DB, bool kAsync, int kWgmma>
__global__ void __launch_bounds__(kThreads, DB <= 64 ? 4 : 1) tile_forward_kernel(AttentionParams p, AttentionTilePlan plan, Sizes z) {
  using C = Cfg<DB, kAsync>;
  using W = WgForm<DB, kAsync, kWgmma>;
  using Lay = typename C::Lay;
  constexpr int S = C::S, DT = C::DT;
  const int count = plan.count[blockIdx.x];
  if (count < 0) return;  // the per-query kernels take this block
  extern __shared__ uint4 smem_u4[];
  bf16* sQ = C::tiles(smem_u4);
  bf16* sK = sQ + kQ * S;
  bf16* sV = sK + C::NB * kTK * S;
  __shared__ BlockShared bs;
  const int64_t bh = blockIdx.x / z.nblk, blk = blockIdx.x % z.nblk, b = bh / z.H, h = bh % z.H;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = threadIdx.x / 32 * 16;
  const int64_t sqk = (int64_t)z.H * z.D, sv = (int64_t)z.H * z.Dv;
  const bf16* q = (const bf16*)p.q + ((int64_t)b * z.L * z.H + h) * z.D;
  const bf16* k = (const bf16*)p.k + ((int64_t)b * z.Lk * z.H + h) * z.D;
  const bf16* v = (const bf16*)p.v + ((int64_t)b * z.Lk * z.H + h) * z.Dv;
  const unsigned long long* mask =
      reinterpret_cast<const unsigned long long*>(plan.mask) + (int64_t)blockIdx.x * kTiles * kQ;

  // The first key tile's copies go out first (they need neither the query rows nor sQ), so that
  // their key-list loads and the query-row loads below wait together (H100, L = 64K, HAX k = 64,
  // ncu: 459-465 -> 449 us a call, 2026-11-24; ptxas no longer spills the hot variant's 12 bytes).
  const int ntiles = (count + kTK - 1) / kTK;
  TileStream<DB, kAsync, kWgmma> ts{sK, sV, bs, plan.keys + (int64_t)blockIdx.x * kU, mask, k, v,
                           p.bias ? (const bf16*)p.bias + bh * z.Lk : nullptr, sqk, sv, z.D, z.Dv, ntiles,
                           z.vec_qk, z.vec_v, false};
  ts.start();
  block_queries(bs.rows, p, z, bh, blk);
  __syncthreads();
  if constexpr (kAsync) {  // completed with the first key tile (as load_block_q_do)
    using Copy = cuda::TileCopy<kQ, DB, kThreads>;
    int32_t pos[Copy::kPer];
#pragma unroll
    for (int e = 0; e < Copy::kPer; ++e) pos[e] = bs.rows[Copy::row(e)];
    Copy::template gather_to<Lay>(sQ, q, sqk, pos, z.D);
    cuda::cp_async_commit();
  } else {
    gather_rows<S>(sQ, q, sqk, bs.rows, kQ, z.D, DB, z.vec_qk);
  }
  const int rr[2] = {r0 + g, r0 + g + 8};  // the thread's two rows of the block

  float o[DT][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  wait_block_q_do<kAsync>(ntiles);
  for (int tt = 0; tt < ntiles; ++tt) {
    const unsigned long long bits[2] = {mask[tt * kQ + rr[0]], mask[tt * kQ + rr[1]]};
    const int buf = ts.begin(tt);
    const float* bias2 = bs.bias2[buf];
    float s[NT][4] = {};
    if constexpr (W::kFirst) cuda::wgmma_dot<NT>(s, sQ, ts.K(buf));
    else warp_dot<DB, NT, Lay>(s, sQ, r0, ts.K(buf));
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2, c = nt * 8 + 2 * t + e % 2;
        s[nt][e] = (bits[r] >> c) & 1ull ? s[nt][e] * z.scale2 + bias2[c] : -INFINITY;
        mx[r] = fmaxf(mx[r], s[nt][e]);
      }
    online_softmax_step<NT, DT>(s, mx, m, l, o);  // a query with no listed key yet keeps m = -inf
    if constexpr (W::kAll) {
      if constexpr (DB == 64) cuda::wgmma_accumulate_rs<kTK / 16>(o, s, ts.V(buf));
      cuda::wgmma_wait<0>();  // (before the next tile's barrier lets its buffer be refilled)
      cuda::wgmma_fence_operands(o);
    } else {
      warp_accumulate<DB, NT, Lay>(o, s, ts.V(buf));
    }
    ts.end();
  }

  float inv[2];
  int row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = sum4(l[r]);
    inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;  // an empty list outputs 0
    row[r] = bs.rows[rr[r]];
  }
  bf16* out = (bf16*)p.out + ((int64_t)b * z.L * z.H + h) * z.Dv;
  // 16-byte stores through the warp's own rows of sQ (only this warp reads them).
  if (kAsync && z.vec_v && cuda::aligned16(p.out)) store_rows_staged<DB, Lay>(sQ + r0 * S, out, sv, o, row, inv, z.L, z.Dv, t);
  else store_rows<DB>(out, sv, o, row, inv, z.L, z.Dv, t);
  float* lse = (float*)p.lse + bh * z.L;
#pragma unroll
  for (int r = 0; r < 2; ++r)
    if (t == 0 && row[r] >= 0) lse[row[r]] = l[r] > 0.f ? m[r] * kLn2 + logf(l[r]) : -INFINITY;
}

// Both backward kernels' start: the block's query rows into bs.rows, their q and dout rows into
// sQ and sdO (kQ rows each). kAsync: by cp.async, one committed group that the first tile's wait
// (TileStream::begin) completes, so the copies overlap Δ and the first key tile's; a block
// without tiles waits for it itself (wait_block_q_do).
template <int S, int DB, bool kAsync>
__device__ __forceinline__ void load_block_q_do(bf16* sQ, bf16* sdO, BlockShared& bs, const AttentionGradParams& gp,
                                                const Sizes& z, int64_t bh, int64_t blk) {
  const int64_t b = bh / z.H, h = bh % z.H;
  block_queries(bs.rows, gp.fwd, z, bh, blk);
  __syncthreads();
  const bf16* q = (const bf16*)gp.fwd.q + (b * z.L * z.H + h) * z.D;
  const bf16* dout = (const bf16*)gp.dout + (b * z.L * z.H + h) * z.Dv;
  if constexpr (kAsync) {
    using Copy = cuda::TileCopy<kQ, DB, kThreads>;
    int32_t pos[Copy::kPer];
#pragma unroll
    for (int e = 0; e < Copy::kPer; ++e) pos[e] = bs.rows[Copy::row(e)];
    using Lay = typename Cfg<DB, kAsync>::Lay;
    Copy::template gather_to<Lay>(sQ, q, (int64_t)z.H * z.D, pos, z.D);
    Copy::template gather_to<Lay>(sdO, dout, (int64_t)z.H * z.Dv, pos, z.Dv);
    cuda::cp_async_commit();
  } else {
    gather_rows<S>(sQ, q, (int64_t)z.H * z.D, bs.rows, kQ, z.D, DB, z.vec_qk);
    gather_rows<S>(sdO, dout, (int64_t)z.H * z.Dv, bs.rows, kQ, z.Dv, DB, z.vec_v);
  }
}


// What both backward tile kernels set up for their block: the shared-memory tiles (sQ, sdO, then
// the key tiles sK, sV), the block's place, the thread's place in its warp's fragments, the rows
// of k and v of its (b, h) and its mask words; load() brings in its queries' q and dout rows.
template <int DB, bool kAsync>
struct GradBlock {
  using C = Cfg<DB, kAsync>;
  static constexpr int S = C::S;
  bf16 *sQ, *sdO, *sK, *sV;
  int64_t bh, blk, b, h, sqk, sv, off_k, off_v;
  int g, t, r0;
  const bf16 *k, *v;
  const unsigned long long* mask;

  __device__ GradBlock(uint4* smem, const AttentionGradParams& gp, const AttentionTilePlan& plan, const Sizes& z) {
    sQ = C::tiles(smem);
    sdO = sQ + kQ * S;
    sK = sdO + kQ * S;
    sV = sK + C::NB * kTK * S;
    bh = blockIdx.x / z.nblk, blk = blockIdx.x % z.nblk, b = bh / z.H, h = bh % z.H;
    const int lane = threadIdx.x % 32;
    g = lane / 4, t = lane % 4, r0 = threadIdx.x / 32 * 16;
    sqk = (int64_t)z.H * z.D, sv = (int64_t)z.H * z.Dv;
    off_k = (b * z.Lk * z.H + h) * z.D, off_v = (b * z.Lk * z.H + h) * z.Dv;
    k = (const bf16*)gp.fwd.k + off_k;
    v = (const bf16*)gp.fwd.v + off_v;
    mask = reinterpret_cast<const unsigned long long*>(plan.mask) + (int64_t)blockIdx.x * kTiles * kQ;
  }

  __device__ void load(BlockShared& bs, const AttentionGradParams& gp, const Sizes& z) {
    load_block_q_do<S, DB, kAsync>(sQ, sdO, bs, gp, z, bh, blk);
  }

  // The block's key tiles streamed into sK, sV (with the mask words when with_mask).
  template <int kWgmma>
  __device__ TileStream<DB, kAsync, kWgmma> stream(BlockShared& bs, const AttentionGradParams& gp, const AttentionTilePlan& plan,
                                          const Sizes& z, int ntiles, bool with_mask) const {
    return TileStream<DB, kAsync, kWgmma>{sK, sV, bs, plan.keys + (int64_t)blockIdx.x * kU, mask, k, v,
                                 gp.fwd.bias ? (const bf16*)gp.fwd.bias + bh * z.Lk : nullptr, sqk, sv, z.D, z.Dv,
                                 ntiles, z.vec_qk, z.vec_v, with_mask};
  }
};

// The backward of a block: per key tile, keys as rows and the block's queries as columns,
// S^T = K Q^T, dP^T = V dO^T, dS^T = P^T ∘ (dP^T - Δ), then dV = P^T dO, dK = dS^T Q and
// dbias = row sums of dS^T, added to the accumulators with atomics. Each warp writes its 16 rows
// of dS^T (bfloat16) into sdS, and after a barrier takes its 16 queries' dQ += dS K from there
// (the A operand read transposed): dQ stays in registers over the tiles, one writer per query.
// (A separate dQ kernel recomputed S and dP from a second gather of the same tiles: 574 us of
// HAX's 64K call, BENCHMARKS.md, fourteenth pass.)
template <int DB, bool kAsync, int kWgmma>
__global__ void __launch_bounds__(kThreads, DB <= 64 ? 3 : 1)
    tile_backward_kernel(AttentionGradParams gp, AttentionTilePlan plan, Sizes z) {
  using C = Cfg<DB, kAsync>;
  using W = WgForm<DB, kAsync, kWgmma>;
  constexpr int S = C::S, DT = C::DT;
  using Lay = typename C::Lay;
  const AttentionParams& p = gp.fwd;
  const int count = plan.count[blockIdx.x];
  if (count < 0) return;
  extern __shared__ uint4 smem_u4[];
  __shared__ BlockShared bs;
  __shared__ float sLse2[kQ], sDl[kQ];
  GradBlock<DB, kAsync> gb(smem_u4, gp, plan, z);
  static_assert(kQ == 64 && kTK % 16 == 0, "sdS rows are 64 queries (Swizzle128's 128 bytes)");
  bf16* sdS = gb.sV + C::NB * kTK * S;  // (kTK keys, kQ queries) dS^T of the tile, Swizzle128
  const int64_t bh = gb.bh, b = gb.b, h = gb.h, sqk = gb.sqk, sv = gb.sv;
  const int g = gb.g, t = gb.t, r0 = gb.r0;
  const bf16 *sQ = gb.sQ, *sdO = gb.sdO;
  float* dk_acc = (float*)gp.dk + gb.off_k;
  float* dv_acc = (float*)gp.dv + gb.off_v;
  float* db_acc = gp.dbias ? (float*)gp.dbias + bh * z.Lk : nullptr;
  const int64_t off_q = ((int64_t)b * z.L * z.H + h) * z.D;

  gb.load(bs, gp, z);
  // The first key tile's copies go out before lse and Δ are loaded, so that their latencies
  // overlap (after them, every block waited for Δ's row loads, then for the tile's key list, then
  // for the tile). (Before gb.load, as in the forward, ptxas spilled 8 bytes.)
  const int ntiles = (count + kTK - 1) / kTK;
  wait_block_q_do<kAsync>(ntiles);
  TileStream<DB, kAsync, kWgmma> ts = gb.template stream<kWgmma>(bs, gp, plan, z, ntiles, true);
  ts.start();
  for (int c = threadIdx.x; c < kQ; c += kThreads) {
    const int i = bs.rows[c];
    const float lse = i >= 0 ? ((const float*)p.lse)[bh * z.L + i] : -INFINITY;
    sLse2[c] = lse == -INFINITY ? 0.f : lse * kLog2e;  // an empty list has no set bit
  }
  block_delta(sDl, gp, z, bs.rows, b, h, bh);  // read after the loop's first barrier
  const bool pairs_k = z.D % 2 == 0, pairs_v = z.Dv % 2 == 0;

  float dq[DT][4] = {};  // the warp's queries r0 + g, r0 + g + 8
  for (int tt = 0; tt < ntiles; ++tt) {
    const int buf = ts.begin(tt);
    const unsigned long long* sMask = bs.mask[buf];
    const float* bias2 = bs.bias2[buf];
    const int kr[2] = {r0 + g, r0 + g + 8};  // the thread's two key rows of the tile
    // With key_uses, whether each row's key is one of few blocks (loaded now, used after the products).
    int32_t nuse[2] = {INT32_MAX, INT32_MAX};
    if (gp.key_uses)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int j = bs.keys[buf][kr[r]];
        if (j >= 0) nuse[r] = __ldg(gp.key_uses + bh * z.Lk + j);
      }
    float st[NT][4] = {}, dpt[NT][4] = {}, db[2] = {0.f, 0.f};
    if constexpr (W::kFirst) {
      cuda::wgmma_dot2<NT>(st, ts.K(buf), sQ, dpt, ts.V(buf), sdO);
    } else {
      warp_dot<DB, NT, Lay>(st, ts.K(buf), r0, sQ);
      warp_dot<DB, NT, Lay>(dpt, ts.V(buf), r0, sdO);
    }
    const float brow[2] = {bias2[kr[0]], bias2[kr[1]]};  // (once a tile: the loop reloaded them for each entry)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2, c = nt * 8 + 2 * t + e % 2;
        const float pr = (sMask[c] >> kr[r]) & 1ull ? fast_exp2(st[nt][e] * z.scale2 + brow[r] - sLse2[c]) : 0.f;
        st[nt][e] = pr;
        dpt[nt][e] = pr * (dpt[nt][e] - sDl[c]);  // dS^T
        db[r] += dpt[nt][e];
      }
#pragma unroll
      for (int r = 0; r < 2; ++r)  // (the same bfloat16 rounding as the A fragments below)
        *reinterpret_cast<uint32_t*>(Swizzle128::at(sdS, kr[r], nt * 8) + 2 * t) =
            pack_bf16(dpt[nt][2 * r], dpt[nt][2 * r + 1]);
    }
    float dk[DT][4] = {}, dv[DT][4] = {};
    if constexpr (W::kAll) {
      if constexpr (DB == 64) {
        cuda::wgmma_accumulate_rs<kQ / 16>(dv, st, sdO);   // dV = P^T dO
        cuda::wgmma_accumulate_rs<kQ / 16>(dk, dpt, sQ);   // dK = dS^T Q
        cuda::fence_proxy_async_shared();                   // this thread's sdS stores, for wgmma
        __syncthreads();                                    // every warp's rows of dS^T are in sdS
        cuda::wgmma_wait<0>();                              // dV, dK (their A fragments free)
        cuda::wgmma_fence_operands(dv);
        cuda::wgmma_fence_operands(dk);
        cuda::wgmma_accumulate_tn<kTK / 16>(dq, sdS, ts.K(buf));  // dQ += dS K, during the atomics
      }
    } else {
      warp_accumulate<DB, NT, Lay>(dv, st, sdO);  // dV = P^T dO
      warp_accumulate<DB, NT, Lay>(dk, dpt, sQ);  // dK = dS^T Q
      __syncthreads();                            // every warp's rows of dS^T are in sdS
      warp_accumulate_tn<DB, kTK / 16, Swizzle128, Lay>(dq, sdS, r0, ts.K(buf));  // dQ += dS K
    }
    if constexpr (DB % 16 == 0) {  // (uniform)
      if (z.quads_k) quad_rows<DB>(dk, t);
      if (z.quads_v) quad_rows<DB>(dv, t);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float dbr = db_acc ? sum4(db[r]) : 0.f;  // (uniform: the shuffles only with a bias)
      const int j = bs.keys[buf][kr[r]];
      if (j < 0) continue;
      // With key_uses, the keys of few blocks go to the bfloat16 rows instead (params.h; the
      // pointers come from the parameters here, where live through the loop they cost spills).
      const int how = nuse[r] == 1 ? kStoreBf16 : nuse[r] <= kAttentionKeyFewUses ? kSumBf16 : kSumF32;
      add_row<DB>(dk_acc + (int64_t)j * sqk, (bf16*)gp.dk_bf16 + gb.off_k + (int64_t)j * sqk, how, dk, r, z.scale, z.D,
                  t, pairs_k, DB % 16 == 0 && z.quads_k);
      add_row<DB>(dv_acc + (int64_t)j * sv, (bf16*)gp.dv_bf16 + gb.off_v + (int64_t)j * sv, how, dv, r, 1.f, z.Dv, t,
                  pairs_v, DB % 16 == 0 && z.quads_v);
      if (db_acc && t == 0) atomicAdd(db_acc + j, dbr);
    }
    if constexpr (W::kAll) {  // dQ's product done before the next barrier lets K's buffer and sdS be rewritten
      cuda::wgmma_wait<0>();
      cuda::wgmma_fence_operands(dq);
    }
    ts.end();  // (the next begin()'s barrier also keeps sdS until every warp has read it)
  }
  const int row[2] = {bs.rows[r0 + g], bs.rows[r0 + g + 8]};
  const float scale[2] = {z.scale, z.scale};
  // 16-byte stores through the warp's own rows of sQ, once no warp reads sQ any more.
  if (kAsync && z.vec_qk && cuda::aligned16(gp.dq)) {
    __syncthreads();
    store_rows_staged<DB, Lay>(gb.sQ + r0 * S, (bf16*)gp.dq + off_q, sqk, dq, row, scale, z.L, z.D, t);
  } else {
    store_rows<DB>((bf16*)gp.dq + off_q, sqk, dq, row, scale, z.L, z.D, t);
  }
}

Sizes sizes_of(const AttentionParams& p, const void* dout) {
  auto fits = [](int64_t x) { return x < (int64_t)INT32_MAX; };
  if (!fits(p.seqlen * p.nheads * (p.dim > p.vdim ? p.dim : p.vdim)) || !fits(p.keylen * p.nheads * p.dim) ||
      !fits(p.keylen * p.nheads * p.vdim))
    throw std::runtime_error("sparse_attention tiles: a row of q, k or v spans more than 2^31 entries");
  Sizes z;
  z.L = (int)p.seqlen, z.Lk = (int)p.keylen, z.H = (int)p.nheads, z.D = (int)p.dim, z.Dv = (int)p.vdim;
  z.nblk = attention_tile_blocks(p.seqlen);
  z.scale = (float)p.scale, z.scale2 = (float)p.scale * kLog2e;
  z.vec_qk = p.dim % 8 == 0 && cuda::aligned16(p.q) && cuda::aligned16(p.k);
  z.vec_v = p.vdim % 8 == 0 && cuda::aligned16(p.v) && (dout == nullptr || cuda::aligned16(dout));
  return z;
}

// HAX_TILE_WGMMA: which products of the swizzled kernels (head dim 64, 16-byte rows) run on
// wgmma where the build targets sm_90a and p.wgmma_products is on: unset or 2 all of them, 1 the
// products of two shared tiles only, 0 none (mma.sync; for comparisons).
int tile_wgmma(const AttentionParams& p) {
  if (!p.wgmma_products) return 0;
  static const int mode = cuda::env_switch(
      "HAX_TILE_WGMMA", 2, 2, "0 mma.sync, 1 wgmma for the products of two shared tiles, 2 wgmma for all");
  return mode;
}

// launch(async, wgmma) with the variant the sizes allow: 16-byte rows copied by cp.async, and at
// head dim 64 the wgmma forms (only DB 64 instantiates them).
template <int DB, class Launch>
void launch_variant(const AttentionParams& p, const Sizes& z, Launch&& launch) {
  using Off = std::integral_constant<int, 0>;
  if (!(z.vec_qk && z.vec_v)) return launch(std::false_type{}, Off{});
  if constexpr (DB == 64) {
    const int mode = tile_wgmma(p);
    if (mode == 2) return launch(std::true_type{}, std::integral_constant<int, 2>{});
    if (mode == 1) return launch(std::true_type{}, std::integral_constant<int, 1>{});
  }
  launch(std::true_type{}, Off{});
}

}  // namespace

void sparse_attention_tile_forward_cuda(const AttentionParams& p, const AttentionTilePlan& plan, void* stream) {
  const Sizes z = sizes_of(p, nullptr);
  const int64_t grid = p.batch * p.nheads * z.nblk;
  if (grid == 0) return;
  HAX_DISPATCH_HEAD_DIM(p.dim > p.vdim ? p.dim : p.vdim, [&] {
    auto launch = [&](auto async, auto wg) {
      constexpr bool kA = decltype(async)::value;
      constexpr int kW = decltype(wg)::value;
      constexpr size_t smem = Cfg<DB, kA>::fwd_smem;
      cuda::allow_smem(tile_forward_kernel<DB, kA, kW>, smem, "sparse_attention tile forward", kStaticSmem);
      tile_forward_kernel<DB, kA, kW><<<(unsigned)grid, kThreads, smem, (cudaStream_t)stream>>>(p, plan, z);
    };
    launch_variant<DB>(p, z, launch);
  });
  cuda::check_launch("sparse_attention tile forward");
}

// HAX_TILE_QUAD_ROWS (default 1): the tile backward adds dK and dV rows 4 entries at a time
// (quad_rows, add_row) where the head dims are multiples of 4 and the rows aligned; 0 two at a time.
bool tile_quad_rows() {
  static const bool on = cuda::env_switch("HAX_TILE_QUAD_ROWS", 1, 1, "0 two entries a reduction, 1 four") != 0;
  return on;
}

void sparse_attention_tile_backward_cuda(const AttentionGradParams& gp, const AttentionTilePlan& plan, void* stream) {
  Sizes z = sizes_of(gp.fwd, gp.dout);
  // float32 rows 16-byte aligned, bfloat16 rows 8-byte aligned (row offsets are multiples of 4 entries)
  auto aligned = [](const void* ptr, uintptr_t a) { return reinterpret_cast<uintptr_t>(ptr) % a == 0; };  // (null too)
  const bool quads = tile_quad_rows() && aligned(gp.dk, 16) && aligned(gp.dv, 16) && aligned(gp.dk_bf16, 8) &&
                     aligned(gp.dv_bf16, 8);
  z.quads_k = quads && z.D % 4 == 0;
  z.quads_v = quads && z.Dv % 4 == 0;
  const int64_t grid = gp.fwd.batch * gp.fwd.nheads * z.nblk;
  if (grid == 0) return;
  HAX_DISPATCH_HEAD_DIM(gp.fwd.dim > gp.fwd.vdim ? gp.fwd.dim : gp.fwd.vdim, [&] {
    auto launch = [&](auto async, auto wg) {
      constexpr bool kA = decltype(async)::value;
      constexpr int kW = decltype(wg)::value;
      constexpr size_t smem = Cfg<DB, kA>::bwd_smem;
      cuda::allow_smem(tile_backward_kernel<DB, kA, kW>, smem, "sparse_attention tile backward", kStaticSmem);
      tile_backward_kernel<DB, kA, kW><<<(unsigned)grid, kThreads, smem, (cudaStream_t)stream>>>(gp, plan, z);
    };
    launch_variant<DB>(gp.fwd, z, launch);
  });
  cuda::check_launch("sparse_attention tile backward");
}

}  // namespace hax::ops
