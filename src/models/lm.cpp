#include "models/lm.h"
#include "layers/project.h"

#include "layers/mamba.h"
#include "layers/mamba2.h"
#include "layers/attention_layer.h"
#include "ops/rmsnorm/rmsnorm.h"

namespace hax {

std::shared_ptr<Mixer> make_mixer(const ModelConfig& cfg, int64_t layer) {
  if (cfg.mixer == "mamba") return std::make_shared<MambaMixer>(cfg, layer);
  if (cfg.mixer == "samba") {
    if (layer % 2 == 1) return std::make_shared<AttentionLayer>(cfg, "swa");
    return std::make_shared<MambaMixer>(cfg, layer);
  }
  if (cfg.mixer == "transformer") return std::make_shared<AttentionLayer>(cfg, cfg.attention);
  return std::make_shared<Mamba2Mixer>(cfg, layer);
}

Block::Block(const ModelConfig& cfg, std::shared_ptr<Mixer> m, bool with_mlp) : eps_(cfg.norm_eps) {
  mixer = register_module("mixer", std::move(m));
  norm_weight = param_group(*this, "norm")->add("weight", at::ones({cfg.d_model}));
  if (with_mlp) {
    norm2_weight = param_group(*this, "norm2")->add("weight", at::ones({cfg.d_model}));
    mlp = register_module("mlp", std::make_shared<SwiGluMlp>(cfg.d_model, cfg.mlp_hidden(), cfg.n_layers));
  }
}

at::Tensor Block::forward(const at::Tensor& x0, const at::Tensor& seq_idx, MixerState* state, ForwardContext* ctx) {
  at::Tensor x = x0 + mixer->forward(ops::rmsnorm(x0, at::Tensor(), norm_weight, eps_, 0), seq_idx, state, ctx);
  if (mlp) x = x + mlp->forward(ops::rmsnorm(x, at::Tensor(), norm2_weight, eps_, 0));
  return x;
}

at::Tensor Block::step(const at::Tensor& x0, MixerState& state, const ForwardContext* ctx) {
  at::Tensor x = x0 + mixer->step(ops::rmsnorm(x0, at::Tensor(), norm_weight, eps_, 0), state, ctx);
  if (mlp) x = x + mlp->forward(ops::rmsnorm(x, at::Tensor(), norm2_weight, eps_, 0));
  return x;
}

LanguageModel::LanguageModel(const ModelConfig& cfg) : cfg_(cfg) {
  cfg_.validate();
  auto backbone = register_module("backbone", std::make_shared<torch::nn::Module>());
  embedding = backbone->register_module("embedding", torch::nn::Embedding(cfg.vocab_size, cfg.d_model));
  {
    torch::NoGradGuard ng;
    embedding->weight.normal_(0.0, cfg.init_std);
  }
  auto list = backbone->register_module("layers", std::make_shared<torch::nn::Module>());
  for (int64_t i = 0; i < cfg.n_layers; ++i)
    layers.push_back(
        list->register_module(std::to_string(i), std::make_shared<Block>(cfg, make_mixer(cfg, i), cfg.mixer == "samba" || cfg.mixer == "transformer")));
  norm_f = param_group(*backbone, "norm_f")->add("weight", at::ones({cfg.d_model}));
  if (!cfg.tie_embeddings)
    lm_head = register_module("lm_head",
                              torch::nn::Linear(torch::nn::LinearOptions(cfg.d_model, cfg.vocab_size).bias(false)));
}

at::Tensor LanguageModel::hidden(const at::Tensor& ids, const at::Tensor& seq_idx, std::vector<MixerState>* states,
                                 ForwardContext* ctx) {
  at::Tensor x = embedding->forward(ids);
  for (size_t i = 0; i < layers.size(); ++i)
    x = layers[i]->forward(x, seq_idx, states ? &(*states)[i] : nullptr, ctx);
  return ops::rmsnorm(x, at::Tensor(), norm_f, cfg_.norm_eps, 0);
}

at::Tensor LanguageModel::logits(const at::Tensor& h) {
  return cfg_.tie_embeddings ? ops::linear(h, embedding->weight, {}) : project(lm_head, h);
}

at::Tensor LanguageModel::forward(const at::Tensor& ids, const at::Tensor& seq_idx, ForwardContext* ctx) {
  return logits(hidden(ids, seq_idx, nullptr, ctx));
}

std::vector<MixerState> LanguageModel::zero_states(int64_t batch) {
  std::vector<MixerState> s;
  auto opts = embedding->weight.options().requires_grad(false);
  for (auto& l : layers) s.push_back(l->mixer->zero_state(batch, opts));
  return s;
}

at::Tensor LanguageModel::step(const at::Tensor& ids, std::vector<MixerState>& states, const ForwardContext* ctx) {
  at::Tensor x = embedding->forward(ids);  // (B, d)
  for (size_t i = 0; i < layers.size(); ++i) x = layers[i]->step(x, states[i], ctx);
  return logits(ops::rmsnorm(x, at::Tensor(), norm_f, cfg_.norm_eps, 0));
}

std::map<std::string, at::Tensor> LanguageModel::state_tensors() {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : named_parameters()) out[p.key()] = p.value();
  return out;
}

int64_t LanguageModel::set_swa_window(int64_t window) {
  int64_t n = 0;
  for (auto& l : layers)
    if (auto* a = dynamic_cast<AttentionLayer*>(l->mixer.get()); a && a->kind() != "full" && a->kind() != "dma") {
      a->set_window(window);
      ++n;
    }
  return n;
}

}  // namespace hax
