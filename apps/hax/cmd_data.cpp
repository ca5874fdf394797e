// hax data: write task samples as JSON lines for inspection.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <iostream>

#include "commands.h"
#include "core/error.h"
#include "core/threads.h"
#include "options.h"
#include "tasks/registry.h"
#include "tasks/splits.h"

namespace hax::cli {

Command add_data_command(CLI::App& app) {
  auto* sub = app.add_subcommand("data", "write samples of a task as JSON lines (tokens, mask, parameters)");
  struct State {
    TaskConfig task;
    int64_t n = 10, n_valid = 14400, n_test = 14400;
    uint64_t seed = 1;
    std::string split = "train", out;
    int threads = 0;
  };
  auto st = std::make_shared<State>();
  add_task_options(sub, &st->task);
  sub->add_option("--n", st->n, "number of samples to write");
  sub->add_option("--seed", st->seed, "seed (the same as hax train's --seed gives its data)");
  sub->add_option("--split", st->split, "train, valid or test");
  sub->add_option("--n-valid", st->n_valid, "validation set size (defines the splits, as in hax train)");
  sub->add_option("--n-test", st->n_test, "test set size");
  sub->add_option("--out", st->out, "output file (default: standard output)");
  add_threads_option(sub, &st->threads);
  Command c;
  c.app = sub;
  c.run = [st]() {
    HAX_CHECK(st->n > 0, "--n {} must be positive", st->n);
    HAX_CHECK(st->split == "train" || st->split == "valid" || st->split == "test",
              "--split {} is unknown; choose train, valid or test", st->split);
    HAX_CHECK(st->n_valid > 0, "--n-valid {} must be positive", st->n_valid);
    HAX_CHECK(st->n_test > 0, "--n-test {} must be positive", st->n_test);
    set_threads(st->threads);  // the eval sets are drawn in parallel
    auto task = make_task(st->task);
    int64_t n_valid = st->n_valid, n_test = st->n_test;
    if (st->split == "valid") HAX_CHECK(st->n <= n_valid, "--n {} exceeds the validation set size --n-valid {}", st->n, n_valid);
    if (st->split == "test") HAX_CHECK(st->n <= n_test, "--n {} exceeds the test set size --n-test {}", st->n, n_test);
    // Only the samples written are kept; the others of the eval sets leave their fingerprints (the
    // validation samples come first, so the first n of them need no others).
    const bool valid = st->split == "valid", test = st->split == "test";
    EvalFingerprints splits = valid ? eval_fingerprints(*task, st->seed, st->n, 0, st->n, 0)
                                    : eval_fingerprints(*task, st->seed, n_valid, test ? st->n : n_test, 0,
                                                        test ? st->n : 0);
    TrainStream stream(*task, st->seed, splits);
    std::ofstream file;
    if (!st->out.empty()) {
      file.open(st->out);
      HAX_CHECK(file.good(), "--out {}: cannot open the file for writing", st->out);
    }
    std::ostream& os = st->out.empty() ? std::cout : file;
    const nlohmann::json desc = task->describe();
    for (int64_t i = 0; i < st->n; ++i) {
      const Sample& s = valid ? splits.valid[i] : test ? splits.test[i] : stream.at(i);
      nlohmann::json j = {{"split", st->split}, {"index", i}, {"task", desc["name"]},
                          {"params", s.params}, {"tokens", s.tokens}, {"mask", s.mask}};
      os << j.dump() << "\n";
    }
    return kExitOk;
  };
  return c;
}

}  // namespace hax::cli
