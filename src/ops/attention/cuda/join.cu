// join_by_lse on CUDA (attention.h; JoinParams in params.h has the formulas), float32 math, one
// pass over the tensors forward and one backward (the LibTorch formula took about eight): a thread
// per 16 bytes of a row where the row is a power of two of 16-byte chunks (up to 32) and the
// tensors are aligned, else a warp per (b, i, h) row with lanes over the Dv entries.
#include "ops/attention/params.h"
#include "ops/cuda/common.cuh"

#include <initializer_list>

namespace hax::ops {
namespace {

constexpr int kWarps = 8;  // rows per block

__device__ __forceinline__ float join_weight(float l1, float l2) {
  const float d = l1 - l2;
  return isnan(d) ? 0.5f : 1.f / (1.f + __expf(-d));
}

// Entries e and e + 1 of a row as floats (the second only where `pair`).
template <class T>
__device__ __forceinline__ void load2(const T* row, int64_t e, bool pair, float& a, float& b) {
  a = cuda::to_f32(row[e]);
  b = pair ? cuda::to_f32(row[e + 1]) : 0.f;
}
template <class T>
__device__ __forceinline__ void store2(T* row, int64_t e, bool pair, float a, float b) {
  row[e] = cuda::from_f32<T>(a);
  if (pair) row[e + 1] = cuda::from_f32<T>(b);
}

template <class T>
__global__ void join_forward_kernel(JoinParams p, int64_t rows) {
  const int64_t row = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;  // (b, i, h) of (B, L, H)
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t H = p.nheads, L = p.seqlen, h = row % H, i = row / H % L, b = row / (H * L);
  const int64_t at = (b * H + h) * L + i;
  const float w = join_weight(p.lse1[at], p.lse2[at]);
  if (lane == 0) p.w[row] = w;
  const T* x1 = (const T*)p.o1 + row * p.vdim;
  const T* x2 = (const T*)p.o2 + row * p.vdim;
  T* y = (T*)p.out + row * p.vdim;
  for (int64_t e = 2 * lane; e < p.vdim; e += 64) {
    const bool pair = e + 1 < p.vdim;
    float a1, b1, a2, b2;
    load2(x1, e, pair, a1, b1);
    load2(x2, e, pair, a2, b2);
    store2(y, e, pair, a2 + w * (a1 - a2), b2 + w * (b1 - b2));
  }
}

template <class T>
__global__ void join_backward_kernel(JoinParams p, int64_t rows) {
  const int64_t row = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t H = p.nheads, L = p.seqlen, h = row % H, i = row / H % L, b = row / (H * L);
  const float w = p.w[row];
  const T* x1 = (const T*)p.o1 + row * p.vdim;
  const T* x2 = (const T*)p.o2 + row * p.vdim;
  const T* g = (const T*)p.dout + row * p.vdim;
  T* y1 = (T*)p.do1 + row * p.vdim;
  T* y2 = (T*)p.do2 + row * p.vdim;
  float dot = 0.f;
  for (int64_t e = 2 * lane; e < p.vdim; e += 64) {
    const bool pair = e + 1 < p.vdim;
    float a1, b1, a2, b2, ga, gb;
    load2(x1, e, pair, a1, b1);
    load2(x2, e, pair, a2, b2);
    load2(g, e, pair, ga, gb);
    store2(y1, e, pair, w * ga, w * gb);
    store2(y2, e, pair, ga - w * ga, gb - w * gb);
    dot += ga * (a1 - a2) + gb * (b1 - b2);
  }
  dot = cuda::warp_sum(dot);
  if (lane == 0) p.dlse1[(b * H + h) * L + i] = dot * w * (1.f - w);
}

// Vector path: C = Dv·size / 16 a power of two <= 32 and 16-byte aligned tensors. A thread per
// 16-byte chunk (V entries), the C chunks of a row on consecutive lanes of one warp (the backward
// sums its dot product over them by shuffles).
template <class T>
struct Vec {
  static constexpr int V = 16 / sizeof(T);
  float x[V];
  __device__ __forceinline__ void load(const void* base, int64_t chunk) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(base) + chunk);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int k = 0; k < V; ++k) x[k] = cuda::to_f32(e[k]);
  }
  __device__ __forceinline__ void store(void* base, int64_t chunk) const {
    uint4 u;
    T* e = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int k = 0; k < V; ++k) e[k] = cuda::from_f32<T>(x[k]);
    reinterpret_cast<uint4*>(base)[chunk] = u;
  }
};

template <class T>
__global__ void join_forward_vec_kernel(JoinParams p, int64_t chunks, int C) {
  const int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (x >= chunks) return;
  const int64_t row = x / C, H = p.nheads, L = p.seqlen, h = row % H, i = row / H % L, b = row / (H * L);
  const int64_t at = (b * H + h) * L + i;
  const float w = join_weight(p.lse1[at], p.lse2[at]);
  if (x % C == 0) p.w[row] = w;
  Vec<T> a, c;
  a.load(p.o1, x);
  c.load(p.o2, x);
#pragma unroll
  for (int k = 0; k < Vec<T>::V; ++k) c.x[k] += w * (a.x[k] - c.x[k]);
  c.store(p.out, x);
}

template <class T>
__global__ void join_backward_vec_kernel(JoinParams p, int64_t chunks, int C) {
  const int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const bool in = x < chunks;  // every lane takes part in the shuffles
  const int64_t row = in ? x / C : 0;
  const float w = in ? p.w[row] : 0.f;
  float dot = 0.f;
  if (in) {
    Vec<T> a, c, g, y;
    a.load(p.o1, x);
    c.load(p.o2, x);
    g.load(p.dout, x);
#pragma unroll
    for (int k = 0; k < Vec<T>::V; ++k) {
      y.x[k] = w * g.x[k];
      dot += g.x[k] * (a.x[k] - c.x[k]);
    }
    y.store(p.do1, x);
#pragma unroll
    for (int k = 0; k < Vec<T>::V; ++k) y.x[k] = g.x[k] - y.x[k];
    y.store(p.do2, x);
  }
  for (int o = C / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (in && x % C == 0) {
    const int64_t H = p.nheads, L = p.seqlen, h = row % H, i = row / H % L, b = row / (H * L);
    p.dlse1[(b * H + h) * L + i] = dot * w * (1.f - w);
  }
}

// The vector path's C, or 0 when it does not apply.
int vec_chunks(const JoinParams& p, int elem, std::initializer_list<const void*> ptrs) {
  if (p.vdim * elem % 16 != 0) return 0;
  const int64_t C = p.vdim * elem / 16;
  if (C > 32 || (C & (C - 1)) != 0) return 0;
  for (const void* q : ptrs)
    if (!cuda::aligned16(q)) return 0;
  return (int)C;
}

}  // namespace

void join_by_lse_forward_cuda(const JoinParams& p, DType dtype, void* stream) {
  const int64_t rows = p.batch * p.seqlen * p.nheads;
  if (rows == 0) return;
  const int elem = dtype == DType::kBF16 ? 2 : 4;
  if (const int C = vec_chunks(p, elem, {p.o1, p.o2, p.out})) {
    const int64_t chunks = rows * C;
    const unsigned grid = (unsigned)cuda::ceil_div(chunks, 256);
    HAX_DISPATCH_DTYPE(dtype, [&] {
      join_forward_vec_kernel<scalar_t><<<grid, 256, 0, (cudaStream_t)stream>>>(p, chunks, C);
    });
    cuda::check_launch("join_by_lse (forward)");
    return;
  }
  const unsigned grid = (unsigned)cuda::ceil_div(rows, kWarps);
  HAX_DISPATCH_DTYPE(dtype, [&] {
    join_forward_kernel<scalar_t><<<grid, 32 * kWarps, 0, (cudaStream_t)stream>>>(p, rows);
  });
  cuda::check_launch("join_by_lse (forward)");
}

void join_by_lse_backward_cuda(const JoinParams& p, DType dtype, void* stream) {
  const int64_t rows = p.batch * p.seqlen * p.nheads;
  if (rows == 0) return;
  const int elem = dtype == DType::kBF16 ? 2 : 4;
  if (const int C = vec_chunks(p, elem, {p.o1, p.o2, p.dout, p.do1, p.do2})) {
    const int64_t chunks = rows * C;
    const unsigned grid = (unsigned)cuda::ceil_div(chunks, 256);
    HAX_DISPATCH_DTYPE(dtype, [&] {
      join_backward_vec_kernel<scalar_t><<<grid, 256, 0, (cudaStream_t)stream>>>(p, chunks, C);
    });
    cuda::check_launch("join_by_lse (backward)");
    return;
  }
  const unsigned grid = (unsigned)cuda::ceil_div(rows, kWarps);
  HAX_DISPATCH_DTYPE(dtype, [&] {
    join_backward_kernel<scalar_t><<<grid, 32 * kWarps, 0, (cudaStream_t)stream>>>(p, rows);
  });
  cuda::check_launch("join_by_lse (backward)");
}

}  // namespace hax::ops
