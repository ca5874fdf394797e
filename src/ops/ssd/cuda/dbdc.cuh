// dB and dC of the SSD backward (launch 8 of ssd_backward.cu, whose header states the gradient
// formulas), in its mma.sync form; the wgmma form is dbdc_wgmma.cuh (dbdc_wg_kernel in
// ssd_backward.cu runs either).
#pragma once
#include "ops/ssd/cuda/grad_rows.cuh"

namespace hax::ops::ssd_cuda {

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

}  // namespace hax::ops::ssd_cuda
