// Causal attention of bfloat16 tensors on tensor cores: the same algorithm as simt.cu (whose
// header has it; cpu.cpp has the formulas), with every tile product an mma.sync m16n8k16 or (TMA
// path, below) a wgmma (bfloat16 operands, float32 accumulation). Scores, the softmax and all accumulators are float32;
// P and dS are rounded to bfloat16 to enter the second product of each step (as in
// FlashAttention-2).
//
// A block is 4 warps and owns 64 rows (queries for the forward and dQ, keys for dK/dV); warp w
// owns rows 16w..16w+15 and loops over column tiles (keys, resp. queries) of BN. Operand tiles sit
// in shared memory row-major, (rows, DB + 8) bfloat16 (TMA path: rows of 64 with the 128-byte
// swizzle, layout Swizzle128); ops/cuda/mma_bf16.cuh has the fragments
// (read with ldmatrix). A warp skips the 16-column groups of a tile that none of its rows sees
// (live_groups): with a window, its 16 rows need about W + 16 of the block's columns.
//
// forward: S = Q K^T, online softmax (per-thread partial row sums, reduced over the row's 4 lanes
//   at the end), O += P V.
// dQ: Δ = dO·O - dlse of the block's rows first (written to gp.workspace for the dK/dV kernel,
//   launched after it), then S = Q K^T, dP = dO V^T, dS = P ∘ (dP - Δ), dQ += dS K, over key
//   sub-tiles of 32 (wgmma: whole key tiles).
// dK, dV: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, over query sub-tiles of 32
//   (the two float32 accumulators of 16 x DB leave room for little more in registers).
// No atomics: each gradient entry is accumulated by one thread in a fixed order.
//
// Three ways to bring tiles in (Mode, below): plain loads (any head dim), cp.async double
// buffering with one block barrier a tile (head dims multiples of 8), and at head dim 64 a ring
// of TMA-filled buffers that each warp waits for on an mbarrier (ops/cuda/tile_ring.cuh). On the
// TMA path the products of two shared tiles (S = Q K^T, dP = dO V^T, and S^T, dP^T for dK/dV)
// run on wgmma, the warpgroup's asynchronous product that reads both operands from shared
// memory (ops/cuda/wgmma.cuh; sm_90a builds), and so do the products with P or dS (O += P V,
// dQ += dS K, dV += P^T dO, dK += dS^T Q: wgmma_accumulate_rs, P or dS from registers, the
// V-like operand read N-major from its swizzled tile; unless p.wgmma_products is off, which
// keeps them on each warp's mma.sync). wgmma is .aligned: all four warps must reach the same
// wgmma instruction, so on this path a warp whose rows see none of a tile still takes part, with
// P or dS masked to zeros (an earlier version branched around it per warp and gave wrong, run-
// dependent gradients). BENCHMARKS.md, twenty-seventh pass: forward 313 -> 262 us (with 5
// blocks an SM), dQ 370 -> 344, dK/dV 514 -> 447 for SW k = 128 at 64K.
// Each warp writes its output rows through its own rows of a shared tile (store_rows_staged), so
// that global stores are whole 16-byte chunks. BENCHMARKS.md, ninth pass: on the H100 the TMA
// ring alone changed nothing (the kernels are bound by each warp's dependency chain, ldmatrix ->
// mma -> row max -> exp -> mma, at 4 warps a scheduler, not by their loads); wgmma took the SW
// k = 128 forward and dQ at 64K from 365 / 460 us to 307 / 376, dK/dV 550 -> 526.
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ops/causal_attention/cuda/kernels.cuh"
#include "ops/causal_attention/cuda/tiles.cuh"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/mma_bf16.cuh"
#include "ops/cuda/smem_align.cuh"
#include "ops/cuda/tile_ring.cuh"
#include "ops/cuda/wgmma.cuh"

namespace hax::ops::causal_cuda {
namespace {

using namespace ::hax::ops::cuda::mma;

constexpr int kThreads = 128;  // 4 warps
constexpr int kRows = 64;      // rows per block, 16 per warp
// Blocks per SM the register budget aims at (__launch_bounds__): 4 (<= 128 registers a thread)
// at head dims up to 64; 2 at 128 (the accumulators alone need more, and shared memory allows
// no more). Blocks of 8 warps and 128 rows measured slower for sliding windows on the H100
// (fewer blocks overlap their loads).
#ifndef HAX_CAUSAL_MIN_BLOCKS
#define HAX_CAUSAL_MIN_BLOCKS 4  // (a macro, so that a timing build can try others)
#endif
constexpr int kMinBlocks = HAX_CAUSAL_MIN_BLOCKS;

// Whether tiles can be copied 16 bytes at a time (head dim a multiple of 8, base 16-byte aligned).
struct VecLoads {
  bool qk = false;  // q, k (D)
  bool v = false;   // v, dout (Dv)
};

using cuda::aligned16;

// How a kernel brings its column tiles into shared memory:
//   kPlain: the block loads each tile (any head dim, any alignment), then computes on it;
//   kCopy:  16-byte cp.async copies (head dims multiples of 8, aligned tensors) into a second
//           buffer while the current tile is computed on, one block barrier a tile;
//   kTma:   head dims of exactly 64: a ring of two buffers filled by the TMA unit (one copy a
//           64 x 64 tile, 128-byte swizzled rows) and completing on mbarriers; each warp waits
//           for a tile on its own and the last warp done with a buffer refills it
//           (ops/cuda/tile_ring.cuh). No block barrier a tile.
enum Mode : int { kPlain = 0, kCopy = 1, kTma = 2 };
// kTma's products of two shared tiles (S = Q K^T, dP = dO V^T and their transposes) run on wgmma
// where the compilation targets sm_90a, else on mma.sync (ops/cuda/wgmma.cuh).
constexpr bool kWgmma = cuda::kHaveWgmma;

// The tensor maps of the kTma mode (unused otherwise): 4-d views (D, H, L, B) of q, k, v and
// dout with boxes of 64 entries x 1 head x 64 positions x 1 batch.
struct TmaMaps {
  CUtensorMap q, k, v, dout;
  CUtensorMap lse, delta;  // dK/dV: 2-d views (L, B H) of lse and Δ (float32), boxes of 64 x 1
};

using Ring = cuda::TileRing<2, kThreads / 32>;

// Where the tiles start in a kernel's dynamic shared memory: after the ring's barriers, and
// 1024-byte aligned for the TMA swizzle.
template <int kMode>
struct SmemHead {
  static constexpr size_t bytes = kMode == kTma ? 64 + 1024 : 0;  // reserve (barriers + alignment slack)
  static __device__ __forceinline__ bf16* tiles(uint4* smem) {
    if constexpr (kMode != kTma) return reinterpret_cast<bf16*>(smem);
    return cuda::align_up<bf16>(smem, 64, 1024);  // (still known as shared memory)
  }
};

template <int DB, int kMode>
struct FwdCfg {
  static constexpr int BN = 64, S = kMode == kTma ? 64 : DB + 8, NB = kMode == kPlain ? 1 : 2;
  using Lay = std::conditional_t<kMode == kTma, Swizzle128, Padded<S>>;
  static constexpr size_t smem = SmemHead<kMode>::bytes + sizeof(bf16) * (kRows + 2 * NB * BN) * S;  // sQ, sK[NB], sV[NB]
};

// acc += P Y for a step's P (or dS) in s (16 rows a warp, 8 NT columns): on the warpgroup (kWg,
// head dim 64: wgmma_accumulate_rs, waited for; every warp must call it) or by each warp's
// mma.sync over its live column groups.
template <bool kWg, int DB, int NT, class Lay>
__device__ __forceinline__ void second_product(float (&acc)[DB / 8][4], const float (&s)[NT][4], const bf16* Y,
                                               unsigned live) {
  if constexpr (kWg) {
    if constexpr (DB == 64) cuda::wgmma_accumulate_rs<NT / 2>(acc, s, Y);
    cuda::wgmma_wait<0>();
    cuda::wgmma_fence_operands(acc);
  } else {
    warp_accumulate<DB, NT, Lay>(acc, s, Y, live);
  }
}

// kSink: p.sink > 0 (A-shaped attention's sink tile); the plain causal form is compiled without it.
// kW2 > 0: with kW, O += P V on the warpgroup too (wgmma_accumulate_rs), not by each warp's
// mma.sync; 2: at 5 blocks an SM (at most 102 registers a thread).
template <int DB, int kMode, bool kSink, int kW2>
__global__ void __launch_bounds__(kThreads, DB <= 64 ? (kW2 == 2 ? 5 : kMinBlocks) : 2)
    forward_kernel(CausalAttentionParams p, Dims dm, VecLoads vec, const __grid_constant__ TmaMaps maps) {
  using Cfg = FwdCfg<DB, kMode>;
  using Lay = typename Cfg::Lay;
  constexpr bool kW = kMode == kTma && kWgmma;  // S of a whole key tile by the warpgroup
  constexpr bool kPV = kW && kW2 > 0 && DB == 64;  // P V of a whole key tile by the warpgroup
  constexpr int BN = Cfg::BN, S = Cfg::S, NT = BN / 8, DT = DB / 8;
  extern __shared__ uint4 smem_u4[];
  Ring& ring = *reinterpret_cast<Ring*>(smem_u4);
  bf16* sQ = SmemHead<kMode>::tiles(smem_u4);
  bf16* sK0 = sQ + kRows * S;
  bf16* sV0 = sK0 + Cfg::NB * BN * S;
  const int L = dm.L, H = dm.H, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = threadIdx.x / 32 * 16;
  const int bh = bh_of(dm), b = bh / H, h = bh % H, i0 = tile_of(dm, true) * kRows;
  const int64_t sqk = (int64_t)H * dm.D, sv = (int64_t)H * dm.Dv;
  const int64_t off_qk = ((int64_t)b * L * H + h) * dm.D, off_v = ((int64_t)b * L * H + h) * dm.Dv;
  const bf16* q = (const bf16*)p.q + off_qk;
  const bf16* k = (const bf16*)p.k + off_qk;
  const bf16* v = (const bf16*)p.v + off_v;
  const Visibility vis = visibility(p, dm, b, bh);

  const int row[2] = {i0 + r0 + g, i0 + r0 + g + 8};  // the thread's two query rows
  int lo[2], hi[2];                                    // the keys each row sees (empty past L)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lo[r] = row[r] < L ? vis.first_key(row[r]) : INT_MAX;
    hi[r] = row[r] < L ? vis.last_key(row[r]) : -1;
  }
  int kt_begin, kt_end;
  tile_span(vis.first_key(i0), vis.last_key(min(i0 + kRows - 1, L - 1)), BN, L, kt_begin, kt_end);
  // A-shaped attention's sink (p.sink > 0, params.h): row r also sees the keys [0, es[r]],
  // es = min(sink - 1, row - window), which come as nsink extra key tiles before the window's
  // (step n < nsink is key tile n, masked to [0, es]; step n >= nsink is tile kt_begin + n - nsink).
  int es[2] = {-1, -1}, nsink = 0;
  if constexpr (kSink) {
    // (int64_t: the window may exceed L, then no query has a sink part)
    auto last_sink = [&](int i) {
      const int64_t e = i - p.window < p.sink - 1 ? i - p.window : p.sink - 1;
      return e < 0 ? -1 : (int)e;
    };
#pragma unroll
    for (int r = 0; r < 2; ++r) es[r] = row[r] < L ? last_sink(row[r]) : -1;
    const int e_last = last_sink(min(i0 + kRows - 1, L - 1));
    nsink = e_last >= 0 ? e_last / BN + 1 : 0;
  }
  auto kt_of = [&](int n) { return n < nsink ? n : kt_begin + n - nsink; };
  // kCopy: tile kt's keys and values into buffer b.
  auto issue = [&](int kt, int b) {
    const int j0 = kt * BN;
    cuda::async_tile<S, BN, DB, kThreads>(sK0 + b * BN * S, k, sqk, j0, L, dm.D);
    cuda::async_tile<S, BN, DB, kThreads>(sV0 + b * BN * S, v, sv, j0, L, dm.Dv);
    cuda::cp_async_commit();
  };
  // kTma: fill n of the ring (key tile kt_of(n)) by the calling warp; the first brings sQ too.
  auto fill = [&](int n) {
    const int buf = ring.buffer(n);
    ring.fill(n, (n == 0 ? 3 : 2) * BN * 64 * 2, [&](uint64_t* bar) {
      cuda::tma_load_4d(sK0 + buf * BN * S, &maps.k, 0, h, kt_of(n) * BN, b, bar);
      cuda::tma_load_4d(sV0 + buf * BN * S, &maps.v, 0, h, kt_of(n) * BN, b, bar);
      if (n == 0) cuda::tma_load_4d(sQ, &maps.q, 0, h, i0, b, bar);
    });
  };
  const int tiles = nsink + kt_end - kt_begin + 1;
  if constexpr (kMode == kTma) {
    ring.start(tiles, fill);
  } else if constexpr (kMode == kCopy) {
    cuda::async_tile<S, kRows, DB, kThreads>(sQ, q, sqk, i0, L, dm.D);
    issue(kt_of(0), 0);  // one group with sQ
  } else {
    load_rows_bf16(sQ, S, q, sqk, i0, kRows, L, dm.D, DB, vec.qk);
  }

  float o[DT][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  for (int kt = kt_begin - nsink; kt <= kt_end; ++kt) {  // (kt < kt_begin: the sink's steps)
    const int n = kt - kt_begin + nsink;
    const bool sink_step = kSink && n < nsink;
    const int j0 = (sink_step ? n : kt) * BN, buf = kMode == kPlain ? 0 : n % 2;
    const bf16* sK = sK0 + buf * BN * S;
    const bf16* sV = sV0 + buf * BN * S;
    // The keys each row sees in this tile: the window's [lo, hi], or a sink tile's [0, es].
    const int lo_n[2] = {sink_step ? 0 : lo[0], sink_step ? 0 : lo[1]};
    const int hi_n[2] = {sink_step ? es[0] : hi[0], sink_step ? es[1] : hi[1]};
    if constexpr (kMode == kTma) {
      ring.wait(n);
    } else if constexpr (kMode == kCopy) {
      // Tile n has landed (this thread's copies: the wait; everyone's: the barrier), and every
      // warp is done with tile n - 1, so its buffer takes tile n + 1.
      cuda::cp_async_wait<0>();
      __syncthreads();
      if (kt < kt_end) issue(kt_of(n + 1), buf ^ 1);
    } else {
      __syncthreads();  // the previous tile's sK, sV are read
      load_rows_bf16(sK0, S, k, sqk, j0, BN, L, dm.D, DB, vec.qk);
      load_rows_bf16(sV0, S, v, sv, j0, BN, L, dm.Dv, DB, vec.v);
      __syncthreads();
    }
    const unsigned live = live_groups<BN / 16>(j0, lo_n, hi_n);
    float s[NT][4] = {};
    // kTma: S = Q K^T of the whole 64 x 64 tile by the warpgroup (every warp takes part).
    if constexpr (kW) cuda::wgmma_dot<NT>(s, sQ, sK);
    // (kPV: every warp takes part in the warpgroup's P V, at the same instructions (wgmma is
    // .aligned); a warp whose rows see none of the tile gives P = 0, from the masked form)
    if (kPV || live) {
      if constexpr (!kW) warp_dot<DB, NT, Lay>(s, sQ, r0, sK, live);
      float mx[2] = {-INFINITY, -INFINITY};
      auto scores = [&](auto masked) {  // -inf where not visible (scaled in the softmax step)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2, j = j0 + nt * 8 + 2 * t + e % 2;
            const bool seen = !decltype(masked)::value || (j <= hi_n[r] && j >= lo_n[r]);
            if (!seen) s[nt][e] = -INFINITY;
            mx[r] = fmaxf(mx[r], s[nt][e]);
          }
      };
      if (all_visible(j0, j0 + BN - 1, lo_n, hi_n)) scores(std::false_type{});
      else scores(std::true_type{});
      online_softmax_step<NT, DT>(s, mx, m, l, o, dm.scale2);
      second_product<kPV, DB, NT, Lay>(o, s, sV, live);
    }
    if constexpr (kMode == kTma) ring.advance(n, tiles, fill);
  }

  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = sum4(l[r]);
    inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;  // a row that sees no key (a band's) outputs 0
  }
  // 16-byte stores through the warp's own rows of sQ (which only this warp reads).
  if constexpr (kMode != kPlain)
    store_rows_staged<DB, Lay>(sQ + r0 * S, (bf16*)p.out + off_v, sv, o, row, inv, L, dm.Dv, t);
  else store_rows<DB>((bf16*)p.out + off_v, sv, o, row, inv, L, dm.Dv, t);
  float* lse = (float*)p.lse + (int64_t)bh * L;
#pragma unroll
  for (int r = 0; r < 2; ++r)
    if (t == 0 && row[r] < L) lse[row[r]] = l[r] > 0.f ? m[r] * kLn2 + logf(l[r]) : -INFINITY;
}

template <int DB, int kMode>
struct DqCfg {
  static constexpr int BN = DB == 128 ? 32 : 64;  // keys staged per step
  static constexpr int SUB = 32;                   // keys per product step (BN / SUB steps; wgmma: BN)
  static constexpr int S = kMode == kTma ? 64 : DB + 8, NB = kMode == kPlain ? 1 : 2;
  using Lay = std::conditional_t<kMode == kTma, Swizzle128, Padded<S>>;
  // sQ, sdO, sK[NB], sV[NB], then Δ of the block's rows (float32)
  static constexpr size_t smem =
      SmemHead<kMode>::bytes + sizeof(bf16) * (2 * kRows + 2 * NB * BN) * S + sizeof(float) * kRows;
};

// Δ_i = dO_i·O_i - dlse_i of the block's rows i0 + rr (rr < kRows) into sDl[rr] (0 past L) and
// into delta (the (b, h) row of the workspace): two threads per row, each over half of the head
// dim; dO comes from the shared tile sdO (stride S), O from global memory.
template <int DB, int S>
__device__ __forceinline__ void block_delta(float* sDl, float* delta, const bf16* sdO, const bf16* out, int64_t sv,
                                            const float* dlse, int i0, const Dims& dm, bool vec) {
  static_assert(kThreads == 2 * kRows, "two threads per row");
  const int rr = threadIdx.x / 2, half = threadIdx.x % 2, i = i0 + rr;
  float part = 0.f;
  if (i < dm.L) {
    const bf16* o = out + (int64_t)i * sv;
    const bf16* d_o = sdO + rr * S;
    if (vec) {  // Dv % 8 == 0, aligned: 16-byte loads of O, all issued before use
      uint4 chunk[DB / 16];
#pragma unroll
      for (int c = 0; c < DB / 16; ++c) {
        const int d = half * (DB / 2) + c * 8;
        chunk[c] = d < dm.Dv ? *reinterpret_cast<const uint4*>(o + d) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int c = 0; c < DB / 16; ++c) {
        const int d = half * (DB / 2) + c * 8;
        const bf16* ov = reinterpret_cast<const bf16*>(&chunk[c]);
#pragma unroll
        for (int e = 0; e < 8; ++e) part += __bfloat162float(ov[e]) * __bfloat162float(d_o[d + e]);
      }
    } else {
      for (int d = half; d < dm.Dv; d += 2) part += __bfloat162float(o[d]) * __bfloat162float(d_o[d]);
    }
  }
  part += __shfl_xor_sync(0xffffffffu, part, 1);
  if (half == 0) {
    const float dl = i < dm.L ? part - (dlse ? dlse[i] : 0.f) : 0.f;
    sDl[rr] = dl;
    if (i < dm.L) delta[i] = dl;
  }
}

// The same Δ for the asynchronous paths, in two halves: `load` issues the block's O rows as
// 16-byte chunks into registers (before the tiles' copies are waited for, so the two latencies
// overlap), `finish` (after sdO, laid out by Lay, has landed) forms the dot products, reduced over
// the threads of a row (consecutive threads take consecutive chunks of a row: whole 32-byte
// sectors). Needs Dv % 8 == 0 and 16-byte aligned rows.
template <int DB, class Lay>
struct BlockDelta {
  static constexpr int kCh = DB / 8, kPer = kRows * kCh / kThreads;  // chunks a row, chunks a thread
  static_assert(kPer >= 1 && kCh <= 32, "BlockDelta: a row's chunks lie within one warp");
  uint4 o[kPer];

  __device__ __forceinline__ void load(const bf16* out, int64_t sv, int i0, const Dims& dm) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int x = threadIdx.x + k * kThreads, rr = x / kCh, c = (x % kCh) * 8, i = i0 + rr;
      o[k] = i < dm.L && c < dm.Dv ? *reinterpret_cast<const uint4*>(out + (int64_t)i * sv + c) : make_uint4(0, 0, 0, 0);
    }
  }

  __device__ __forceinline__ void finish(float* sDl, float* delta, const bf16* sdO, const float* dlse, int i0,
                                         const Dims& dm) const {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int x = threadIdx.x + k * kThreads, rr = x / kCh, c = (x % kCh) * 8, i = i0 + rr;
      const bf16* ov = reinterpret_cast<const bf16*>(&o[k]);
      const bf16* gv = Lay::at(sdO, rr, c);  // zeros past L and past Dv
      float part = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) part += __bfloat162float(ov[e]) * __bfloat162float(gv[e]);
#pragma unroll
      for (int off = kCh / 2; off >= 1; off /= 2) part += __shfl_xor_sync(0xffffffffu, part, off);
      if (c == 0) {
        const float dl = i < dm.L ? part - (dlse ? dlse[i] : 0.f) : 0.f;
        sDl[rr] = dl;
        if (i < dm.L) delta[i] = dl;
      }
    }
  }
};

// kW2: with kW, dQ += dS K on the warpgroup too (wgmma_accumulate_rs).
template <int DB, int kMode, bool kW2>
__global__ void __launch_bounds__(kThreads, DB <= 64 ? kMinBlocks : 2)
    dq_kernel(CausalAttentionGradParams gp, Dims dm, VecLoads vec, const __grid_constant__ TmaMaps maps) {
  using Cfg = DqCfg<DB, kMode>;
  using Lay = typename Cfg::Lay;
  constexpr bool kW = kMode == kTma && kWgmma;  // S and dP of a whole key tile by the warpgroup
  constexpr bool kDQ = kW && kW2 && DB == 64;   // dS K of a whole key tile by the warpgroup
  constexpr int BN = Cfg::BN, SUB = kW ? BN : Cfg::SUB, S = Cfg::S, NT = SUB / 8, DT = DB / 8;
  const CausalAttentionParams& p = gp.fwd;
  extern __shared__ uint4 smem_u4[];
  Ring& ring = *reinterpret_cast<Ring*>(smem_u4);
  bf16* sQ = SmemHead<kMode>::tiles(smem_u4);
  bf16* sdO = sQ + kRows * S;
  bf16* sK0 = sdO + kRows * S;
  bf16* sV0 = sK0 + Cfg::NB * BN * S;
  float* sDl = reinterpret_cast<float*>(sV0 + Cfg::NB * BN * S);
  const int L = dm.L, H = dm.H, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = threadIdx.x / 32 * 16;
  const int bh = bh_of(dm), b = bh / H, h = bh % H, i0 = tile_of(dm, true) * kRows;
  const int64_t sqk = (int64_t)H * dm.D, sv = (int64_t)H * dm.Dv;
  const int64_t off_qk = ((int64_t)b * L * H + h) * dm.D, off_v = ((int64_t)b * L * H + h) * dm.Dv;
  const bf16* q = (const bf16*)p.q + off_qk;
  const bf16* k = (const bf16*)p.k + off_qk;
  const bf16* v = (const bf16*)p.v + off_v;
  const bf16* dout = (const bf16*)gp.dout + off_v;
  const float* lse = (const float*)p.lse + (int64_t)bh * L;
  float* delta = (float*)gp.workspace + (int64_t)bh * L;
  const float* dlse = gp.dlse ? (const float*)gp.dlse + (int64_t)bh * L : nullptr;
  const Visibility vis = visibility(p, dm, b, bh);

  int kt_begin, kt_end;
  tile_span(vis.first_key(i0), vis.last_key(min(i0 + kRows - 1, L - 1)), BN, L, kt_begin, kt_end);
  auto issue = [&](int kt, int b) {  // kCopy
    const int j0 = kt * BN;
    cuda::async_tile<S, BN, DB, kThreads>(sK0 + b * BN * S, k, sqk, j0, L, dm.D);
    cuda::async_tile<S, BN, DB, kThreads>(sV0 + b * BN * S, v, sv, j0, L, dm.Dv);
    cuda::cp_async_commit();
  };
  // kTma: fill n of the ring (key tile kt_begin + n) by the calling warp; the first brings sQ, sdO.
  auto fill = [&](int n) {
    const int buf = ring.buffer(n);
    ring.fill(n, (n == 0 ? 4 : 2) * BN * 64 * 2, [&](uint64_t* bar) {
      cuda::tma_load_4d(sK0 + buf * BN * S, &maps.k, 0, h, (kt_begin + n) * BN, b, bar);
      cuda::tma_load_4d(sV0 + buf * BN * S, &maps.v, 0, h, (kt_begin + n) * BN, b, bar);
      if (n == 0) {
        cuda::tma_load_4d(sQ, &maps.q, 0, h, i0, b, bar);
        cuda::tma_load_4d(sdO, &maps.dout, 0, h, i0, b, bar);
      }
    });
  };
  const int tiles = kt_end - kt_begin + 1;
  const int row[2] = {i0 + r0 + g, i0 + r0 + g + 8};
  float lse_row[2];  // lse of the thread's rows, loaded first: its latency overlaps the tile copies'
#pragma unroll
  for (int r = 0; r < 2; ++r) lse_row[r] = row[r] < L ? lse[row[r]] : 0.f;
  if constexpr (kMode == kTma) {
    BlockDelta<DB, Lay> bd;
    bd.load((const bf16*)p.out + off_v, sv, i0, dm);
    ring.start(tiles, fill);
    ring.wait(0);  // sdO for Δ (with the first key tile)
    bd.finish(sDl, delta, sdO, dlse, i0, dm);
  } else if constexpr (kMode == kCopy) {
    BlockDelta<DB, Lay> bd;
    bd.load((const bf16*)p.out + off_v, sv, i0, dm);
    cuda::async_tile<S, kRows, DB, kThreads>(sQ, q, sqk, i0, L, dm.D);
    cuda::async_tile<S, kRows, DB, kThreads>(sdO, dout, sv, i0, L, dm.Dv);
    issue(kt_begin, 0);
    cuda::cp_async_wait<0>();  // sdO for Δ (the first key tile comes with it)
    __syncthreads();
    bd.finish(sDl, delta, sdO, dlse, i0, dm);
  } else {
    load_rows_bf16(sQ, S, q, sqk, i0, kRows, L, dm.D, DB, vec.qk);
    load_rows_bf16(sdO, S, dout, sv, i0, kRows, L, dm.Dv, DB, vec.v);
    __syncthreads();
    block_delta<DB, S>(sDl, delta, sdO, (const bf16*)p.out + off_v, sv, dlse, i0, dm, vec.v);
  }
  __syncthreads();

  int lo[2], hi[2];
  float lse2[2], dl[2];  // lse in base 2 and Δ of the two rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool in = row[r] < L;
    lo[r] = in ? vis.first_key(row[r]) : INT_MAX;
    hi[r] = in ? vis.last_key(row[r]) : -1;
    lse2[r] = lse_row[r] * kLog2e;
    dl[r] = sDl[r0 + g + 8 * r];
  }

  float acc[DT][4] = {};
  for (int kt = kt_begin; kt <= kt_end; ++kt) {
    const int j0 = kt * BN, n = kt - kt_begin, buf = kMode == kPlain ? 0 : n % 2;
    const bf16* sK = sK0 + buf * BN * S;
    const bf16* sV = sV0 + buf * BN * S;
    if constexpr (kMode == kTma) {
      ring.wait(n);
    } else if constexpr (kMode == kCopy) {  // as in forward_kernel: one barrier a tile
      cuda::cp_async_wait<0>();
      __syncthreads();
      if (kt < kt_end) issue(kt + 1, buf ^ 1);
    } else {
      __syncthreads();
      load_rows_bf16(sK0, S, k, sqk, j0, BN, L, dm.D, DB, vec.qk);
      load_rows_bf16(sV0, S, v, sv, j0, BN, L, dm.Dv, DB, vec.v);
      __syncthreads();
    }
#pragma unroll
    for (int sub = 0; sub < BN / SUB; ++sub) {
      const int c0 = j0 + sub * SUB;  // the step's first key
      const unsigned live = live_groups<SUB / 16>(c0, lo, hi);
      const bf16* sKs = sK + sub * SUB * S;
      float s[NT][4] = {}, dp[NT][4] = {};
      if constexpr (kW) cuda::wgmma_dot2<NT>(s, sQ, sKs, dp, sdO, sV + sub * SUB * S);
      // (kDQ: every warp takes part in the warpgroup's product; a warp whose rows see none of the
      // step's keys gives dS = 0, from the masked form)
      if (!live && !kDQ) continue;
      if constexpr (!kW) {
        warp_dot<DB, NT, Lay>(s, sQ, r0, sKs, live);
        warp_dot<DB, NT, Lay>(dp, sdO, r0, sV + sub * SUB * S, live);
      }
      auto grads = [&](auto masked) {  // s becomes dS
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2, j = c0 + nt * 8 + 2 * t + e % 2;
            const bool seen = !decltype(masked)::value || (j <= hi[r] && j >= lo[r]);
            const float pr = seen ? fast_exp2(s[nt][e] * dm.scale2 - lse2[r]) : 0.f;
            s[nt][e] = pr * (dp[nt][e] - dl[r]);
          }
      };
      if (all_visible(c0, c0 + SUB - 1, lo, hi)) grads(std::false_type{});
      else grads(std::true_type{});
      second_product<kDQ, DB, NT, Lay>(acc, s, sKs, live);  // dQ += dS K
    }
    if constexpr (kMode == kTma) ring.advance(n, tiles, fill);
  }
  const float scale[2] = {(float)p.scale, (float)p.scale};
  // 16-byte stores through the warp's own rows of sQ (read by this warp only since Δ).
  if constexpr (kMode != kPlain)
    store_rows_staged<DB, Lay>(sQ + r0 * S, (bf16*)gp.dq + off_qk, sqk, acc, row, scale, L, dm.D, t);
  else store_rows<DB>((bf16*)gp.dq + off_qk, sqk, acc, row, scale, L, dm.D, t);
}

// A split dK/dV block's sums (unscaled) for its key rows, as float32 into split blockIdx.y of
// gp.partial (params.h: (splits, B, KR, H, D), then the same with Dv). The rows are below KR.
template <int DB>
__device__ __forceinline__ void store_partial(const CausalAttentionGradParams& gp, const Dims& dm,
                                              const float (&dk)[DB / 8][4], const float (&dv)[DB / 8][4],
                                              const int (&row)[2], int b, int h, int t) {
  const int64_t B = gp.fwd.batch, s = blockIdx.y, nk = (int64_t)gridDim.y * B * dm.KR * dm.H * dm.D;
  float* pk = gp.partial + ((s * B + b) * dm.KR * dm.H + h) * dm.D;
  float* pv = gp.partial + nk + ((s * B + b) * dm.KR * dm.H + h) * dm.Dv;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int nt = 0; nt < DB / 8; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int d = nt * 8 + 2 * t + c;
        if (d < dm.D) pk[(int64_t)row[r] * dm.H * dm.D + d] = dk[nt][2 * r + c];
        if (d < dm.Dv) pv[(int64_t)row[r] * dm.H * dm.Dv + d] = dv[nt][2 * r + c];
      }
}

// dk = scale Σ_s partial dK, dv = Σ_s partial dV for the key rows below min(KR, L), the splits
// added in order (deterministic); one thread an entry.
__global__ void sum_partials_kernel(CausalAttentionGradParams gp, Dims dm) {
  const int64_t B = gp.fwd.batch, S = gp.dkdv_splits;
  const int64_t nk = B * dm.KR * dm.H * dm.D, nv = B * dm.KR * dm.H * dm.Dv;
  const float scale = (float)gp.fwd.scale;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < nk + nv; e += (int64_t)gridDim.x * blockDim.x) {
    const bool is_k = e < nk;
    const int64_t x = is_k ? e : e - nk, W = is_k ? dm.D : dm.Dv, n = is_k ? nk : nv;
    const int64_t rest = x / W, c = x % W, h = rest % dm.H, j = rest / dm.H % dm.KR, b = rest / dm.H / dm.KR;
    if (j >= dm.L) continue;
    const float* src = gp.partial + (is_k ? 0 : S * nk) + x;
    float acc = 0.f;
    for (int64_t s = 0; s < S; ++s) acc += src[s * n];
    bf16* dst = (bf16*)(is_k ? gp.dk : gp.dv) + ((b * dm.L + j) * dm.H + h) * W + c;
    *dst = __float2bfloat16(is_k ? acc * scale : acc);
  }
}

template <int DB, int kMode>
struct DkdvCfg {
  static constexpr int BN = DB == 128 ? 32 : 64;  // queries staged per step
  static constexpr int SUB = 32;                   // queries per product step (BN / SUB steps)
  // Query tile buffers: kTma's ring 3 (a window of 128 keys' three query tiles all in flight from
  // the start; at 3 blocks an SM the shared memory allows it: ncu 520 -> 507 us for SW k = 128 at
  // 64K), kCopy's double buffering 2.
  static constexpr int S = kMode == kTma ? 64 : DB + 8, NB = kMode == kPlain ? 1 : kMode == kTma ? 3 : 2;
  using Lay = std::conditional_t<kMode == kTma, Swizzle128, Padded<S>>;
  // sK, sV, sQ[NB], sdO[NB], then lse[NB] and Δ[NB] of the staged queries (float32)
  static constexpr size_t smem =
      SmemHead<kMode>::bytes + sizeof(bf16) * (2 * kRows + 2 * NB * BN) * S + sizeof(float) * 2 * NB * BN;
};

// On the kTma path dK/dV runs at 3 blocks an SM (up to 168 registers a thread): with wgmma, both
// query steps of a tile are issued at once (two commit groups, the second step's products running
// while the first step's P^T, dS^T and accumulates are formed), which needs two steps' products
// in registers; at 4 blocks an SM the kernel spilled 88 bytes a thread even without that.
// kW2: with kW, dV += P^T dO and dK += dS^T Q on the warpgroup too (wgmma_accumulate_rs).
template <int DB, int kMode, bool kW2>
__global__ void __launch_bounds__(kThreads, DB <= 64 ? (kMode == kTma ? 3 : kMinBlocks) : 2)
    dkdv_kernel(CausalAttentionGradParams gp, Dims dm, VecLoads vec, const __grid_constant__ TmaMaps maps) {
  using Cfg = DkdvCfg<DB, kMode>;
  using Lay = typename Cfg::Lay;
  constexpr bool kW = kMode == kTma && kWgmma;  // S^T and dP^T of each query step by the warpgroup
  constexpr bool kKV = kW && kW2 && DB == 64;   // dV and dK of each query step by the warpgroup
  static_assert(!kKV || Cfg::BN / Cfg::SUB == 2, "kKV's waits are those of the two-step loop");
  constexpr int BN = Cfg::BN, SUB = Cfg::SUB, S = Cfg::S, NT = SUB / 8, DT = DB / 8;
  const CausalAttentionParams& p = gp.fwd;
  extern __shared__ uint4 smem_u4[];
  using KRing = cuda::TileRing<(Cfg::NB > 1 ? Cfg::NB : 2), kThreads / 32>;
  static_assert(sizeof(KRing) <= 64, "the ring's barriers fit SmemHead's reserve");
  KRing& ring = *reinterpret_cast<KRing*>(smem_u4);
  bf16* sK = SmemHead<kMode>::tiles(smem_u4);
  bf16* sV = sK + kRows * S;
  bf16* sQ0 = sV + kRows * S;
  bf16* sdO0 = sQ0 + Cfg::NB * BN * S;
  float* sLse0 = reinterpret_cast<float*>(sdO0 + Cfg::NB * BN * S);  // 16-byte aligned: S is a multiple of 8
  float* sDl0 = sLse0 + Cfg::NB * BN;
  const int L = dm.L, H = dm.H, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = threadIdx.x / 32 * 16;
  const int bh = bh_of(dm), b = bh / H, h = bh % H, j0 = tile_of(dm, false) * kRows;
  const int64_t sqk = (int64_t)H * dm.D, sv = (int64_t)H * dm.Dv;
  const int64_t off_qk = ((int64_t)b * L * H + h) * dm.D, off_v = ((int64_t)b * L * H + h) * dm.Dv;
  const bf16* q = (const bf16*)p.q + off_qk;
  const bf16* k = (const bf16*)p.k + off_qk;
  const bf16* v = (const bf16*)p.v + off_v;
  const bf16* dout = (const bf16*)gp.dout + off_v;
  const float* lse = (const float*)p.lse + (int64_t)bh * L;
  const float* delta = (const float*)gp.workspace + (int64_t)bh * L;
  const Visibility vis = visibility(p, dm, b, bh);

  const int row[2] = {j0 + r0 + g, j0 + r0 + g + 8};  // the thread's two key rows
  int lo[2], hi[2];                                    // the queries each key is seen by (empty past L)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lo[r] = row[r] < L ? vis.first_query(row[r]) : INT_MAX;
    hi[r] = row[r] < L ? vis.last_query(row[r]) : -1;
  }
  int qt_begin, qt_end;
  tile_span(vis.first_query(j0), vis.last_query(min(j0 + kRows - 1, L - 1)), BN, L, qt_begin, qt_end);
  if (gridDim.y > 1) {  // split blockIdx.y of the query tiles (params.h, dkdv_splits)
    const int per = (qt_end - qt_begin + (int)gridDim.y) / (int)gridDim.y;
    qt_begin += (int)blockIdx.y * per;
    qt_end = min(qt_end, qt_begin + per - 1);
  }
  // Query tile qt's rows, lse and Δ into buffer b (kCopy: asynchronous; kPlain: loaded).
  auto stage = [&](int qt, int b) {
    const int i0 = qt * BN;
    if constexpr (kMode == kCopy) {
      cuda::async_tile<S, BN, DB, kThreads>(sQ0 + b * BN * S, q, sqk, i0, L, dm.D);
      cuda::async_tile<S, BN, DB, kThreads>(sdO0 + b * BN * S, dout, sv, i0, L, dm.Dv);
      for (int c = threadIdx.x; c < 2 * BN; c += kThreads) {
        const int i = i0 + c % BN;
        const float* src = c < BN ? lse : delta;
        float* dst = c < BN ? sLse0 : sDl0;
        cuda::cp_async4(dst + b * BN + c % BN, i < L ? src + i : src, i < L);
      }
      cuda::cp_async_commit();
    } else {
      load_rows_bf16(sQ0, S, q, sqk, i0, BN, L, dm.D, DB, vec.qk);
      load_rows_bf16(sdO0, S, dout, sv, i0, BN, L, dm.Dv, DB, vec.v);
      for (int c = threadIdx.x; c < BN; c += kThreads) {
        const int i = i0 + c;
        sLse0[c] = i < L ? lse[i] : 0.f;
        sDl0[c] = i < L ? delta[i] : 0.f;
      }
    }
  };
  // kTma: fill n of the ring (query tile qt_begin + n: rows, lse and Δ) by the calling warp; the
  // first also brings the block's keys and values.
  auto fill = [&](int n) {
    const int i0 = (qt_begin + n) * BN, buf = ring.buffer(n);
    ring.fill(n, (n == 0 ? 4 : 2) * BN * 64 * 2 + 2 * BN * 4, [&](uint64_t* bar) {
      cuda::tma_load_4d(sQ0 + buf * BN * S, &maps.q, 0, h, i0, b, bar);
      cuda::tma_load_4d(sdO0 + buf * BN * S, &maps.dout, 0, h, i0, b, bar);
      cuda::tma_load_2d(sLse0 + buf * BN, &maps.lse, i0, bh, bar);
      cuda::tma_load_2d(sDl0 + buf * BN, &maps.delta, i0, bh, bar);
      if (n == 0) {
        cuda::tma_load_4d(sK, &maps.k, 0, h, j0, b, bar);
        cuda::tma_load_4d(sV, &maps.v, 0, h, j0, b, bar);
      }
    });
  };
  const int tiles = qt_end - qt_begin + 1;
  if (tiles <= 0) {  // an empty split: zero partial sums (block-uniform, before any barrier)
    const float zero[DT][4] = {};
    store_partial<DB>(gp, dm, zero, zero, row, b, h, t);
    return;
  }
  if constexpr (kMode == kTma) {
    ring.start(tiles, fill);
  } else if constexpr (kMode == kCopy) {
    cuda::async_tile<S, kRows, DB, kThreads>(sK, k, sqk, j0, L, dm.D);
    cuda::async_tile<S, kRows, DB, kThreads>(sV, v, sv, j0, L, dm.Dv);
    stage(qt_begin, 0);
  } else {
    load_rows_bf16(sK, S, k, sqk, j0, kRows, L, dm.D, DB, vec.qk);
    load_rows_bf16(sV, S, v, sv, j0, kRows, L, dm.Dv, DB, vec.v);
  }

  float dk[DT][4] = {}, dv[DT][4] = {};
  // kKV: dV += P^T dO and dK += dS^T Q on the warpgroup, two commit groups (waited for by the loop).
  auto issue_kv = [&](const float (&pt)[NT][4], const float (&dst)[NT][4], const bf16* sdO, const bf16* sQ) {
    if constexpr (kKV) {
      cuda::wgmma_accumulate_rs<SUB / 16>(dv, pt, sdO);
      cuda::wgmma_accumulate_rs<SUB / 16>(dk, dst, sQ);
    }
  };
  // Step (n, c0): queries c0 .. c0 + SUB - 1 of the ring's tile n (query tile qt_begin + n), with
  // st = S^T and dpt = dP^T already computed when kW: P^T and dS^T, then dV += P^T dO and
  // dK += dS^T Q (kKV: issued on the warpgroup as one commit group, not waited for).
  auto finish = [&](int n, int c0, float (&st)[NT][4], float (&dpt)[NT][4]) {
    const int i0 = (qt_begin + n) * BN, buf = kMode == kPlain ? 0 : n % Cfg::NB;
    const unsigned live = live_groups<SUB / 16>(i0 + c0, lo, hi);
    // (kKV: every warp takes part in the warpgroup's products, at the same instructions (wgmma is
    // .aligned); a warp whose keys no query of the step sees gives zeros, from the masked form)
    if (!live && !kKV) return;
    const bf16* sQ = sQ0 + (buf * BN + c0) * S;
    const bf16* sdO = sdO0 + (buf * BN + c0) * S;
    const float* sLse = sLse0 + buf * BN + c0;
    const float* sDl = sDl0 + buf * BN + c0;
    if constexpr (!kW) {
      warp_dot<DB, NT, Lay>(st, sK, r0, sQ, live);
      warp_dot<DB, NT, Lay>(dpt, sV, r0, sdO, live);
    }
    auto grads = [&](auto masked) {  // st becomes P^T, dpt dS^T
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2, c = nt * 8 + 2 * t + e % 2, i = i0 + c0 + c;
          const bool seen = !decltype(masked)::value || (i >= lo[r] && i <= hi[r]);
          const float pr = seen ? fast_exp2(st[nt][e] * dm.scale2 - sLse[c] * kLog2e) : 0.f;
          st[nt][e] = pr;
          dpt[nt][e] = pr * (dpt[nt][e] - sDl[c]);
        }
    };
    if (all_visible(i0 + c0, i0 + c0 + SUB - 1, lo, hi)) grads(std::false_type{});
    else grads(std::true_type{});
    if constexpr (kKV) {
      issue_kv(st, dpt, sdO, sQ);
    } else {
      warp_accumulate<DB, NT, Lay>(dv, st, sdO, live);  // dV += P^T dO
      warp_accumulate<DB, NT, Lay>(dk, dpt, sQ, live);  // dK += dS^T Q
    }
  };
  if constexpr (kW && BN / SUB == 2) {
    // Both steps of a tile issued as two commit groups; step 1's products run while step 0 is
    // finished. Nothing stays in flight across the loop's back edge: an accumulator in flight
    // across it made ptxas serialize the products (warning C7515), and the whole kernel slower
    // (BENCHMARKS.md, twenty-first pass).
    for (int n = 0; n < tiles; ++n) {
      const int buf = ring.buffer(n);
      ring.wait(n);
      float st0[NT][4], dp0[NT][4], st1[NT][4], dp1[NT][4];
      cuda::wgmma_issue2<NT>(st0, sK, sQ0 + buf * BN * S, dp0, sV, sdO0 + buf * BN * S);
      cuda::wgmma_issue2<NT>(st1, sK, sQ0 + (buf * BN + SUB) * S, dp1, sV, sdO0 + (buf * BN + SUB) * S);
      cuda::wgmma_wait<1>();
      cuda::wgmma_fence_operands(st0);
      cuda::wgmma_fence_operands(dp0);
      finish(n, 0, st0, dp0);  // (kKV: two more groups, step 0's dV and dK)
      if constexpr (kKV) cuda::wgmma_wait<2>();  // step 1's S^T, dP^T
      else cuda::wgmma_wait<0>();
      cuda::wgmma_fence_operands(st1);
      cuda::wgmma_fence_operands(dp1);
      finish(n, SUB, st1, dp1);
      if constexpr (kKV) {  // every product done before the buffers are released
        cuda::wgmma_wait<0>();
        cuda::wgmma_fence_operands(dv);
        cuda::wgmma_fence_operands(dk);
      }
      ring.advance(n, tiles, fill);
    }
  } else {
    for (int qt = qt_begin; qt <= qt_end; ++qt) {
      const int n = qt - qt_begin, buf = kMode == kPlain ? 0 : n % Cfg::NB;
      if constexpr (kMode == kTma) {
        ring.wait(n);
      } else if constexpr (kMode == kCopy) {  // as in forward_kernel: one barrier a tile
        cuda::cp_async_wait<0>();
        __syncthreads();
        if (qt < qt_end) stage(qt + 1, buf ^ 1);
      } else {
        __syncthreads();  // the previous tile's sQ, sdO, sLse, sDl are read
        stage(qt, 0);
        __syncthreads();
      }
#pragma unroll
      for (int sub = 0; sub < BN / SUB; ++sub) {
        const int c0 = sub * SUB;  // the step's first query within the tile
        float st[NT][4] = {}, dpt[NT][4] = {};  // rows: keys; columns: queries
        if constexpr (kW)
          cuda::wgmma_dot2<NT>(st, sK, sQ0 + (buf * BN + c0) * S, dpt, sV, sdO0 + (buf * BN + c0) * S);
        finish(n, c0, st, dpt);  // (never kKV: its head dim 64 takes the loop above)
      }
      if constexpr (kMode == kTma) ring.advance(n, tiles, fill);
    }
  }
  if (gridDim.y > 1) {  // split: float32 partial sums, added by sum_partials_kernel
    store_partial<DB>(gp, dm, dk, dv, row, b, h, t);
    return;
  }
  const float scale[2] = {(float)p.scale, (float)p.scale}, one[2] = {1.f, 1.f};
  if constexpr (kMode != kPlain) {  // 16-byte stores through the warp's own rows of sK and sV
    store_rows_staged<DB, Lay>(sK + r0 * S, (bf16*)gp.dk + off_qk, sqk, dk, row, scale, L, dm.D, t);
    store_rows_staged<DB, Lay>(sV + r0 * S, (bf16*)gp.dv + off_v, sv, dv, row, one, L, dm.Dv, t);
  } else {
    store_rows<DB>((bf16*)gp.dk + off_qk, sqk, dk, row, scale, L, dm.D, t);
    store_rows<DB>((bf16*)gp.dv + off_v, sv, dv, row, one, L, dm.Dv, t);
  }
}

// The forward passes its output, the backward its cotangent and gradients (all written or read
// 16 bytes at a time on the asynchronous path).
VecLoads vec_loads(const CausalAttentionParams& p, std::initializer_list<const void*> more) {
  VecLoads vec;
  vec.qk = p.dim % 8 == 0 && aligned16(p.q) && aligned16(p.k);
  vec.v = p.vdim % 8 == 0 && aligned16(p.v);
  for (const void* ptr : more) vec.v = vec.v && aligned16(ptr);
  return vec;
}

// Which kernels take the kTma path when it is possible: HAX_CAUSAL_TMA as a bit mask (1 forward,
// 2 dQ, 4 dK/dV), for comparisons; unset: 7. dK/dV's ring also takes lse and Δ, by 2-d tensor
// maps (L % 4 == 0, else dK/dV takes kCopy), so every ring is filled by TMA tensor copies only.
int tma_mask() {
  static const int mask = cuda::env_switch("HAX_CAUSAL_TMA", 7, 7, "a bit mask: 1 forward, 2 dQ, 4 dK/dV");
  return mask;
}

// Which kTma kernels also run their second products (O += P V, dQ += dS K, dV += P^T dO and
// dK += dS^T Q) on wgmma when p.wgmma_products is on: HAX_CAUSAL_WGMMA2 as a bit mask (1 forward,
// 2 dQ, 4 dK/dV, 8 the forward at 5 blocks an SM, which its 96 registers allow), for comparisons;
// unset: 15.
int wgmma2_mask(const CausalAttentionParams& p) {
  static const int mask =
      cuda::env_switch("HAX_CAUSAL_WGMMA2", 15, 15, "a bit mask: 1 forward, 2 dQ, 4 dK/dV, 8 forward at 5 blocks an SM");
  return p.wgmma_products ? mask : 0;
}

// kTma's conditions: head dims of exactly 64 (the 128-byte swizzled rows), 16-byte aligned
// tensors, a Hopper GPU, and HAX_CAUSAL_TMA not set to 0 (which keeps the kCopy path, for
// comparisons). Fills `maps` when they hold.
bool tma_maps(const CausalAttentionParams& p, const void* dout, TmaMaps& maps) {
  if (tma_mask() == 0 || p.dim != 64 || p.vdim != 64) return false;
  for (const void* ptr : {p.q, p.k, p.v, dout})
    if (ptr && !aligned16(ptr)) return false;
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      major < 9)
    return false;
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (!encode) return false;
  auto make = [&](CUtensorMap& map, const void* base) {
    if (!base) return true;
    const cuuint64_t dims[4] = {64, (cuuint64_t)p.nheads, (cuuint64_t)p.seqlen, (cuuint64_t)p.batch};
    const cuuint64_t strides[3] = {64 * 2, (cuuint64_t)p.nheads * 64 * 2, (cuuint64_t)p.seqlen * p.nheads * 64 * 2};
    const cuuint32_t box[4] = {64, 1, 64, 1}, unit[4] = {1, 1, 1, 1};
    return encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(base), dims, strides, box, unit,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  return make(maps.q, p.q) && make(maps.k, p.k) && make(maps.v, p.v) && make(maps.dout, dout);
}

// dK/dV's kTma also needs lse and Δ as tensor maps: rows of L float32 a (b, h), whose stride
// must be a multiple of 16 bytes (L % 4 == 0). Call after tma_maps.
bool tma_row_maps(const CausalAttentionGradParams& gp, TmaMaps& maps) {
  const CausalAttentionParams& p = gp.fwd;
  if (p.seqlen % 4 != 0) return false;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess)
    return false;
  const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  auto make = [&](CUtensorMap& map, const void* base) {
    if (!aligned16(base)) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)p.seqlen, (cuuint64_t)(p.batch * p.nheads)};
    const cuuint64_t strides[1] = {(cuuint64_t)p.seqlen * 4};
    const cuuint32_t box[2] = {64, 1}, unit[2] = {1, 1};
    return encode(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<void*>(base), dims, strides, box, unit,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  return make(maps.lse, p.lse) && make(maps.delta, gp.workspace);
}

}  // namespace

void forward_mma(const CausalAttentionParams& p, cudaStream_t stream) {
  const Dims dm = make_dims(p, kRows);
  const unsigned grid = grid_size(dm);
  const VecLoads vec = vec_loads(p, {p.out});
  TmaMaps maps{};
  const bool tma = vec.qk && vec.v && tma_maps(p, nullptr, maps);
  HAX_CAUSAL_DISPATCH_HEAD_DIM(std::max(dm.D, dm.Dv), [&] {
    // (kTma kernels exist at head dim 64 only; the condition is dependent here, so the others
    // are not compiled)
    auto launch = [&](auto mode, auto w2) {
      constexpr int kM = decltype(mode)::value;
      constexpr int kW2 = decltype(w2)::value;
      if constexpr ((kM != kTma || DB == 64) && (kW2 == 0 || kM == kTma)) {
        constexpr size_t smem = FwdCfg<DB, kM>::smem;
        auto kernel = p.sink > 0 ? forward_kernel<DB, kM, true, kW2> : forward_kernel<DB, kM, false, kW2>;
        allow_smem(kernel, smem, "causal_attention_forward_cuda");
        kernel<<<grid, kThreads, smem, stream>>>(p, dm, vec, maps);
      }
    };
    if constexpr (DB == 64)
      if (tma && (tma_mask() & 1)) {
        if (wgmma2_mask(p) & 8) return launch(std::integral_constant<int, kTma>{}, std::integral_constant<int, 2>{});
        if (wgmma2_mask(p) & 1) return launch(std::integral_constant<int, kTma>{}, std::integral_constant<int, 1>{});
        return launch(std::integral_constant<int, kTma>{}, std::integral_constant<int, 0>{});
      }
    if (vec.qk && vec.v) launch(std::integral_constant<int, kCopy>{}, std::integral_constant<int, 0>{});
    else launch(std::integral_constant<int, kPlain>{}, std::integral_constant<int, 0>{});
  });
  cuda::check_launch("causal_attention_forward_cuda (tensor cores)");
}

void backward_mma(const CausalAttentionGradParams& gp, cudaStream_t stream) {
  Dims dm = make_dims(gp.fwd, kRows);
  const unsigned grid = grid_size(dm);
  // dK/dV: the key tiles below KR (params.h, key_rows), times the splits of their query tiles.
  const int64_t KR = causal_attention_key_rows(gp), splits = gp.dkdv_splits > 1 ? gp.dkdv_splits : 1;
  if (splits > 65535 || (splits > 1 && !gp.partial))
    throw std::runtime_error("causal_attention_backward_cuda: dkdv_splits = " + std::to_string(splits) +
                             " must be at most 65535 and come with its partial buffer");
  dm.KR = (int)KR;
  const dim3 grid_kv((unsigned)((KR / kRows) * dm.BH), (unsigned)splits);
  const VecLoads vec = vec_loads(gp.fwd, {gp.fwd.out, gp.dout, gp.dq, gp.dk, gp.dv});
  TmaMaps maps{};
  const bool tma = vec.qk && vec.v && tma_maps(gp.fwd, gp.dout, maps);
  HAX_CAUSAL_DISPATCH_HEAD_DIM(std::max(dm.D, dm.Dv), [&] {
    // (kTma kernels: their second products on wgmma where wgmma2_mask() says so)
    auto launch = [&](auto mode_q, auto mode_kv) {
      constexpr int kQ = decltype(mode_q)::value, kKV = decltype(mode_kv)::value;
      if constexpr ((kQ != kTma && kKV != kTma) || DB == 64) {  // (as in forward_mma)
        constexpr size_t smem_q = DqCfg<DB, kQ>::smem, smem_kv = DkdvCfg<DB, kKV>::smem;
        const int w2 = wgmma2_mask(gp.fwd);
        auto dq = dq_kernel<DB, kQ, false>;
        auto dkdv = dkdv_kernel<DB, kKV, false>;
        if constexpr (kQ == kTma)
          if (w2 & 2) dq = dq_kernel<DB, kQ, true>;
        if constexpr (kKV == kTma)
          if (w2 & 4) dkdv = dkdv_kernel<DB, kKV, true>;
        allow_smem(dq, smem_q, "causal_attention_backward_cuda");
        allow_smem(dkdv, smem_kv, "causal_attention_backward_cuda");
        dq<<<grid, kThreads, smem_q, stream>>>(gp, dm, vec, maps);
        dkdv<<<grid_kv, kThreads, smem_kv, stream>>>(gp, dm, vec, maps);
      }
    };
    using Tma = std::integral_constant<int, kTma>;
    using Copy = std::integral_constant<int, kCopy>;
    if constexpr (DB == 64)
      if (tma) {
        const int m = tma_mask() & (tma_row_maps(gp, maps) ? 6 : 2);
        if (m == 6) return launch(Tma{}, Tma{});
        if (m == 2) return launch(Tma{}, Copy{});
        if (m == 4) return launch(Copy{}, Tma{});
      }
    if (vec.qk && vec.v) launch(Copy{}, Copy{});
    else launch(std::integral_constant<int, kPlain>{}, std::integral_constant<int, kPlain>{});
  });
  cuda::check_launch("causal_attention_backward_cuda (tensor cores)");
  if (splits > 1) {
    const int64_t n = gp.fwd.batch * std::min<int64_t>(KR, dm.L) * dm.H * (dm.D + dm.Dv);
    sum_partials_kernel<<<(unsigned)std::min<int64_t>(cuda::ceil_div(n, 256), 4096), 256, 0, stream>>>(gp, dm);
    cuda::check_launch("causal_attention_backward_cuda (split sums)");
  }
  if (KR < dm.L) {  // rows no query sees: zero gradients, one 2-d memset per tensor
    const int64_t B = gp.fwd.batch, row_k = (int64_t)dm.H * dm.D * 2, row_v = (int64_t)dm.H * dm.Dv * 2;
    const int64_t rest = dm.L - KR;
    auto zero = [&](void* base, int64_t row_bytes) {
      if (cudaMemset2DAsync((char*)base + KR * row_bytes, dm.L * row_bytes, 0, rest * row_bytes, B, stream) != cudaSuccess)
        throw std::runtime_error("causal_attention_backward_cuda: zeroing the unseen key rows failed");
    };
    zero(gp.dk, row_k);
    zero(gp.dv, row_v);
  }
}

}  // namespace hax::ops::causal_cuda
