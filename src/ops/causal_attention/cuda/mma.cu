// Causal attention of bfloat16 tensors on tensor cores: the same algorithm as simt.cu (whose
// header has it; cpu.cpp has the formulas), with every tile product an mma.sync m16n8k16
// (bfloat16 operands, float32 accumulation). Scores, the softmax and all accumulators are float32;
// P and dS are rounded to bfloat16 to enter the second product of each step (as in
// FlashAttention-2).
//
// A block is 4 warps and owns 64 rows (queries for the forward and dQ, keys for dK/dV); warp w
// owns rows 16w..16w+15 and loops over column tiles (keys, resp. queries) of BN. Operand tiles sit
// in shared memory row-major, (rows, DB + 8) bfloat16; ops/cuda/mma_bf16.cuh has the fragments
// (read with ldmatrix). A warp skips the 16-column groups of a tile that none of its rows sees
// (live_groups): with a window, its 16 rows need about W + 16 of the block's columns.
//
// forward: S = Q K^T, online softmax (per-thread partial row sums, reduced over the row's 4 lanes
//   at the end), O += P V.
// dQ: Δ = dO·O - dlse of the block's rows first (written to gp.workspace for the dK/dV kernel,
//   launched after it), then S = Q K^T, dP = dO V^T, dS = P ∘ (dP - Δ), dQ += dS K, over key
//   sub-tiles of 32.
// dK, dV: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, over query sub-tiles of 32
//   (the two float32 accumulators of 16 x DB leave room for little more in registers).
// No atomics: each gradient entry is accumulated by one thread in a fixed order.
//
// Memory access (16-byte rows, the kAsync path): column tiles are double-buffered by cp.async
// with one barrier per tile (after the wait; the next tile is then issued into the buffer every
// warp has finished with); each warp writes its output rows through its own rows of a shared
// tile (store_rows_staged), so that global stores are whole 16-byte chunks. ncu on the H100 shows
// the kernels bound by each warp's dependency chain (ldmatrix -> mma -> row max -> exp -> mma) at
// 4 warps a scheduler, not by their loads. BENCHMARKS.md records what did not help: a streaming
// design (blocks over strips of tiles; eighth pass) and rings of tile buffers on mbarriers with
// no block barrier a tile, filled by per-row bulk copies or by TMA (ninth pass: the TMA version
// timed the forward and dQ as this path does, to 0.3 us).
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "ops/causal_attention/cuda/kernels.cuh"
#include "ops/causal_attention/cuda/tiles.cuh"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/mma_bf16.cuh"

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

// kAsync (16-byte rows: head dims multiples of 8, aligned tensors): the next column tile is
// copied with cp.async into a second buffer while the current one is computed on; otherwise each
// tile is loaded, then computed on.
template <int DB, bool kAsync>
struct FwdCfg {
  static constexpr int BN = 64, S = DB + 8, NB = kAsync ? 2 : 1;
  static constexpr size_t smem = sizeof(bf16) * (kRows + 2 * NB * BN) * S;  // sQ, sK[NB], sV[NB]
};

template <int DB, bool kAsync>
__global__ void __launch_bounds__(kThreads, DB <= 64 ? kMinBlocks : 2) forward_kernel(CausalAttentionParams p, Dims dm, VecLoads vec) {
  using Cfg = FwdCfg<DB, kAsync>;
  constexpr int BN = Cfg::BN, S = Cfg::S, NT = BN / 8, DT = DB / 8;
  extern __shared__ uint4 smem_u4[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_u4);
  bf16* sK0 = sQ + kRows * S;
  bf16* sV0 = sK0 + Cfg::NB * BN * S;
  const int L = dm.L, H = dm.H, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = threadIdx.x / 32 * 16;
  const int bh = bh_of(dm), b = bh / H, h = bh % H, i0 = tile_of(dm, true) * kRows;
  const int64_t sqk = (int64_t)H * dm.D, sv = (int64_t)H * dm.Dv;
  const int64_t off_qk = ((int64_t)b * L * H + h) * dm.D, off_v = ((int64_t)b * L * H + h) * dm.Dv;
  const bf16* q = (const bf16*)p.q + off_qk;
  const bf16* k = (const bf16*)p.k + off_qk;
  const bf16* v = (const bf16*)p.v + off_v;
  const int32_t* seq = p.seq_idx ? p.seq_idx + (int64_t)b * L : nullptr;

  const int row[2] = {i0 + r0 + g, i0 + r0 + g + 8};  // the thread's two query rows
  int lo[2], hi[2];                                    // the keys each row sees (empty past L)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lo[r] = row[r] < L ? first_key(seq, dm.W, row[r]) : INT_MAX;
    hi[r] = row[r] < L ? row[r] : -1;
  }
  const int kt_begin = first_key(seq, dm.W, i0) / BN, kt_end = min(i0 + kRows - 1, L - 1) / BN;
  // Tile kt's keys and values into buffer b (asynchronous path).
  auto issue = [&](int kt, int b) {
    const int j0 = kt * BN;
    cuda::async_tile<S, BN, DB, kThreads>(sK0 + b * BN * S, k, sqk, j0, L, dm.D);
    cuda::async_tile<S, BN, DB, kThreads>(sV0 + b * BN * S, v, sv, j0, L, dm.Dv);
    cuda::cp_async_commit();
  };
  if constexpr (kAsync) {
    cuda::async_tile<S, kRows, DB, kThreads>(sQ, q, sqk, i0, L, dm.D);
    issue(kt_begin, 0);  // one group with sQ
  } else {
    load_rows_bf16(sQ, S, q, sqk, i0, kRows, L, dm.D, DB, vec.qk);
  }

  float o[DT][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  for (int kt = kt_begin; kt <= kt_end; ++kt) {
    const int j0 = kt * BN, buf = kAsync ? (kt - kt_begin) & 1 : 0;
    const bf16* sK = sK0 + buf * BN * S;
    const bf16* sV = sV0 + buf * BN * S;
    if constexpr (kAsync) {
      // Tile kt has landed (this thread's copies: the wait; everyone's: the barrier), and every
      // warp is done with tile kt - 1, so its buffer takes tile kt + 1.
      cuda::cp_async_wait<0>();
      __syncthreads();
      if (kt < kt_end) issue(kt + 1, buf ^ 1);
    } else {
      __syncthreads();  // the previous tile's sK, sV are read
      load_rows_bf16(sK0, S, k, sqk, j0, BN, L, dm.D, DB, vec.qk);
      load_rows_bf16(sV0, S, v, sv, j0, BN, L, dm.Dv, DB, vec.v);
      __syncthreads();
    }
    const unsigned live = live_groups<BN / 16>(j0, lo, hi);
    if (live) {
      float s[NT][4] = {};
      warp_dot<DB, NT, S>(s, sQ, r0, sK, live);
      float mx[2] = {-INFINITY, -INFINITY};
      auto scores = [&](auto masked) {  // -inf where not visible (scaled in the softmax step)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2, j = j0 + nt * 8 + 2 * t + e % 2;
            const bool vis = !decltype(masked)::value || (j <= row[r] && j >= lo[r]);
            if (!vis) s[nt][e] = -INFINITY;
            mx[r] = fmaxf(mx[r], s[nt][e]);
          }
      };
      if (all_visible(j0, j0 + BN - 1, lo, hi)) scores(std::false_type{});
      else scores(std::true_type{});
      online_softmax_step<NT, DT>(s, mx, m, l, o, dm.scale2);
      warp_accumulate<DB, NT, S>(o, s, sV, live);
    }
  }

  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = sum4(l[r]);
    inv[r] = 1.f / l[r];
  }
  // 16-byte stores through the warp's own rows of sQ (which only this warp reads).
  if constexpr (kAsync) store_rows_staged<DB, S>(sQ + r0 * S, (bf16*)p.out + off_v, sv, o, row, inv, L, dm.Dv, t);
  else store_rows<DB>((bf16*)p.out + off_v, sv, o, row, inv, L, dm.Dv, t);
  float* lse = (float*)p.lse + (int64_t)bh * L;
#pragma unroll
  for (int r = 0; r < 2; ++r)
    if (t == 0 && row[r] < L) lse[row[r]] = m[r] * kLn2 + logf(l[r]);
}

template <int DB, bool kAsync>
struct DqCfg {
  static constexpr int BN = DB == 128 ? 32 : 64;  // keys staged per step
  static constexpr int SUB = 32;                   // keys per product step (BN / SUB steps)
  static constexpr int S = DB + 8, NB = kAsync ? 2 : 1;
  // sQ, sdO, sK[NB], sV[NB], then Δ of the block's rows (float32)
  static constexpr size_t smem = sizeof(bf16) * (2 * kRows + 2 * NB * BN) * S + sizeof(float) * kRows;
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

// The same Δ for the asynchronous path, in two halves: `load` issues the block's O rows as
// 16-byte chunks into registers (before the tiles' copies are waited for, so the two latencies
// overlap), `finish` (after sdO has landed) forms the dot products, reduced over the threads of a
// row (consecutive threads take consecutive chunks of a row: whole 32-byte sectors). Needs
// Dv % 8 == 0 and 16-byte aligned rows.
template <int DB, int S>
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
      const bf16* gv = sdO + rr * S + c;  // zeros past L and past Dv
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

template <int DB, bool kAsync>
__global__ void __launch_bounds__(kThreads, DB <= 64 ? kMinBlocks : 2) dq_kernel(CausalAttentionGradParams gp, Dims dm, VecLoads vec) {
  using Cfg = DqCfg<DB, kAsync>;
  constexpr int BN = Cfg::BN, SUB = Cfg::SUB, S = Cfg::S, NT = SUB / 8, DT = DB / 8;
  const CausalAttentionParams& p = gp.fwd;
  extern __shared__ uint4 smem_u4[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_u4);
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
  const int32_t* seq = p.seq_idx ? p.seq_idx + (int64_t)b * L : nullptr;

  const int kt_begin = first_key(seq, dm.W, i0) / BN, kt_end = min(i0 + kRows - 1, L - 1) / BN;
  auto issue = [&](int kt, int b) {
    const int j0 = kt * BN;
    cuda::async_tile<S, BN, DB, kThreads>(sK0 + b * BN * S, k, sqk, j0, L, dm.D);
    cuda::async_tile<S, BN, DB, kThreads>(sV0 + b * BN * S, v, sv, j0, L, dm.Dv);
    cuda::cp_async_commit();
  };
  const int row[2] = {i0 + r0 + g, i0 + r0 + g + 8};
  float lse_row[2];  // lse of the thread's rows, loaded first: its latency overlaps the tile copies'
#pragma unroll
  for (int r = 0; r < 2; ++r) lse_row[r] = row[r] < L ? lse[row[r]] : 0.f;
  if constexpr (kAsync) {
    BlockDelta<DB, S> bd;
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
    lo[r] = in ? first_key(seq, dm.W, row[r]) : INT_MAX;
    hi[r] = in ? row[r] : -1;
    lse2[r] = lse_row[r] * kLog2e;
    dl[r] = sDl[r0 + g + 8 * r];
  }

  float acc[DT][4] = {};
  for (int kt = kt_begin; kt <= kt_end; ++kt) {
    const int j0 = kt * BN, buf = kAsync ? (kt - kt_begin) & 1 : 0;
    const bf16* sK = sK0 + buf * BN * S;
    const bf16* sV = sV0 + buf * BN * S;
    if constexpr (kAsync) {  // as in forward_kernel: one barrier a tile
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
      if (!live) continue;
      const bf16* sKs = sK + sub * SUB * S;
      float s[NT][4] = {}, dp[NT][4] = {};
      warp_dot<DB, NT, S>(s, sQ, r0, sKs, live);
      warp_dot<DB, NT, S>(dp, sdO, r0, sV + sub * SUB * S, live);
      auto grads = [&](auto masked) {  // s becomes dS
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2, j = c0 + nt * 8 + 2 * t + e % 2;
            const bool vis = !decltype(masked)::value || (j <= row[r] && j >= lo[r]);
            const float pr = vis ? fast_exp2(s[nt][e] * dm.scale2 - lse2[r]) : 0.f;
            s[nt][e] = pr * (dp[nt][e] - dl[r]);
          }
      };
      if (all_visible(c0, c0 + SUB - 1, lo, hi)) grads(std::false_type{});
      else grads(std::true_type{});
      warp_accumulate<DB, NT, S>(acc, s, sKs, live);  // dQ += dS K
    }
  }
  const float scale[2] = {(float)p.scale, (float)p.scale};
  // 16-byte stores through the warp's own rows of sQ (read by this warp only since Δ).
  if constexpr (kAsync) store_rows_staged<DB, S>(sQ + r0 * S, (bf16*)gp.dq + off_qk, sqk, acc, row, scale, L, dm.D, t);
  else store_rows<DB>((bf16*)gp.dq + off_qk, sqk, acc, row, scale, L, dm.D, t);
}

template <int DB, bool kAsync>
struct DkdvCfg {
  static constexpr int BN = DB == 128 ? 32 : 64;  // queries staged per step
  static constexpr int SUB = 32;                   // queries per product step (BN / SUB steps)
  static constexpr int S = DB + 8, NB = kAsync ? 2 : 1;
  static constexpr size_t smem = sizeof(bf16) * (2 * kRows + 2 * NB * BN) * S + sizeof(float) * 2 * NB * BN;
};

template <int DB, bool kAsync>
__global__ void __launch_bounds__(kThreads, DB <= 64 ? kMinBlocks : 2)
    dkdv_kernel(CausalAttentionGradParams gp, Dims dm, VecLoads vec) {
  using Cfg = DkdvCfg<DB, kAsync>;
  constexpr int BN = Cfg::BN, SUB = Cfg::SUB, S = Cfg::S, NT = SUB / 8, DT = DB / 8;
  const CausalAttentionParams& p = gp.fwd;
  extern __shared__ uint4 smem_u4[];
  bf16* sK = reinterpret_cast<bf16*>(smem_u4);
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
  const int32_t* seq = p.seq_idx ? p.seq_idx + (int64_t)b * L : nullptr;

  const int row[2] = {j0 + r0 + g, j0 + r0 + g + 8};  // the thread's two key rows
  int lo[2], hi[2];                                    // the queries each key is seen by (empty past L)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lo[r] = row[r] < L ? row[r] : INT_MAX;
    hi[r] = row[r] < L ? last_query(seq, L, dm.W, row[r]) : -1;
  }
  const int qt_begin = j0 / BN, qt_end = last_query(seq, L, dm.W, min(j0 + kRows - 1, L - 1)) / BN;
  // Query tile qt's rows, lse and Δ into buffer b (the copies asynchronous when kAsync).
  auto stage = [&](int qt, int b) {
    const int i0 = qt * BN;
    if constexpr (kAsync) {
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
  if constexpr (kAsync) {
    cuda::async_tile<S, kRows, DB, kThreads>(sK, k, sqk, j0, L, dm.D);
    cuda::async_tile<S, kRows, DB, kThreads>(sV, v, sv, j0, L, dm.Dv);
    stage(qt_begin, 0);
  } else {
    load_rows_bf16(sK, S, k, sqk, j0, kRows, L, dm.D, DB, vec.qk);
    load_rows_bf16(sV, S, v, sv, j0, kRows, L, dm.Dv, DB, vec.v);
  }

  float dk[DT][4] = {}, dv[DT][4] = {};
  for (int qt = qt_begin; qt <= qt_end; ++qt) {
    const int i0 = qt * BN, buf = kAsync ? (qt - qt_begin) & 1 : 0;
    if constexpr (kAsync) {  // as in forward_kernel: one barrier a tile
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
      const unsigned live = live_groups<SUB / 16>(i0 + c0, lo, hi);
      if (!live) continue;
      const bf16* sQ = sQ0 + (buf * BN + c0) * S;
      const bf16* sdO = sdO0 + (buf * BN + c0) * S;
      const float* sLse = sLse0 + buf * BN + c0;
      const float* sDl = sDl0 + buf * BN + c0;
      float st[NT][4] = {}, dpt[NT][4] = {};  // rows: keys; columns: queries
      warp_dot<DB, NT, S>(st, sK, r0, sQ, live);
      warp_dot<DB, NT, S>(dpt, sV, r0, sdO, live);
      auto grads = [&](auto masked) {  // st becomes P^T, dpt dS^T
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2, c = nt * 8 + 2 * t + e % 2, i = i0 + c0 + c;
            const bool vis = !decltype(masked)::value || (i >= row[r] && i <= hi[r]);
            const float pr = vis ? fast_exp2(st[nt][e] * dm.scale2 - sLse[c] * kLog2e) : 0.f;
            st[nt][e] = pr;
            dpt[nt][e] = pr * (dpt[nt][e] - sDl[c]);
          }
      };
      if (all_visible(i0 + c0, i0 + c0 + SUB - 1, lo, hi)) grads(std::false_type{});
      else grads(std::true_type{});
      warp_accumulate<DB, NT, S>(dv, st, sdO, live);  // dV += P^T dO
      warp_accumulate<DB, NT, S>(dk, dpt, sQ, live);  // dK += dS^T Q
    }
  }
  const float scale[2] = {(float)p.scale, (float)p.scale}, one[2] = {1.f, 1.f};
  if constexpr (kAsync) {  // 16-byte stores through the warp's own rows of sK and sV
    store_rows_staged<DB, S>(sK + r0 * S, (bf16*)gp.dk + off_qk, sqk, dk, row, scale, L, dm.D, t);
    store_rows_staged<DB, S>(sV + r0 * S, (bf16*)gp.dv + off_v, sv, dv, row, one, L, dm.Dv, t);
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

}  // namespace

void forward_mma(const CausalAttentionParams& p, cudaStream_t stream) {
  const Dims dm = make_dims(p, kRows);
  const unsigned grid = grid_size(dm);
  const VecLoads vec = vec_loads(p, {p.out});
  HAX_CAUSAL_DISPATCH_HEAD_DIM(std::max(dm.D, dm.Dv), [&] {
    auto launch = [&](auto async) {
      constexpr bool kA = decltype(async)::value;
      constexpr size_t smem = FwdCfg<DB, kA>::smem;
      allow_smem(forward_kernel<DB, kA>, smem, "causal_attention_forward_cuda");
      forward_kernel<DB, kA><<<grid, kThreads, smem, stream>>>(p, dm, vec);
    };
    if (vec.qk && vec.v) launch(std::true_type{});
    else launch(std::false_type{});
  });
  cuda::check_launch("causal_attention_forward_cuda (tensor cores)");
}

void backward_mma(const CausalAttentionGradParams& gp, cudaStream_t stream) {
  const Dims dm = make_dims(gp.fwd, kRows);
  const unsigned grid = grid_size(dm);
  const VecLoads vec = vec_loads(gp.fwd, {gp.fwd.out, gp.dout, gp.dq, gp.dk, gp.dv});
  HAX_CAUSAL_DISPATCH_HEAD_DIM(std::max(dm.D, dm.Dv), [&] {
    auto launch = [&](auto async) {
      constexpr bool kA = decltype(async)::value;
      constexpr size_t smem_q = DqCfg<DB, kA>::smem, smem_kv = DkdvCfg<DB, kA>::smem;
      allow_smem(dq_kernel<DB, kA>, smem_q, "causal_attention_backward_cuda");
      allow_smem(dkdv_kernel<DB, kA>, smem_kv, "causal_attention_backward_cuda");
      dq_kernel<DB, kA><<<grid, kThreads, smem_q, stream>>>(gp, dm, vec);
      dkdv_kernel<DB, kA><<<grid, kThreads, smem_kv, stream>>>(gp, dm, vec);
    };
    if (vec.qk && vec.v) launch(std::true_type{});
    else launch(std::false_type{});
  });
  cuda::check_launch("causal_attention_backward_cuda (tensor cores)");
}

}  // namespace hax::ops::causal_cuda
