// Mamba (S6) mixer: in_proj -> [x, z]; causal conv + SiLU on x; x_proj -> [dt_low, B, C];
// delta = softplus(dt_proj(dt_low)); selective scan with per-channel diagonal A = -exp(A_log);
// D skip; y * silu(z); out_proj. Parameter names follow mamba_ssm.
//
// With a sparse branch (ModelConfig::sparse), the hybrid of the HAX paper's Figure 3:
// (y + E ∘ attention(Q, K, V = x)) * silu(z), Q and K projected from the post-conv x (with
// qk_init = bc, starting as the x_proj rows that give C and B).
#pragma once
#include "layers/mixer.h"
#include "layers/sparse_branch.h"
#include "models/model_config.h"

namespace hax {

class MambaMixer : public Mixer {
 public:
  MambaMixer(const ModelConfig& cfg, int64_t layer);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& seq_idx, MixerState* state, ForwardContext* ctx) override;
  at::Tensor step(const at::Tensor& x, MixerState& state, const ForwardContext* ctx) override;
  MixerState zero_state(int64_t batch, const at::TensorOptions& opts) const override;

  torch::nn::Linear in_proj{nullptr}, x_proj{nullptr}, dt_proj{nullptr}, out_proj{nullptr};
  at::Tensor conv_weight, conv_bias;  // (d_inner, 1, W), (d_inner)
  at::Tensor A_log;                   // (d_inner, N)
  at::Tensor D;                       // (d_inner)
  std::shared_ptr<SparseAttentionBranch> sparse;  // null without a sparse branch

 protected:
  int64_t d_model_, d_inner_, N_, W_, R_;
};

}  // namespace hax
