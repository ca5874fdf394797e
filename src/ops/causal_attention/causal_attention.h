// Dense causal attention, optionally restricted to a sliding window, computed block by block with
// an online softmax (FlashAttention's algorithm) so that memory stays O(L·D):
//
//   out[b,i,h] = Σ_{j ∈ W(i)} softmax_j( scale · q[b,i,h]·k[b,j,h] ) v[b,j,h],
//   W(i) = { j : max(0, i - window + 1) <= j <= i, seq_idx[b,j] = seq_idx[b,i] }   (window 0 = no limit)
//   or, with a band, W(i) = [band[0][b,h,i], band[1][b,h,i]]
//
// It is the "full" baseline of the sparse-attention family and the sliding-window attention of
// Samba's attention layers.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

#include "ops/causal_attention/params.h"
#include "ops/check.h"

namespace hax::ops {

void causal_attention_forward_cpu(const CausalAttentionParams& p, at::ScalarType dtype);
void causal_attention_backward_cpu(const CausalAttentionGradParams& p, at::ScalarType dtype);

// bfloat16 tensors on CUDA run on tensor cores (mma.sync tiles, bfloat16 P and dS) unless this is
// off (the float32 FMA tiles, slower); float32 tensors always use the FMA tiles. On by default;
// tests run both.
void set_causal_attention_tensor_cores(bool on);
bool causal_attention_tensor_cores();

// On the tensor cores at head dim 64 on Hopper (the TMA-fed tiles), the second product of each
// step (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q) runs on wgmma with P or dS from
// registers, like the first; off: on each warp's mma.sync (the form before, kept for comparison;
// both round P and dS to bfloat16 the same way). On by default; tests run both.
// HAX_CAUSAL_WGMMA2 (a bit mask: 1 forward, 2 dQ, 4 dK/dV, 8 the forward at 5 blocks an SM;
// default 15) picks the kernels that use it when on, for timing comparisons.
void set_causal_attention_wgmma_products(bool on);
bool causal_attention_wgmma_products();

// Differentiable in q, k, v (through both outputs). seq_idx may be undefined; window >= 0;
// scale > 0 (e.g. 1/sqrt(D)). Returns (out (B, L, H, Dv), lse (B, H, L)); lse has q's dtype on
// the CPU and is float32 on CUDA (the kernels' math type; the backward needs it that precise).
// `band` (int32 (4, B, H, L), params.h), if defined, replaces the causal visibility (window 0, no
// seq_idx): query i of head h sees keys [band[0][b][h][i], band[1][b][h][i]]. A query that sees no
// key outputs 0 with lse = -inf. LSH attention runs as such a band over bucket-sorted rows.
// With a band, key_rows (> 0: no query sees a key row at or past it) and dkdv_splits (each key
// tile's query tiles split over that many dK/dV blocks) shape the CUDA backward's work
// (params.h); they change no result. Dilated attention's compacted keys use them.
std::tuple<at::Tensor, at::Tensor> causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& seq_idx, int64_t window, double scale,
                                                    const at::Tensor& band = {}, int64_t key_rows = 0,
                                                    int64_t dkdv_splits = 1);

// The kernels' parameters for contiguous q, k, v of sizes d (no seq_idx; out, lse and the sink
// left unset), for bindings that call causal_attention_forward_cuda / _backward_cuda themselves
// (ops/a_shaped_attention, ops/dilated_attention, whose fast paths need the tensor-core tiles: on).
CausalAttentionParams causal_attention_params(const QkvDims& d, int64_t window, double scale, const at::Tensor& q,
                                              const at::Tensor& k, const at::Tensor& v, const at::Tensor& band = {});

// Dense masked-softmax reference with LibTorch ops (test oracle; float64, small L); with a band as
// above (parts 0 and 1 define it).
std::tuple<at::Tensor, at::Tensor> causal_attention_reference(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& seq_idx,
                                                              int64_t window, double scale,
                                                              const at::Tensor& band = {});

}  // namespace hax::ops
