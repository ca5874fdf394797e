// The CUDA entry points of causal attention: pick the tile family (tensor cores for bfloat16
// unless switched off, float32 FMA tiles otherwise). The backward needs Δ_i = dO_i · O_i - dlse_i
// (float32, in the workspace (B, H, L)): the tensor-core dQ kernel computes it for its rows; for
// the FMA tiles a kernel here does first (one warp per (b, i, h) row).
#include <stdexcept>
#include <string>

#include "ops/causal_attention/cuda/kernels.cuh"
#include "ops/causal_attention/cuda/tiles.cuh"

namespace hax::ops {
namespace {

constexpr int kDeltaWarps = 8;  // rows per block of the Δ kernel

template <class T>
__global__ void delta_kernel(CausalAttentionGradParams gp, int64_t rows) {
  const CausalAttentionParams& p = gp.fwd;
  const int64_t row = (int64_t)blockIdx.x * kDeltaWarps + threadIdx.x / 32;  // (b, i, h) of (B, L, H)
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t Dv = p.vdim;
  const T* o = (const T*)p.out + row * Dv;
  const T* dO = (const T*)gp.dout + row * Dv;
  float s = 0.f;
  for (int64_t d = lane; d < Dv; d += 32) s += cuda::to_f32(o[d]) * cuda::to_f32(dO[d]);
  s = cuda::warp_sum(s);
  if (lane != 0) return;
  const int64_t h = row % p.nheads, i = row / p.nheads % p.seqlen, b = row / (p.nheads * p.seqlen);
  const int64_t at = (b * p.nheads + h) * p.seqlen + i;  // (B, H, L)
  ((float*)gp.workspace)[at] = s - (gp.dlse ? ((const float*)gp.dlse)[at] : 0.f);
}

bool use_tensor_cores(const CausalAttentionParams& p, DType dtype) { return dtype == DType::kBF16 && p.tensor_cores; }

}  // namespace

void causal_attention_forward_cuda(const CausalAttentionParams& p, DType dtype, void* stream) {
  if (p.batch * p.nheads * p.seqlen == 0) return;
  const auto s = (cudaStream_t)stream;
  if (p.sink > 0 && (!use_tensor_cores(p, dtype) || p.window < 1 || p.band || p.seq_idx))
    throw std::runtime_error("causal_attention_forward_cuda: a sink of " + std::to_string(p.sink) +
                             " keys needs the bfloat16 tensor-core kernels, a window >= 1, no band and no seq_idx");
  if (use_tensor_cores(p, dtype)) causal_cuda::forward_mma(p, s);
  else causal_cuda::forward_simt(p, dtype, s);
}

void causal_attention_backward_cuda(const CausalAttentionGradParams& gp, DType dtype, void* stream) {
  const CausalAttentionParams& p = gp.fwd;
  const int64_t rows = p.batch * p.seqlen * p.nheads;
  if (rows == 0) return;
  const auto s = (cudaStream_t)stream;
  if (use_tensor_cores(p, dtype)) {
    causal_cuda::backward_mma(gp, s);
    return;
  }
  const unsigned grid = (unsigned)cuda::ceil_div(rows, kDeltaWarps);
  HAX_DISPATCH_DTYPE(dtype, [&] { delta_kernel<scalar_t><<<grid, 32 * kDeltaWarps, 0, s>>>(gp, rows); });
  cuda::check_launch("causal_attention_backward_cuda (delta)");
  causal_cuda::backward_simt(gp, dtype, s);
}

}  // namespace hax::ops
