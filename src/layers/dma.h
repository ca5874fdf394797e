// Dynamic mask attention's key weights (DMA; seed 001, DESIGN.md section 2).
//
//   δ[b, j, h] = exp(A_h · τ((v_j Δ)_h)),   τ = softplus (non-negative)
//
// from the values v_j (all heads' values, as the reference's projection), with Δ a learnable
// projection (v_dim -> H) and A a learnable per-head scalar. Each query attends to the top-w keys
// of δ over its causal prefix (its own head's δ: a distinct mask per head), and δ is added to the
// selected scores as a per-key bias, which is how Δ and A learn (the choice itself is discrete).
// The seed does not say how A starts. A = 0 would make every δ equal to 1, so that the first
// top-w would be a tie between all keys; hax initializes A to 1 (δ = exp(softplus(vΔ)) > 1 and
// differs between keys from the first step; a constant shift of δ does not change the softmax).
#pragma once
#include <torch/torch.h>

namespace hax {

class DynamicMaskWeights : public torch::nn::Module {
 public:
  DynamicMaskWeights(int64_t v_dim, int64_t heads);
  // v (B, L, v_dim) -> δ (B, L, H).
  at::Tensor forward(const at::Tensor& v);

  torch::nn::Linear delta{nullptr};  // Δ: v_dim -> H, no bias
  at::Tensor A;                      // (H)
};

// DMA's attention: each query of q, k (B, L, H, N), v (B, L, H, Dv) attends to the top w keys of
// its head's δ (B, L, H) over its causal prefix (ties: the earlier key), with δ added to their
// scores: softmax_j(scale q_i·k_j + δ_j). Differentiable in q, k, v and δ. -> (B, L, H, Dv).
at::Tensor dma_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& delta,
                         int64_t w, const at::Tensor& seq_idx, double scale);

}  // namespace hax
