// CPU kernels of the decoding steps: plain loops over the state rows, in x's dtype (the state is
// read and written in its own dtype). These are the CUDA kernels' references; the LibTorch
// expressions in reference.cpp are theirs.
#include <ATen/Parallel.h>

#include <cmath>

#include "ops/ssm_step/ssm_step.h"

namespace hax::ops {
namespace {

template <class T>
T softplus(T v) {  // LibTorch's softplus (beta 1, threshold 20)
  return v > T(20) ? v : std::log1p(std::exp(v));
}

template <class T>
void conv1d_step_impl(const Conv1dStepParams& p) {
  const int64_t C = p.channels, W = p.width;
  const T* weight = (const T*)p.weight;
  const T* bias = (const T*)p.bias;
  at::parallel_for(0, p.batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const T* x = (const T*)p.x + b * p.x_stride;
      T* st = (T*)p.state + b * (W - 1) * C;  // (W-1, C)
      T* out = (T*)p.out + b * C;
      for (int64_t c = 0; c < C; ++c) {
        const T* w = weight + c * W;
        const T xv = x[c];
        // Taps oldest first, after the bias (causal_conv1d's order).
        T acc = bias ? bias[c] : T(0);
        for (int64_t k = 0; k + 1 < W; ++k) acc += w[k] * st[k * C + c];
        acc += w[W - 1] * xv;
        for (int64_t k = 0; k + 2 < W; ++k) st[k * C + c] = st[(k + 1) * C + c];
        if (W > 1) st[(W - 2) * C + c] = xv;
        out[c] = p.silu ? acc * (T(1) / (T(1) + std::exp(-acc))) : acc;
      }
    }
  });
}

template <class T, class S>
void ssd_step_impl(const SsdStepParams& p) {
  const int64_t H = p.nheads, P = p.headdim, N = p.dstate, hpg = p.heads_per_group();
  const T* A = (const T*)p.A;
  const T* dt_bias = (const T*)p.dt_bias;
  const T* skip = (const T*)p.skip;
  at::parallel_for(0, p.batch * H, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H, g = h / hpg;
      T dt = ((const T*)p.dt)[b * p.dt_stride + h] + (dt_bias ? dt_bias[h] : T(0));
      if (p.dt_softplus) dt = softplus(dt);
      const T decay = std::exp(dt * A[h]);
      const T* x = (const T*)p.x + b * p.x_stride + h * P;
      const T* Bv = (const T*)p.Bm + b * p.B_stride + g * N;
      const T* Cv = (const T*)p.Cm + b * p.C_stride + g * N;
      S* st = (S*)p.state + i * P * N;  // (P, N)
      T* y = (T*)p.y + i * P;
      for (int64_t q = 0; q < P; ++q) {
        const T xv = x[q], dx = dt * xv;
        T acc = 0;
        for (int64_t n = 0; n < N; ++n) {
          const T s = T(st[q * N + n]) * decay + dx * Bv[n];
          st[q * N + n] = S(s);
          acc += s * Cv[n];
        }
        y[q] = skip ? acc + xv * skip[h] : acc;
      }
    }
  });
}

template <class T, class S>
void selective_scan_step_impl(const SelectiveScanStepParams& p) {
  const int64_t D = p.dim, N = p.dstate, dpg = p.dim_per_group();
  const T* A = (const T*)p.A;
  const T* bias = (const T*)p.delta_bias;
  const T* skip = (const T*)p.skip;
  at::parallel_for(0, p.batch * D, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / D, d = i % D, g = d / dpg;
      T dl = ((const T*)p.delta)[b * p.delta_stride + d] + (bias ? bias[d] : T(0));
      if (p.delta_softplus) dl = softplus(dl);
      const T xv = ((const T*)p.x)[b * p.x_stride + d], dx = dl * xv;
      const T* Bv = (const T*)p.Bm + b * p.B_stride + g * N;
      const T* Cv = (const T*)p.Cm + b * p.C_stride + g * N;
      S* st = (S*)p.state + i * N;
      T acc = 0;
      for (int64_t n = 0; n < N; ++n) {
        const T s = T(st[n]) * std::exp(dl * A[d * N + n]) + dx * Bv[n];
        st[n] = S(s);
        acc += s * Cv[n];
      }
      ((T*)p.y)[i] = skip ? acc + xv * skip[d] : acc;
    }
  });
}

// Runs f<T, S>() for the CPU dtypes: T float or double, S T or float.
template <template <class, class> class Impl, class P>
void dispatch_cpu(const P& p, at::ScalarType dtype, at::ScalarType state_dtype) {
  if (dtype == at::kDouble)
    return state_dtype == at::kDouble ? Impl<double, double>::run(p) : Impl<double, float>::run(p);
  return Impl<float, float>::run(p);
}

template <class T, class S>
struct SsdStep {
  static void run(const SsdStepParams& p) { ssd_step_impl<T, S>(p); }
};
template <class T, class S>
struct ScanStep {
  static void run(const SelectiveScanStepParams& p) { selective_scan_step_impl<T, S>(p); }
};

}  // namespace

void conv1d_step_cpu(const Conv1dStepParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return conv1d_step_impl<double>(p);
  return conv1d_step_impl<float>(p);
}

void ssd_step_cpu(const SsdStepParams& p, at::ScalarType dtype, at::ScalarType state_dtype) {
  dispatch_cpu<SsdStep>(p, dtype, state_dtype);
}

void selective_scan_step_cpu(const SelectiveScanStepParams& p, at::ScalarType dtype, at::ScalarType state_dtype) {
  dispatch_cpu<ScanStep>(p, dtype, state_dtype);
}

}  // namespace hax::ops
