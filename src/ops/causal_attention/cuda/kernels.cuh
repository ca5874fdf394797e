// The causal attention kernel families, launched by launch.cu: float32 FMA tiles (simt.cu, float32
// and bfloat16 storage) and bfloat16 tensor-core tiles (mma.cu). backward_simt expects Δ
// (gp.workspace) already computed (launch.cu); backward_mma computes it itself.
#pragma once
#include <cuda_runtime.h>

#include "ops/causal_attention/params.h"

namespace hax::ops::causal_cuda {

void forward_simt(const CausalAttentionParams& p, DType dtype, cudaStream_t stream);
void backward_simt(const CausalAttentionGradParams& gp, DType dtype, cudaStream_t stream);

void forward_mma(const CausalAttentionParams& p, cudaStream_t stream);
void backward_mma(const CausalAttentionGradParams& gp, cudaStream_t stream);

}  // namespace hax::ops::causal_cuda
