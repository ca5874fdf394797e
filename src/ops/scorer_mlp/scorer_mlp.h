// Key Selection's scorer (HAX paper section 4.2) as one op: a 3-layer MLP applied to every row
// r = (b, l, h) of its two inputs,
//   h1_r    = relu(W1 [k_r ; u_r] + b1)        (hidden)
//   h2_r    = relu(W2 h1_r + b2)               (hidden)
//   score_r = w3 · h2_r + b3                   (one value)
// with k the keys and u the normalized running sum of the queries (layers/key_scorer.h).
//
// On CUDA in bfloat16 (or under autocast) one kernel computes the whole MLP per tile of 32 rows
// on tensor cores: the weights stay in shared memory, h1 and h2 stay in registers (rounded to
// bfloat16 between the layers, as three bfloat16 GEMMs round them), and only the scores are
// written. The three GEMMs through cuBLAS wrote and re-read both (R, hidden) activations and a
// concatenated input: about 1 ms at R = 1M rows (64K positions x 16 heads) on an H100, where the
// fused kernel reads the inputs once. Elsewhere (the CPU, float32, sizes the kernel does not
// take: see scorer_mlp_fused_applies) the op is scorer_mlp_reference.
//
// Shapes: k, u (..., N); w1 (hidden, 2N), b1 (hidden) or undefined; w2 (hidden, hidden), b2
// (hidden) or undefined; w3 (1, hidden), b3 (1) or undefined. Output: (...), k's dtype.
#pragma once
#include <ATen/ATen.h>

namespace hax::ops {

// Differentiable in the weights and biases only (k and u are the scorer's detached inputs and get
// no gradient). The fused path's backward recomputes the activations with LibTorch products in
// float32 (no activations are saved; see the backward in api.cpp).
at::Tensor scorer_mlp(const at::Tensor& k, const at::Tensor& u, const at::Tensor& w1, const at::Tensor& b1,
                      const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& w3, const at::Tensor& b3);

// Whether scorer_mlp runs the fused kernel for these arguments: a CUDA build and device, bfloat16
// inputs (float ones under autocast), 2N a multiple of 16 and at most 256, hidden one of 16, 32,
// 64, 128, and k, u 16-byte aligned.
bool scorer_mlp_fused_applies(const at::Tensor& k, const at::Tensor& u, const at::Tensor& w1, const at::Tensor& w2);

// The definition with LibTorch ops (any device and dtype), differentiated by autograd: the
// fallback and the tests' oracle.
at::Tensor scorer_mlp_reference(const at::Tensor& k, const at::Tensor& u, const at::Tensor& w1, const at::Tensor& b1,
                                const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& w3,
                                const at::Tensor& b3);

}  // namespace hax::ops
