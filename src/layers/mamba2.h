// Mamba-2 mixer (SSD): in_proj -> [z, xBC, dt]; causal conv + SiLU on xBC; chunked SSD with
// per-head scalar A = -exp(A_log) and dt = softplus(dt_raw + dt_bias); D skip; gated RMSNorm
// RMSNorm(y * silu(z)); out_proj. Parameter names follow mamba_ssm.
//
// With a sparse branch (ModelConfig::sparse), the hybrid of the HAX paper's Figure 3:
// RMSNorm((y + E ∘ attention(Q, K, V = x)) * silu(z)), Q and K projected from the post-conv x
// (or, with qk_init = bc, from the whole post-conv xBC, starting as C and B).
#pragma once
#include "layers/mixer.h"
#include "layers/sparse_branch.h"
#include "models/model_config.h"

namespace hax {

class Mamba2Mixer : public Mixer {
 public:
  Mamba2Mixer(const ModelConfig& cfg, int64_t layer);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& seq_idx, MixerState* state, ForwardContext* ctx) override;
  at::Tensor step(const at::Tensor& x, MixerState& state, const ForwardContext* ctx) override;
  MixerState zero_state(int64_t batch, const at::TensorOptions& opts) const override;

  struct Projected {
    at::Tensor z, xBC, dt;  // (B, L, d_inner), (B, L, conv_dim), (B, L, H)
  };
  Projected project_input(const at::Tensor& x);
  int64_t conv_dim() const { return d_inner_ + 2 * G_ * N_; }

  torch::nn::Linear in_proj{nullptr}, out_proj{nullptr};
  at::Tensor conv_weight, conv_bias;  // (conv_dim, 1, W), (conv_dim)
  at::Tensor dt_bias, A_log, D;       // (H) each
  at::Tensor norm_weight;             // (d_inner)
  std::shared_ptr<SparseAttentionBranch> sparse;  // null without a sparse branch

 protected:
  // The sparse branch's Q/K input: the post-conv x (xflat, a view of xBC), or all of xBC with qk_init = bc.
  at::Tensor qk_input(const at::Tensor& xBC, const at::Tensor& xflat) const;
  int64_t d_model_, d_inner_, H_, P_, G_, N_, W_, chunk_;
  double eps_;
  bool qk_from_xbc_ = false;
};

}  // namespace hax
