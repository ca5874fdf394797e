// CPU kernels of the chunked SSD scan: forward and hand-written backward.
//
// One (batch row, head) at a time, chunk by chunk. Per chunk of Qc steps with local positions
// i, j and inclusive log-decay cumsum cs_i = Σ_{t<=i} dt_t A:
//   y_i   = Σ_{j<=i} [s_i=s_j] exp(cs_i - cs_j) (C_i·B_j) Xd_j  +  r_i exp(cs_i) h C_i
//   h'    = g h + Σ_j w_j Xd_j B_j^T,   w_j = [s_j=s_last] exp(cs_last - cs_j),
//   g     = [s_last = s_prev] exp(cs_last),   r_i = [s_i = s_prev],   Xd_j = dt_j x_j
// where s are sequence numbers (seq_idx) and s_prev the one of the position before the chunk.
// The state is kept transposed, hT (N, P). Every product is a small dense matrix product
// (small_gemm), so the work runs on vector FMAs; in matrix form, with M = (C B^T) ∘ G the masked
// decayed "attention" matrix of the chunk (G_ij = [j<=i][s_i=s_j] exp(cs_i - cs_j)):
//   Y = M Xd + diag(r e) C hT,        hT' = g hT + (w ∘ B)^T Xd.
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "core/small_gemm.h"
#include "ops/ssd/ssd.h"

namespace hax::ops {
namespace {

// Per-thread scratch buffers for one chunk (Q rows at most).
template <class T>
struct Chunk {
  int64_t Q, P, N;
  std::vector<T> cs, Xd, Bc, Cc, Bt, M, Ce, BtW;  // (Q) (Q,P) (Q,N) (Q,N) (N,Q) (Q,Q) (Q,N) (N,Q)
  std::vector<int32_t> s;                         // (Q)
  int32_t s_prev = 0;                             // sequence of the position before the chunk
  Chunk(int64_t Q_, int64_t P_, int64_t N_)
      : Q(Q_), P(P_), N(N_), cs(Q), Xd(Q * P), Bc(Q * N), Cc(Q * N), Bt(N * Q), M(Q * Q), Ce(Q * N), BtW(N * Q),
        s(Q) {}
};

// Index helpers over the contiguous layouts documented in ssd.h.
struct Layout {
  int64_t L, H, P, G, N, nc, hpg;
  int64_t x(int64_t b, int64_t t, int64_t h) const { return ((b * L + t) * H + h) * P; }
  int64_t dt(int64_t b, int64_t t, int64_t h) const { return (b * L + t) * H + h; }
  int64_t bc(int64_t b, int64_t t, int64_t h) const { return ((b * L + t) * G + h / hpg) * N; }
  int64_t bh_head(int64_t b, int64_t t, int64_t h) const { return ((b * L + t) * H + h) * N; }
  int64_t state(int64_t b, int64_t h) const { return (b * H + h) * P * N; }
  int64_t cstate(int64_t b, int64_t h, int64_t c) const { return ((b * H + h) * nc + c) * N * P; }
  int64_t x_row_stride() const { return H * P; }  // distance between time steps of one head in x, y
};

Layout layout_of(const SsdParams& p) {
  return {p.seqlen, p.nheads, p.headdim, p.ngroups, p.dstate, p.nchunks(), p.nheads / p.ngroups};
}

// Loads chunk [t0, t0+Qc) of (b, h): decays, sequence ids, Xd, B, C, B^T, the masked decayed
// matrix M (zero above the diagonal and across sequences) and Ce = diag(r e) C.
template <class T>
void load_chunk(const SsdParams& p, const Layout& lay, int64_t b, int64_t h, int64_t t0, int64_t Qc, Chunk<T>& k) {
  const T* x = (const T*)p.x;
  const T* dt = (const T*)p.dt;
  const T A = ((const T*)p.A)[h];
  const int64_t P = lay.P, N = lay.N, Q = k.Q;
  k.s_prev = !p.seq_idx ? 0 : (t0 > 0 ? p.seq_idx[b * lay.L + t0 - 1] : p.seq_idx[b * lay.L]);
  T acc = 0;
  for (int64_t i = 0; i < Qc; ++i) {
    const int64_t t = t0 + i;
    const T d = dt[lay.dt(b, t, h)];
    acc += d * A;
    k.cs[i] = acc;
    k.s[i] = p.seq_idx ? p.seq_idx[b * lay.L + t] : 0;
    const T* xr = x + lay.x(b, t, h);
    for (int64_t q = 0; q < P; ++q) k.Xd[i * P + q] = d * xr[q];
    const T* br = (const T*)p.Bm + lay.bc(b, t, h);
    const T* cr = (const T*)p.Cm + lay.bc(b, t, h);
    const T e = k.s[i] == k.s_prev ? std::exp(k.cs[i]) : T(0);
    for (int64_t n = 0; n < N; ++n) {
      k.Bc[i * N + n] = br[n];
      k.Cc[i * N + n] = cr[n];
      k.Bt[n * Q + i] = br[n];
      k.Ce[i * N + n] = e * cr[n];
    }
  }
  small_gemm<T>(Qc, Qc, N, k.Cc.data(), N, k.Bt.data(), Q, k.M.data(), Q, false);  // C B^T
  for (int64_t i = 0; i < Qc; ++i) {
    T* m = &k.M[i * Q];
    for (int64_t j = 0; j <= i; ++j) m[j] = (k.s[i] == k.s[j]) ? m[j] * std::exp(k.cs[i] - k.cs[j]) : T(0);
    for (int64_t j = i + 1; j < Qc; ++j) m[j] = 0;
  }
}

template <class T>
void forward_impl(const SsdParams& p) {
  const Layout lay = layout_of(p);
  const int64_t P = p.headdim, N = p.dstate, Q = p.chunk, L = p.seqlen, ldy = lay.x_row_stride();
  at::parallel_for(0, p.batch * p.nheads, 1, [&](int64_t begin, int64_t end) {
    Chunk<T> k(Q, P, N);
    std::vector<T> hT(N * P);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.nheads, h = bh % p.nheads;
      if (p.init_state) transpose<T>(P, N, (const T*)p.init_state + lay.state(b, h), N, hT.data(), P);
      else std::fill(hT.begin(), hT.end(), T(0));
      for (int64_t c = 0; c < lay.nc; ++c) {
        const int64_t t0 = c * Q, Qc = std::min(Q, L - t0);
        std::copy(hT.begin(), hT.end(), (T*)p.chunk_states + lay.cstate(b, h, c));
        load_chunk(p, lay, b, h, t0, Qc, k);
        // Y = M Xd + Ce hT, written straight into y (rows H*P apart).
        T* y = (T*)p.y + lay.x(b, t0, h);
        small_gemm<T>(Qc, P, Qc, k.M.data(), Q, k.Xd.data(), P, y, ldy, false);
        small_gemm<T>(Qc, P, N, k.Ce.data(), N, hT.data(), P, y, ldy, true);
        // hT' = g hT + (w ∘ B)^T Xd.
        const int64_t last = Qc - 1;
        const int32_t s_last = k.s[last];
        const T g = (s_last == k.s_prev) ? std::exp(k.cs[last]) : T(0);
        for (auto& v : hT) v *= g;
        for (int64_t j = 0; j < Qc; ++j) {
          const T w = k.s[j] == s_last ? std::exp(k.cs[last] - k.cs[j]) : T(0);
          for (int64_t n = 0; n < N; ++n) k.BtW[n * Q + j] = w * k.Bc[j * N + n];
        }
        small_gemm<T>(N, P, Qc, k.BtW.data(), Q, k.Xd.data(), P, hT.data(), P, true);
      }
      transpose<T>(N, P, hT.data(), P, (T*)p.final_state + lay.state(b, h), N);
    }
  });
}

template <class T>
void backward_impl(const SsdGradParams& gp) {
  const SsdParams& p = gp.fwd;
  const Layout lay = layout_of(p);
  const int64_t P = p.headdim, N = p.dstate, Q = p.chunk, L = p.seqlen, ldy = lay.x_row_stride();
  at::parallel_for(0, p.batch * p.nheads, 1, [&](int64_t begin, int64_t end) {
    Chunk<T> k(Q, P, N);
    std::vector<T> dS(N * P), dS_pn(P * N), hPN(P * N), dhPrev(N * P), w(Q);
    std::vector<T> Bw(Q * N), CeT(N * Q), XdT(P * Q), MT(Q * Q), dM(Q * Q), dMT(Q * Q);
    std::vector<T> dXd(Q * P), dBq(Q * N), dCq(Q * N), dcs(Q);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.nheads, h = bh % p.nheads;
      const T A = ((const T*)p.A)[h];
      if (gp.dfinal) transpose<T>(P, N, (const T*)gp.dfinal + lay.state(b, h), N, dS.data(), P);
      else std::fill(dS.begin(), dS.end(), T(0));
      T dA_acc = 0;
      for (int64_t c = lay.nc - 1; c >= 0; --c) {
        const int64_t t0 = c * Q, Qc = std::min(Q, L - t0);
        load_chunk(p, lay, b, h, t0, Qc, k);
        const T* hT = (const T*)p.chunk_states + lay.cstate(b, h, c);
        const T* dY = (const T*)gp.dy + lay.x(b, t0, h);  // (Qc, P), rows ldy apart
        std::fill(dcs.begin(), dcs.end(), T(0));
        const int64_t last = Qc - 1;
        const int32_t s_last = k.s[last];

        // State leaving the chunk, hT' = g hT + (w ∘ B)^T Xd, with gradient dS:
        //   dXd = (w ∘ B) dS,  dB_j = w_j Xd_j dS^T,  dcs via w and g.
        for (int64_t j = 0; j < Qc; ++j) {
          w[j] = k.s[j] == s_last ? std::exp(k.cs[last] - k.cs[j]) : T(0);
          for (int64_t n = 0; n < N; ++n) Bw[j * N + n] = w[j] * k.Bc[j * N + n];
        }
        small_gemm<T>(Qc, P, N, Bw.data(), N, dS.data(), P, dXd.data(), P, false);
        transpose<T>(N, P, dS.data(), P, dS_pn.data(), N);
        small_gemm<T>(Qc, N, P, k.Xd.data(), P, dS_pn.data(), N, dBq.data(), N, false);
        for (int64_t j = 0; j < Qc; ++j) {
          T v = 0;
          for (int64_t n = 0; n < N; ++n) {
            dBq[j * N + n] *= w[j];
            v += k.Bc[j * N + n] * dBq[j * N + n];
          }
          dcs[last] += v;
          dcs[j] -= v;
        }
        const T g = (s_last == k.s_prev) ? std::exp(k.cs[last]) : T(0);
        if (g != T(0)) {
          T dg = 0;
          for (int64_t e = 0; e < N * P; ++e) dg += dS[e] * hT[e];
          dcs[last] += dg * g;
        }
        // Gradient of the state entering the chunk: g dS + Ce^T dY.
        for (int64_t e = 0; e < N * P; ++e) dhPrev[e] = g * dS[e];
        transpose<T>(Qc, N, k.Ce.data(), N, CeT.data(), Q);
        small_gemm<T>(N, P, Qc, CeT.data(), Q, dY, ldy, dhPrev.data(), P, true);
        // Inter-chunk output term Y += Ce hT:  dC_i = r_i e_i dY_i hT^T, and dcs_i = C_i · dC_i.
        transpose<T>(N, P, hT, P, hPN.data(), N);
        small_gemm<T>(Qc, N, P, dY, ldy, hPN.data(), N, dCq.data(), N, false);
        for (int64_t i = 0; i < Qc; ++i) {
          const T e = k.s[i] == k.s_prev ? std::exp(k.cs[i]) : T(0);
          T u = 0;
          for (int64_t n = 0; n < N; ++n) {
            dCq[i * N + n] *= e;
            u += k.Cc[i * N + n] * dCq[i * N + n];
          }
          dcs[i] += u;
        }
        // Intra-chunk term Y += M Xd:  dM = dY Xd^T (lower part), dXd += M^T dY,
        // dcs from M's decays, and dCB = dM ∘ G gives dC += dCB B, dB += dCB^T C.
        transpose<T>(Qc, P, k.Xd.data(), P, XdT.data(), Q);
        small_gemm<T>(Qc, Qc, P, dY, ldy, XdT.data(), Q, dM.data(), Q, false);
        for (int64_t i = 0; i < Qc; ++i) {
          const T* m = &k.M[i * Q];
          T* dm = &dM[i * Q];  // becomes dCB in place
          for (int64_t j = 0; j <= i; ++j) {
            if (k.s[i] != k.s[j]) {
              dm[j] = 0;
              continue;
            }
            const T tij = dm[j] * m[j];
            dcs[i] += tij;
            dcs[j] -= tij;
            dm[j] *= std::exp(k.cs[i] - k.cs[j]);
          }
          for (int64_t j = i + 1; j < Qc; ++j) dm[j] = 0;
        }
        transpose<T>(Qc, Qc, k.M.data(), Q, MT.data(), Q);
        small_gemm<T>(Qc, P, Qc, MT.data(), Q, dY, ldy, dXd.data(), P, true);
        small_gemm<T>(Qc, N, Qc, dM.data(), Q, k.Bc.data(), N, dCq.data(), N, true);
        transpose<T>(Qc, Qc, dM.data(), Q, dMT.data(), Q);
        small_gemm<T>(Qc, N, Qc, dMT.data(), Q, k.Cc.data(), N, dBq.data(), N, true);
        // Decays: da_t = Σ_{i>=t} dcs_i ; a_t = dt_t A ; Xd_t = dt_t x_t.
        T run = 0;
        for (int64_t t = Qc - 1; t >= 0; --t) {
          run += dcs[t];
          const int64_t tt = t0 + t;
          const T d = ((const T*)p.dt)[lay.dt(b, tt, h)];
          const T* xr = (const T*)p.x + lay.x(b, tt, h);
          T* dxr = (T*)gp.dx + lay.x(b, tt, h);
          T dd = run * A;
          for (int64_t q = 0; q < P; ++q) {
            dd += xr[q] * dXd[t * P + q];
            dxr[q] = d * dXd[t * P + q];
          }
          ((T*)gp.ddt)[lay.dt(b, tt, h)] = dd;
          dA_acc += run * d;
          std::copy(&dBq[t * N], &dBq[t * N] + N, (T*)gp.dB_head + lay.bh_head(b, tt, h));
          std::copy(&dCq[t * N], &dCq[t * N] + N, (T*)gp.dC_head + lay.bh_head(b, tt, h));
        }
        std::swap(dS, dhPrev);
      }
      ((T*)gp.dA_part)[b * p.nheads + h] = dA_acc;
      if (gp.dinit) transpose<T>(N, P, dS.data(), P, (T*)gp.dinit + lay.state(b, h), N);
    }
  });
}

}  // namespace

void ssd_forward_cpu(const SsdParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return forward_impl<double>(p);
  return forward_impl<float>(p);
}

void ssd_backward_cpu(const SsdGradParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return backward_impl<double>(p);
  return backward_impl<float>(p);
}

}  // namespace hax::ops
