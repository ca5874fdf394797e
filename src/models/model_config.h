// Configuration of a hax language model: the mixer and its sizes.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace hax {

struct ModelConfig {
  std::string mixer = "mamba2";  // sequence mixer of every block: "mamba" (S6) or "mamba2" (SSD)
  int64_t vocab_size = 100;      // embedding rows; must exceed the task's largest token id
  int64_t d_model = 64;          // residual stream width
  int64_t n_layers = 2;          // number of residual blocks
  int64_t expand = 2;            // d_inner = expand * d_model (Mamba's and Mamba-2's inner width)
  int64_t d_state = 32;          // SSM state size N per head (Mamba-2) or per channel (Mamba); paper: 32 / 16
  int64_t d_conv = 4;            // causal depthwise conv width
  int64_t headdim = 16;          // Mamba-2 head dim P; heads = d_inner / headdim (paper: 8 x 16)
  int64_t ngroups = 1;           // Mamba-2 groups of B/C shared by heads; must divide the head count
  int64_t chunk_size = 256;      // Mamba-2 SSD chunk length (a speed knob; results are the same)
  int64_t dt_rank = 0;           // Mamba: rank of the dt projection; 0 = ceil(d_model / 16)
  double dt_min = 0.001;         // initial dt drawn log-uniform in [dt_min, dt_max]
  double dt_max = 0.1;
  double dt_init_floor = 1e-4;   // and floored at this value
  double norm_eps = 1e-5;        // RMSNorm epsilon
  double init_std = 0.02;        // std of the embedding's normal initialization
  bool tie_embeddings = true;    // LM head shares the embedding matrix (as the reference trains it)
  bool rescale_prenorm_residual = true;  // scale out_proj init by 1/sqrt(n_layers), as mamba_ssm

  // Derived sizes.
  int64_t d_inner() const { return expand * d_model; }
  int64_t nheads() const { return d_inner() / headdim; }
  int64_t dt_rank_resolved() const { return dt_rank > 0 ? dt_rank : (d_model + 15) / 16; }

  // Throws UsageError naming the option (CLI spelling), the value and the constraint.
  void validate() const;
  nlohmann::json to_json() const;
};

}  // namespace hax

namespace hax {
// Reads a ModelConfig written by to_json (missing keys keep their defaults); validates it.
ModelConfig model_config_from_json(const nlohmann::json& j);
}  // namespace hax
