// CUDA kernels of the (gated) RMSNorm; cpu.cpp is the reference and the formulas' home.
//
// Forward and the dx/dz part of the backward: one warp per (row, group), float32 math.
// dweight: each block of kRowsPerPart rows writes a float32 partial per column, and a block per 32
// columns sums the partials in a fixed order (deterministic, no atomics).
#include "ops/cuda/common.cuh"
#include "ops/rmsnorm/params.h"

namespace hax::ops {
namespace {

using cuda::from_f32;
using cuda::to_f32;

constexpr int kWarpsPerBlock = 8;
constexpr int64_t kRowsPerPart = 64;  // rmsnorm_cuda_workspace assumes 64

template <class T>
__device__ __forceinline__ float gate_of(const T* z, int64_t i) {
  return z ? cuda::silu(to_f32(z[i])) : 1.f;
}

template <class T>
__global__ void forward_kernel(RmsNormParams p) {
  const int64_t G = p.ngroups(), gs = p.group_size;
  const int64_t task = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (task >= p.rows * G) return;
  const int lane = threadIdx.x % 32;
  const int64_t base = task * gs;  // row r, group g: (r * D + g * gs) = task * gs
  const T* x = (const T*)p.x;
  const T* z = (const T*)p.z;
  float ss = 0;
  for (int64_t c = lane; c < gs; c += 32) {
    float u = to_f32(x[base + c]) * gate_of(z, base + c);
    ss += u * u;
  }
  ss = cuda::warp_sum(ss);
  const float r = rsqrtf(ss / (float)gs + (float)p.eps);
  if (lane == 0 && p.rstd) ((float*)p.rstd)[task] = r;
  const T* w = (const T*)p.weight;
  T* out = (T*)p.out;
  const int64_t g = task % G;
  for (int64_t c = lane; c < gs; c += 32) {
    float u = to_f32(x[base + c]) * gate_of(z, base + c);
    out[base + c] = from_f32<T>(u * r * to_f32(w[g * gs + c]));
  }
}

template <class T>
__global__ void backward_kernel(RmsNormGradParams gp) {
  const RmsNormParams& p = gp.fwd;
  const int64_t G = p.ngroups(), gs = p.group_size;
  const int64_t task = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (task >= p.rows * G) return;
  const int lane = threadIdx.x % 32;
  const int64_t base = task * gs, g = task % G;
  const T* x = (const T*)p.x;
  const T* z = (const T*)p.z;
  const T* w = (const T*)p.weight;
  const T* dout = (const T*)gp.dout;
  const float r = ((const float*)p.rstd)[task];
  float dot = 0;  // Σ a n over the group
  for (int64_t c = lane; c < gs; c += 32) {
    float u = to_f32(x[base + c]) * gate_of(z, base + c);
    dot += to_f32(dout[base + c]) * to_f32(w[g * gs + c]) * u * r;
  }
  const float mean_an = cuda::warp_sum(dot) / (float)gs;
  T* dx = (T*)gp.dx;
  T* dz = (T*)gp.dz;
  for (int64_t c = lane; c < gs; c += 32) {
    const float xv = to_f32(x[base + c]);
    float s = 1.f, sig = 0.f, zv = 0.f;
    if (z) {
      zv = to_f32(z[base + c]);
      sig = 1.f / (1.f + __expf(-zv));
      s = zv * sig;
    }
    const float n = xv * s * r;
    const float a = to_f32(dout[base + c]) * to_f32(w[g * gs + c]);
    const float du = r * (a - n * mean_an);
    dx[base + c] = from_f32<T>(du * s);
    if (z) dz[base + c] = from_f32<T>(du * xv * sig * (1.f + zv * (1.f - sig)));
  }
}

// partial[part, c] = Σ_{rows of part} dout[r, c] n[r, c]
template <class T>
__global__ void dweight_partial_kernel(RmsNormGradParams gp, float* partial) {
  const RmsNormParams& p = gp.fwd;
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.dim) return;
  const int64_t part = blockIdx.y, G = p.ngroups(), g = c / p.group_size;
  const int64_t r0 = part * kRowsPerPart, r1 = min(p.rows, r0 + kRowsPerPart);
  const T* x = (const T*)p.x;
  const T* z = (const T*)p.z;
  const T* dout = (const T*)gp.dout;
  const float* rstd = (const float*)p.rstd;
  float acc = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r * p.dim + c;
    acc += to_f32(dout[i]) * to_f32(x[i]) * gate_of(z, i) * rstd[r * G + g];
  }
  partial[part * p.dim + c] = acc;
}

// out[c] = Σ_k partial[k, c] over the parts in a fixed order: a block of 32 columns x kSumRows
// threads, thread (c, r) summing parts r, r + kSumRows, ..., then the kSumRows sums added in order.
constexpr int kSumRows = 16;
__global__ void sum_parts_kernel(const float* partial, int64_t parts, int64_t dim, float* out) {
  __shared__ float sums[kSumRows][33];
  const int cx = threadIdx.x % 32, r = threadIdx.x / 32;
  const int64_t c = (int64_t)blockIdx.x * 32 + cx;
  float acc = 0;
  if (c < dim)
    for (int64_t k = r; k < parts; k += kSumRows) acc += partial[k * dim + c];
  sums[r][cx] = acc;
  __syncthreads();
  if (r == 0 && c < dim) {
    float total = 0;
    for (int i = 0; i < kSumRows; ++i) total += sums[i][cx];
    out[c] = total;
  }
}

}  // namespace

void rmsnorm_forward_cuda(const RmsNormParams& p, DType dtype, void* stream) {
  const int64_t tasks = p.rows * p.ngroups();
  if (tasks == 0) return;
  const auto s = (cudaStream_t)stream;
  const unsigned grid = (unsigned)cuda::ceil_div(tasks, kWarpsPerBlock);
  HAX_DISPATCH_DTYPE(dtype, [&] { forward_kernel<scalar_t><<<grid, 32 * kWarpsPerBlock, 0, s>>>(p); });
  cuda::check_launch("rmsnorm_forward_cuda");
}

void rmsnorm_backward_cuda(const RmsNormGradParams& gp, DType dtype, void* stream) {
  const RmsNormParams& p = gp.fwd;
  const int64_t tasks = p.rows * p.ngroups();
  if (tasks == 0) return;
  const auto s = (cudaStream_t)stream;
  const unsigned grid = (unsigned)cuda::ceil_div(tasks, kWarpsPerBlock);
  HAX_DISPATCH_DTYPE(dtype, [&] { backward_kernel<scalar_t><<<grid, 32 * kWarpsPerBlock, 0, s>>>(gp); });
  cuda::check_launch("rmsnorm_backward_cuda (dx)");
  const int64_t parts = cuda::ceil_div(p.rows, kRowsPerPart);
  float* partial = (float*)gp.workspace;  // (parts, D), see rmsnorm_cuda_workspace
  const dim3 pgrid((unsigned)cuda::ceil_div(p.dim, 128), (unsigned)parts);
  HAX_DISPATCH_DTYPE(dtype, [&] { dweight_partial_kernel<scalar_t><<<pgrid, 128, 0, s>>>(gp, partial); });
  sum_parts_kernel<<<(unsigned)cuda::ceil_div(p.dim, 32), 32 * kSumRows, 0, s>>>(partial, parts, p.dim, (float*)gp.dweight);
  cuda::check_launch("rmsnorm_backward_cuda (dweight)");
}

}  // namespace hax::ops
