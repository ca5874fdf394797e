// The attention mixers of the Transformer-style models and of Samba: multi-head attention with q,
// k, v, o projections without bias (head dim d_model / swa_heads), of one kind:
//   "full"     causal attention, RoPE;
//   "swa"      each query sees the swa_window most recent keys of its own sequence, RoPE (Samba's);
//   "swa+hsa"  that sliding window plus hierarchical sparse attention (layers/hsa.h) with q, k, v
//              projections of its own and no positional encoding, the two outputs summed (the
//              HSA seed's model: RoPE locally, NoPE for retrieval);
//   "dma"      dynamic mask attention (layers/dma.h): the top sparse_keys keys of δ over the
//              causal prefix, per head, δ added to their scores; RoPE.
// The sliding window can be changed between steps (set_window), for a window warm-up schedule.
#pragma once
#include "layers/dma.h"
#include "layers/hsa.h"
#include "layers/mixer.h"
#include "models/model_config.h"

namespace hax {

class AttentionLayer : public Mixer {
 public:
  AttentionLayer(const ModelConfig& cfg, const std::string& kind);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& seq_idx, MixerState* state, ForwardContext* ctx) override;
  at::Tensor step(const at::Tensor& x, MixerState& state, const ForwardContext* ctx) override;
  MixerState zero_state(int64_t batch, const at::TensorOptions& opts) const override;

  // Keys per query of the sliding window ("swa", "swa+hsa").
  void set_window(int64_t window) { window_ = window; }
  int64_t window() const { return window_; }
  const std::string& kind() const { return kind_; }

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  // swa+hsa: HSA's own projections (NoPE) and retrieval.
  torch::nn::Linear hq_proj{nullptr}, hk_proj{nullptr}, hv_proj{nullptr}, ho_proj{nullptr};
  std::shared_ptr<HierarchicalSparseAttention> hsa;
  std::shared_ptr<DynamicMaskWeights> dma;  // dma: δ from the values

 private:
  at::Tensor hsa_forward(const at::Tensor& x, const at::Tensor& seq_idx);
  std::string kind_;
  int64_t d_, H_, Dh_, window_, keys_;
  double theta_, scale_;
};

}  // namespace hax
