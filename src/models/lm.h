// The hax language model: embedding, n_layers residual pre-norm blocks
// (x + mixer(RMSNorm(x))), a final RMSNorm and a head tied to the embedding.
// Parameter names follow mamba_ssm's MambaLMHeadModel ("backbone.layers.0.mixer.in_proj.weight").
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "layers/mixer.h"
#include "models/model_config.h"

namespace hax {

// One residual block: x + mixer(RMSNorm(x)).
class Block : public torch::nn::Module {
 public:
  Block(const ModelConfig& cfg, std::shared_ptr<Mixer> mixer);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& seq_idx, MixerState* state);
  at::Tensor step(const at::Tensor& x, MixerState& state);
  std::shared_ptr<Mixer> mixer;
  at::Tensor norm_weight;  // (d_model)

 private:
  double eps_;
};

class LanguageModel : public torch::nn::Module {
 public:
  explicit LanguageModel(const ModelConfig& cfg);

  // ids (B, L) int64 -> final normalized hidden states (B, L, d_model). seq_idx (B, L) int32 or
  // undefined (see Mixer::forward). With `states` (one per layer) the scan starts from and
  // updates them.
  at::Tensor hidden(const at::Tensor& ids, const at::Tensor& seq_idx, std::vector<MixerState>* states = nullptr);
  // Hidden (..., d_model) -> logits (..., vocab).
  at::Tensor logits(const at::Tensor& hidden);
  // ids (B, L) -> logits (B, L, vocab).
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& seq_idx = {});

  // Recurrent decoding: zero states, then one token (B) int64 at a time -> logits (B, vocab).
  std::vector<MixerState> zero_states(int64_t batch);
  at::Tensor step(const at::Tensor& ids, std::vector<MixerState>& states);

  const ModelConfig& config() const { return cfg_; }
  // name -> parameter, in a stable order (the names of the safetensors file).
  std::map<std::string, at::Tensor> state_tensors();

  torch::nn::Embedding embedding{nullptr};
  std::vector<std::shared_ptr<Block>> layers;
  at::Tensor norm_f;                    // (d_model)
  torch::nn::Linear lm_head{nullptr};   // only when tie_embeddings is false

 private:
  ModelConfig cfg_;
};

// Builds the mixer the config names.
std::shared_ptr<Mixer> make_mixer(const ModelConfig& cfg);

}  // namespace hax
