// CUDA backward of the chunked SSD scan (cpu.cpp's backward_impl is the reference and states the
// gradient formulas; notation in chunk.cuh). Per (row, head, sub-chunk), with M = cb ∘ Gm the
// masked decayed matrix (Gm_ij = [j<=i][s_i=s_j] exp(cs_i - cs_j)), dS the gradient of the state
// leaving the sub-chunk and S the state entering it:
//   dXd_j   = w_j Σ_n B_j[n] dS[n][.] + Σ_i M_ij dy_i              dx = dt dXd
//   dM_ij   = dy_i . Xd_j,  dCB = dM ∘ Gm (summed over the group's heads)
//   dB_j    = Σ_heads w_j Xd_j^T dS + Σ_i dCB_ij C_i,   dC_i = Σ_heads re_i dy_i^T S + Σ_j dCB_ij B_j
//   dS_enter = g dS + Σ_i re_i C_i dy_i^T  (the reverse pass over sub-chunks; dinit at the start)
//   d(cs_i)  = intra_i + u_i - v_i + [i = last] (Σ_j v_j + g <dS, S>), with
//     intra_i = Σ_j dM_ij M_ij - Σ_j dM_ji M_ji,  v_j = Xd_j . (Σ_n w_j B_j[n] dS[n][.]),
//     u_i = dy_i . (re_i Σ_n C_i[n] S[n][.])
//   da_t = Σ_{i>=t} d(cs_i);  ddt_t = da_t A + x_t . dXd_t;  dA = Σ_t da_t dt_t.
// Launches, in order:
//   1-2. prep_kernel, cb_kernel (as the forward; skipped when p.prepped: the autograd op keeps
//        the forward's cs, decay and cb, 20 MB at L = 64K, H 16, and saves their ~40 us)
//   3.   with several sub-chunks per chunk: local states + a pass restarted from chunk_states at
//        each chunk, giving the entering state of every sub-chunk (else chunk_states has them)
//   4.   local_state_kernel<kGrad>: Σ_i re_i C_i dy_i^T per sub-chunk (or its wgmma form,
//        local_state_wgmma.cuh, launch_local_state)
//   5.   state_pass_kernel<kReverse>: dS of every sub-chunk, dinit
//   6.   dx_kernel    per (row, head, sub-chunk): dx, and the per-step v, u, x.dXd, and g <dS, S>
//                    (u not where 8 runs its wgmma form: kY false)
//   7.   dcb_kernel   per (row, group, sub-chunk), heads in order: dM, intra_i, dCB summed over heads
//                    (launched after 4 on a side stream, ops/cuda/side_stream.cuh: it needs neither
//                    states nor dx's results, and runs beside 5 and 6; joined before 8)
//   8.   dbdc_kernel  per (row, group, sub-chunk, 64 columns of N, dB or dC): heads summed in the
//                    product's k (no atomics); its wgmma form (dbdc_wgmma.cuh) also gives u, in
//                    a part per 64 columns of N (grad_rows.cuh)
//   9.   ddt_kernel   one thread per (row, head, sub-chunk): d(cs), its reverse cumsum, ddt, dA
//  10.   da_kernel    block per (row, head): dA_part summed over sub-chunks (fixed order)
// Every reduction has a fixed order: the backward is deterministic.
// Speed: as in the forward, staging is vectorized where P and N are multiples of 8 (kVec) and
// register budgets keep 4-6 blocks per SM. dx_kernel runs its two state products one after the
// other (Y folded into u before X starts) so that one accumulator tile is live at a time. dcb
// and dbdc (bfloat16) copy their raw tiles by cp.async, the next head's while the current one
// multiplies. At L = 64K (B 1, H 16, P 64, N 128, bf16) on an H100, ncu, in ms: local_state 0.46,
// pass 0.20, dx 1.50, dcb 0.29, dbdc 0.52, the rest about 0.15. Three forms of dx measured no
// faster there and are not used (BENCHMARKS.md, tenth pass): every raw tile copied by cp.async
// up front (1.79 ms at 2 blocks an SM; branch exp/ssd-async), the stages double-buffered as in
// dbdc (1.53; exp/ssd-dx-stages), and the epilogue in pairs of columns (1.60: more spills).
// Since (H100, 2026-11-23: `hax bench ssm` fwd+bwd at 64K 3.85 -> 3.50 ms; 3.52 without the dx
// stores through the tile): dx_kernel (bfloat16, kVec) copies its dy and x tiles (the sub-chunk's
// steps x 64 columns) by cp.async at the start of each 64 columns, in flight during the Y product;
// its three epilogues read them from shared memory in pairs of columns, where they were scalar
// 2-byte global loads consumed at once (42% of the warp samples stalled on long_sb in an ncu
// source profile, the top ones on those loads), and the intra product takes dy from its tile as
// stored (mma_slab_kn) instead of staging it again; dx goes out through the dy tile, 16 bytes a
// store (the 2-byte stores of the accumulator layout used a quarter of each sector). Static shared
// memory 48128 bytes a block (was 29696; the static limit is 49152): 4 blocks an SM still fit,
// and ptxas spills less (4 bytes of stores, was 52). The dx 1.50 ms above is from before this.
// Then, as local_state's vectorized form: dx_kernel (bfloat16, kVec) stages no operand
// transposed. S and dS enter in their [n][p] layout (S by 16-byte stores, dS by cp.async) and M as
// [i][j] rows, all read by ldmatrix.trans; same buffers, same shared memory. H100, ncu, 2026-11-23:
// dx 1.04 -> 0.91 ms; local_state (gradient) is 0.25 ms now, dbdc 0.52, dcb 0.30, pass 0.20.
// With chunk.cuh's heads-fastest block order and dbdc's row factors loaded a head ahead
// (2026-11-24): dx 0.83, dbdc 0.37, local_state (gradient) 0.23, dcb 0.30, pass 0.20 ms.
// With the wgmma forms (H200, ncu, L = 64K, 2026-11-29, BENCHMARKS.md pass 29): local_state
// (either direction) 0.25 -> 0.20 ms; dB/dC 0.38 (mma.sync) -> 0.42 ms with u moved into it, and dx
// without the Y product 0.83 -> 0.67 ms; `hax bench ssm` fwd+bwd at 64K 2.33-2.37 -> 2.10-2.19 ms.
#include "ops/cuda/side_stream.cuh"
#include "ops/ssd/cuda/dbdc_wgmma.cuh"
#include "ops/ssd/cuda/grad_rows.cuh"
#include "ops/ssd/cuda/local_state_wgmma.cuh"
#include "ops/ssd/cuda/state_pass.cuh"

namespace hax::ops {
namespace ssd_cuda {
namespace {


// for_each over the thread's elements (same order) with v, the entry (i, q) of a raw bfloat16
// 64 x 64 tile in shared memory (rows Operand::kLd apart): f(mi, ni, r, i, q, rs, v). Each pair of
// the thread's adjacent columns is one 32-bit load, free of bank conflicts (a warp's 8 rows x 4
// pairs fall in 32 distinct banks with rows 36 words apart).
template <class F>
__device__ __forceinline__ void for_each_entry(const __nv_bfloat16* tile, F&& f) {
  for_each_pair([&](int mi, int ni, int rp, int i, int q) {
    const uint32_t w = load_pair(tile + i * Operand<__nv_bfloat16>::kLd + q);
    f(mi, ni, 2 * rp, i, q, mi * 2 + rp, __uint_as_float(w << 16));                   // column q
    f(mi, ni, 2 * rp + 1, i, q + 1, mi * 2 + rp, __uint_as_float(w & 0xffff0000u));  // q + 1
  });
}

// M_ij = [j <= i < len][seq_i = seq_j] cb_ij exp(cs_i - cs_j) of one (row, head, sub-chunk), staged
// [i][j] (rows i, 16-byte octets along j) as bfloat16 halves hi and lo (store8's split). Only the
// 288 octets on or below the diagonal (octet column j / 8 <= i / 8) are computed, numbered by row
// block io (rows 8 io .. 8 io + 7, from octet 4 io (io + 1)) and in it column-major, so that the
// 8 lanes of a column write 8 rows 144 bytes apart (no bank conflicts); the 224 above the diagonal
// are zeros. The exponential is __expf (ex2.approx: a few ulp against expf's full range reduction;
// M enters the product as hi + lo, about 16 bits), cs comes in 16-byte shared loads, and one_seq
// (no reset among the sub-chunk's steps) skips the sequence test. Staged with every octet through
// stage_op and expf, this took about 1000 of dx_kernel's 3600 instructions a warp (ncu, H200, L =
// 64K, 2026-11-29). sv 16-byte aligned.
__device__ __forceinline__ void stage_decayed_mask(__nv_bfloat16* hi, __nv_bfloat16* lo, const float* cb,
                                                   const StepVals& sv, int len, bool one_seq) {
  constexpr int kLower = 4 * 8 * 9;  // octets on or below the diagonal: Σ_io 8 (io + 1)
#pragma unroll
  for (int e = 0; e < (kLower + kThreads - 1) / kThreads; ++e) {
    const int o = threadIdx.x + e * kThreads;
    if (o >= kLower) break;
    int io = 0;
#pragma unroll
    for (int k = 1; k < 8; ++k) io += o >= 4 * k * (k + 1);
    const int local = o - 4 * io * (io + 1);
    const int i = 8 * io + (local & 7), j = 8 * (local >> 3);
    float v[8];
    if (i < len) {
      load8(cb + i * kT + j, true, v);
      const float4 c0 = *reinterpret_cast<const float4*>(sv.cs + j), c1 = *reinterpret_cast<const float4*>(sv.cs + j + 4);
      const float cj[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
      const float ci = sv.cs[i];
      const int32_t si = sv.seq[i];
#pragma unroll
      for (int m = 0; m < 8; ++m) {  // (bitwise: no branch around each entry)
        const bool in = (j + m <= i) & (one_seq | (si == sv.seq[j + m]));
        const float g = __expf(ci - cj[m]);
        v[m] = in ? v[m] * g : 0.f;
      }
    } else {
#pragma unroll
      for (int m = 0; m < 8; ++m) v[m] = 0.f;
    }
    store8<true, true>(hi, lo, i, j, v);
  }
  constexpr int ld = Operand<__nv_bfloat16>::kLd;
#pragma unroll
  for (int e = 0; e < 4; ++e) {  // the zeros above the diagonal
    int i, j;
    oct_pos<true>(e, i, j);
    if (j > i) {  // (then the octet's first column is past the row's 8-block)
      *reinterpret_cast<uint4*>(hi + i * ld + j) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(lo + i * ld + j) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// dx, v, u, x.dXd and g <dS, S> of one (row, head, sub-chunk), 64 columns of P at a time:
//   X(j, p) = w_j Σ_n B_j[n] dS[n][p]        (then v_j = Σ_p dt_j x_j[p] X(j, p))
//   Y(i, p) = re_i Σ_n C_i[n] S[n][p]        (then u_i = Σ_p dy_i[p] Y(i, p))
//   X(j, p) += Σ_i M_ij dy_i[p]              (X = dXd: dx = dt X, x.dXd = Σ_p x_j[p] X(j, p))
// B, C, dy, and dS, S (stored in x's dtype) enter as is; M is split; w and re scale the accumulators.
// bfloat16 with kVec (kTiles): the block's dy and x tiles (its steps x the 64 columns, [i][q] as
// in global memory) come by cp.async at the start of each 64 columns, in flight during the Y
// product, and the three epilogues read them from shared memory: read from global memory, one
// 2-byte load per element consumed at once, they were the kernel's main stall (long scoreboard).
// The intra product takes B(p, i) = dy_i[p] from the dy tile as is ([k][n]), and dx goes out
// through the dy tile once it is done with, in 16-byte runs of its rows. No operand is staged
// transposed there: S and dS (contiguous along p) are stored [n][q] as they are in global memory,
// S by one 16-byte store per octet (the same octets of dS give <dS, S>), dS by cp.async, and read
// by ldmatrix.trans (mma_slab_kn); the mask M is staged [i][j], along cb's contiguous j, one
// 16-byte store per octet and half, and read by ldmatrix.trans as A (mma_slab_tt, hi then lo).
// Staged transposed ([q][n] and [j][i]), each octet was 8 scattered 2-byte shared stores.
// Grid: S * B * H blocks; block h + H (s + S b) (chunk.cuh: heads fastest).
// kY false (bfloat16 with kVec, where dbdc_wg gives u: dbdc_wgmma.cuh): no Y product and no u;
// S is still read, beside dS's tile in the X product, for <dS, S>. (Builds without wgmma, whose
// dbdc_wg_kernel runs the mma.sync form, keep Y and write u whole, kU2 zero.) There the X
// product's B and dS come by cp.async through a ring of three tiles (kRingX, below: B was staged
// through registers, its L2 latency exposed once a slab), and M by stage_decayed_mask. H200, ncu,
// L = 64K, 2026-11-29: 675 -> 665 us with the ring, 574 us with the mask too (its first form, with
// && and || in the mask; the landed bitwise form was timed only inside `hax bench ssm`).
template <class T, bool kVec, bool kY = true>
__global__ void __launch_bounds__(kThreads, kMinDx) dx_kernel(SsdGradParams gp, SsdScratch w, const T* states) {
  const SsdParams& p = gp.fwd;
  using S_t = typename Operand<T>::S;
  constexpr bool kTiles = kVec && std::is_same_v<T, __nv_bfloat16>;
  constexpr bool kWithY = kY || !kTiles || !cuda::kHaveWgmma;
  constexpr bool kRingX = kTiles && !kWithY;  // the X product's slabs through a ring (below)
  constexpr int ld = Operand<T>::kLd;  // of the tiles too: the epilogues' accesses are conflict-free
  // sA: C or B [i][n], then M (kTiles: [i][j], else [j][i]) with its lo half in sL; sB: S or dS
  // (kTiles: [n][q] as in global memory, else [q][n]).
  __shared__ __align__(16) S_t sA[kSlabSize<T>];
  __shared__ __align__(16) S_t sL[kLoSize<T>];
  __shared__ __align__(16) S_t sB[kSlabSize<T>];
  __shared__ __align__(16) S_t tDy[kTiles ? kSlabSize<T> : 1];  // kTiles: dy_i[p0 + q] at [i ld + q]
  __shared__ __align__(16) S_t tX[kTiles ? kSlabSize<T> : 1];   // kTiles: x_i[p0 + q] likewise
  __shared__ __align__(16) StepVals sv;  // (16-byte loads of cs: stage_decayed_mask)
  __shared__ float wj[kT], re[kT];
  __shared__ float tail[6 * kT + 4];  // the row partials of v, u, x.dXd and <dS, S>'s (put_rows, put_block)
  const int64_t S = p.nsubs(), H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim;
  const HeadSub place = head_sub_of_block(H, S, G);
  const int64_t b = place.b, h = place.h, s = place.s, bh = place.bh, g = place.g;
  const Sub u = sub_of(p, b, s);
  // kTiles: copies the tiles of columns p0.. (rows >= len and columns >= P zero-filled) as one
  // commit group; waited for at the last barrier of the Y product, which publishes them.
  auto copy_tiles = [&](int64_t p0) {
    if constexpr (kTiles) {
      using Copy = cuda::TileCopy<kT, kT, kThreads>;
      const int64_t off = ((b * p.seqlen + u.t0) * H + h) * P + p0;
      const int kp = (int)(P - p0 < kT ? P - p0 : kT);  // a multiple of 8 (kVec)
      Copy::template rows<ld>(tDy, (const T*)gp.dy + off, H * P, 0, u.len, kp);
      Copy::template rows<ld>(tX, (const T*)p.x + off, H * P, 0, u.len, kp);
      cuda::cp_async_commit();
    }
  };
  // kRingX: the X product's operands, slab t (64 values of n) of B ([j][k], rows >= len zero) and
  // of dS ([k][q], as in global memory), go by cp.async into a ring of three tiles (sA, sL, sB):
  // dS of slab t into ring[2t % 3], B into ring[(2t + 1) % 3]. dS of slab t + 1 is in flight while
  // slab t multiplies; B of slab t + 1 (read from L2) goes into slab t's dS tile once it is free.
  auto ring = [&](int64_t i) -> S_t* { return i == 0 ? sA : i == 1 ? sL : sB; };
  const int64_t nslabs = (N + kSlab - 1) / kSlab;
  const int64_t ldn = G * N;  // between steps
  const T* Bm = (const T*)p.Bm + ((b * p.seqlen + u.t0) * G + g) * N;
  const T* ds = (const T*)w.dstates + (bh * S + s) * N * P;  // entry (n, p) at [n P + p]
  auto slab_kn = [&](int64_t t) { return (int)(N - t * kSlab < kSlab ? N - t * kSlab : kSlab); };
  auto issue_ds = [&](int64_t t, int64_t p0) {
    if constexpr (kRingX) {
      const int kp = (int)(P - p0 < kT ? P - p0 : kT);
      cuda::TileCopy<kT, kT, kThreads>::template rows<ld>(ring((2 * t) % 3), ds + t * kSlab * P + p0, P, 0, slab_kn(t), kp);
    }
  };
  auto issue_b = [&](int64_t t) {
    if constexpr (kRingX)
      cuda::TileCopy<kT, kT, kThreads>::template rows<ld>(ring((2 * t + 1) % 3), Bm + t * kSlab, ldn, 0, u.len, slab_kn(t));
  };
  // After the tiles of columns p0: slab 0 (dS, B) as one group, then dS of slab 1 as another.
  auto issue_first_slabs = [&](int64_t p0) {
    if constexpr (kRingX) {
      if (nslabs > 0) {
        issue_ds(0, p0);
        issue_b(0);
        cuda::cp_async_commit();
      }
      if (nslabs > 1) {
        issue_ds(1, p0);
        cuda::cp_async_commit();
      }
    }
  };
  copy_tiles(0);
  issue_first_slabs(0);
  load_steps<T>(p, w, b, h, s, u, sv);
  __syncthreads();
  if (threadIdx.x < kT) {
    const int i = threadIdx.x;
    const bool in = i < u.len;
    wj[i] = in && sv.seq[i] == u.s_last ? expf(sv.cs[u.len - 1] - sv.cs[i]) : 0.f;
    re[i] = in && sv.seq[i] == u.s_prev ? expf(sv.cs[i]) : 0.f;
  }
  // one_seq: no reset among the sub-chunk's steps (seq_idx is non-decreasing).
  const bool one_seq = __syncthreads_and((int)threadIdx.x >= u.len || sv.seq[threadIdx.x] == sv.seq[0]);
  const int64_t ldx = H * P;  // between steps
  const T* x = (const T*)p.x + ((b * p.seqlen + u.t0) * H + h) * P;
  const T* dy = (const T*)gp.dy + ((b * p.seqlen + u.t0) * H + h) * P;
  T* dx = (T*)gp.dx + ((b * p.seqlen + u.t0) * H + h) * P;
  const T* C = (const T*)p.Cm + ((b * p.seqlen + u.t0) * G + g) * N;
  const float* cb = w.cb + ((b * G + g) * S + s) * kT * kT;
  const T* st = states + (bh * S + s) * N * P;  // entry (n, p) at [n P + p], as ds
  const int ks = round16(u.len);
  float vpart[4] = {0.f, 0.f, 0.f, 0.f}, upart[4] = {0.f, 0.f, 0.f, 0.f}, xpart[4] = {0.f, 0.f, 0.f, 0.f};
  float dot = 0.f;  // this thread's share of <dS, S>
#pragma unroll 1
  for (int64_t p0 = 0; p0 < P; p0 += kT) {
    // One accumulator tile at a time (registers): Y first, folded into u, then X.
    Acc ax;
    if constexpr (kWithY) {
      Acc& ay = ax;
      ay.zero();
#pragma unroll 1
      for (int64_t n0 = 0; n0 < N; n0 += kSlab) {
        const int kn = (int)(N - n0 < kSlab ? N - n0 : kSlab), kk = round16(kn);
        stage_op<kVec, true, false>(
            sA, sA, kk, [&](int i, int k) { return i < u.len && k < kn ? to_f32(C[i * ldn + n0 + k]) : 0.f; },
            [&](int i, int k, float(&v)[8]) { load8(C + i * ldn + n0 + k, i < u.len && k < kn, v); });
        if constexpr (kTiles) {
          // sB (k, q) = S[n0 + k][p0 + q] as stored, one 16-byte store per octet along q; each
          // entry is staged once per block, so the octets of dS at the same places give <dS, S>.
          uint4 sr[4], dr[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            int k, q;
            oct_pos<true>(e, k, q);
            sr[e] = dr[e] = make_uint4(0u, 0u, 0u, 0u);
            if (k < kn && p0 + q < P) {
              const int64_t o = (n0 + k) * P + p0 + q;
              sr[e] = __ldg(reinterpret_cast<const uint4*>(st + o));
              dr[e] = __ldg(reinterpret_cast<const uint4*>(ds + o));
            }
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            int k, q;
            oct_pos<true>(e, k, q);
            dot_bf16x8(dot, sr[e], dr[e]);
            *reinterpret_cast<uint4*>(sB + k * ld + q) = sr[e];
          }
        } else {
          stage_op<kVec, false, false>(
              sB, sB, kk,
              [&](int q, int k) {
                if (k >= kn || p0 + q >= P) return 0.f;
                const int64_t e = (n0 + k) * P + p0 + q;  // each entry is staged once per block
                const float v = to_f32(st[e]);
                dot += v * to_f32(ds[e]);
                return v;
              },
              [&](int q, int k, float(&v)[8]) {
                const bool in = k < kn && p0 + q < P;
                const int64_t e = (n0 + k) * P + p0 + q;
                float d[8];
                load8(st + e, in, v);
                load8(ds + e, in, d);
#pragma unroll
                for (int m = 0; m < 8; ++m) dot += v[m] * d[m];
              });
        }
        __syncthreads();
        if constexpr (kTiles) mma_slab_kn(ay, sA, sB, kk);  // sB as [k][q]
        else mma_slab(ay, sA, sB, kk);
        if (kTiles && n0 + kSlab >= N) cuda::cp_async_wait<0>();  // the tiles, published by the barrier
        __syncthreads();
      }
      if (kTiles && N <= 0) {  // no Y product (no state): its barrier is missing
        cuda::cp_async_wait<0>();
        __syncthreads();
      }
      if constexpr (kTiles)
        for_each_entry(tDy, [&](int mi, int ni, int r, int i, int q, int rs, float d) {
          if (i < u.len && p0 + q < P) upart[rs] += d * re[i] * ay.v[mi][ni][r];
        });
      else
        for_each([&](int mi, int ni, int r, int i, int q, int rs, int) {
          if (i < u.len && p0 + q < P) upart[rs] += to_f32(dy[i * ldx + p0 + q]) * re[i] * ay.v[mi][ni][r];
        });
    }
    ax.zero();
    if constexpr (kRingX) {
      if (nslabs == 0) {  // the tiles' group is still to be waited for and published
        cuda::cp_async_wait<0>();
        __syncthreads();
      }
#pragma unroll 1
      for (int64_t t = 0; t < nslabs; ++t) {
        const int64_t n0 = t * kSlab;
        const int kn = slab_kn(t), kk = round16(kn);
        const S_t* const tds = ring((2 * t) % 3);
        const S_t* const tb = ring((2 * t + 1) % 3);
        uint4 sr[4];  // S's octets at the places of the thread's octets of the dS tile, for <dS, S>
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int k, q;
          oct_pos<true>(e, k, q);
          sr[e] = make_uint4(0u, 0u, 0u, 0u);
          if (k < kn && p0 + q < P) sr[e] = __ldg(reinterpret_cast<const uint4*>(st + (n0 + k) * P + p0 + q));
        }
        if (t + 1 < nslabs) cuda::cp_async_wait<1>();  // dS of slab t + 1 may stay in flight
        else cuda::cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int k, q;
          oct_pos<true>(e, k, q);
          dot_bf16x8(dot, sr[e], *reinterpret_cast<const uint4*>(tds + k * ld + q));  // zeros past kn, P
        }
        mma_slab_kn(ax, tb, tds, kk);  // B [j][k], dS [k][q]
        __syncthreads();
        if (t + 1 < nslabs) {  // into slab t's dS tile
          issue_b(t + 1);
          cuda::cp_async_commit();
        }
        if (t + 2 < nslabs) {  // into slab t's B tile
          issue_ds(t + 2, p0);
          cuda::cp_async_commit();
        }
      }
    } else {  // with Y (S's <dS, S> came in Y): B staged, dS by cp.async (kTiles) or staged
#pragma unroll 1
      for (int64_t n0 = 0; n0 < N; n0 += kSlab) {
        const int kn = (int)(N - n0 < kSlab ? N - n0 : kSlab), kk = round16(kn);
        if constexpr (kTiles) {  // sB (k, q) = dS[n0 + k][p0 + q] as stored, by cp.async
          const int kp = (int)(P - p0 < kT ? P - p0 : kT);
          cuda::TileCopy<kT, kT, kThreads>::template rows<ld>(sB, ds + n0 * P + p0, P, 0, kn, kp);
          cuda::cp_async_commit();
        }
        stage_op<kVec, true, false>(
            sA, sA, kk, [&](int j, int k) { return j < u.len && k < kn ? to_f32(Bm[j * ldn + n0 + k]) : 0.f; },
            [&](int j, int k, float(&v)[8]) { load8(Bm + j * ldn + n0 + k, j < u.len && k < kn, v); });
        if constexpr (kTiles) {
          cuda::cp_async_wait<0>();  // the only group in flight (the tiles were waited for in Y)
        } else {
          stage_op<kVec, false, false>(
              sB, sB, kk, [&](int q, int k) { return k < kn && p0 + q < P ? to_f32(ds[(n0 + k) * P + p0 + q]) : 0.f; },
              [&](int q, int k, float(&v)[8]) { load8(ds + (n0 + k) * P + p0 + q, k < kn && p0 + q < P, v); });
        }
        __syncthreads();
        if constexpr (kTiles) mma_slab_kn(ax, sA, sB, kk);  // sB as [k][q]
        else mma_slab(ax, sA, sB, kk);
        __syncthreads();
      }
    }
    if constexpr (kTiles)
      for_each_entry(tX, [&](int mi, int ni, int r, int i, int q, int rs, float xv) {
        ax.v[mi][ni][r] *= wj[i];
        if (i < u.len && p0 + q < P) vpart[rs] += sv.dt[i] * xv * ax.v[mi][ni][r];
      });
    else
      for_each([&](int mi, int ni, int r, int i, int q, int rs, int) {
        ax.v[mi][ni][r] *= wj[i];
        if (i < u.len && p0 + q < P) vpart[rs] += sv.dt[i] * to_f32(x[i * ldx + p0 + q]) * ax.v[mi][ni][r];
      });
    // Intra-sub-chunk part: A(j, i) = M_ij (cb is contiguous along j), B(p, i) = dy_i[p].
    // mf(j, i) = M_ij; mg(j, i, v): v[e] = M_i,j+e.
    auto mf = [&](int j, int i) {
      return i < u.len && j <= i && sv.seq[i] == sv.seq[j] ? cb[i * kT + j] * expf(sv.cs[i] - sv.cs[j]) : 0.f;
    };
    auto mg = [&](int j, int i, float(&v)[8]) {
      const bool col = i < u.len && j <= i;
      load8(cb + i * kT + j, col, v);
      const float ci = sv.cs[i];
      const int32_t si = sv.seq[i];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = col && j + e <= i && si == sv.seq[j + e] ? v[e] * expf(ci - sv.cs[j + e]) : 0.f;
    };
    if constexpr (kTiles)  // stored [i][j] ([k][m]): rows i, one 16-byte store per octet and half
      stage_decayed_mask(sA, sL, cb, sv, u.len, one_seq);
    else  // stored [j][i]
      stage_op<kVec, false, true>(sA, sL, ks, mf, mg);
    if constexpr (!kTiles)
      stage_op<kVec, false, false>(
          sB, sB, ks, [&](int q, int i) { return i < u.len && p0 + q < P ? to_f32(dy[i * ldx + p0 + q]) : 0.f; },
          [&](int q, int i, float(&v)[8]) { load8(dy + i * ldx + p0 + q, i < u.len && p0 + q < P, v); });
    __syncthreads();
    if constexpr (kTiles) {  // A [i][j] and the dy tile as stored ([k][n]); hi then lo, as mma_split_a
      mma_slab_tt(ax, sA, tDy, ks);
      mma_slab_tt(ax, sL, tDy, ks);
    } else {
      mma_split_a(ax, sA, sL, sB, ks);
    }
    __syncthreads();
    if constexpr (kTiles) {
      // dx goes out through the dy tile (free after the barrier above): each pair of the thread's
      // columns is rounded into it (one 32-bit store; entries out of range are not copied out),
      // then whole 16-byte runs of its rows go to global memory. The thread's own 2-byte stores
      // used a quarter of each 32-byte sector they wrote.
      for_each_pair([&](int mi, int ni, int rp, int j, int q) {
        const uint32_t xw = load_pair(tX + j * ld + q);
        const float d0 = ax.v[mi][ni][2 * rp], d1 = ax.v[mi][ni][2 * rp + 1], dt = sv.dt[j];
        if (j < u.len && p0 + q < P) {  // q + 1 too (P is a multiple of 8, q even)
          xpart[mi * 2 + rp] += __uint_as_float(xw << 16) * d0;
          xpart[mi * 2 + rp] += __uint_as_float(xw & 0xffff0000u) * d1;
        }
        *reinterpret_cast<__nv_bfloat162*>(tDy + j * ld + q) = __floats2bfloat162_rn(dt * d0, dt * d1);
      });
      __syncthreads();
      using Copy = cuda::TileCopy<kT, kT, kThreads>;  // the copy's chunks: row(k), col()
      const int c = Copy::col(), kp = (int)(P - p0 < kT ? P - p0 : kT);
      const bool wide = reinterpret_cast<uintptr_t>(gp.dx) % 16 == 0;  // then every run is aligned (kVec)
#pragma unroll
      for (int k = 0; k < Copy::kPer; ++k) {
        const int j = Copy::row(k);
        if (j >= u.len || c >= kp) continue;
        const uint4 v = *reinterpret_cast<const uint4*>(tDy + j * ld + c);
        T* o = dx + j * ldx + p0 + c;
        if (wide) {
          *reinterpret_cast<uint4*>(o) = v;
        } else {  // dx only 2-byte aligned
          const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            o[2 * m] = __ushort_as_bfloat16((unsigned short)(wv[m] & 0xffffu));
            o[2 * m + 1] = __ushort_as_bfloat16((unsigned short)(wv[m] >> 16));
          }
        }
      }
    } else {
      for_each([&](int mi, int ni, int r, int j, int q, int rs, int) {
        if (j < u.len && p0 + q < P) {
          const int64_t o = j * ldx + p0 + q;
          const float d = ax.v[mi][ni][r];
          dx[o] = from_f32<T>(sv.dt[j] * d);
          xpart[rs] += to_f32(x[o]) * d;
        }
      });
    }
    if (kTiles && p0 + kT < P) {  // the next columns' tiles, once every thread is done with these
      __syncthreads();
      copy_tiles(p0 + kT);
      issue_first_slabs(p0 + kT);
    }
  }
  const int64_t bhs = bh * S + s;
  // Every sum's partials first, then one barrier (put_rows, put_block: tile.cuh).
  put_rows(vpart, tail);
  if constexpr (kWithY) put_rows(upart, tail + 2 * kT);
  put_rows(xpart, tail + 4 * kT);
  put_block(dot, tail + 6 * kT);
  __syncthreads();
  if (threadIdx.x < kT) {
    const int i = threadIdx.x;
    row_terms(p, w, kV, bhs)[i] = total(tail, i);
    if constexpr (kWithY) {
      row_terms(p, w, kU, bhs)[i] = total(tail + 2 * kT, i);
      if (!kY) row_terms(p, w, kU2, bhs)[i] = 0.f;
    }
    row_terms(p, w, kXdot, bhs)[i] = total(tail + 4 * kT, i);
  }
  if (threadIdx.x == 0) w.dg[bhs] = w.decay[bhs] * block_total(tail + 6 * kT);
}

// dM = dy Xd^T per head of a group (dy x^T, scaled by dt_j), its intra_i terms, and
// dCB = Σ_heads dM ∘ Gm (64 x 64). Grid: S * B * G blocks; block s + S (b G + g).
// bfloat16 with kVec (kAsync): dy and x are raw and contiguous along k, so cp.async copies each
// (head, 64-slab of P) into a second pair of buffers while the previous one multiplies (as
// dbdc_kernel does).
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads, kMinDcb) dcb_kernel(SsdGradParams gp, SsdScratch w) {
  const SsdParams& p = gp.fwd;
  using S_t = typename Operand<T>::S;
  constexpr bool kAsync = kVec && std::is_same_v<T, __nv_bfloat16>;
  __shared__ __align__(16) S_t sA[kSlabSize<T>];
  __shared__ __align__(16) S_t sB[kSlabSize<T>];
  __shared__ __align__(16) S_t sA2[kAsync ? kSlabSize<T> : 1];  // kAsync: the second buffers
  __shared__ __align__(16) S_t sB2[kAsync ? kSlabSize<T> : 1];
  __shared__ StepVals sv;
  __shared__ float sums[4 * kT];  // a head's row partials, then its column partials (put_rows, put_cols)
  const int64_t S = p.nsubs(), H = p.nheads, G = p.ngroups, P = p.headdim, hpg = ssd_div(H, G);
  const int64_t bg = ssd_div(blockIdx.x, S), s = blockIdx.x - bg * S, b = ssd_div(bg, G), g = bg - b * G;
  const Sub u = sub_of(p, b, s);
  // one_seq: no reset among the sub-chunk's steps (seq_idx is non-decreasing), so no sequence test.
  // bfloat16: the decay by __expf (a few ulp; dCB enters dB and dC as bfloat16 halves hi + lo).
  const bool one_seq = p.seq_idx == nullptr || p.seq_idx[b * p.seqlen + u.t0] == u.s_last;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  const float* cb = w.cb + (int64_t)blockIdx.x * kT * kT;
  const int64_t ldx = H * P;
  Acc dcb;
  dcb.zero();
  // Head h's dM (in dm) into its intra_i terms and dCB (sv holds head h's steps).
  auto head_done = [&](int64_t h, const Acc& dm) {
    float rp[4] = {0.f, 0.f, 0.f, 0.f}, cp[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for_each([&](int mi, int ni, int r, int i, int j, int rs, int cs) {
      if ((i < u.len) & (j <= i) & (one_seq | (sv.seq[i] == sv.seq[j]))) {  // (bitwise: one branch)
        const float x = sv.cs[i] - sv.cs[j];
        const float gd = kBf16 ? __expf(x) : expf(x), d = dm.v[mi][ni][r] * sv.dt[j];  // dM_ij
        const float t = d * cb[i * kT + j] * gd;                                        // dM_ij M_ij
        rp[rs] += t;
        cp[cs] += t;
        dcb.v[mi][ni][r] += d * gd;
      }
    });
    // One barrier: the next head writes sums only after the loop's next barrier (run_pipeline's
    // after compute, or the barriers before each head's product).
    put_rows(rp, sums);
    put_cols(cp, sums + 2 * kT);
    __syncthreads();
    if (threadIdx.x < kT)
      row_terms(p, w, kIntra, (b * H + h) * S + s)[threadIdx.x] =
          total(sums, threadIdx.x) - total(sums + 2 * kT, threadIdx.x);
  };
  if constexpr (kAsync) {
    const HeadSlabs<S_t> hs{sA, sA2, sB, sB2, (int)((P + kSlab - 1) / kSlab), P};
    auto issue = [&](int t) {
      const int64_t off = ((b * p.seqlen + u.t0) * H + g * hpg + hs.head(t)) * P + hs.k0(t);
      hs.copy(hs.A(t), (const T*)gp.dy + off, ldx, u.len, hs.kp(t));  // A(i, k) = dy_i[k0 + k]
      hs.copy(hs.B(t), (const T*)p.x + off, ldx, u.len, hs.kp(t));    // B(j, k) = x_j[k0 + k]
      cuda::cp_async_commit();
    };
    Acc dm;
    dm.zero();
    run_pipeline(
        (int)hpg * hs.slabs, issue,
        [&](int t) {
          if (hs.first(t)) load_steps<T>(p, w, b, g * hpg + hs.head(t), s, u, sv);
        },
        [&](int t) {
          mma_slab(dm, hs.A(t), hs.B(t), round16(hs.kp(t)));
          if (hs.last(t)) {
            head_done(g * hpg + hs.head(t), dm);
            dm.zero();
          }
        });
  } else {
#pragma unroll 1
    for (int64_t hh = 0; hh < hpg; ++hh) {
      const int64_t h = g * hpg + hh;
      __syncthreads();  // the previous head is done with sv
      load_steps<T>(p, w, b, h, s, u, sv);
      __syncthreads();
      const T* x = (const T*)p.x + ((b * p.seqlen + u.t0) * H + h) * P;
      const T* dy = (const T*)gp.dy + ((b * p.seqlen + u.t0) * H + h) * P;
      Acc dm;
      dm.zero();
      product_over_k<kVec>(dm, sA, sB, dy, ldx, u.len, x, ldx, u.len, P);  // A(i, k) = dy_i, B(j, k) = x_j
      head_done(h, dm);
    }
  }
  float* out = w.dcb + (int64_t)blockIdx.x * kT * kT;
  for_each_pair([&](int mi, int ni, int rp, int i, int j) {
    store_pair(out + i * kT + j, dcb.v[mi][ni][2 * rp], dcb.v[mi][ni][2 * rp + 1], true, true, true);
  });
}

// dB (even blockIdx.x) or dC (odd) of one (row, group, sub-chunk) and 64 columns of N:
//   dB(j, n) = Σ_heads w_j dt_j Σ_p x_j[p] dS[n][p] + Σ_i dCB_ij C_i[n]
//   dC(i, n) = Σ_heads re_i Σ_p dy_i[p] S[n][p]     + Σ_j dCB_ij B_j[n]
// Each head's product (x or dy, and dS or S, as stored) is scaled by its row factors and added in
// head order; then dCB (split) times C or B. Grid: S * B * G * ceil(N / 64) * 2 blocks, block
// 2 (n_tile + tiles_n ((b G + g) S + s)) + (dC): the 2 tiles_n blocks of one sub-chunk run together,
// so x and dy, which each n tile reads whole, come from DRAM once (with the grid (S B G, tiles_n,
// 2) the n tiles of a sub-chunk ran a whole sweep apart, and each read them again).
// bfloat16 with kVec (kAsync): both tiles of every (head, 64-slab of P) are raw and contiguous
// along k, so cp.async copies them into a second pair of buffers, the next slab's while the
// current one multiplies, instead of staging each through registers between barriers.
template <class T, bool kVec>
__device__ __forceinline__ void dbdc_mma(const SsdGradParams& gp, const SsdScratch& w, const T* states) {
  const SsdParams& p = gp.fwd;
  using S_t = typename Operand<T>::S;
  constexpr bool kAsync = kVec && std::is_same_v<T, __nv_bfloat16>;
  __shared__ __align__(16) S_t sA[kSlabSize<T>];
  __shared__ __align__(16) S_t sL[kLoSize<T>];
  __shared__ __align__(16) S_t sB[kSlabSize<T>];
  __shared__ __align__(16) S_t sA2[kAsync ? kSlabSize<T> : 1];  // kAsync: the second buffers
  __shared__ __align__(16) S_t sB2[kAsync ? kSlabSize<T> : 1];
  __shared__ float coef[kT];
  const int64_t S = p.nsubs(), H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim, hpg = ssd_div(H, G);
  const int64_t tiles_n = (N + kT - 1) / kT, pair = blockIdx.x / 2, chunk = ssd_div(pair, tiles_n);  // (b G + g) S + s
  const int64_t bg = ssd_div(chunk, S), s = chunk - bg * S, b = ssd_div(bg, G), g = bg - b * G;
  const int64_t n0 = (pair - chunk * tiles_n) * kT;
  const bool is_dc = blockIdx.x % 2 == 1;
  const Sub u = sub_of(p, b, s);
  const int64_t ldx = H * P, ldn = G * N;
  // The row factors of a head: thread i < kT loads step i's inputs into registers (coef_load) and
  // writes coef[i] from them (coef_store), no other thread's values needed. kAsync: the next
  // head's inputs are loaded while the current head's stage runs, and coef is written when that
  // head's stage begins (the pipeline's barrier then publishes it). Loading the step values into
  // shared memory and waiting at a barrier for them before computing coef exposed their latency
  // once per head (H100, ncu, L = 64K: dbdc 462 -> 378 us without that wait, 2026-11-24).
  auto coef_load = [&](int64_t h) { return RowFactorIn::load<T>(p, w, b, h, s, S, u); };  // (grad_rows.cuh)
  auto coef_store = [&](const RowFactorIn& in) { coef[threadIdx.x] = in.value(u, is_dc); };
  Acc acc;
  acc.zero();
  if constexpr (kAsync) {
    const HeadSlabs<S_t> hs{sA, sA2, sB, sB2, (int)((P + kSlab - 1) / kSlab), P};
    const int nrows = (int)(N - n0 < kT ? N - n0 : kT);
    RowFactorIn next;  // (threads < kT) the inputs of the next head's coef
    if (threadIdx.x < kT) next = coef_load(g * hpg);
    auto issue = [&](int t) {
      const int64_t h = g * hpg + hs.head(t), k0 = hs.k0(t);
      const T* v = (const T*)(is_dc ? gp.dy : p.x) + ((b * p.seqlen + u.t0) * H + h) * P + k0;
      const T* st = (is_dc ? states : (const T*)w.dstates) + ((b * H + h) * S + s) * N * P + n0 * P + k0;
      hs.copy(hs.A(t), v, ldx, u.len, hs.kp(t));  // A(i, k) = v_i[k0 + k]
      hs.copy(hs.B(t), st, P, nrows, hs.kp(t));   // B(n, k) = S[n0 + n][k0 + k]
      cuda::cp_async_commit();
    };
    Acc part;
    part.zero();
    run_pipeline(
        (int)hpg * hs.slabs, issue,
        [&](int t) {
          if (hs.first(t) && threadIdx.x < kT) {
            coef_store(next);
            if (hs.head(t) + 1 < hpg) next = coef_load(g * hpg + hs.head(t) + 1);
          }
        },
        [&](int t) {
          mma_slab(part, hs.A(t), hs.B(t), round16(hs.kp(t)));
          if (hs.last(t)) {
            for_each([&](int mi, int ni, int r, int i, int, int, int) { acc.v[mi][ni][r] += coef[i] * part.v[mi][ni][r]; });
            part.zero();
          }
        });
  } else {
#pragma unroll 1
    for (int64_t hh = 0; hh < hpg; ++hh) {
      const int64_t h = g * hpg + hh, bh = b * H + h;
      __syncthreads();  // the previous head is done with coef
      if (threadIdx.x < kT) coef_store(coef_load(h));
      __syncthreads();
      const T* v = (const T*)(is_dc ? gp.dy : p.x) + ((b * p.seqlen + u.t0) * H + h) * P;
      const T* st = (is_dc ? states : (const T*)w.dstates) + (bh * S + s) * N * P + n0 * P;  // (n0 + n, p) at [n P + p]
      Acc part;
      part.zero();
      const int rows = (int)(N - n0 < kT ? N - n0 : kT);
      product_over_k<kVec>(part, sA, sB, v, ldx, u.len, st, P, rows, P);  // A(i, k) = v_i, B(n, k) = S[n0 + n]
      for_each([&](int mi, int ni, int r, int i, int, int, int) { acc.v[mi][ni][r] += coef[i] * part.v[mi][ni][r]; });
    }
  }
  // dB: A(j, i) = dCB_ij, B(n, i) = C_i[n];  dC: A(i, j) = dCB_ij, B(n, j) = B_j[n].
  const float* dcb = w.dcb + chunk * kT * kT;
  const T* U = (const T*)(is_dc ? p.Bm : p.Cm) + ((b * p.seqlen + u.t0) * G + g) * N + n0;
  const int ks = round16(u.len);
  // dcb is zero outside the sub-chunk's steps (dcb_kernel writes the whole tile).
  if (is_dc)
    stage_op<kVec, true, true>(
        sA, sL, ks, [&](int i, int j) { return i < u.len && j < u.len ? dcb[i * kT + j] : 0.f; },
        [&](int i, int j, float(&o)[8]) { load8(dcb + i * kT + j, true, o); });
  else
    stage_op<kVec, false, true>(
        sA, sL, ks, [&](int j, int i) { return i < u.len && j < u.len ? dcb[i * kT + j] : 0.f; },
        [&](int j, int i, float(&o)[8]) { load8(dcb + i * kT + j, true, o); });
  stage_op<kVec, false, false>(
      sB, sB, ks, [&](int n, int k) { return k < u.len && n0 + n < N ? to_f32(U[k * ldn + n]) : 0.f; },
      [&](int n, int k, float(&o)[8]) { load8(U + k * ldn + n, k < u.len && n0 + n < N, o); });
  __syncthreads();
  mma_split_a(acc, sA, sL, sB, ks);
  T* out = (T*)(is_dc ? gp.dC : gp.dB) + ((b * p.seqlen + u.t0) * G + g) * N + n0;
  const bool pairs = kVec && reinterpret_cast<uintptr_t>(out) % 4 == 0;  // N even: every pair is aligned too
  for_each_pair([&](int mi, int ni, int rp, int i, int n) {
    const bool ok0 = i < u.len && n0 + n < N, ok1 = ok0 && n0 + n + 1 < N;
    store_pair(out + i * ldn + n, acc.v[mi][ni][2 * rp], acc.v[mi][ni][2 * rp + 1], ok0, ok1, ok1 && pairs);
  });
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads, kMinDbdc) dbdc_kernel(SsdGradParams gp, SsdScratch w, const T* states) {
  dbdc_mma<T, kVec>(gp, w, states);
}

// The wgmma form (dbdc_wgmma.cuh) where this binary has wgmma; the mma.sync form in builds for
// other GPUs.
__global__ void __launch_bounds__(kThreads, kMinDbdcWg)
    dbdc_wg_kernel(SsdGradParams gp, SsdScratch w, const __nv_bfloat16* states) {
  if constexpr (cuda::kHaveWgmma) dbdc_wg(gp, w, states);
  else dbdc_mma<__nv_bfloat16, true>(gp, w, states);
}

// d(cs) of one (row, head, sub-chunk), its reverse cumsum da, ddt and the sub-chunk's dA.
// One thread each, index ((b S + s) H + h), steps in the CPU's order. The thread's rows of v (all
// of it, for vsum) and then, 16 steps at a time from the end, of intra, u, x.dXd and dt are loaded
// into registers first, as independent loads (16 bytes each for the rows): loaded one step at a
// time inside the loops, each load waited on before the next (the ddt stores may alias them for
// the compiler), the kernel took 45 us at L = 64K, H = 16 on the H100.
// u_split: u comes in two parts (kU + kU2: dbdc_wg with N = 128 and dx_kernel<.., false>).
template <class T>
__global__ void ddt_kernel(SsdGradParams gp, SsdScratch w, bool u_split) {
  const SsdParams& p = gp.fwd;
  const int64_t H = p.nheads, S = p.nsubs();
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.batch * S * H) return;
  const int64_t q = ssd_div(idx, H), h = idx - q * H, b = ssd_div(q, S), s = q - b * S, bhs = (b * H + h) * S + s;
  const Sub u = sub_of(p, b, s);
  const int len = u.len;
  // (each row is kT floats, 256-byte aligned: SsdScratch::rows)
  const float4* intra = reinterpret_cast<const float4*>(row_terms(p, w, kIntra, bhs));
  const float4* vrow = reinterpret_cast<const float4*>(row_terms(p, w, kV, bhs));
  const float4* uu = reinterpret_cast<const float4*>(row_terms(p, w, kU, bhs));
  const float4* uu2 = reinterpret_cast<const float4*>(row_terms(p, w, kU2, bhs));
  const float4* xd = reinterpret_cast<const float4*>(row_terms(p, w, kXdot, bhs));
  const float A = to_f32(((const T*)p.A)[h]);
  const T* dt = (const T*)p.dt + (b * p.seqlen + u.t0) * H + h;
  T* ddt = (T*)gp.ddt + (b * p.seqlen + u.t0) * H + h;
  auto at = [](const float4& q, int e) { return e == 0 ? q.x : e == 1 ? q.y : e == 2 ? q.z : q.w; };
  float v[kT];
#pragma unroll
  for (int i = 0; i < kT / 4; ++i) {
    const float4 q = vrow[i];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[4 * i + e] = at(q, e);
  }
  float vsum = 0.f;
#pragma unroll
  for (int i = 0; i < kT; ++i)
    if (i < len) vsum += v[i];
  constexpr int kC = 16;  // steps per batch of loads
  float run = 0.f, dA = 0.f;
#pragma unroll
  for (int c = kT / kC - 1; c >= 0; --c) {
    if (c * kC >= len) continue;
    float in[kC], uv[kC], xv[kC], dv[kC];
#pragma unroll
    for (int i = 0; i < kC / 4; ++i) {
      const float4 a4 = intra[c * kC / 4 + i], u4 = uu[c * kC / 4 + i], x4 = xd[c * kC / 4 + i];
#pragma unroll
      for (int e = 0; e < 4; ++e) in[4 * i + e] = at(a4, e), uv[4 * i + e] = at(u4, e), xv[4 * i + e] = at(x4, e);
      if (u_split) {
        const float4 u4b = uu2[c * kC / 4 + i];
#pragma unroll
        for (int e = 0; e < 4; ++e) uv[4 * i + e] += at(u4b, e);
      }
    }
#pragma unroll
    for (int i = 0; i < kC; ++i) dv[i] = c * kC + i < len ? to_f32(dt[(c * kC + i) * H]) : 0.f;
#pragma unroll
    for (int i = kC - 1; i >= 0; --i) {
      const int t = c * kC + i;
      if (t >= len) continue;
      float d = in[i] + uv[i] - v[t];
      if (t == len - 1) d += vsum + w.dg[bhs];
      run += d;
      ddt[t * H] = from_f32<T>(run * A + xv[i]);
      dA += run * dv[i];
    }
  }
  w.dA_sub[bhs] = dA;
}

// dA_part(b, h) = Σ_s dA of sub-chunk s: a block per (row, head); thread t sums s = t, t + 256,
// ... in order, then a fixed tree over the threads (deterministic). One thread per (row, head)
// summing all S in order took 65 us at L = 64K (S = 1024) on the H100.
constexpr int kDaThreads = 256;
__global__ void __launch_bounds__(kDaThreads) da_kernel(SsdGradParams gp, SsdScratch w) {
  __shared__ float part[kDaThreads];
  const int64_t S = gp.fwd.nsubs(), bh = blockIdx.x;
  const float* src = w.dA_sub + bh * S;
  float acc = 0.f;
  for (int64_t s = threadIdx.x; s < S; s += kDaThreads) acc += src[s];
  part[threadIdx.x] = acc;
  __syncthreads();
#pragma unroll
  for (int n = kDaThreads / 2; n > 0; n /= 2) {
    if ((int)threadIdx.x < n) part[threadIdx.x] += part[threadIdx.x + n];
    __syncthreads();
  }
  if (threadIdx.x == 0) ((float*)gp.dA_part)[bh] = part[0];
}

template <class T>
void backward(const SsdGradParams& gp, cudaStream_t stream) {
  const SsdParams& p = gp.fwd;
  const int64_t S = p.nsubs(), B = p.batch, H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim;
  const SsdScratch w = ssd_cuda_scratch(p, true, sizeof(T), (float*)p.workspace);
  const int64_t tiles_n = (N + kT - 1) / kT;
  const bool has_states = N * P > 0;
  const unsigned thread_blocks = (unsigned)cuda::ceil_div(B * S * H, 128);

  const bool vec = ssd_vec(p, gp.dy);
  if (!p.prepped) {  // (else the forward's cs, decay and cb are in p.prep)
    prep_kernel<T><<<thread_blocks, 128, 0, stream>>>(p, w);
    if (vec) cb_kernel<T, true><<<(unsigned)(B * S * G), kThreads, 0, stream>>>(p, w);
    else cb_kernel<T, false><<<(unsigned)(B * S * G), kThreads, 0, stream>>>(p, w);
  }
  // The state entering each sub-chunk.
  T* states = (T*)p.chunk_states;
  if (w.states) {
    states = (T*)w.states;
    if (has_states) {
      launch_local_state<T, false>(p, w, (const T*)p.x, states, vec, stream);
      launch_state_pass<T, false>(p, w, states, true, nullptr, nullptr, stream);
    }
  }
  // The gradient of the state leaving each sub-chunk, and dinit. dcb needs neither states nor
  // dx's results: it runs on a side stream beside the pass (memory-bound, a block an SM) and dx.
  if (has_states) {
    launch_local_state<T, true>(p, w, (const T*)gp.dy, (T*)w.dstates, vec, stream);
  }
  const cudaStream_t side = cuda::SideStream::fork(stream);
  if (vec) dcb_kernel<T, true><<<(unsigned)(B * S * G), kThreads, 0, side>>>(gp, w);
  else dcb_kernel<T, false><<<(unsigned)(B * S * G), kThreads, 0, side>>>(gp, w);
  if (has_states) launch_state_pass<T, true>(p, w, (T*)w.dstates, false, (const T*)gp.dfinal, (T*)gp.dinit, stream);
  // With dbdc's wgmma form, u comes from it (kU, and kU2 for the second 64 columns of N).
  bool wg_dbdc = false;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    wg_dbdc = vec && tiles_n > 0 && dbdc_wg_applies(gp, states, w.dstates);
    if (wg_dbdc) dx_kernel<T, true, false><<<(unsigned)(B * S * H), kThreads, 0, stream>>>(gp, w, states);
  }
  if (!wg_dbdc) {
    if (vec) dx_kernel<T, true><<<(unsigned)(B * S * H), kThreads, 0, stream>>>(gp, w, states);
    else dx_kernel<T, false><<<(unsigned)(B * S * H), kThreads, 0, stream>>>(gp, w, states);
  }
  cuda::SideStream::join(stream);  // dbdc reads dcb
  if (tiles_n > 0) {
    const unsigned grid = (unsigned)(B * S * G * tiles_n * 2);
    if (wg_dbdc) {
      cuda::allow_smem(dbdc_wg_kernel, kDbdcWgSmem, "ssd_backward_cuda (dB, dC)", sizeof(float) * 2 * kT);
      dbdc_wg_kernel<<<grid, kThreads, kDbdcWgSmem, stream>>>(gp, w, (const __nv_bfloat16*)states);
    } else if (vec) dbdc_kernel<T, true><<<grid, kThreads, 0, stream>>>(gp, w, states);
    else dbdc_kernel<T, false><<<grid, kThreads, 0, stream>>>(gp, w, states);
  }
  ddt_kernel<T><<<thread_blocks, 128, 0, stream>>>(gp, w, wg_dbdc && tiles_n == 2);
  da_kernel<<<(unsigned)(B * H), kDaThreads, 0, stream>>>(gp, w);
  cuda::check_launch("ssd_backward_cuda");
}

}  // namespace
}  // namespace ssd_cuda

void ssd_backward_cuda(const SsdGradParams& gp, DType dtype, void* stream) {
  const SsdParams& p = gp.fwd;
  if (p.batch * p.seqlen * p.nheads == 0) return;  // the binding handles empty sequences
  HAX_DISPATCH_DTYPE(dtype, [&] { ssd_cuda::backward<scalar_t>(gp, (cudaStream_t)stream); });
}

}  // namespace hax::ops
