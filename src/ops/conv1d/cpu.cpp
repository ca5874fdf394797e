// CPU kernels of the depthwise causal conv1d: forward and hand-written backward.
//
// One work item is (batch row b, block of up to kBlock channels). For each output position t the
// W taps are resolved once for the whole block into row pointers (x, the initial state, or none
// across a sequence boundary); the inner loops then run over the block's contiguous channels.
// Backward, with pre = bias + Σ_k w_k in_{t-(W-1)+k} and dpre = dout act'(pre):
//   dx_s += w_k dpre_t  (s = t-(W-1)+k >= 0),   dinit_{(W-1)+s} += w_k dpre_t  (s < 0),
//   dw_k += dpre_t in_s,   dbias += dpre_t
// each accumulated by the one work item that owns (b, channels), positions in increasing order;
// dweight and dbias are per-row partials summed over rows by the caller.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/conv1d/conv1d.h"

namespace hax::ops {
namespace {

constexpr int64_t kBlock = 64;

// Where tap k of output position t reads from, for all channels at once: a pointer to the
// position's channel 0 (x or the initial state), or null (zeros). `grad` gives the matching
// pointer in dx / dinit (same offsets), for the backward.
template <class T>
struct Taps {
  std::vector<const T*> src;
  std::vector<T*> grad;
  explicit Taps(int64_t W) : src(W), grad(W) {}
};

// Resolves the W taps of position t of row b (t may be L, for the final state's window).
// `seq_t` is the sequence number the taps must belong to.
template <class T>
void resolve_taps(const Conv1dParams& p, int64_t b, int64_t t, int32_t seq_t, T* dx, T* dinit, Taps<T>& taps) {
  const int64_t W = p.width, L = p.seqlen, C = p.channels;
  const T* x = (const T*)p.x;
  const T* init = (const T*)p.init_state;
  const int32_t* seq = p.seq_idx ? p.seq_idx + b * L : nullptr;
  for (int64_t k = 0; k < W; ++k) {
    const int64_t s = t - (W - 1) + k;
    taps.src[k] = nullptr;
    taps.grad[k] = nullptr;
    if (s >= L) continue;  // only for t = L (the final state's window)
    if (s >= 0) {
      if (seq && seq[s] != seq_t) continue;
      taps.src[k] = x + (b * L + s) * C;
      if (dx) taps.grad[k] = dx + (b * L + s) * C;
    } else {
      if (!init || (seq && L > 0 && seq[0] != seq_t)) continue;
      const int64_t off = (b * (W - 1) + (W - 1) + s) * C;
      taps.src[k] = init + off;
      if (dinit) taps.grad[k] = dinit + off;
    }
  }
}

// acc[c] = bias[c0 + c] + Σ_k w[c0 + c, k] * tap_k[c0 + c] for the cb channels of a block, with the
// block's weights transposed in wT (W, kBlock).
template <class T>
void pre_activation(const Taps<T>& taps, const T* wT, const T* bias, int64_t W, int64_t c0, int64_t cb, T* acc) {
  for (int64_t c = 0; c < cb; ++c) acc[c] = bias ? bias[c0 + c] : T(0);
  for (int64_t k = 0; k < W; ++k) {
    const T* src = taps.src[k];
    if (!src) continue;
    src += c0;
    const T* w = &wT[k * kBlock];
    for (int64_t c = 0; c < cb; ++c) acc[c] += w[c] * src[c];
  }
}

template <class T>
T sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

template <class T>
void forward_impl(const Conv1dParams& p) {
  const int64_t L = p.seqlen, C = p.channels, W = p.width;
  const int64_t nblk = (C + kBlock - 1) / kBlock;
  const T* weight = (const T*)p.weight;
  const T* bias = (const T*)p.bias;
  at::parallel_for(0, p.batch * nblk, 1, [&](int64_t begin, int64_t end) {
    Taps<T> taps(W);
    std::vector<T> wT(W * kBlock);  // (W, block) transposed weights
    T acc[kBlock];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / nblk, c0 = (item % nblk) * kBlock, cb = std::min(kBlock, C - c0);
      for (int64_t c = 0; c < cb; ++c)
        for (int64_t k = 0; k < W; ++k) wT[k * kBlock + c] = weight[(c0 + c) * W + k];
      for (int64_t t = 0; t < L; ++t) {
        resolve_taps<T>(p, b, t, p.seq_idx ? p.seq_idx[b * L + t] : 0, nullptr, nullptr, taps);
        pre_activation<T>(taps, wT.data(), bias, W, c0, cb, acc);
        T* o = (T*)p.out + (b * L + t) * C + c0;
        if (p.silu)
          for (int64_t c = 0; c < cb; ++c) o[c] = acc[c] * sigmoid(acc[c]);
        else
          for (int64_t c = 0; c < cb; ++c) o[c] = acc[c];
      }
      // Final state: the first W-1 taps of a position t = L, in the row's last sequence.
      if (p.final_state && W > 1) {
        const int32_t seq_last = p.seq_idx && L > 0 ? p.seq_idx[b * L + L - 1] : 0;
        resolve_taps<T>(p, b, L, seq_last, nullptr, nullptr, taps);
        for (int64_t j = 0; j < W - 1; ++j) {
          const T* src = taps.src[j];
          T* f = (T*)p.final_state + (b * (W - 1) + j) * C + c0;
          for (int64_t c = 0; c < cb; ++c) f[c] = src ? src[c0 + c] : T(0);
        }
      }
    }
  });
}

template <class T>
void backward_impl(const Conv1dGradParams& gp) {
  const Conv1dParams& p = gp.fwd;
  const int64_t L = p.seqlen, C = p.channels, W = p.width;
  const int64_t nblk = (C + kBlock - 1) / kBlock;
  const T* weight = (const T*)p.weight;
  const T* bias = (const T*)p.bias;
  at::parallel_for(0, p.batch * nblk, 1, [&](int64_t begin, int64_t end) {
    Taps<T> taps(W);
    std::vector<T> wT(W * kBlock), dwT(W * kBlock);
    T acc[kBlock], dpre[kBlock], db[kBlock];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / nblk, c0 = (item % nblk) * kBlock, cb = std::min(kBlock, C - c0);
      for (int64_t c = 0; c < cb; ++c)
        for (int64_t k = 0; k < W; ++k) wT[k * kBlock + c] = weight[(c0 + c) * W + k];
      std::fill(dwT.begin(), dwT.end(), T(0));
      std::fill(db, db + kBlock, T(0));
      for (int64_t t = 0; t < L; ++t) {
        resolve_taps<T>(p, b, t, p.seq_idx ? p.seq_idx[b * L + t] : 0, (T*)gp.dx, (T*)gp.dinit, taps);
        const T* dout = (const T*)gp.dout + (b * L + t) * C + c0;
        if (p.silu) {
          // Recompute the pre-activation; dpre = dout silu'(pre), silu' = σ (1 + pre (1 - σ)).
          pre_activation<T>(taps, wT.data(), bias, W, c0, cb, acc);
          for (int64_t c = 0; c < cb; ++c) {
            const T sg = sigmoid(acc[c]);
            dpre[c] = dout[c] * sg * (T(1) + acc[c] * (T(1) - sg));
          }
        } else {
          for (int64_t c = 0; c < cb; ++c) dpre[c] = dout[c];
        }
        for (int64_t c = 0; c < cb; ++c) db[c] += dpre[c];
        for (int64_t k = 0; k < W; ++k) {
          const T* src = taps.src[k];
          if (!src) continue;
          src += c0;
          const T* w = &wT[k * kBlock];
          T* dw = &dwT[k * kBlock];
          for (int64_t c = 0; c < cb; ++c) dw[c] += dpre[c] * src[c];
          T* g = taps.grad[k];
          if (!g) continue;  // an initial-state tap without dinit requested
          g += c0;
          for (int64_t c = 0; c < cb; ++c) g[c] += w[c] * dpre[c];
        }
      }
      T* dwp = (T*)gp.dweight_part + b * C * W;
      for (int64_t c = 0; c < cb; ++c)
        for (int64_t k = 0; k < W; ++k) dwp[(c0 + c) * W + k] = dwT[k * kBlock + c];
      if (gp.dbias_part)
        for (int64_t c = 0; c < cb; ++c) ((T*)gp.dbias_part)[b * C + c0 + c] = db[c];
    }
  });
}

}  // namespace

void conv1d_forward_cpu(const Conv1dParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return forward_impl<double>(p);
  return forward_impl<float>(p);
}

void conv1d_backward_cpu(const Conv1dGradParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return backward_impl<double>(p);
  return backward_impl<float>(p);
}

}  // namespace hax::ops
