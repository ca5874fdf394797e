// CPU kernels of the selective scan: forward and hand-written backward.
//
// One work item is (batch row b, channel block): up to kSelectiveScanChannelBlock channels of one
// group, which share B_t and C_t. Inside a block the state is kept as H[n][c] (channel index
// innermost, padded to the block width with inert channels: delta = x = A = 0), so every inner
// loop runs over a fixed-width contiguous axis and vectorizes.
//
// Backward, per channel (index d dropped), with a_t = exp(delta_t A), r_t = 0 where a packed
// sequence starts at t > 0 (else 1), hp_t = r_t h_{t-1} the state the step at t reads:
//   g_t      = dy_t C_t + r_{t+1} a_{t+1} g_{t+1}          (adjoint of h_t, g_{L-1} from dfinal)
//   dC_t    += dy_t h_t            dB_t += g_t delta_t x_t      dx_t = delta_t Σ_n g_t B_t
//   ddelta_t = Σ_n g_t (B_t x_t + A a_t hp_t)                  dA  += g_t delta_t a_t hp_t
//   dinit    = a_0 g_0
// The states h_t come from the checkpoints: segment by segment, last first, the forward is
// recomputed from the segment's checkpoint into a per-thread buffer and then walked backward.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ops/selective_scan/selective_scan.h"

namespace hax::ops {
namespace {

constexpr int64_t CB = kSelectiveScanChannelBlock;

// exp that the compiler can vectorize. float: Cephes' expf polynomial after a round-to-nearest
// range reduction (within 1.5 ulp of exp on [-88, 88.37]; 0 below -88, where exp is denormal,
// and inf above 88.37), written without calls or branches so that the loops over a block's
// channels become SIMD even without -ffast-math; double: std::exp (the precise path).
inline double vexp(double v) { return std::exp(v); }
inline float vexp(float v) {
  const float xc = std::min(std::max(v, -88.0f), 88.37f);
  const float k = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(xc / ln 2)
  float r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)k + 127) << 23;  // 2^k
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  // Out-of-range factors as selects between constants (a select around p * scale itself would
  // make the compiler predicate the whole polynomial).
  const float hi = v > 88.37f ? std::numeric_limits<float>::infinity() : 1.0f;
  const float lo = v < -88.0f ? 0.0f : 1.0f;
  return p * scale * hi * lo;
}

// Index helpers over the contiguous layouts documented in selective_scan.h.
struct Layout {
  int64_t L, D, G, N, K, ns, dpg, bpg;
  int64_t x(int64_t b, int64_t t) const { return (b * L + t) * D; }  // + channel
  int64_t bc(int64_t b, int64_t t, int64_t g) const { return ((b * L + t) * G + g) * N; }
  int64_t part(int64_t b, int64_t t, int64_t g, int64_t j) const { return (((b * L + t) * G + g) * bpg + j) * N; }
  int64_t state(int64_t b, int64_t d) const { return (b * D + d) * N; }
  int64_t ckpt(int64_t b, int64_t s, int64_t d) const { return ((b * ns + s) * D + d) * N; }
};

Layout layout_of(const SelectiveScanParams& p) {
  return {p.seqlen, p.dim, p.ngroups, p.dstate, p.checkpoint, p.nsegments(), p.dim_per_group(), p.blocks_per_group()};
}

// One channel block: group g, first channel c0, cb real channels (the rest of CB are padding).
struct Block {
  int64_t g, j, c0, cb;
};

Block block_of(const Layout& lay, int64_t blk) {
  Block k;
  k.g = blk / lay.bpg;
  k.j = blk % lay.bpg;
  k.c0 = k.g * lay.dpg + k.j * CB;
  k.cb = std::min(CB, lay.dpg - k.j * CB);
  return k;
}

// Loads a (D, N) state slice of channels [c0, c0 + cb) into H[n][c] (zero padding); src may be null.
template <class T>
void load_state(const T* src, const Layout& lay, int64_t stride_d, const Block& k, T* H) {
  std::fill(H, H + lay.N * CB, T(0));
  if (!src) return;
  for (int64_t c = 0; c < k.cb; ++c)
    for (int64_t n = 0; n < lay.N; ++n) H[n * CB + c] = src[(k.c0 + c) * stride_d + n];
}

template <class T>
void store_state(const T* H, const Layout& lay, int64_t stride_d, const Block& k, T* dst) {
  for (int64_t c = 0; c < k.cb; ++c)
    for (int64_t n = 0; n < lay.N; ++n) dst[(k.c0 + c) * stride_d + n] = H[n * CB + c];
}

// Loads channels [c0, c0 + cb) of a (B, L, D) row position into v[CB] (zero padding).
template <class T>
void load_channels(const T* src, const Block& k, T* v) {
  for (int64_t c = 0; c < CB; ++c) v[c] = c < k.cb ? src[k.c0 + c] : T(0);
}

// out[n] = Σ_c P[n][c], lanes added in order (a fixed order).
template <class T>
void sum_channels(const T* P, int64_t N, T* out) {
  for (int64_t n = 0; n < N; ++n) {
    const T* row = P + n * CB;
    T s = 0;
    for (int64_t c = 0; c < CB; ++c) s += row[c];
    out[n] = s;
  }
}

bool resets(const SelectiveScanParams& p, int64_t b, int64_t t) {
  return p.seq_idx && t > 0 && p.seq_idx[b * p.seqlen + t] != p.seq_idx[b * p.seqlen + t - 1];
}

template <class T>
void forward_impl(const SelectiveScanParams& p) {
  const Layout lay = layout_of(p);
  const int64_t N = lay.N, L = lay.L;
  const T* x = (const T*)p.x;
  const T* delta = (const T*)p.delta;
  const T* Bm = (const T*)p.Bm;
  const T* Cm = (const T*)p.Cm;
  const int64_t nblk = p.ngroups * lay.bpg;
  at::parallel_for(0, p.batch * nblk, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> H(N * CB), At(N * CB);
    T dl[CB], dx[CB], yv[CB];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / nblk;
      const Block k = block_of(lay, item % nblk);
      load_state((const T*)p.A, lay, N, k, At.data());
      load_state(p.init_state ? (const T*)p.init_state + lay.state(b, 0) : nullptr, lay, N, k, H.data());
      for (int64_t t = 0; t < L; ++t) {
        if (resets(p, b, t)) std::fill(H.begin(), H.end(), T(0));
        if (p.checkpoints && t % lay.K == 0)
          store_state(H.data(), lay, N, k, (T*)p.checkpoints + lay.ckpt(b, t / lay.K, 0));
        load_channels(delta + lay.x(b, t), k, dl);
        load_channels(x + lay.x(b, t), k, dx);
        for (int64_t c = 0; c < CB; ++c) dx[c] *= dl[c], yv[c] = 0;
        const T* Bt = Bm + lay.bc(b, t, k.g);
        const T* Ct = Cm + lay.bc(b, t, k.g);
        for (int64_t n = 0; n < N; ++n) {
          const T bn = Bt[n], cn = Ct[n];
          T* h = &H[n * CB];
          const T* a = &At[n * CB];
          for (int64_t c = 0; c < CB; ++c) {
            const T v = vexp(dl[c] * a[c]) * h[c] + dx[c] * bn;
            h[c] = v;
            yv[c] += cn * v;
          }
        }
        T* yr = (T*)p.y + lay.x(b, t) + k.c0;
        for (int64_t c = 0; c < k.cb; ++c) yr[c] = yv[c];
      }
      store_state(H.data(), lay, N, k, (T*)p.final_state + lay.state(b, 0));
    }
  });
}

template <class T>
void backward_impl(const SelectiveScanGradParams& gp) {
  const SelectiveScanParams& p = gp.fwd;
  const Layout lay = layout_of(p);
  const int64_t N = lay.N, L = lay.L, K = lay.K, NC = N * CB;
  const T* x = (const T*)p.x;
  const T* delta = (const T*)p.delta;
  const T* Bm = (const T*)p.Bm;
  const T* Cm = (const T*)p.Cm;
  const T* dy = (const T*)gp.dy;
  const int64_t nblk = p.ngroups * lay.bpg;
  at::parallel_for(0, p.batch * nblk, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> At(NC), H(NC), G(NC), dAacc(NC), Pb(NC), Pc(NC);
    std::vector<T> Hp(K * NC), Aa(K * NC);  // per step of a segment: state read, decay
    T dl[CB], xv[CB], dyv[CB], dxacc[CB], dgah[CB];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / nblk;
      const Block k = block_of(lay, item % nblk);
      load_state((const T*)p.A, lay, N, k, At.data());
      load_state(gp.dfinal ? (const T*)gp.dfinal + lay.state(b, 0) : nullptr, lay, N, k, G.data());
      std::fill(dAacc.begin(), dAacc.end(), T(0));
      for (int64_t s = lay.ns - 1; s >= 0; --s) {
        const int64_t t0 = s * K, len = std::min(K, L - t0);
        // Recompute the segment's states from its checkpoint.
        load_state((const T*)p.checkpoints + lay.ckpt(b, s, 0), lay, N, k, H.data());
        for (int64_t i = 0; i < len; ++i) {
          const int64_t t = t0 + i;
          if (resets(p, b, t)) std::fill(H.begin(), H.end(), T(0));
          std::copy(H.begin(), H.end(), &Hp[i * NC]);
          load_channels(delta + lay.x(b, t), k, dl);
          load_channels(x + lay.x(b, t), k, xv);
          for (int64_t c = 0; c < CB; ++c) xv[c] *= dl[c];
          const T* Bt = Bm + lay.bc(b, t, k.g);
          T* aa = &Aa[i * NC];
          for (int64_t n = 0; n < N; ++n) {
            const T bn = Bt[n];
            T* h = &H[n * CB];
            const T* a = &At[n * CB];
            T* ar = aa + n * CB;
            for (int64_t c = 0; c < CB; ++c) {
              const T e = vexp(dl[c] * a[c]);
              ar[c] = e;
              h[c] = e * h[c] + xv[c] * bn;
            }
          }
        }
        // Walk the segment backward.
        for (int64_t i = len - 1; i >= 0; --i) {
          const int64_t t = t0 + i;
          load_channels(delta + lay.x(b, t), k, dl);
          load_channels(x + lay.x(b, t), k, xv);
          load_channels(dy + lay.x(b, t), k, dyv);
          for (int64_t c = 0; c < CB; ++c) dxacc[c] = 0, dgah[c] = 0;
          const T* Bt = Bm + lay.bc(b, t, k.g);
          const T* Ct = Cm + lay.bc(b, t, k.g);
          const T* hp_i = &Hp[i * NC];
          const T* a_i = &Aa[i * NC];
          for (int64_t n = 0; n < N; ++n) {
            const T bn = Bt[n], cn = Ct[n];
            const T* hp = hp_i + n * CB;
            const T* e = a_i + n * CB;
            const T* a = &At[n * CB];
            T* gr = &G[n * CB];
            T* da = &dAacc[n * CB];
            T* pb = &Pb[n * CB];
            T* pc = &Pc[n * CB];
            for (int64_t c = 0; c < CB; ++c) {
              const T xd = dl[c] * xv[c];
              const T h = e[c] * hp[c] + xd * bn;
              const T g = gr[c] + dyv[c] * cn;
              const T gah = g * e[c] * hp[c];
              pc[c] = dyv[c] * h;
              pb[c] = g * xd;
              dxacc[c] += g * bn;
              dgah[c] += a[c] * gah;
              da[c] += gah * dl[c];
              gr[c] = g * e[c];
            }
          }
          T* dxr = (T*)gp.dx + lay.x(b, t) + k.c0;
          T* ddr = (T*)gp.ddelta + lay.x(b, t) + k.c0;
          for (int64_t c = 0; c < k.cb; ++c) {
            dxr[c] = dl[c] * dxacc[c];
            ddr[c] = xv[c] * dxacc[c] + dgah[c];
          }
          sum_channels(Pb.data(), N, (T*)gp.dB_part + lay.part(b, t, k.g, k.j));
          sum_channels(Pc.data(), N, (T*)gp.dC_part + lay.part(b, t, k.g, k.j));
          if (resets(p, b, t)) std::fill(G.begin(), G.end(), T(0));
        }
      }
      if (gp.dinit) store_state(G.data(), lay, N, k, (T*)gp.dinit + lay.state(b, 0));
      store_state(dAacc.data(), lay, N, k, (T*)gp.dA_part + lay.state(b, 0));
    }
  });
}

}  // namespace

void selective_scan_forward_cpu(const SelectiveScanParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return forward_impl<double>(p);
  return forward_impl<float>(p);
}

void selective_scan_backward_cpu(const SelectiveScanGradParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return backward_impl<double>(p);
  return backward_impl<float>(p);
}

}  // namespace hax::ops
