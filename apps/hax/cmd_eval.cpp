// hax eval: accuracy of a checkpoint on its task's validation or test set.
#include <fmt/format.h>

#include "commands.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "core/threads.h"
#include "eval/evaluator.h"
#include "options.h"
#include "tasks/registry.h"
#include "tasks/splits.h"
#include "train/checkpoint.h"

namespace hax::cli {

Command add_eval_command(CLI::App& app) {
  auto* sub = app.add_subcommand("eval", "evaluate a checkpoint on its task's validation or test set");
  struct State {
    std::string checkpoint, split = "test", json;
    int64_t n = 0, batch_size = 128;
    int threads = 0;
  };
  auto st = std::make_shared<State>();
  sub->add_option("--checkpoint", st->checkpoint, "checkpoint file (.safetensors)")->required();
  sub->add_option("--split", st->split, "valid or test");
  sub->add_option("--n", st->n, "evaluate the first N samples of the split (0 = all of them)");
  sub->add_option("--batch-size", st->batch_size, "samples per batch");
  sub->add_option("--json", st->json, "also write the result as JSON to this file");
  add_threads_option(sub, &st->threads);
  Command c;
  c.app = sub;
  c.run = [st]() {
    HAX_CHECK(st->split == "valid" || st->split == "test", "--split {} is unknown; choose valid or test", st->split);
    HAX_CHECK(st->n >= 0, "--n {} must be >= 0", st->n);
    HAX_CHECK(st->batch_size > 0, "--batch-size {} must be positive", st->batch_size);
    set_threads(st->threads);
    Checkpoint ck = read_checkpoint(st->checkpoint);
    // The run's seed and split sizes define its validation and test sets.
    nlohmann::json tj = nlohmann::json::parse(ck.file.metadata.count("train_config") ? ck.file.metadata.at("train_config")
                                                                                     : std::string("{}"));
    TrainConfig tc;
    tc.seed = tj.value("seed", tc.seed);
    tc.n_valid = tj.value("n_valid", tc.n_valid);
    tc.n_test = tj.value("n_test", tc.n_test);
    tc.pack = tj.value("pack", tc.pack);
    tc.pack_len = tj.value("pack_len", tc.pack_len);
    LanguageModel model(ck.meta.model);
    load_weights(model, ck, st->checkpoint);
    auto task = make_task(ck.meta.task);
    EvalSplits splits = make_eval_splits(*task, tc.seed, tc.n_valid, tc.n_test);
    std::vector<Sample>& set = st->split == "valid" ? splits.valid : splits.test;
    if (st->n > 0 && st->n < (int64_t)set.size()) set.resize(st->n);
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
