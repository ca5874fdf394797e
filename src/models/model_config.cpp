#include "models/model_config.h"

#include <algorithm>

#include "core/error.h"

namespace hax {

std::vector<std::string> ModelConfig::sparse_parts() const {
  if (sparse == "none") return {};
  if (sparse == "sw+d") return {"sw", "d"};
  if (sparse == "a") return {"sw", "sink"};
  if (sparse == "hax") return {"lsh", "ks"};
  return {sparse};
}

void ModelConfig::validate() const {
  HAX_CHECK(mixer == "mamba" || mixer == "mamba2" || mixer == "samba" || mixer == "transformer",
            "--mixer {} is unknown; choose mamba, mamba2, samba or transformer", mixer);
  auto positive = [](const char* flag, int64_t v) { HAX_CHECK(v > 0, "{} {} must be positive", flag, v); };
  positive("--vocab-size", vocab_size);
  positive("--d-model", d_model);
  positive("--n-layers", n_layers);
  positive("--expand", expand);
  positive("--d-state", d_state);
  positive("--d-conv", d_conv);
  HAX_CHECK(dt_rank >= 0, "--dt-rank {} must be >= 0 (0 picks ceil(d_model/16))", dt_rank);
  HAX_CHECK(dt_min > 0 && dt_min <= dt_max, "--dt-min {} and --dt-max {} must satisfy 0 < dt-min <= dt-max",
            dt_min, dt_max);
  HAX_CHECK(norm_eps > 0, "--norm-eps {} must be positive", norm_eps);
  HAX_CHECK(init_std > 0, "--init-std {} must be positive", init_std);
  const std::vector<std::string> kinds = {"none", "sw", "d", "sw+d", "a", "lsh", "ks", "hax", "dma", "hsa", "full"};
  HAX_CHECK(std::find(kinds.begin(), kinds.end(), sparse) != kinds.end(),
            "--sparse {} is unknown; choose none, sw, d, sw+d, a, lsh, ks, hax, dma, hsa or full", sparse);
  auto check_hsa = [&] {
    positive("--hsa-chunk", hsa_chunk);
    positive("--hsa-topk", hsa_topk);
    HAX_CHECK(hsa_landmark == "cls" || hsa_landmark == "mean", "--hsa-landmark {} is unknown; choose cls or mean",
              hsa_landmark);
    HAX_CHECK(hsa_dim >= 0, "--hsa-dim {} must be >= 0 (0 uses the input width)", hsa_dim);
  };
  if (has_sparse()) {
    HAX_CHECK(mixer == "mamba" || mixer == "mamba2",
              "--sparse {} needs --mixer mamba or mamba2 (--mixer {} has its own attention layers)", sparse, mixer);
    if (sparse == "hsa") check_hsa();
    const int64_t parts = (int64_t)sparse_parts().size();
    HAX_CHECK(sparse_keys >= parts, "--sparse-keys {} must be at least {} (one key per part of --sparse {})",
              sparse_keys, parts, sparse);
    positive("--attn-heads", attn_heads);
    HAX_CHECK(d_inner() % attn_heads == 0, "--attn-heads {} must divide the inner width d_inner = {}", attn_heads,
              d_inner());
    HAX_CHECK(qk_dim >= 0, "--qk-dim {} must be >= 0 (0 uses d_state)", qk_dim);
    HAX_CHECK(qk_init == "random" || qk_init == "bc", "--qk-init {} is unknown; choose random or bc", qk_init);
    if (qk_init == "bc")
      HAX_CHECK(qk_dim_resolved() == d_state && attn_heads == 1 && (mixer == "mamba" || ngroups == 1),
                "--qk-init bc needs one attention head with --qk-dim equal to --d-state ({}) and, for mamba2, "
                "--ngroups 1 (got heads {}, qk-dim {})",
                d_state, attn_heads, qk_dim_resolved());
    HAX_CHECK(lsh_bits >= 1 && lsh_bits <= 30, "--lsh-bits {} must be in 1..30", lsh_bits);
    HAX_CHECK(lsh_binning == "sign" || lsh_binning == "argmax", "--lsh-binning {} is unknown; choose sign or argmax",
              lsh_binning);
    const auto names = sparse_parts();
    if (std::find(names.begin(), names.end(), "d") != names.end())
      HAX_CHECK(dilated_span >= keys_per_part(), "--dilated-span {} must be at least the keys per part {}",
                dilated_span, keys_per_part());
    HAX_CHECK(ks_hidden >= 0, "--ks-hidden {} must be >= 0 (0 uses 2 * qk-dim)", ks_hidden);
    HAX_CHECK(ks_candidates >= 0, "--ks-candidates {} must be >= 0 (0 uses the keys per part)", ks_candidates);
  }
  if (mixer == "transformer") {
    const std::vector<std::string> kinds2 = {"full", "swa", "swa+hsa", "dma"};
    HAX_CHECK(std::find(kinds2.begin(), kinds2.end(), attention) != kinds2.end(),
              "--attention {} is unknown; choose full, swa, swa+hsa or dma", attention);
    if (attention == "swa+hsa") check_hsa();
    if (attention == "dma") positive("--sparse-keys", sparse_keys);
  }
  if (mixer == "samba" || mixer == "transformer") {
    positive("--swa-window", swa_window);
    positive("--swa-heads", swa_heads);
    HAX_CHECK(d_model % swa_heads == 0, "--swa-heads {} must divide --d-model {}", swa_heads, d_model);
    HAX_CHECK((d_model / swa_heads) % 2 == 0, "the attention head dim d_model / swa-heads = {} must be even (RoPE)",
              d_model / swa_heads);
    HAX_CHECK(mlp_ratio > 0, "--mlp-ratio {} must be positive", mlp_ratio);
    HAX_CHECK(rope_theta > 0, "--rope-theta {} must be positive", rope_theta);
  }
  if (mixer == "mamba2") {
    positive("--headdim", headdim);
    positive("--ngroups", ngroups);
    positive("--chunk-size", chunk_size);
    HAX_CHECK(d_inner() % headdim == 0, "--headdim {} must divide the inner width d_inner = expand * d_model = {}",
              headdim, d_inner());
    HAX_CHECK(nheads() % ngroups == 0, "--ngroups {} must divide the head count d_inner / headdim = {}", ngroups,
              nheads());
  }
}

nlohmann::ordered_json ModelConfig::to_json() const {
  return {{"mixer", mixer},       {"vocab_size", vocab_size}, {"d_model", d_model},   {"n_layers", n_layers},
          {"expand", expand},     {"d_state", d_state},       {"d_conv", d_conv},     {"headdim", headdim},
          {"ngroups", ngroups},   {"chunk_size", chunk_size}, {"dt_rank", dt_rank},   {"dt_min", dt_min},
          {"dt_max", dt_max},     {"dt_init_floor", dt_init_floor}, {"norm_eps", norm_eps},
          {"init_std", init_std}, {"tie_embeddings", tie_embeddings},
          {"rescale_prenorm_residual", rescale_prenorm_residual},
          {"sparse", sparse}, {"sparse_keys", sparse_keys}, {"attn_heads", attn_heads}, {"qk_dim", qk_dim},
          {"qk_init", qk_init}, {"lsh_bits", lsh_bits}, {"lsh_binning", lsh_binning},
          {"dilated_span", dilated_span}, {"ks_hidden", ks_hidden}, {"ks_candidates", ks_candidates},
          {"hsa_chunk", hsa_chunk}, {"hsa_topk", hsa_topk}, {"hsa_landmark", hsa_landmark}, {"hsa_dim", hsa_dim},
          {"attention", attention}, {"swa_window", swa_window}, {"swa_heads", swa_heads}, {"mlp_ratio", mlp_ratio},
          {"rope_theta", rope_theta}};
}

}  // namespace hax

namespace hax {

ModelConfig model_config_from_json(const nlohmann::json& j) {
  ModelConfig c;
  auto get = [&](const char* k, auto& field) {
    if (j.contains(k)) j.at(k).get_to(field);
  };
  get("mixer", c.mixer), get("vocab_size", c.vocab_size), get("d_model", c.d_model), get("n_layers", c.n_layers);
  get("expand", c.expand), get("d_state", c.d_state), get("d_conv", c.d_conv), get("headdim", c.headdim);
  get("ngroups", c.ngroups), get("chunk_size", c.chunk_size), get("dt_rank", c.dt_rank), get("dt_min", c.dt_min);
  get("dt_max", c.dt_max), get("dt_init_floor", c.dt_init_floor), get("norm_eps", c.norm_eps);
  get("init_std", c.init_std), get("tie_embeddings", c.tie_embeddings);
  get("rescale_prenorm_residual", c.rescale_prenorm_residual);
  get("sparse", c.sparse), get("sparse_keys", c.sparse_keys), get("attn_heads", c.attn_heads);
  get("qk_dim", c.qk_dim), get("qk_init", c.qk_init), get("lsh_bits", c.lsh_bits), get("lsh_binning", c.lsh_binning);
  get("dilated_span", c.dilated_span), get("ks_hidden", c.ks_hidden), get("ks_candidates", c.ks_candidates);
  get("hsa_chunk", c.hsa_chunk), get("hsa_topk", c.hsa_topk), get("hsa_landmark", c.hsa_landmark);
  get("hsa_dim", c.hsa_dim), get("attention", c.attention);
  get("swa_window", c.swa_window), get("swa_heads", c.swa_heads), get("mlp_ratio", c.mlp_ratio);
  get("rope_theta", c.rope_theta);
  c.validate();
  return c;
}

}  // namespace hax
