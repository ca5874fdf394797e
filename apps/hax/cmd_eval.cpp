// hax eval: accuracy of a checkpoint on its task's validation or test set, or (--lengths) its
// length-extrapolation grid: accuracy by sequence length and needle depth, as a table, JSON and an
// SVG heat map.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>

#include "commands.h"
#include "config_file.h"
#include "core/atomic_file.h"
#include "core/device.h"
#include "core/error.h"
#include "core/threads.h"
#include "eval/evaluator.h"
#include "eval/heatmap_svg.h"
#include "eval/length_eval.h"
#include "options.h"
#include "tasks/registry.h"
#include "tasks/splits.h"
#include "train/checkpoint.h"

namespace hax::cli {

namespace {

struct EvalState {
  std::string checkpoint, split = "test", json;
  int64_t n = 0, batch_size = 128;
  int threads = 0;
  // --lengths mode
  std::string lengths, depths, svg;
  int64_t max_batch_tokens = 65536;
  int64_t seed = -1;
  std::string device = "cpu";  // where the model runs: cpu, cuda, cuda:N or auto
};

// The length grid of one checkpoint (hax eval --lengths).
int run_length_eval(const EvalState& st, const Checkpoint& ck, const TrainConfig& tc) {
  LengthEvalConfig cfg;
  cfg.lengths = parse_size_list(st.lengths, "--lengths");
  const TaskConfig& task = ck.meta.task;
  if (!st.depths.empty()) {
    cfg.depths = parse_number_list(st.depths, "--depths", 0, 1);
    HAX_CHECK(task_has_depth(task), "--depths {}: the checkpoint's task {} has no needle depth (niah has)", st.depths,
              task.name);
  } else if (task_has_depth(task)) {
    cfg.depths = {0, 0.25, 0.5, 0.75, 1};
  }
  cfg.n = st.n > 0 ? st.n : 20;
  cfg.batch_size = st.batch_size;
  cfg.max_batch_tokens = st.max_batch_tokens;
  cfg.seed = st.seed >= 0 ? (uint64_t)st.seed : eval_seed(tc.seed);
  for (int64_t L : cfg.lengths)
    for (double d : cfg.depths.empty() ? std::vector<double>{std::nan("")} : cfg.depths)
      length_eval_task(task, L, d);  // every cell valid before the model is built
  LanguageModel model(ck.meta.model);
  load_weights(model, ck, st.checkpoint);
  const at::Device device = resolve_device(st.device);
  model.to(device);
  fmt::print("checkpoint {} (step {}), task {}: {} samples per cell, seed {}, on {}{}\n", st.checkpoint,
             ck.meta.step, task.name, cfg.n, cfg.seed, device.str(),
             device.is_cpu() ? fmt::format(", {} thread(s)", at::get_num_threads()) : std::string());
  std::fflush(stdout);
  LengthEvalGrid grid = length_eval(model, task, cfg, [](const LengthEvalCell& c) {
    fmt::print("  length {}{}: {:.1f}% (loss {:.4f}) in {:.1f}s, batch {}{}\n", c.length,
               std::isnan(c.depth) ? std::string() : fmt::format(" depth {:g}", c.depth), 100 * c.result.accuracy,
               c.result.loss, c.seconds, c.batch_size,
               c.peak_memory_bytes >= 0 ? fmt::format(", peak +{:.1f} MB", c.peak_memory_bytes / 1048576.0)
                                        : std::string());
    std::fflush(stdout);
  });
  fmt::print("accuracy (%) by length{}:\n{}", grid.depths.size() > 1 || !std::isnan(grid.depths[0]) ? " x depth" : "",
             length_eval_table(grid));
  const std::string title = fmt::format("{} (step {})", st.checkpoint, ck.meta.step);
  if (!st.json.empty()) {
    nlohmann::json j = length_eval_json(grid);
    j["checkpoint"] = st.checkpoint;
    j["step"] = ck.meta.step;
    j["model"] = ck.meta.model.to_json();
    write_file_atomic(st.json, j.dump(2) + "\n");
  }
  if (!st.svg.empty()) write_file_atomic(st.svg, heatmap_svg(length_eval_heatmap(grid, title)));
  return kExitOk;
}

}  // namespace

Command add_eval_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "eval", "evaluate a checkpoint on its task's validation or test set, or (--lengths) at other lengths and depths");
  auto st = std::make_shared<EvalState>();
  sub->add_option("--checkpoint", st->checkpoint, "checkpoint file (.safetensors)")->required();
  sub->add_option("--split", st->split, "valid or test (not used with --lengths)");
  sub->add_option("--n", st->n,
                  "evaluate the first N samples of the split (0 = all of them); with --lengths: samples per cell "
                  "(0 = 20)");
  sub->add_option("--batch-size", st->batch_size, "samples per batch");
  sub->add_option("--json", st->json, "also write the result as JSON to this file");
  const char* g = "Length grid";
  sub->add_option("--lengths", st->lengths,
                  "evaluate at these input lengths instead of the split, e.g. 1k,4k,16k,64k (mqar and niah)")
      ->group(g);
  sub->add_option("--depths", st->depths, "with --lengths, niah: needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)")
      ->group(g);
  sub->add_option("--svg", st->svg, "with --lengths: write the accuracy heat map (length x depth) to this SVG file")
      ->group(g);
  sub->add_option("--max-batch-tokens", st->max_batch_tokens,
                  "with --lengths: most tokens per batch (fewer samples per batch at long lengths)")
      ->group(g);
  sub->add_option("--seed", st->seed,
                  "with --lengths: seed of the grid's samples (default: derived from the checkpoint's training seed)")
      ->group(g);
  sub->add_option("--device", st->device,
                  "cpu, cuda (cuda:N) or auto (cuda when a GPU is present); checkpoints are device-free");
  add_threads_option(sub, &st->threads);
  Command c;
  c.app = sub;
  c.run = [st]() {
    HAX_CHECK(st->split == "valid" || st->split == "test", "--split {} is unknown; choose valid or test", st->split);
    HAX_CHECK(st->n >= 0, "--n {} must be >= 0", st->n);
    HAX_CHECK(st->batch_size > 0, "--batch-size {} must be positive", st->batch_size);
    const bool grid = !st->lengths.empty();
    HAX_CHECK(grid || st->depths.empty(), "--depths {} needs --lengths", st->depths);
    HAX_CHECK(grid || st->svg.empty(), "--svg {} needs --lengths", st->svg);
    HAX_CHECK(st->max_batch_tokens > 0, "--max-batch-tokens {} must be positive", st->max_batch_tokens);
    set_threads(st->threads);
    Checkpoint ck = read_checkpoint(st->checkpoint);
    // The run's seed and split sizes define its validation and test sets.
    nlohmann::json tj = nlohmann::json::parse(ck.file.metadata.count("train_config") ? ck.file.metadata.at("train_config")
                                                                                     : std::string("{}"));
    TrainConfig tc;
    tc.seed = tj.value("seed", tc.seed);
    if (grid) return run_length_eval(*st, ck, tc);
    tc.n_valid = tj.value("n_valid", tc.n_valid);
    tc.n_test = tj.value("n_test", tc.n_test);
    tc.pack = tj.value("pack", tc.pack);
    tc.pack_len = tj.value("pack_len", tc.pack_len);
    LanguageModel model(ck.meta.model);
    load_weights(model, ck, st->checkpoint);
    model.to(resolve_device(st->device));
    auto task = make_task(ck.meta.task);
    // Only the samples evaluated are kept (the first --n of the split).
    const bool valid = st->split == "valid";
    const int64_t keep = st->n > 0 ? st->n : (valid ? tc.n_valid : tc.n_test);
    EvalFingerprints splits = eval_fingerprints(*task, tc.seed, tc.n_valid, valid ? 0 : tc.n_test, valid ? keep : 0,
                                                valid ? 0 : keep);
    std::vector<Sample>& set = valid ? splits.valid : splits.test;
    const int64_t pack_len = tc.pack_len > 0 ? tc.pack_len : task->max_length() - 1;
    EvalResult r = evaluate(model, set, st->batch_size, tc.pack, pack_len, eval_seed(tc.seed));
    fmt::print("checkpoint {} (step {}): {} accuracy {:.2f}% (loss {:.4f}) on {} samples of task {}\n", st->checkpoint,
               ck.meta.step, st->split, 100 * r.accuracy, r.loss, r.samples, task->name());
    if (!st->json.empty()) {
      nlohmann::json j = {{"checkpoint", st->checkpoint}, {"step", ck.meta.step}, {"split", st->split},
                          {"accuracy", r.accuracy},       {"loss", r.loss},     {"samples", r.samples},
                          {"positions", r.positions},     {"task", task->describe()}};
      write_file_atomic(st->json, j.dump(2) + "\n");
    }
    return kExitOk;
  };
  return c;
}

}  // namespace hax::cli
