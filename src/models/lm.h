// The hax language model: embedding, n_layers residual pre-norm blocks, a final RMSNorm and a
// head tied to the embedding. A block is x + mixer(RMSNorm(x)), followed for Samba by
// x + MLP(RMSNorm(x)). Parameter names follow mamba_ssm ("backbone.layers.0.mixer.in_proj.weight").
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "layers/forward_context.h"
#include "layers/mixer.h"
#include "layers/mlp.h"
#include "models/model_config.h"

namespace hax {

class Block : public torch::nn::Module {
 public:
  Block(const ModelConfig& cfg, std::shared_ptr<Mixer> mixer, bool with_mlp);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& seq_idx, MixerState* state, ForwardContext* ctx);
  at::Tensor step(const at::Tensor& x, MixerState& state, const ForwardContext* ctx);
  std::shared_ptr<Mixer> mixer;
  std::shared_ptr<SwiGluMlp> mlp;  // Samba only
  at::Tensor norm_weight;          // (d_model)
  at::Tensor norm2_weight;         // (d_model), before the MLP

 private:
  double eps_;
};

class LanguageModel : public torch::nn::Module {
 public:
  explicit LanguageModel(const ModelConfig& cfg);

  // ids (B, L) int64 -> final normalized hidden states (B, L, d_model). seq_idx (B, L) int32 or
  // undefined (see Mixer::forward). With `states` (one per layer) the SSM scans start from and
  // update them. ctx (optional) carries the training flag, the seed and the auxiliary losses.
  at::Tensor hidden(const at::Tensor& ids, const at::Tensor& seq_idx, std::vector<MixerState>* states = nullptr,
                    ForwardContext* ctx = nullptr);
  // Hidden (..., d_model) -> logits (..., vocab).
  at::Tensor logits(const at::Tensor& hidden);
  // ids (B, L) -> logits (B, L, vocab).
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& seq_idx = {}, ForwardContext* ctx = nullptr);

  // Decoding: zero states, then one token (B) int64 at a time -> logits (B, vocab).
  std::vector<MixerState> zero_states(int64_t batch);
  at::Tensor step(const at::Tensor& ids, std::vector<MixerState>& states, const ForwardContext* ctx = nullptr);

  const ModelConfig& config() const { return cfg_; }
  // The device of the model's parameters.
  at::Device device() const { return norm_f.device(); }
  // name -> parameter, in a stable order (the names of the safetensors file).
  std::map<std::string, at::Tensor> state_tensors();

  // Sets the window of every sliding-window attention layer (a window warm-up schedule's step);
  // returns how many layers have one.
  int64_t set_swa_window(int64_t window);

  torch::nn::Embedding embedding{nullptr};
  std::vector<std::shared_ptr<Block>> layers;
  at::Tensor norm_f;                   // (d_model)
  torch::nn::Linear lm_head{nullptr};  // only when tie_embeddings is false

 private:
  ModelConfig cfg_;
};

// The mixer of layer `layer` for the config: Mamba, Mamba-2 (with their sparse branch when
// configured), or for Samba a Mamba layer (even layers) or a sliding-window attention layer.
std::shared_ptr<Mixer> make_mixer(const ModelConfig& cfg, int64_t layer);

}  // namespace hax
