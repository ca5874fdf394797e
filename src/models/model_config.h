// Configuration of a hax language model: the mixer and its sizes.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace hax {

struct ModelConfig {
  std::string mixer = "mamba2";  // sequence mixer: "mamba" (S6), "mamba2" (SSD), "samba" (Mamba
                                 // layers interleaved with sliding-window attention layers, each
                                 // block followed by a SwiGLU MLP), or "transformer" (attention
                                 // layers of kind `attention`, each followed by a SwiGLU MLP)
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

  // Sparse attention branch inside every Mamba / Mamba-2 mixer (the paper's Figure 3).
  std::string sparse = "none";   // none | sw | d | sw+d | a | lsh | ks | hax | dma | hsa | full
  int64_t sparse_keys = 64;      // k: keys per query, split evenly across the parts of a union
                                 // (sw+d, a = sw+sink, hax = lsh+ks), as in the reference
  int64_t attn_heads = 1;        // heads of the branch; the values (the post-conv x) are split among them
  int64_t qk_dim = 0;            // query/key width per head; 0 = d_state (the reference)
  std::string qk_init = "random";  // "random", or "bc": Q and K start as the SSM's C and B
  int64_t lsh_bits = 8;          // h hyperplanes of LSH (paper: 8, sign-bit)
  std::string lsh_binning = "sign";  // "sign" (2^h buckets) or "argmax" (h buckets)
  int64_t dilated_span = 2048;   // dilated stride r = dilated_span / k_part (reference: 2048 / k)
  int64_t ks_hidden = 0;         // Key Selection scorer MLP width; 0 = 2 * qk_dim (the reference)
  int64_t ks_candidates = 0;     // keys sampled per row for the ranking loss; 0 = k_part
  // DMA (sparse = "dma", attention = "dma") attends to the top sparse_keys keys of its δ.
  // HSA (sparse = "hsa", attention = "swa+hsa"): chunks, retrieval and landmarks.
  int64_t hsa_chunk = 64;        // tokens per chunk (seed: 64)
  int64_t hsa_topk = 4;          // chunks each query retrieves (seed: 64 at 16M tokens)
  std::string hsa_landmark = "cls";  // "cls" (bidirectional chunk encoder with a CLS token) or "mean"
  int64_t hsa_dim = 0;           // retrieval width (landmarks, retrieval queries); 0 = the HSA input width

  // Samba (mixer = "samba"): layers alternate Mamba and sliding-window attention.
  // Transformer (mixer = "transformer"): every layer is attention of this kind: "full" (causal,
  // RoPE), "swa" (sliding window, RoPE), "swa+hsa" (sliding window with RoPE plus HSA without
  // positions, summed: the HSA seed's model) or "dma" (dynamic mask attention, RoPE).
  std::string attention = "swa";
  int64_t swa_window = 64;       // keys per query of the attention layers (paper: 64)
  int64_t swa_heads = 4;         // attention heads (head dim = d_model / swa_heads)
  double mlp_ratio = 4.0;        // SwiGLU hidden width = round8(mlp_ratio * d_model * 2 / 3)
  double rope_theta = 10000.0;   // rotary embedding base of the attention layers

  // Derived sizes.
  int64_t d_inner() const { return expand * d_model; }
  int64_t nheads() const { return d_inner() / headdim; }
  int64_t dt_rank_resolved() const { return dt_rank > 0 ? dt_rank : (d_model + 15) / 16; }
  int64_t qk_dim_resolved() const { return qk_dim > 0 ? qk_dim : d_state; }
  int64_t ks_hidden_resolved() const { return ks_hidden > 0 ? ks_hidden : 2 * qk_dim_resolved(); }
  bool has_sparse() const { return sparse != "none"; }
  int64_t hsa_dim_for(int64_t input_width) const { return hsa_dim > 0 ? hsa_dim : input_width; }
  // The parts of the sparse pattern ("sw", "d", "sink", "lsh", "ks", or "full") and k per part.
  std::vector<std::string> sparse_parts() const;
  int64_t keys_per_part() const { return sparse_keys / (int64_t)sparse_parts().size(); }
  int64_t ks_candidates_resolved() const { return ks_candidates > 0 ? ks_candidates : keys_per_part(); }
  int64_t mlp_hidden() const { return ((int64_t)(mlp_ratio * d_model * 2.0 / 3.0) + 7) / 8 * 8; }

  // Throws UsageError naming the option (CLI spelling), the value and the constraint.
  void validate() const;
  nlohmann::ordered_json to_json() const;  // fields in declaration order
};

}  // namespace hax

namespace hax {
// Reads a ModelConfig written by to_json (missing keys keep their defaults); validates it.
ModelConfig model_config_from_json(const nlohmann::json& j);
}  // namespace hax
