// Dense causal attention, optionally restricted to a sliding window, computed block by block with
// an online softmax (FlashAttention's algorithm) so that memory stays O(L·D):
//
//   out[b,i,h] = Σ_{j ∈ W(i)} softmax_j( scale · q[b,i,h]·k[b,j,h] ) v[b,j,h],
//   W(i) = { j : max(0, i - window + 1) <= j <= i, seq_idx[b,j] = seq_idx[b,i] }   (window 0 = no limit)
//
// It is the "full" baseline of the sparse-attention family and the sliding-window attention of
// Samba's attention layers.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace hax::ops {

struct CausalAttentionParams {
  int64_t batch = 0, seqlen = 0, nheads = 0, dim = 0, vdim = 0;
  int64_t window = 0;             // keys per query at most (0 = all earlier keys)
  double scale = 1.0;             // score multiplier, e.g. 1/sqrt(D) (double, so that float64 runs are exact)
  const void* q = nullptr;        // (B, L, H, D)
  const void* k = nullptr;        // (B, L, H, D)
  const void* v = nullptr;        // (B, L, H, Dv)
  const int32_t* seq_idx = nullptr;  // (B, L) packed sequence numbers (non-decreasing), or null
  void* out = nullptr;            // out (B, L, H, Dv)
  void* lse = nullptr;            // out (B, H, L)
};

struct CausalAttentionGradParams {
  CausalAttentionParams fwd;      // inputs, out and lse of the forward
  const void* dout = nullptr;     // (B, L, H, Dv)
  const void* dlse = nullptr;     // (B, H, L) gradient of lse, or null (zero)
  void* dq = nullptr;             // out (B, L, H, D)
  void* dk = nullptr;             // out (B, L, H, D)
  void* dv = nullptr;             // out (B, L, H, Dv)
};

void causal_attention_forward_cpu(const CausalAttentionParams& p, at::ScalarType dtype);
void causal_attention_backward_cpu(const CausalAttentionGradParams& p, at::ScalarType dtype);

// Differentiable in q, k, v (through both outputs). seq_idx may be undefined; window >= 0;
// scale > 0 (e.g. 1/sqrt(D)). Returns (out (B, L, H, Dv), lse (B, H, L)).
std::tuple<at::Tensor, at::Tensor> causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& seq_idx, int64_t window, double scale);

// Dense masked-softmax reference with LibTorch ops (test oracle; float64, small L).
std::tuple<at::Tensor, at::Tensor> causal_attention_reference(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& seq_idx,
                                                              int64_t window, double scale);

}  // namespace hax::ops
