// CUDA kernels of the decoding steps; cpu.cpp is the reference, ssm_step.h the definitions.
//
// One thread per state row, float32 math:
//   conv1d_step          (b, c): the W-1 past inputs of channel c, shifted by one in place while
//                        they are read (each entry is read before the next tap overwrites it),
//                        then the new input appended.
//   ssd_step             (b, h, p): dt, its softplus and exp(dt A_h) recomputed per thread (cheap),
//                        then the N entries of the row updated and dotted with C in one pass.
//   selective_scan_step  (b, d): the N entries with their own decay exp(delta A[d, n]).
// Consecutive threads take consecutive p (d, c), so the loads of x and y coalesce and the threads
// of a warp read the same B and C entries (a broadcast). A state row is N contiguous entries of one
// thread.
#include <climits>
#include <stdexcept>
#include <string>

#include "ops/cuda/common.cuh"
#include "ops/ssm_step/params.h"

namespace hax::ops {
namespace {

using cuda::from_f32;
using cuda::to_f32;

constexpr int kThreads = 256;

__device__ __forceinline__ float softplus(float v) { return v > 20.f ? v : log1pf(expf(v)); }

template <class T>
__global__ void conv1d_step_kernel(Conv1dStepParams p) {
  const int64_t C = p.channels, W = p.width;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.batch * C) return;
  const int64_t b = idx / C, c = idx % C;
  const T* w = (const T*)p.weight + c * W;
  T* st = (T*)p.state + b * (W - 1) * C + c;  // entry k at st[k * C]
  const T xr = ((const T*)p.x)[b * p.x_stride + c];
  float acc = p.bias ? to_f32(((const T*)p.bias)[c]) : 0.f;  // taps oldest first, after the bias
  for (int64_t k = 0; k + 1 < W; ++k) {
    const T v = st[k * C];
    acc += to_f32(w[k]) * to_f32(v);
    if (k > 0) st[(k - 1) * C] = v;
  }
  acc += to_f32(w[W - 1]) * to_f32(xr);
  if (W > 1) st[(W - 2) * C] = xr;
  ((T*)p.out)[idx] = from_f32<T>(p.silu ? acc * (1.f / (1.f + expf(-acc))) : acc);
}

template <class T, class S>
__global__ void ssd_step_kernel(SsdStepParams p) {
  const int64_t H = p.nheads, P = p.headdim, N = p.dstate;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;  // (b, h, q)
  if (idx >= p.batch * H * P) return;
  const int64_t q = idx % P, h = (idx / P) % H, b = idx / (H * P), g = h / p.heads_per_group();
  float dt = to_f32(((const T*)p.dt)[b * p.dt_stride + h]) + (p.dt_bias ? to_f32(((const T*)p.dt_bias)[h]) : 0.f);
  if (p.dt_softplus) dt = softplus(dt);
  const float decay = expf(dt * to_f32(((const T*)p.A)[h]));
  const float xv = to_f32(((const T*)p.x)[b * p.x_stride + h * P + q]), dx = dt * xv;
  const T* Bv = (const T*)p.Bm + b * p.B_stride + g * N;
  const T* Cv = (const T*)p.Cm + b * p.C_stride + g * N;
  S* st = (S*)p.state + idx * N;
  float acc = 0.f;
  for (int64_t n = 0; n < N; ++n) {
    const float s = to_f32(st[n]) * decay + dx * to_f32(Bv[n]);
    st[n] = from_f32<S>(s);
    acc += s * to_f32(Cv[n]);
  }
  if (p.skip) acc += xv * to_f32(((const T*)p.skip)[h]);
  ((T*)p.y)[idx] = from_f32<T>(acc);
}

template <class T, class S>
__global__ void selective_scan_step_kernel(SelectiveScanStepParams p) {
  const int64_t D = p.dim, N = p.dstate;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;  // (b, d)
  if (idx >= p.batch * D) return;
  const int64_t d = idx % D, b = idx / D, g = d / p.dim_per_group();
  float dl = to_f32(((const T*)p.delta)[b * p.delta_stride + d]) +
             (p.delta_bias ? to_f32(((const T*)p.delta_bias)[d]) : 0.f);
  if (p.delta_softplus) dl = softplus(dl);
  const float xv = to_f32(((const T*)p.x)[b * p.x_stride + d]), dx = dl * xv;
  const T* A = (const T*)p.A + d * N;
  const T* Bv = (const T*)p.Bm + b * p.B_stride + g * N;
  const T* Cv = (const T*)p.Cm + b * p.C_stride + g * N;
  S* st = (S*)p.state + idx * N;
  float acc = 0.f;
  for (int64_t n = 0; n < N; ++n) {
    const float s = to_f32(st[n]) * expf(dl * to_f32(A[n])) + dx * to_f32(Bv[n]);
    st[n] = from_f32<S>(s);
    acc += s * to_f32(Cv[n]);
  }
  if (p.skip) acc += xv * to_f32(((const T*)p.skip)[d]);
  ((T*)p.y)[idx] = from_f32<T>(acc);
}

unsigned blocks_for(int64_t n, const char* what) {
  const int64_t blocks = cuda::ceil_div(n, kThreads);
  if (blocks > INT_MAX) throw std::runtime_error(std::string(what) + ": too many state rows for one launch");
  return (unsigned)blocks;
}

// Runs f with scalar_t (inputs) and state_t (the state): float/float, bf16/bf16 or bf16/float.
template <class F>
void dispatch_state(DType dtype, DType state_dtype, const char* what, F&& f) {
  if (dtype == DType::kF32 && state_dtype == DType::kF32) return f(float{}, float{});
  if (dtype == DType::kBF16 && state_dtype == DType::kBF16) return f(__nv_bfloat16{}, __nv_bfloat16{});
  if (dtype == DType::kBF16 && state_dtype == DType::kF32) return f(__nv_bfloat16{}, float{});
  throw std::invalid_argument(std::string(what) + ": the state must have the inputs' dtype or be float32");
}

}  // namespace

void conv1d_step_cuda(const Conv1dStepParams& p, DType dtype, void* stream) {
  const int64_t rows = p.batch * p.channels;
  if (rows == 0) return;
  const auto s = (cudaStream_t)stream;
  HAX_DISPATCH_DTYPE(dtype, [&] {
    conv1d_step_kernel<scalar_t><<<blocks_for(rows, "conv1d_step_cuda"), kThreads, 0, s>>>(p);
  });
  cuda::check_launch("conv1d_step_cuda");
}

void ssd_step_cuda(const SsdStepParams& p, DType dtype, DType state_dtype, void* stream) {
  const int64_t rows = p.batch * p.nheads * p.headdim;
  if (rows == 0) return;
  const auto s = (cudaStream_t)stream;
  dispatch_state(dtype, state_dtype, "ssd_step_cuda", [&](auto t, auto st) {
    using T = decltype(t);
    using S = decltype(st);
    ssd_step_kernel<T, S><<<blocks_for(rows, "ssd_step_cuda"), kThreads, 0, s>>>(p);
  });
  cuda::check_launch("ssd_step_cuda");
}

void selective_scan_step_cuda(const SelectiveScanStepParams& p, DType dtype, DType state_dtype, void* stream) {
  const int64_t rows = p.batch * p.dim;
  if (rows == 0) return;
  const auto s = (cudaStream_t)stream;
  dispatch_state(dtype, state_dtype, "selective_scan_step_cuda", [&](auto t, auto st) {
    using T = decltype(t);
    using S = decltype(st);
    selective_scan_step_kernel<T, S><<<blocks_for(rows, "selective_scan_step_cuda"), kThreads, 0, s>>>(p);
  });
  cuda::check_launch("selective_scan_step_cuda");
}

}  // namespace hax::ops
