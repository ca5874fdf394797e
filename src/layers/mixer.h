// The sequence mixer interface every block uses (Mamba, Mamba-2, their sparse-attention hybrids,
// and Samba's sliding-window attention).
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>

#include "layers/forward_context.h"

namespace hax {

// Recurrent state of one mixer for decoding, or for continuing a sequence in pieces.
struct MixerState {
  at::Tensor conv;  // (B, d_conv - 1, conv channels): the last inputs of the causal conv
  at::Tensor ssm;   // Mamba-2: (B, H, P, N); Mamba: (B, d_inner, N)
  // Attention caches of the sparse branch and of attention layers (decoding only).
  at::Tensor keys, values;  // (B, t, H, N), (B, t, H, Dv): every past key and value
  at::Tensor queries;       // (B, t, H, N): every past query (LSH centers by their running mean)
  at::Tensor key_scores;    // (B, t, H): Key Selection score of every past key
  at::Tensor q_sum;         // (B, H, N): Σ of past queries (Key Selection's query context)
  at::Tensor aux_keys, aux_values;  // (B, t, H, N), (B, t, H, Dv): HSA's keys and values beside an attention layer's own
  at::Tensor landmarks;     // (B, NC, d_ret): HSA landmarks of the complete chunks so far
  at::Tensor chunk_inputs;  // (B, n, d_in): HSA inputs of the current, incomplete chunk
  int64_t pos = 0;          // tokens seen
};

class Mixer : public torch::nn::Module {
 public:
  // x (B, L, d_model) -> (B, L, d_model). seq_idx (B, L) int32 numbers packed sequences (state
  // resets where it changes) or is undefined. With `state`, its SSM tensors are the initial states
  // (undefined = zeros) and are replaced by the final ones. ctx may be null (evaluation, seed 0).
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& seq_idx, MixerState* state,
                             ForwardContext* ctx) = 0;
  // One decoding step: x (B, d_model) -> (B, d_model); updates `state` (from zero_state). Under
  // the same ctx seed, decoding token by token gives what forward gives.
  virtual at::Tensor step(const at::Tensor& x, MixerState& state, const ForwardContext* ctx) = 0;
  // State for a batch of `batch` sequences before their first token.
  virtual MixerState zero_state(int64_t batch, const at::TensorOptions& opts) const = 0;
};

// dt bias initialization shared by Mamba and Mamba-2: dt ~ exp(U(log dt_min, log dt_max)),
// floored at `floor`, stored as its inverse softplus so that softplus(bias) = dt.
at::Tensor init_dt_bias(int64_t n, double dt_min, double dt_max, double floor);

// Depthwise causal conv weights as nn.Conv1d initializes them: U(-1/sqrt(W), 1/sqrt(W)).
void init_conv(at::Tensor& weight, at::Tensor& bias, int64_t width);

// A module that only holds named parameters, to give them dotted names such as "conv1d.weight"
// (LibTorch parameter names may not contain dots; submodule names make the prefix).
struct ParamGroup : torch::nn::Module {
  at::Tensor add(const std::string& name, const at::Tensor& t) { return register_parameter(name, t); }
};

// Registers an empty ParamGroup named `name` on `owner` and returns it.
inline std::shared_ptr<ParamGroup> param_group(torch::nn::Module& owner, const std::string& name) {
  return owner.register_module(name, std::make_shared<ParamGroup>());
}

}  // namespace hax
