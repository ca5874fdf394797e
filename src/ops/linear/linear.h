// y = x W^T + b on the CPU with hax's register-tiled small_gemm, parallel over blocks of rows.
// Debian's OpenBLAS runs AVX2 kernels on one thread (hax keeps it there, see core/threads.cpp):
// a (16384 x 128) x (128 x 128) product took 8.1 ms through it and about 1.5 ms here on 2 cores.
//
// Shapes: x (..., in), W (out, in), b (out) or undefined; y (..., out).
#pragma once
#include <ATen/ATen.h>

namespace hax::ops {

struct LinearParams {
  int64_t rows = 0, in = 0, out = 0;
  const void* x = nullptr;  // (rows, in)
  const void* w = nullptr;  // (out, in)
  const void* b = nullptr;  // (out) or null
  void* y = nullptr;        // out (rows, out)
  bool relu = false;        // y = max(0, x W^T + b), applied to each row block while it is in cache
};

struct LinearGradParams {
  LinearParams fwd;
  const void* dy = nullptr;  // (rows, out)
  void* dx = nullptr;        // out (rows, in), or null when not needed
  void* dw = nullptr;        // out (out, in), or null
  void* db = nullptr;        // out (out), or null
};

void linear_forward_cpu(const LinearParams& p, at::ScalarType dtype);
// Deterministic: weight gradients are summed over fixed row blocks in a fixed order.
void linear_backward_cpu(const LinearGradParams& p, at::ScalarType dtype);

// Differentiable in x, W and b. CPU float32/float64: hax's kernels; CUDA float32/bfloat16: cuBLAS
// products in one autograd node (under autocast, on bfloat16 copies); others go to at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

// relu(linear(x, W, b)) in one pass over the output on the CPU (the backward masks dy with the
// saved output); other devices and dtypes: at::relu(at::linear(...)).
at::Tensor linear_relu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

}  // namespace hax::ops
