#include "eval/compare.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"
#include "eval/length_eval.h"
#include "eval/run_reuse.h"
#include "tasks/registry.h"
#include "train/checkpoint.h"
#include "train/run_config_text.h"

namespace hax {
namespace {

// The model of a variant at the comparison's size.
ModelConfig variant_model(const std::string& name, const CompareConfig& cfg, int64_t vocab) {
  ModelConfig m;
  m.vocab_size = vocab;
  m.d_model = cfg.d_model;
  m.n_layers = cfg.n_layers;
  m.sparse_keys = cfg.sparse_keys;
  m.hsa_chunk = cfg.hsa_chunk, m.hsa_topk = cfg.hsa_topk;
  m.swa_window = cfg.swa_window;
  m.swa_heads = std::max<int64_t>(1, cfg.d_model / 16);  // head dim 16
  m.chunk_size = 64;
  if (name == "full" || name == "swa" || name == "swa+hsa") {
    m.mixer = "transformer";
    m.attention = name;
  } else if (name == "mamba2") {
    m.mixer = "mamba2";
  } else {
    HAX_CHECK(name.rfind("mamba2+", 0) == 0, "--variants: `{}` is unknown; choose among {}", name,
              nlohmann::json(compare_variants()).dump());
    m.mixer = "mamba2";
    m.sparse = name.substr(7);
    HAX_CHECK(m.sparse == "hax" || m.sparse == "dma" || m.sparse == "hsa",
              "--variants: `{}` is unknown; choose among {}", name, nlohmann::json(compare_variants()).dump());
  }
  m.validate();
  return m;
}

}  // namespace

std::vector<std::string> compare_variants() {
  return {"full", "swa", "swa+hsa", "mamba2", "mamba2+hax", "mamba2+dma", "mamba2+hsa"};
}

void run_compare(const CompareConfig& cfg) {
  HAX_CHECK(task_has_length(cfg.task), "--task {}: hax compare needs a task with a --seq-len (niah or mqar)",
            cfg.task.name);
  HAX_CHECK(!cfg.factors.empty(), "--factors must list at least one length factor");
  const std::vector<std::string> variants = cfg.variants.empty() ? compare_variants() : cfg.variants;
  const auto task = make_task(cfg.task);
  const int64_t vocab = (task->min_vocab() + 7) / 8 * 8;
  std::vector<int64_t> lengths;
  for (int64_t f : cfg.factors) {
    HAX_CHECK(f >= 1, "--factors: {} must be >= 1", f);
    lengths.push_back(f * cfg.task.seq_len);
  }
  for (const auto& name : variants) variant_model(name, cfg, vocab);  // bad names fail before any training
  LengthEvalConfig lc;
  lc.lengths = lengths;
  lc.depths = cfg.depths;
  lc.n = cfg.eval_n;
  lc.batch_size = 16;
  lc.seed = cfg.seed + 0x5EED;
  nlohmann::json rows = nlohmann::json::array();
  std::string table;
  for (const auto& name : variants) {
    RunConfig run;
    run.model = variant_model(name, cfg, vocab);
    run.task = cfg.task;
    run.train.run_dir = fmt::format("{}/{}", cfg.runs_dir, name);
    run.train.seed = cfg.seed;
    run.train.steps = cfg.steps;
    run.train.batch_size = cfg.batch_size;
    run.train.lr = cfg.lr;
    run.train.warmup_steps = cfg.warmup_steps;
    run.train.eval_every = cfg.eval_every;
    run.train.save_every = cfg.eval_every;
    run.train.log_every = std::max<int64_t>(1, cfg.eval_every / 5);
    run.train.n_valid = cfg.n_valid;
    run.train.n_test = cfg.n_test;
    run.train.pack = false;
    run.train.progress = false;
    run.config_text = run_config_text(run.model, run.task, run.train);
    const ExperimentRun r = train_or_reuse(run, "compare", name);
    // The best-validation model at every evaluation length.
    const std::string best = best_checkpoint_path(run.train.run_dir);
    Checkpoint ck = read_checkpoint(best);
    LanguageModel model(ck.meta.model);
    load_weights(model, ck, best);
    const LengthEvalGrid grid = length_eval(model, cfg.task, lc);
    int64_t params = 0;
    for (const auto& p : model.parameters()) params += p.numel();
    nlohmann::json accs = nlohmann::json::array();
    std::string cells;
    for (size_t row = 0; row < grid.lengths.size(); ++row) {
      double sum = 0;
      for (size_t col = 0; col < grid.depths.size(); ++col) sum += grid.at(row, col).result.accuracy;
      const double acc = sum / grid.depths.size();
      accs.push_back({{"length", grid.lengths[row]}, {"accuracy", acc}});
      cells += fmt::format(" {:.1f} |", 100 * acc);
    }
    fmt::print("compare: {}: test {:.2f}%{}, by length:{}\n", name, 100 * r.test_acc, r.reused ? " (reused)" : "",
               cells);
    std::fflush(stdout);
    table += fmt::format("| {} | {} | {:.0f} | {:.1f} |{}\n", name, params, r.seconds, 100 * r.test_acc, cells);
    rows.push_back({{"variant", name}, {"params", params}, {"train_seconds", r.seconds}, {"test_acc", r.test_acc},
                    {"by_length", accs}, {"grid", length_eval_json(grid)}, {"run_dir", run.train.run_dir}});
  }
  std::string md = fmt::format("# hax compare: {} (accuracy %)\n\nCommand: `{}`\n\n", cfg.task.name, cfg.command);
  md += fmt::format(
      "Budget per variant: {} steps of batch {} at length {} (lr {} after {} warmup steps, constant), seed {}; "
      "models of d_model {} and {} layers (k = {} for HAX and DMA, HSA chunks of {} with top-{}, sliding window {}). "
      "Test: {} samples at the training length with the best-validation model. Length columns: {} samples per "
      "length{}, the same checkpoint. \"train s\": seconds of the session that finished the run (a run resumed "
      "after an interruption shows only its last part). Task: {}.\n\n",
      cfg.steps, cfg.batch_size, cfg.task.seq_len, cfg.lr, cfg.warmup_steps, cfg.seed, cfg.d_model, cfg.n_layers,
      cfg.sparse_keys, cfg.hsa_chunk, cfg.hsa_topk, cfg.swa_window, cfg.n_test, cfg.eval_n,
      cfg.depths.empty() ? "" : fmt::format(" and depth (averaged over depths {})", nlohmann::json(cfg.depths).dump()),
      task->describe().dump());
  md += "| variant | parameters | train s | test |";
  for (int64_t L : lengths) md += fmt::format(" {} |", length_label(L));
  md += "\n|---|---|---|---|";
  for (size_t i = 0; i < lengths.size(); ++i) md += "---|";
  md += "\n" + table;
  write_file_atomic(cfg.out_md, md);
  write_file_atomic(cfg.out_json, nlohmann::json({{"command", cfg.command}, {"rows", rows}}).dump(2) + "\n");
  fmt::print("\n{}\nwrote {} and {}\n", md, cfg.out_md, cfg.out_json);
}

}  // namespace hax
