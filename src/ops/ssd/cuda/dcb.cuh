// dcb_kernel of the SSD backward (launch 7 of ssd_backward.cu, whose header states the gradient
// formulas): dM, its intra_i terms and dCB summed over the heads of one (row, group, sub-chunk).
#pragma once
#include "ops/ssd/cuda/grad_rows.cuh"

namespace hax::ops::ssd_cuda {

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

}  // namespace hax::ops::ssd_cuda
