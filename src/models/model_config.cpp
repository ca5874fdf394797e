#include "models/model_config.h"

#include "core/error.h"

namespace hax {

void ModelConfig::validate() const {
  HAX_CHECK(mixer == "mamba" || mixer == "mamba2", "--mixer {} is unknown; choose mamba or mamba2", mixer);
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

nlohmann::json ModelConfig::to_json() const {
  return {{"mixer", mixer},       {"vocab_size", vocab_size}, {"d_model", d_model},   {"n_layers", n_layers},
          {"expand", expand},     {"d_state", d_state},       {"d_conv", d_conv},     {"headdim", headdim},
          {"ngroups", ngroups},   {"chunk_size", chunk_size}, {"dt_rank", dt_rank},   {"dt_min", dt_min},
          {"dt_max", dt_max},     {"dt_init_floor", dt_init_floor}, {"norm_eps", norm_eps},
          {"init_std", init_std}, {"tie_embeddings", tie_embeddings},
          {"rescale_prenorm_residual", rescale_prenorm_residual}};
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
  c.validate();
  return c;
}

}  // namespace hax
