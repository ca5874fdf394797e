// The sparse attention branch of a hybrid mixer (HAX paper Figure 3; DESIGN.md section 3).
//
// Q and K come from a new projection of the mixer's post-conv input (K scaled by 1/sqrt(N), as
// the reference), V is the post-conv x itself, split among the heads; the pattern chooses each
// query's keys (sliding window, dilated, sink, LSH, Key Selection, their unions, DMA's top keys
// of δ with δ as a score bias, HSA's retrieved chunks with their weights, or all of them for
// "full"); the output is gated per channel by E (initialized to ones) and added to the SSM's
// output by the mixer. HSA retrieves with the post-conv input too (its retrieval queries and
// chunk landmarks are computed from it).
#pragma once
#include <torch/torch.h>

#include <memory>

#include "layers/dma.h"
#include "layers/forward_context.h"
#include "layers/hsa.h"
#include "layers/key_scorer.h"
#include "layers/mixer.h"
#include "models/model_config.h"
#include "patterns/pattern.h"

namespace hax {

class SparseAttentionBranch : public torch::nn::Module {
 public:
  // qk_in_dim: width of the projection's input; v_dim: width of the values (d_inner); layer: the
  // layer's index (it seeds the layer's LSH projections and ranking-loss candidates).
  SparseAttentionBranch(const ModelConfig& cfg, int64_t qk_in_dim, int64_t v_dim, int64_t layer);

  // qk_in (B, L, qk_in_dim), v (B, L, v_dim) -> E ∘ attention output (B, L, v_dim). When ctx
  // trains and the pattern has Key Selection, the layer's ranking loss is appended to ctx.
  at::Tensor forward(const at::Tensor& qk_in, const at::Tensor& v, const at::Tensor& seq_idx, ForwardContext* ctx);

  // One decoding step at position state.pos: qk_in (B, qk_in_dim), v (B, v_dim) -> (B, v_dim).
  // Caches every past query sum, key, value and Key Selection score in `state`, and builds the
  // newest query's key list with the same pattern builders as forward, so decoding token by
  // token gives what forward gives (under the same ctx seed).
  at::Tensor step(const at::Tensor& qk_in, const at::Tensor& v, MixerState& state, const ForwardContext* ctx);

  // The attention output (B, L, H, Dv) for queries and keys q, k (B, L, H, N), values vh
  // (B, L, H, Dv) and the projection's input qk_in (HSA's retrieval input), before the gate E.
  // Key Selection scores or DMA weights go to *scores (B, L, H) when it is given.
  at::Tensor attend(const at::Tensor& qk_in, const at::Tensor& q, const at::Tensor& k, const at::Tensor& vh,
                    const at::Tensor& seq_idx, ForwardContext* ctx, at::Tensor* scores);

  // Queries and keys (B, L, H, N) of qk_in.
  std::pair<at::Tensor, at::Tensor> queries_keys(const at::Tensor& qk_in);
  // The lists of each part of the pattern (one for single patterns; "hax": LSH's, then Key
  // Selection's), with the Key Selection scores as for key_lists.
  // skip_lsh: leave LSH's part out (the GPU runs it as a band, layers/lsh_attention.h).
  std::vector<patterns::KeyLists> part_lists(const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                                             const ForwardContext* ctx, at::Tensor* ks_scores, bool skip_lsh = false);
  // The pattern's key lists for q, k (not for "full"). The Key Selection scores are computed
  // into *ks_scores, or taken from it when it is defined on entry (decoding).
  patterns::KeyLists key_lists(const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                               const ForwardContext* ctx, at::Tensor* ks_scores);
  // The LSH projection this layer uses under ctx's seed.
  at::Tensor lsh_projection(const ForwardContext* ctx) const;
  // The same in the form the bucket kernels take: rounded to q's dtype, float64, on q's device
  // (made on the host once per step when ctx holds host inputs).
  at::Tensor lsh_projection_input(const at::Tensor& q, const ForwardContext* ctx) const;
  // The LSH band of q, k (patterns::lsh_band) with this layer's projection and keys per part.
  // key_side as patterns::lsh_band's.
  patterns::LshBand lsh_band(const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                             const ForwardContext* ctx, bool key_side = true) const;

  torch::nn::Linear qk_proj{nullptr};     // qk_in_dim -> 2·H·N: [K; Q], as the reference's xx_proj
  at::Tensor E;                           // (v_dim) output gate, ones at init
  std::shared_ptr<KeyScorer> scorer;      // Key Selection scorer (ks, hax only)
  std::shared_ptr<DynamicMaskWeights> dma;          // DMA's δ (dma only)
  std::shared_ptr<HierarchicalSparseAttention> hsa;  // HSA's retrieval (hsa only)

  const std::string& kind() const { return kind_; }
  int64_t heads() const { return H_; }
  int64_t qk_dim() const { return N_; }

 private:
  std::string kind_;
  std::vector<std::string> parts_;
  int64_t H_, N_, v_dim_, keys_per_part_, stride_, bits_, candidates_, layer_;
  patterns::Binning binning_;
};

}  // namespace hax
