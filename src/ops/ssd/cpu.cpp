// CPU kernels of the chunked SSD scan: forward and hand-written backward.
//
// One (batch row, head) at a time, chunk by chunk. Per chunk of Qc steps with local positions
// i, j and inclusive log-decay cumsum cs_i = Σ_{t<=i} dt_t A:
//   y_i   = Σ_{j<=i} [s_i=s_j] exp(cs_i - cs_j) (C_i·B_j) Xd_j  +  r_i exp(cs_i) h C_i
//   h'    = g h + Σ_j w_j Xd_j B_j^T,   w_j = [s_j=s_last] exp(cs_last - cs_j),
//   g     = [s_last = s_prev] exp(cs_last),   r_i = [s_i = s_prev],   Xd_j = dt_j x_j
// where s are sequence numbers (seq_idx) and s_prev the one of the position before the chunk.
// The state is kept transposed, hT (N, P), so every inner loop runs over a contiguous axis.
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "ops/ssd/ssd.h"

namespace hax::ops {
namespace {

// Per-thread scratch buffers for one chunk.
template <class T>
struct Chunk {
  int64_t Q, P, N;
  std::vector<T> cs, Xd, Bc, Cc, Bt, CB, M;  // (Q) (Q,P) (Q,N) (Q,N) (N,Q) (Q,Q) (Q,Q)
  std::vector<int32_t> s;                    // (Q)
  Chunk(int64_t Q_, int64_t P_, int64_t N_)
      : Q(Q_), P(P_), N(N_), cs(Q), Xd(Q * P), Bc(Q * N), Cc(Q * N), Bt(N * Q), CB(Q * Q), M(Q * Q), s(Q) {}
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
};

Layout layout_of(const SsdParams& p) {
  return {p.seqlen, p.nheads, p.headdim, p.ngroups, p.dstate, p.nchunks(), p.nheads / p.ngroups};
}

// Loads chunk c of (b, h): decays, sequence ids, Xd, B, C, B^T, and the masked decayed C·B^T.
// Returns s_prev, the sequence id of the position before the chunk.
template <class T>
int32_t load_chunk(const SsdParams& p, const Layout& lay, int64_t b, int64_t h, int64_t t0, int64_t Qc,
                   Chunk<T>& k) {
  const T* x = (const T*)p.x;
  const T* dt = (const T*)p.dt;
  const T* Bm = (const T*)p.Bm;
  const T* Cm = (const T*)p.Cm;
  const T A = ((const T*)p.A)[h];
  const int64_t P = lay.P, N = lay.N, Q = k.Q;
  T acc = 0;
  for (int64_t i = 0; i < Qc; ++i) {
    const int64_t t = t0 + i;
    const T d = dt[lay.dt(b, t, h)];
    acc += d * A;
    k.cs[i] = acc;
    k.s[i] = p.seq_idx ? p.seq_idx[b * lay.L + t] : 0;
    const T* xr = x + lay.x(b, t, h);
    for (int64_t q = 0; q < P; ++q) k.Xd[i * P + q] = d * xr[q];
    const T* br = Bm + lay.bc(b, t, h);
    const T* cr = Cm + lay.bc(b, t, h);
    for (int64_t n = 0; n < N; ++n) {
      k.Bc[i * N + n] = br[n];
      k.Cc[i * N + n] = cr[n];
      k.Bt[n * Q + i] = br[n];
    }
  }
  // CB[i][j] = C_i · B_j for j <= i, then M = CB ∘ [s_i = s_j] exp(cs_i - cs_j).
  for (int64_t i = 0; i < Qc; ++i) {
    T* cb = &k.CB[i * Q];
    for (int64_t j = 0; j <= i; ++j) cb[j] = 0;
    for (int64_t n = 0; n < N; ++n) {
      const T c = k.Cc[i * N + n];
      const T* bt = &k.Bt[n * Q];
      for (int64_t j = 0; j <= i; ++j) cb[j] += c * bt[j];
    }
    T* m = &k.M[i * Q];
    for (int64_t j = 0; j <= i; ++j) m[j] = (k.s[i] == k.s[j]) ? cb[j] * std::exp(k.cs[i] - k.cs[j]) : T(0);
  }
  if (!p.seq_idx) return 0;
  return t0 > 0 ? p.seq_idx[b * lay.L + t0 - 1] : p.seq_idx[b * lay.L];
}

template <class T>
void forward_impl(const SsdParams& p) {
  const Layout lay = layout_of(p);
  const int64_t P = p.headdim, N = p.dstate, Q = p.chunk, L = p.seqlen;
  at::parallel_for(0, p.batch * p.nheads, 1, [&](int64_t begin, int64_t end) {
    Chunk<T> k(Q, P, N);
    std::vector<T> hT(N * P), yrow(P);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.nheads, h = bh % p.nheads;
      if (p.init_state) {
        const T* h0 = (const T*)p.init_state + lay.state(b, h);
        for (int64_t q = 0; q < P; ++q)
          for (int64_t n = 0; n < N; ++n) hT[n * P + q] = h0[q * N + n];
      } else {
        std::fill(hT.begin(), hT.end(), T(0));
      }
      for (int64_t c = 0; c < lay.nc; ++c) {
        const int64_t t0 = c * Q, Qc = std::min(Q, L - t0);
        std::copy(hT.begin(), hT.end(), (T*)p.chunk_states + lay.cstate(b, h, c));
        const int32_t s_prev = load_chunk(p, lay, b, h, t0, Qc, k);
        // Outputs.
        for (int64_t i = 0; i < Qc; ++i) {
          std::fill(yrow.begin(), yrow.end(), T(0));
          const T* m = &k.M[i * Q];
          for (int64_t j = 0; j <= i; ++j) {
            const T coef = m[j];
            if (coef == T(0)) continue;
            const T* xd = &k.Xd[j * P];
            for (int64_t q = 0; q < P; ++q) yrow[q] += coef * xd[q];
          }
          if (k.s[i] == s_prev) {
            const T e = std::exp(k.cs[i]);
            for (int64_t n = 0; n < N; ++n) {
              const T coef = e * k.Cc[i * N + n];
              const T* hr = &hT[n * P];
              for (int64_t q = 0; q < P; ++q) yrow[q] += coef * hr[q];
            }
          }
          std::copy(yrow.begin(), yrow.end(), (T*)p.y + lay.x(b, t0 + i, h));
        }
        // State passed to the next chunk.
        const int64_t last = Qc - 1;
        const int32_t s_last = k.s[last];
        const T g = (s_last == s_prev) ? std::exp(k.cs[last]) : T(0);
        for (auto& v : hT) v *= g;
        for (int64_t j = 0; j < Qc; ++j) {
          if (k.s[j] != s_last) continue;
          const T w = std::exp(k.cs[last] - k.cs[j]);
          const T* xd = &k.Xd[j * P];
          for (int64_t n = 0; n < N; ++n) {
            const T coef = w * k.Bc[j * N + n];
            T* hr = &hT[n * P];
            for (int64_t q = 0; q < P; ++q) hr[q] += coef * xd[q];
          }
        }
      }
      T* hf = (T*)p.final_state + lay.state(b, h);
      for (int64_t q = 0; q < P; ++q)
        for (int64_t n = 0; n < N; ++n) hf[q * N + n] = hT[n * P + q];
    }
  });
}

template <class T>
void backward_impl(const SsdGradParams& gp) {
  const SsdParams& p = gp.fwd;
  const Layout lay = layout_of(p);
  const int64_t P = p.headdim, N = p.dstate, Q = p.chunk, L = p.seqlen;
  at::parallel_for(0, p.batch * p.nheads, 1, [&](int64_t begin, int64_t end) {
    Chunk<T> k(Q, P, N);
    std::vector<T> dS(N * P), dS_pn(P * N), hPN(P * N), dhPrev(N * P);
    std::vector<T> dY(Q * P), XdT(P * Q), dM(Q * Q), dXd(Q * P), dBq(Q * N), dCq(Q * N), dcs(Q), tmp(N);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.nheads, h = bh % p.nheads;
      const T A = ((const T*)p.A)[h];
      if (gp.dfinal) {
        const T* df = (const T*)gp.dfinal + lay.state(b, h);
        for (int64_t q = 0; q < P; ++q)
          for (int64_t n = 0; n < N; ++n) dS[n * P + q] = df[q * N + n];
      } else {
        std::fill(dS.begin(), dS.end(), T(0));
      }
      T dA_acc = 0;
      for (int64_t c = lay.nc - 1; c >= 0; --c) {
        const int64_t t0 = c * Q, Qc = std::min(Q, L - t0);
        const int32_t s_prev = load_chunk(p, lay, b, h, t0, Qc, k);
        const T* hT = (const T*)p.chunk_states + lay.cstate(b, h, c);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t q = 0; q < P; ++q) {
            hPN[q * N + n] = hT[n * P + q];
            dS_pn[q * N + n] = dS[n * P + q];
          }
        for (int64_t i = 0; i < Qc; ++i) {
          const T* dy = (const T*)gp.dy + lay.x(b, t0 + i, h);
          std::copy(dy, dy + P, &dY[i * P]);
        }
        std::fill(dXd.begin(), dXd.end(), T(0));
        std::fill(dBq.begin(), dBq.end(), T(0));
        std::fill(dCq.begin(), dCq.end(), T(0));
        std::fill(dcs.begin(), dcs.end(), T(0));
        const int64_t last = Qc - 1;
        const int32_t s_last = k.s[last];
        // State leaving the chunk: h' = g h + Σ_j w_j Xd_j B_j^T.
        for (int64_t j = 0; j < Qc; ++j) {
          if (k.s[j] != s_last) continue;
          const T w = std::exp(k.cs[last] - k.cs[j]);
          T* dxd = &dXd[j * P];
          for (int64_t n = 0; n < N; ++n) {
            const T coef = w * k.Bc[j * N + n];
            const T* ds = &dS[n * P];
            for (int64_t q = 0; q < P; ++q) dxd[q] += coef * ds[q];
          }
          T* dbq = &dBq[j * N];
          for (int64_t q = 0; q < P; ++q) {
            const T coef = w * k.Xd[j * P + q];
            const T* ds = &dS_pn[q * N];
            for (int64_t n = 0; n < N; ++n) dbq[n] += coef * ds[n];
          }
          T v = 0;
          for (int64_t n = 0; n < N; ++n) v += k.Bc[j * N + n] * dbq[n];
          dcs[last] += v;
          dcs[j] -= v;
        }
        const T g = (s_last == s_prev) ? std::exp(k.cs[last]) : T(0);
        if (g != T(0)) {
          T dg = 0;
          for (int64_t e = 0; e < N * P; ++e) dg += dS[e] * hT[e];
          dcs[last] += dg * g;
        }
        for (int64_t e = 0; e < N * P; ++e) dhPrev[e] = g * dS[e];
        // Inter-chunk output term: y_i += r_i exp(cs_i) h C_i.
        for (int64_t i = 0; i < Qc; ++i) {
          if (k.s[i] != s_prev) continue;
          const T e = std::exp(k.cs[i]);
          std::fill(tmp.begin(), tmp.end(), T(0));
          for (int64_t q = 0; q < P; ++q) {
            const T coef = e * dY[i * P + q];
            const T* hr = &hPN[q * N];
            for (int64_t n = 0; n < N; ++n) tmp[n] += coef * hr[n];
          }
          T u = 0;
          for (int64_t n = 0; n < N; ++n) {
            u += k.Cc[i * N + n] * tmp[n];
            dCq[i * N + n] += tmp[n];
          }
          dcs[i] += u;
          for (int64_t n = 0; n < N; ++n) {
            const T coef = e * k.Cc[i * N + n];
            T* dh = &dhPrev[n * P];
            const T* dy = &dY[i * P];
            for (int64_t q = 0; q < P; ++q) dh[q] += coef * dy[q];
          }
        }
        // Intra-chunk term: y_i += Σ_{j<=i} M_ij Xd_j, M = CB ∘ decay mask.
        for (int64_t j = 0; j < Qc; ++j)
          for (int64_t q = 0; q < P; ++q) XdT[q * Q + j] = k.Xd[j * P + q];
        for (int64_t i = 0; i < Qc; ++i) {
          T* dm = &dM[i * Q];
          for (int64_t j = 0; j <= i; ++j) dm[j] = 0;
          for (int64_t q = 0; q < P; ++q) {
            const T coef = dY[i * P + q];
            const T* xt = &XdT[q * Q];
            for (int64_t j = 0; j <= i; ++j) dm[j] += coef * xt[j];
          }
        }
        for (int64_t i = 0; i < Qc; ++i) {
          const T* m = &k.M[i * Q];
          T* dm = &dM[i * Q];  // becomes dCB in place
          const T* dy = &dY[i * P];
          for (int64_t j = 0; j <= i; ++j) {
            if (k.s[i] != k.s[j]) {
              dm[j] = 0;
              continue;
            }
            const T tij = dm[j] * m[j];
            dcs[i] += tij;
            dcs[j] -= tij;
            if (m[j] != T(0)) {
              T* dxd = &dXd[j * P];
              const T coef = m[j];
              for (int64_t q = 0; q < P; ++q) dxd[q] += coef * dy[q];
            }
            dm[j] *= std::exp(k.cs[i] - k.cs[j]);
          }
          // dC_i += Σ_j dCB_ij B_j ;  dB_j += dCB_ij C_i
          T* dc = &dCq[i * N];
          const T* ci = &k.Cc[i * N];
          for (int64_t j = 0; j <= i; ++j) {
            const T coef = dm[j];
            if (coef == T(0)) continue;
            const T* bj = &k.Bc[j * N];
            T* db = &dBq[j * N];
            for (int64_t n = 0; n < N; ++n) {
              dc[n] += coef * bj[n];
              db[n] += coef * ci[n];
            }
          }
        }
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
      if (gp.dinit) {
        T* di = (T*)gp.dinit + lay.state(b, h);
        for (int64_t q = 0; q < P; ++q)
          for (int64_t n = 0; n < N; ++n) di[q * N + n] = dS[n * P + q];
      }
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
