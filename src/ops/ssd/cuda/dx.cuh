// dx_kernel of the SSD backward (launch 6 of ssd_backward.cu, whose header states the gradient
// formulas): dx and the per-step v, u, x.dXd and g <dS, S> of one (row, head, sub-chunk).
#pragma once
#include "ops/ssd/cuda/grad_rows.cuh"

namespace hax::ops::ssd_cuda {

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
// kDot false (only with kRingX, where the joint dB/dC gives g: dbdc_joint_wgmma.cuh): no S at
// all, and g is not written here.
template <class T, bool kVec, bool kY = true, bool kDot = true>
__global__ void __launch_bounds__(kThreads, kMinDx) dx_kernel(SsdGradParams gp, SsdScratch w, const T* states) {
  const SsdParams& p = gp.fwd;
  using S_t = typename Operand<T>::S;
  constexpr bool kTiles = kVec && std::is_same_v<T, __nv_bfloat16>;
  constexpr bool kWithY = kY || !kTiles || !cuda::kHaveWgmma;
  constexpr bool kRingX = kTiles && !kWithY;  // the X product's slabs through a ring (below)
  // (builds without wgmma instantiate kDot false but never launch it: ssd_backward.cu joint_built)
  static_assert(kDot || kRingX || !cuda::kHaveWgmma, "dx_kernel leaves g out only in its ring form");
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
        if constexpr (kDot) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            int k, q;
            oct_pos<true>(e, k, q);
            sr[e] = make_uint4(0u, 0u, 0u, 0u);
            if (k < kn && p0 + q < P) sr[e] = __ldg(reinterpret_cast<const uint4*>(st + (n0 + k) * P + p0 + q));
          }
        }
        if (t + 1 < nslabs) cuda::cp_async_wait<1>();  // dS of slab t + 1 may stay in flight
        else cuda::cp_async_wait<0>();
        __syncthreads();
        if constexpr (kDot) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            int k, q;
            oct_pos<true>(e, k, q);
            dot_bf16x8(dot, sr[e], *reinterpret_cast<const uint4*>(tds + k * ld + q));  // zeros past kn, P
          }
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
  if constexpr (kDot) put_block(dot, tail + 6 * kT);
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
  if (kDot && threadIdx.x == 0) w.dg[bhs] = w.decay[bhs] * block_total(tail + 6 * kT);
}

}  // namespace hax::ops::ssd_cuda
