// Kernels that the SSD forward and backward share: per-sub-chunk decays, C B^T, the sub-chunks'
// local states (and, by the same product, the backward's local state gradients), and the
// sequential pass of states over the sub-chunks. Notation as in cpu.cpp: for a sub-chunk of
// `len` steps starting at t0, with local steps i, j:
//   cs_i = Σ_{t<=i} dt_t A              (inclusive, within the sub-chunk)
//   s_i  = seq_idx[t0 + i],  s_prev = seq_idx[t0 - 1] (seq_idx[0] when t0 = 0),  s_last = s_{len-1}
//   w_j  = [s_j = s_last] exp(cs_last - cs_j)   weight of step j in the state leaving the sub-chunk
//   re_i = [s_i = s_prev] exp(cs_i)             weight of the entering state in y_i
//   g    = [s_last = s_prev] exp(cs_last)       decay of the entering state across the sub-chunk
//   S_leave = g S_enter + Σ_j w_j (dt_j x_j) B_j^T
// Block order: the per-(row, head, sub-chunk) kernels (local states, chunk_scan, dx) number their
// blocks h + H (s + S b), heads fastest, so that the H blocks of one sub-chunk run at the same
// time: B, C and cb, which a group's heads share, then come from DRAM once per sub-chunk and from
// L2 for the other heads, and x, dy (B, L, H, P) are read as the sub-chunk's whole contiguous rows.
// (Ordered s + S (b H + h), a head's sub-chunks one after the other, the blocks of one sub-chunk
// ran ~S blocks apart, farther than L2 holds at long L, and read B and C again for every head.
// H100, L = 64K, ncu, 2026-11-24: chunk_scan 491 -> 450 us, dx 914 -> 839, local_state 258 -> 236
// and 251 -> 235; with dbdc's n tiles together, 525 -> 462; fwd+bwd 3.17 -> 2.76 ms.)
// The tile kernels come in two forms (kVec): vectorized staging (16-byte loads of 8 neighbours
// along global memory's contiguous direction, see tile.cuh), used when P and N are multiples of
// 8 and x, B, C (dy) are 16-byte aligned; element-wise staging otherwise. The sequential pass of
// states over the sub-chunks is in state_pass.cuh.
#pragma once
#include "ops/ssd/cuda/tile.cuh"
#include "ops/ssd/params.h"

namespace hax::ops::ssd_cuda {

// The (row, head, sub-chunk) of a per-(row, head, sub-chunk) block, heads fastest (block
// h + H (s + S b), see above), and its row-head index bh and group g; H heads, S sub-chunks a
// row, G groups.
struct HeadSub {
  int64_t b, h, s, bh, g;
};
// In 32 bits: the grid has fewer than 2^31 blocks, so H, S and every quotient fit. (The 64-bit
// ssd_div, with its shift and its division path both kept, cost chunk_scan_wg 8 registers (93 ->
// 101) and local_state_wg 3 (95 -> 98): each fell from 5 resident blocks an SM to 4. This form
// gives them back: the forward at L = 64K went 0.669-0.676 -> 0.612-0.623 ms, H200, 2026-11-29.)
__device__ __forceinline__ HeadSub head_sub_of_block(int64_t H, int64_t S, int64_t G) {
  HeadSub r;
  const uint32_t x = blockIdx.x, h32 = (uint32_t)H, q = x / h32, b = q / (uint32_t)S, h = x - q * h32;
  r.h = h, r.s = q - b * (uint32_t)S, r.b = b;
  r.bh = r.b * H + r.h, r.g = h / (h32 / (uint32_t)G);
  return r;
}

// Where a sub-chunk lies and the sequence numbers around it.
struct Sub {
  int64_t t0;      // first step
  int len;         // steps, 1..64
  int32_t s_prev;  // sequence of the step before (of step 0 for the first sub-chunk)
  int32_t s_last;  // sequence of the last step
};

__device__ __forceinline__ Sub sub_of(const SsdParams& p, int64_t b, int64_t s) {
  Sub u;
  u.t0 = p.sub_start(s);
  u.len = (int)p.sub_size(s);
  const int32_t* seq = p.seq_idx ? p.seq_idx + b * p.seqlen : nullptr;
  u.s_prev = seq ? seq[u.t0 > 0 ? u.t0 - 1 : 0] : 0;
  u.s_last = seq ? seq[u.t0 + u.len - 1] : 0;
  return u;
}

// The factor of step i in the local states and in dB/dC: re_i = [s_i = s_prev] exp(cs_i) (re
// true: the gradient's local states, dC) or w_i dt_i = [s_i = s_last] exp(cs_last - cs_i) dt_i
// (the forward's local states, dB), from the step's sequence number si, cs_i, cs_last and dt_i.
__device__ __forceinline__ float step_factor(bool re, const Sub& u, int32_t si, float cs_i, float cs_last, float dt) {
  if (re) return si == u.s_prev ? expf(cs_i) : 0.f;
  return si == u.s_last ? expf(cs_last - cs_i) * dt : 0.f;
}

// step_factor of step i < kT of a bfloat16 sub-chunk, read from global memory (the local states'
// kernels: local_state_kn, local_state_wgmma.cuh, segment_scan_wgmma.cuh; dt only where it is
// used); 0 past the sub-chunk. bhs = (b H + h) S + s.
template <bool kGrad>
__device__ __forceinline__ float local_coef(const SsdParams& p, const SsdScratch& w, int64_t b, int64_t h, int64_t bhs,
                                            const Sub& u, int i) {
  if (i >= u.len) return 0.f;
  const int64_t L = p.seqlen;
  const int32_t si = p.seq_idx ? p.seq_idx[b * L + u.t0 + i] : 0;
  const float* cs = w.cs + bhs * kT;
  const float dt = kGrad ? 0.f : to_f32(((const __nv_bfloat16*)p.dt)[(b * L + u.t0 + i) * p.nheads + h]);
  return step_factor(kGrad, u, si, cs[i], kGrad ? 0.f : cs[u.len - 1], dt);
}

// Per-step values of one (row, head, sub-chunk) in shared memory: cs, sequence numbers, dt.
struct StepVals {
  float cs[kT];
  int32_t seq[kT];
  float dt[kT];
};

// Loads StepVals for head h (threads < 64, one step each; call __syncthreads() before use).
template <class T>
__device__ __forceinline__ void load_steps(const SsdParams& p, const SsdScratch& w, int64_t b, int64_t h, int64_t s,
                                           const Sub& u, StepVals& sv) {
  const int i = threadIdx.x;
  if (i >= kT) return;
  const int64_t S = p.nsubs();
  sv.cs[i] = w.cs[((b * p.nheads + h) * S + s) * kT + i];
  const bool in = i < u.len;
  sv.seq[i] = in && p.seq_idx ? p.seq_idx[b * p.seqlen + u.t0 + i] : 0;
  sv.dt[i] = in ? to_f32(((const T*)p.dt)[(b * p.seqlen + u.t0 + i) * p.nheads + h]) : 0.f;
}

// cs and the decay g of every (row, head, sub-chunk): one thread each, steps in order (the CPU's
// summation order). Thread index ((b S + s) H + h): neighbouring threads read neighbouring dt.
// The sub-chunk's dt values are loaded first, all at once (unrolled, independent loads), and the
// cs row goes out in 16-byte stores: loaded and stored step by step inside the summing loop, each
// load waited on before the next (the stores to cs may alias dt for the compiler), the kernel took
// 36 us at L = 64K, H = 16 on the H100, bound by the latency of 64 dependent loads.
template <class T>
__global__ void prep_kernel(SsdParams p, SsdScratch w) {
  const int64_t H = p.nheads, S = p.nsubs();
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.batch * S * H) return;
  const int64_t q = ssd_div(idx, H), h = idx - q * H, b = ssd_div(q, S), s = q - b * S;
  const Sub u = sub_of(p, b, s);
  const float A = to_f32(((const T*)p.A)[h]);
  const T* dt = (const T*)p.dt + (b * p.seqlen + u.t0) * H + h;
  float v[kT];
#pragma unroll
  for (int i = 0; i < kT; ++i) v[i] = i < u.len ? to_f32(dt[i * H]) : 0.f;
  float4* cs = reinterpret_cast<float4*>(w.cs + ((b * H + h) * S + s) * kT);  // 256-byte aligned rows
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kT; i += 4) {
    float c[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (i + e < u.len) acc += v[i + e] * A;  // padding past len repeats the last cs, never used as a step
      c[e] = acc;
    }
    cs[i / 4] = make_float4(c[0], c[1], c[2], c[3]);
  }
  w.decay[(b * H + h) * S + s] = u.s_last == u.s_prev ? expf(acc) : 0.f;
}

// Whether the vectorized staging applies (tile.cuh): head dim and state size multiples of 8 and
// x, B, C (and dy, when given) 16-byte aligned, so that every octet the kernels load is aligned.
inline bool ssd_vec(const SsdParams& p, const void* dy = nullptr) {
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  return p.headdim % 8 == 0 && p.dstate % 8 == 0 && aligned(p.x) && aligned(p.Bm) && aligned(p.Cm) &&
         (dy == nullptr || aligned(dy));
}

// cb(i, j) = C_i . B_j for every (row, group, sub-chunk), 64 x 64 (zero outside the sub-chunk).
// Grid: S * B * G blocks, block s + S (b G + g).
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads, kMinBlocks) cb_kernel(SsdParams p, SsdScratch w) {
  using S_t = typename Operand<T>::S;
  __shared__ __align__(16) S_t sA[kSlabSize<T>];
  __shared__ __align__(16) S_t sB[kSlabSize<T>];
  const int64_t S = p.nsubs(), G = p.ngroups, N = p.dstate;
  const int64_t bg = ssd_div(blockIdx.x, S), s = blockIdx.x - bg * S, b = ssd_div(bg, G), g = bg - b * G;
  const Sub u = sub_of(p, b, s);
  const int64_t ld = G * N;  // between steps of one group
  const T* C = (const T*)p.Cm + ((b * p.seqlen + u.t0) * G + g) * N;
  const T* Bm = (const T*)p.Bm + ((b * p.seqlen + u.t0) * G + g) * N;
  Acc acc;
  acc.zero();
#pragma unroll 1
  for (int64_t n0 = 0; n0 < N; n0 += kSlab) {
    const int kn = (int)(N - n0 < kSlab ? N - n0 : kSlab), ks = round16(kn);
    stage_op<kVec, true, false>(
        sA, sA, ks, [&](int i, int k) { return i < u.len && k < kn ? to_f32(C[i * ld + n0 + k]) : 0.f; },
        [&](int i, int k, float(&v)[8]) { load8(C + i * ld + n0 + k, i < u.len && k < kn, v); });
    stage_op<kVec, true, false>(
        sB, sB, ks, [&](int j, int k) { return j < u.len && k < kn ? to_f32(Bm[j * ld + n0 + k]) : 0.f; },
        [&](int j, int k, float(&v)[8]) { load8(Bm + j * ld + n0 + k, j < u.len && k < kn, v); });
    __syncthreads();
    mma_slab(acc, sA, sB, ks);
    __syncthreads();
  }
  float* out = w.cb + (int64_t)blockIdx.x * kT * kT;
  for_each_pair([&](int mi, int ni, int rp, int i, int j) {
    store_pair(out + i * kT + j, acc.v[mi][ni][2 * rp], acc.v[mi][ni][2 * rp + 1], true, true, true);
  });
}

// Local states of the sub-chunks, (N, P) per (row, head, sub-chunk):
//   forward (kGrad false): out(n, p) = Σ_j coef_j U_j[n] V_j[p],  coef_j = w_j dt_j, U = B, V = x
//                                                                     (S_leave with S_enter = 0)
//   backward (kGrad true): same with coef_i = re_i, U = C, V = dy     (dS_enter from y's inter-chunk term)
// Grid: (S * B * H, ceil(P / 64)); block h + H (s + S b) (heads fastest, above) stages its 64 columns of V once and
// loops over 64-row tiles of N. `out` holds (B, H, S, N, P) in x's dtype (the float32 product
// rounded once). Two forms:
//   - bfloat16 with kVec (local_state_kn): coef goes on the V side, staged once as the split
//     operand coef_j V_j[q] in a [j][q] tile (one 16-byte store per octet and half); U enters raw,
//     copied by cp.async in global memory's [j][n] layout, double-buffered over the n tiles (the
//     first two issued before V is staged); both operands are read by ldmatrix.trans
//     (mma_slab_tt_split_b). Each out tile is rounded into its U buffer once the mma is done
//     with it and copied out in 16-byte runs of its rows (out 16-byte aligned; else pair stores).
//   - otherwise (local_state_staged): coef U is the computed (split) operand, staged [n][j] for
//     every n tile, and V [q][j] once.
// On sm_90a, bfloat16 with P and N multiples of 64 and N <= 128 runs local_state_wgmma.cuh's form
// instead (launch_local_state chooses).

// The staged form: A(n, j) = coef_j U_j[n] per n tile (hi + lo), B(q, j) = V_j[q].
template <class T, bool kGrad, bool kVec>
__device__ __forceinline__ void local_state_staged(const SsdParams& p, const SsdScratch& w, const T* v_src, T* out) {
  using S_t = typename Operand<T>::S;
  __shared__ __align__(16) S_t sA[kSlabSize<T>];
  __shared__ __align__(16) S_t sL[kLoSize<T>];
  __shared__ __align__(16) S_t sB[kSlabSize<T>];
  __shared__ StepVals sv;
  __shared__ float coef[kT];
  const int64_t S = p.nsubs(), H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim;
  const HeadSub place = head_sub_of_block(H, S, G);
  const int64_t b = place.b, h = place.h, s = place.s, bh = place.bh, g = place.g;
  const int64_t p0 = (int64_t)blockIdx.y * kT;
  const Sub u = sub_of(p, b, s);
  load_steps<T>(p, w, b, h, s, u, sv);
  __syncthreads();
  if (threadIdx.x < kT) {
    const int i = threadIdx.x;
    coef[i] = i < u.len ? step_factor(kGrad, u, sv.seq[i], sv.cs[i], sv.cs[u.len - 1], sv.dt[i]) : 0.f;
  }
  __syncthreads();
  const int64_t ldu = G * N, ldv = H * P;  // between steps
  const T* V = v_src + ((b * p.seqlen + u.t0) * H + h) * P + p0;
  const int ks = round16(u.len);
  // B(p, j) = V_j[p] (contiguous along p in global memory), staged once for every n tile.
  stage_op<kVec, false, false>(
      sB, sB, ks, [&](int q, int j) { return j < u.len && p0 + q < P ? to_f32(V[j * ldv + q]) : 0.f; },
      [&](int q, int j, float(&v)[8]) { load8(V + j * ldv + q, j < u.len && p0 + q < P, v); });
  T* o = out + (bh * S + s) * N * P;
  const bool pairs = P % 2 == 0 && reinterpret_cast<uintptr_t>(o) % (2 * sizeof(T)) == 0;
#pragma unroll 1
  for (int64_t n0 = 0; n0 < N; n0 += kT) {
    // A(n, j) = coef_j U_j[n] (contiguous along n).
    const T* U = (const T*)(kGrad ? p.Cm : p.Bm) + ((b * p.seqlen + u.t0) * G + g) * N + n0;
    stage_op<kVec, false, true>(
        sA, sL, ks,
        [&](int n, int j) { return j < u.len && n0 + n < N ? coef[j] * to_f32(U[j * ldu + n]) : 0.f; },
        [&](int n, int j, float(&v)[8]) {
          load8(U + j * ldu + n, j < u.len && n0 + n < N, v);
          const float c = coef[j];
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] *= c;
        });
    __syncthreads();
    Acc acc;
    acc.zero();
    mma_split_a(acc, sA, sL, sB, ks);
    for_each_pair([&](int mi, int ni, int rp, int n, int q) {
      const bool ok0 = n0 + n < N && p0 + q < P, ok1 = ok0 && p0 + q + 1 < P;
      store_pair(o + (n0 + n) * P + p0 + q, acc.v[mi][ni][2 * rp], acc.v[mi][ni][2 * rp + 1], ok0, ok1, ok1 && pairs);
    });
    __syncthreads();  // every warp is done with sA, sL before the next n tile
  }
}

// The bfloat16 form with vectorized staging (P and N multiples of 8, x, B, C, dy 16-byte aligned):
//   sV, sVl (j, q) = coef_j V_j[p0 + q] as hi + lo   (zeros for j >= len or p0 + q >= P)
//   sU[t % 2] (j, n) = U_j[64 t + n], raw by cp.async (zeros for j >= len or 64 t + n >= N)
// and out tile t (n, q) = Σ_{j < ks} sU(j, n) (sV + sVl)(j, q), rounded into sU[t % 2] as [n][q]
// and stored from there in 16-byte runs (mma, barrier, round in, barrier, copy out, barrier, refill).
template <bool kGrad>
__device__ __forceinline__ void local_state_kn(const SsdParams& p, const SsdScratch& w, const __nv_bfloat16* v_src,
                                               __nv_bfloat16* out) {
  using bf16 = __nv_bfloat16;
  using Copy = cuda::TileCopy<kT, kT, kThreads>;
  constexpr int ld = Operand<bf16>::kLd;
  __shared__ __align__(16) bf16 sU0[kSlabSize<bf16>];  // the two U buffers, [j][n]
  __shared__ __align__(16) bf16 sU1[kSlabSize<bf16>];
  __shared__ __align__(16) bf16 sV[kSlabSize<bf16>];  // coef V, [j][q]: hi
  __shared__ __align__(16) bf16 sVl[kSlabSize<bf16>];  // and lo
  __shared__ float coef[kT];
  const int64_t S = p.nsubs(), H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim;
  const HeadSub place = head_sub_of_block(H, S, G);
  const int64_t b = place.b, h = place.h, s = place.s, bh = place.bh, g = place.g;
  const int64_t p0 = (int64_t)blockIdx.y * kT;
  const Sub u = sub_of(p, b, s);
  const int64_t ldu = G * N, ldv = H * P;  // between steps
  const bf16* U = (const bf16*)(kGrad ? p.Cm : p.Bm) + ((b * p.seqlen + u.t0) * G + g) * N;
  const int tiles = (int)((N + kT - 1) / kT);
  // Tile t of U: rows j < len, columns n < min(64, N - 64 t), one commit group.
  auto issue = [&](int t) {
    const int64_t n0 = (int64_t)t * kT;
    Copy::template rows<ld>(t & 1 ? sU1 : sU0, U + n0, ldu, 0, u.len, (int)(N - n0 < kT ? N - n0 : kT));
    cuda::cp_async_commit();
  };
  issue(0);
  if (tiles > 1) issue(1);
  // V's octets (row j, columns q .. q + 7) in flight while coef is computed.
  const bf16* V = v_src + ((b * p.seqlen + u.t0) * H + h) * P + p0;
  uint4 raw[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    int j, q;
    oct_pos<true>(e, j, q);
    raw[e] = make_uint4(0u, 0u, 0u, 0u);
    if (j < u.len && p0 + q < P) raw[e] = __ldg(reinterpret_cast<const uint4*>(V + j * ldv + q));
  }
  if (threadIdx.x < kT) coef[threadIdx.x] = local_coef<kGrad>(p, w, b, h, bh * S + s, u, threadIdx.x);
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    int j, q;
    oct_pos<true>(e, j, q);
    const float c = coef[j];
    const uint32_t r[4] = {raw[e].x, raw[e].y, raw[e].z, raw[e].w};
    float v[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = __uint_as_float(r[k] << 16) * c;
      v[2 * k + 1] = __uint_as_float(r[k] & 0xffff0000u) * c;
    }
    store8<true, true>(sV, sVl, j, q, v);
  }
  const int ks = round16(u.len);
  // Entry (n0 + n, p0 + q) of the sub-chunk's state at o[n0 P] + n P + q; P is even here (kVec).
  bf16* o = out + (bh * S + s) * N * P + p0;
  const int Pi = (int)P, kp = (int)(P - p0 < kT ? P - p0 : kT);  // kp a multiple of 8 (kVec)
  const bool pairs = reinterpret_cast<uintptr_t>(out) % (2 * sizeof(bf16)) == 0;
  // Rows of o are 16-byte aligned when out is (P, p0, n0 and the block's offset are multiples of 8).
  const bool runs = reinterpret_cast<uintptr_t>(out) % 16 == 0;
#pragma unroll 1
  for (int t = 0; t < tiles; ++t) {
    if (t + 1 < tiles) cuda::cp_async_wait<1>();  // tile t + 1 is the only group that may be in flight
    else cuda::cp_async_wait<0>();
    __syncthreads();  // tile t (and, at t = 0, sV, sVl) visible to every warp
    Acc acc;
    acc.zero();
    mma_slab_tt_split_b(acc, t & 1 ? sU1 : sU0, sV, sVl, ks);
    const int64_t n0 = (int64_t)t * kT;
    const int kn = (int)(N - n0 < kT ? N - n0 : kT);
    bf16* ot = o + n0 * P;
    if (runs) {  // block-uniform
      // The tile goes out through its U buffer: each pair rounded into it at [n][q] (one 32-bit
      // store, conflict-free; entries out of range are not copied out), then 16-byte runs of its
      // rows (a warp writes 4 rows x 128 bytes where the pairs wrote 8 rows x 16 bytes).
      // Shared addresses stay 32-bit (with generic ones the kernel spilled).
      const uint32_t sb = (uint32_t)__cvta_generic_to_shared(t & 1 ? sU1 : sU0);
      __syncthreads();  // every warp is done reading buffer t % 2
      for_each_pair([&](int mi, int ni, int rp, int n, int q) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(acc.v[mi][ni][2 * rp], acc.v[mi][ni][2 * rp + 1]);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sb + 2 * (n * ld + q)),
                     "r"(*reinterpret_cast<const uint32_t*>(&v))
                     : "memory");
      });
      __syncthreads();
      // Two runs a pass, rolled: unrolled, the passes' address offsets (multiples of P) were
      // hoisted out of the tile loop and the kernel spilled.
      const int c = Copy::col();
#pragma unroll 1
      for (int k = 0; k < Copy::kPer; k += 2) {
        uint4 v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e)
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(v[e].x), "=r"(v[e].y), "=r"(v[e].z), "=r"(v[e].w)
                       : "r"(sb + 2 * (Copy::row(k + e) * ld + c))
                       : "memory");
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = Copy::row(k + e);
          if (n < kn && c < kp) *reinterpret_cast<uint4*>(ot + n * Pi + c) = v[e];
        }
      }
    } else {
      for_each_pair([&](int mi, int ni, int rp, int n, int q) {
        const bool ok0 = n < kn && q < kp, ok1 = ok0 && q + 1 < kp;
        store_pair(ot + n * Pi + q, acc.v[mi][ni][2 * rp], acc.v[mi][ni][2 * rp + 1], ok0, ok1, ok1 && pairs);
      });
    }
    if (t + 2 < tiles) {
      __syncthreads();  // every warp is done with buffer t % 2 (its copy-out too)
      issue(t + 2);
    }
  }
}

template <class T, bool kGrad, bool kVec>
__global__ void __launch_bounds__(kThreads, kMinLocal)
    local_state_kernel(SsdParams p, SsdScratch w, const T* v_src, T* out) {
  if constexpr (kVec && std::is_same_v<T, __nv_bfloat16>) local_state_kn<kGrad>(p, w, v_src, out);
  else local_state_staged<T, kGrad, kVec>(p, w, v_src, out);
}

}  // namespace hax::ops::ssd_cuda
