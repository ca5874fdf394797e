// What both scorer MLP kernels (scorer_mlp.cu, scorer_mlp_wgmma.cu) stage the same way: the
// biases and w3 as float32 in shared memory, and the source of each 16-byte chunk of an input
// row [k_r ; u_r].
#pragma once
#include "ops/cuda/common.cuh"
#include "ops/scorer_mlp/params.h"

namespace hax::ops::scorer_mlp_cuda {

// b1, b2 (zeros where null) and w3 into sB1, sB2, sW3 (hidden floats each) by the block's
// threads; returns b3 (0 where null).
__device__ __forceinline__ float stage_biases(const ScorerMlpParams& p, int hidden, float* sB1, float* sB2,
                                              float* sW3) {
  using bf16 = __nv_bfloat16;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    sB1[c] = p.b1 ? cuda::to_f32(((const bf16*)p.b1)[c]) : 0.f;
    sB2[c] = p.b2 ? cuda::to_f32(((const bf16*)p.b2)[c]) : 0.f;
    sW3[c] = cuda::to_f32(((const bf16*)p.w3)[c]);
  }
  return p.b3 ? cuda::to_f32(((const bf16*)p.b3)[0]) : 0.f;
}

// The source of input columns q .. q + 7 (q a multiple of 8, q < 2N) of row `row` (< rows): k's
// while q < N, then u's.
__device__ __forceinline__ const __nv_bfloat16* input_chunk(const ScorerMlpParams& p, int64_t row, int q) {
  const int64_t at = row * p.half;
  return q < p.half ? (const __nv_bfloat16*)p.k + at + q : (const __nv_bfloat16*)p.u + at + (q - p.half);
}

}  // namespace hax::ops::scorer_mlp_cuda
