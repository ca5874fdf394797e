// Plain parameters of the causal (sliding-window, packed) attention kernels and the CUDA launchers
// (no LibTorch: the .cu files include this). See causal_attention.h for the definition.
#pragma once
#include <cstdint>

#include "ops/kernel_dtype.h"

namespace hax::ops {

// Raw-pointer parameters of the kernels (all tensors contiguous; q, k, v, out share one dtype).
struct CausalAttentionParams {
  int64_t batch = 0, seqlen = 0, nheads = 0, dim = 0, vdim = 0;  // B, L, H, D, Dv
  int64_t window = 0;             // keys per query at most (0 = all earlier keys)
  double scale = 1.0;             // score multiplier, e.g. 1/sqrt(D) (double, so that float64 runs are exact)
  const void* q = nullptr;        // (B, L, H, D)
  const void* k = nullptr;        // (B, L, H, D)
  const void* v = nullptr;        // (B, L, H, Dv)
  const int32_t* seq_idx = nullptr;  // (B, L) packed sequence numbers (non-decreasing), or null
  // (4, B, H, L) or null: a band replacing the causal visibility (window 0 and no seq_idx then).
  // For each (b, h): query i sees keys [band[0][i], band[1][i]] and key j is seen by queries
  // [band[2][j], band[3][j]] (empty when first > last); the two descriptions must agree and all
  // four be non-decreasing in i resp. j. LSH in bucket order is such a band (patterns/lsh_band).
  const int32_t* band = nullptr;
  // A-shaped attention's sink (ops/a_shaped_attention): query i also sees the keys
  // j <= min(sink - 1, i - window), the row's first keys outside its window (window >= 1, no band,
  // no seq_idx). Only the bfloat16 tensor-core forward takes it (the backward's dQ and dK/dV stay
  // the window's; ops/a_shaped_attention adds the sink's share); 0 everywhere else.
  int64_t sink = 0;
  void* out = nullptr;            // out (B, L, H, Dv)
  void* lse = nullptr;            // out (B, H, L): q's dtype on the CPU, always float32 on CUDA
  bool tensor_cores = true;       // CUDA, bfloat16 only: mma.sync tiles (false: the float32 FMA tiles)
  bool wgmma_products = true;     // tensor cores at head dim 64 on sm_90a: the second products (P V, dS K,
                                  // P^T dO, dS^T Q) on wgmma too (false: each warp's mma.sync, as before)
};

// Gradient parameters: the forward's inputs, out and lse, plus the output cotangents.
struct CausalAttentionGradParams {
  CausalAttentionParams fwd;      // inputs, out and lse of the forward
  const void* dout = nullptr;     // (B, L, H, Dv)
  const void* dlse = nullptr;     // (B, H, L) gradient of lse (lse's dtype), or null (zero)
  void* dq = nullptr;             // out (B, L, H, D)
  void* dk = nullptr;             // out (B, L, H, D)
  void* dv = nullptr;             // out (B, L, H, Dv)
  void* workspace = nullptr;      // CUDA only: float32 scratch of causal_attention_cuda_workspace(fwd) entries
  // With a band, on the bfloat16 tensor-core path (elsewhere these change nothing, as they change
  // no result): key rows at or past key_rows are seen by no query (the caller's promise), so only
  // the key tiles below it get dK/dV blocks and the rows past them are set to zero (0 = every row);
  // and each key tile's query tiles are split over dkdv_splits blocks, whose float32 partial sums
  // (in `partial`) a second kernel adds in split order (deterministic). Splits are for bands whose
  // keys are each seen by very many queries (ops/dilated_attention's compacted keys), where one
  // block a key tile would walk them all alone.
  int64_t key_rows = 0;
  int64_t dkdv_splits = 1;
  float* partial = nullptr;       // dkdv_splits > 1: causal_attention_partial_entries(*this) float32 entries
};

// Key rows that get dK/dV blocks on the tensor-core path: key_rows (or L) rounded up to whole
// 64-key tiles (kCausalKeyTile).
constexpr int64_t kCausalKeyTile = 64;
inline int64_t causal_attention_key_rows(const CausalAttentionGradParams& gp) {
  const int64_t L = gp.fwd.seqlen, kr = gp.key_rows > 0 && gp.key_rows < L ? gp.key_rows : L;
  return (kr + kCausalKeyTile - 1) / kCausalKeyTile * kCausalKeyTile;
}
// Float32 entries of `partial`: (splits, B, key rows, H, D), then (splits, B, key rows, H, Dv).
inline int64_t causal_attention_partial_entries(const CausalAttentionGradParams& gp) {
  if (gp.dkdv_splits <= 1) return 0;
  return gp.dkdv_splits * gp.fwd.batch * causal_attention_key_rows(gp) * gp.fwd.nheads * (gp.fwd.dim + gp.fwd.vdim);
}

// Float32 entries of scratch the CUDA backward needs: Δ_i = dO_i · O_i - dlse_i, (B, H, L).
inline int64_t causal_attention_cuda_workspace(const CausalAttentionParams& p) {
  return p.batch * p.nheads * p.seqlen;
}

// Largest head dim (D and Dv) the CUDA kernels take.
constexpr int64_t kCausalAttentionCudaMaxDim = 128;

// CUDA kernels (float32 or bfloat16 storage, float32 math); `stream` is a cudaStream_t. lse (and
// dlse) are float32. Deterministic (no atomics: every gradient entry is summed by one thread in a
// fixed order). Need L < 2^31 and D, Dv <= kCausalAttentionCudaMaxDim.
void causal_attention_forward_cuda(const CausalAttentionParams& p, DType dtype, void* stream);
void causal_attention_backward_cuda(const CausalAttentionGradParams& p, DType dtype, void* stream);

}  // namespace hax::ops
