// Sliding-window multi-head attention with RoPE: Samba's attention layer. q, k, v, o projections
// without bias; each query sees the swa_window most recent keys of its own sequence.
#pragma once
#include "layers/mixer.h"
#include "models/model_config.h"

namespace hax {

class SlidingWindowAttention : public Mixer {
 public:
  explicit SlidingWindowAttention(const ModelConfig& cfg);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& seq_idx, MixerState* state, ForwardContext* ctx) override;
  at::Tensor step(const at::Tensor& x, MixerState& state, const ForwardContext* ctx) override;
  MixerState zero_state(int64_t batch, const at::TensorOptions& opts) const override;

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  int64_t d_, H_, Dh_, window_;
  double theta_;
};

}  // namespace hax
