// hax patterns: the key indices each query of a random model input attends to, as JSON lines.
#include <fmt/format.h>

#include <fstream>
#include <iostream>

#include "commands.h"
#include "core/error.h"
#include "core/rng.h"
#include "models/lm.h"
#include "options.h"

namespace hax::cli {

Command add_patterns_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "patterns", "write, as JSON lines, the keys each query attends to in a sparse layer for a random input");
  struct State {
    ModelConfig model;
    int64_t length = 256, layer = 0, head = 0;
    uint64_t seed = 1;
    std::string out;
  };
  auto st = std::make_shared<State>();
  add_model_options(sub, &st->model);
  sub->remove_option(sub->get_option("--sparse"));
  sub->add_option("--pattern", st->model.sparse, "sw, d, sw+d, a, lsh, ks, hax, dma, hsa or full")->required();
  sub->add_option("--length", st->length, "sequence length L");
  sub->add_option("--seed", st->seed, "seed of the model init, the input tokens and the LSH hash");
  sub->add_option("--layer", st->layer, "which layer's pattern to write");
  sub->add_option("--head", st->head, "which attention head");
  sub->add_option("--out", st->out, "output file (default: standard output)");
  Command c;
  c.app = sub;
  c.run = [st]() {
    ModelConfig cfg = st->model;
    HAX_CHECK(cfg.sparse != "none", "--pattern none has no keys to list; choose sw, d, sw+d, a, lsh, ks, hax, dma, hsa or full");
    cfg.validate();
    HAX_CHECK(st->length > 0, "--length {} must be positive", st->length);
    HAX_CHECK(st->layer >= 0 && st->layer < cfg.n_layers, "--layer {} must be in [0, n_layers = {})", st->layer,
              cfg.n_layers);
    HAX_CHECK(st->head >= 0 && st->head < cfg.attn_heads, "--head {} must be in [0, attn_heads = {})", st->head,
              cfg.attn_heads);
    torch::manual_seed(st->seed);
    LanguageModel model(cfg);
    model.eval();
    // A random input: token ids uniform over the vocabulary.
    Rng rng(derive_seed(st->seed, 0x9A77));
    at::Tensor ids = at::empty({1, st->length}, at::kLong);
    for (int64_t t = 0; t < st->length; ++t) ids[0][t] = (int64_t)rng.below((uint64_t)cfg.vocab_size);
    std::vector<PatternRecord> rec;
    ForwardContext ctx;
    ctx.seed = st->seed;
    ctx.record = &rec;
    {
      torch::NoGradGuard ng;
      model.hidden(ids, {}, nullptr, &ctx);
    }
    std::ofstream file;
    if (!st->out.empty()) {
      file.open(st->out);
      HAX_CHECK(file.good(), "--out {}: cannot open the file for writing", st->out);
    }
    std::ostream& os = st->out.empty() ? std::cout : file;
    os << nlohmann::json({{"pattern", cfg.sparse},
                          {"length", st->length},
                          {"keys", cfg.sparse_keys},
                          {"keys_per_part", cfg.keys_per_part()},
                          {"seed", st->seed},
                          {"layer", st->layer},
                          {"head", st->head},
                          {"mixer", cfg.mixer},
                          {"lsh_bits", cfg.lsh_bits},
                          {"lsh_binning", cfg.lsh_binning},
                          {"dilated_stride", std::max<int64_t>(1, cfg.dilated_span / cfg.keys_per_part())}})
              .dump()
       << "\n";
    if (cfg.sparse == "full") {
      for (int64_t i = 0; i < st->length; ++i) {
        std::vector<int64_t> keys(i + 1);
        for (int64_t j = 0; j <= i; ++j) keys[j] = j;
        os << nlohmann::json({{"query", i}, {"keys", keys}}).dump() << "\n";
      }
      return kExitOk;
    }
    const PatternRecord& r = rec.at(st->layer);
    at::Tensor idx = r.lists.idx.select(0, 0).select(0, st->head).contiguous();  // (L, K)
    for (int64_t i = 0; i < st->length; ++i) {
      std::vector<int32_t> keys;
      for (int64_t s = 0; s < idx.size(1); ++s) {
        const int32_t j = idx[i][s].item<int32_t>();
        if (j >= 0) keys.push_back(j);
      }
      nlohmann::json line = {{"query", i}, {"keys", keys}};
      if (r.q_bucket.defined()) {
        line["q_bucket"] = r.q_bucket[0][i][st->head].item<int32_t>();
        line["k_bucket"] = r.k_bucket[0][i][st->head].item<int32_t>();
      }
      if (r.scores.defined()) line["score"] = r.scores[0][i][st->head].item<double>();
      os << line.dump() << "\n";
    }
    return kExitOk;
  };
  return c;
}

}  // namespace hax::cli
