// hax table1: the paper's Table 1 grid under a stated budget, as a markdown table.
#include <fmt/format.h>

#include "commands.h"
#include "config_file.h"
#include "core/error.h"
#include "core/threads.h"
#include "eval/table1.h"
#include "options.h"

namespace hax::cli {

Command add_table1_command(CLI::App& app, int argc, char** argv) {
  auto* sub = app.add_subcommand("table1",
                                 "train the HAX paper's Table 1 grid (every sparse variant on Mamba and Mamba-2, the "
                                 "double-width bases, Samba) and write its test accuracies beside the paper's");
  struct State {
    Table1Config cfg;
    std::string variants, seeds = "1", command;
    bool list = false;
  };
  auto st = std::make_shared<State>();
  st->cfg.task.nc_min = 4, st->cfg.task.nc_max = 8, st->cfg.task.nk_min = 4, st->cfg.task.nk_max = 8;
  for (int i = 0; i < argc; ++i) st->cfg.command += (i ? " " : "") + std::string(argv[i]);
  sub->add_option("--variants", st->variants, "comma-separated subset, e.g. mamba2+hax,mamba+base,samba (default: all)");
  sub->add_option("--seeds", st->seeds, "comma-separated seeds (one run each)");
  sub->add_option("--steps", st->cfg.steps, "optimizer steps per run");
  sub->add_option("--batch-size", st->cfg.batch_size, "samples per step");
  sub->add_option("--lr", st->cfg.lr, "peak learning rate");
  sub->add_option("--warmup-steps", st->cfg.warmup_steps, "warmup steps");
  sub->add_option("--eval-every", st->cfg.eval_every, "validation interval");
  sub->add_option("--n-valid", st->cfg.n_valid, "validation samples");
  sub->add_option("--n-test", st->cfg.n_test, "test samples");
  sub->add_option("--sparse-keys", st->cfg.sparse_keys, "k of every sparse variant");
  sub->add_option("--chunk-size", st->cfg.chunk_size, "Mamba-2 SSD chunk (speed only)");
  sub->add_option("--nc-min", st->cfg.task.nc_min, "fewest contexts per sample");
  sub->add_option("--nc-max", st->cfg.task.nc_max, "most contexts per sample");
  sub->add_option("--nk-min", st->cfg.task.nk_min, "fewest keys per context");
  sub->add_option("--nk-max", st->cfg.task.nk_max, "most keys per context");
  sub->add_option("--runs-dir", st->cfg.runs_dir, "directory of the runs (finished ones are reused)");
  sub->add_option("--out", st->cfg.out_md, "markdown output");
  sub->add_option("--json", st->cfg.out_json, "JSON output");
  sub->add_option("--command", st->command,
                  "the command line written into the table (default: this one; scripts/table1_parallel.sh passes its own)");
  sub->add_flag("--list-variants", st->list, "print the grid's variant names, one per line, and exit");
  add_threads_option(sub, &st->cfg.threads);
  Command c;
  c.app = sub;
  c.run = [st]() {
    if (st->list) {
      for (const auto& v : table1_variants()) fmt::print("{}\n", v);
      return kExitOk;
    }
    Table1Config cfg = st->cfg;
    if (!st->command.empty()) cfg.command = st->command;
    if (!st->variants.empty()) cfg.variants = split_list(st->variants);
    cfg.seeds.clear();
    for (int64_t s : parse_size_list(st->seeds, "--seeds")) cfg.seeds.push_back((uint64_t)s);
    HAX_CHECK(cfg.steps > 0, "--steps {} must be positive", cfg.steps);
    HAX_CHECK(cfg.batch_size > 0, "--batch-size {} must be positive", cfg.batch_size);
    HAX_CHECK(cfg.lr > 0, "--lr {} must be positive", cfg.lr);
    cfg.task.name = "joint_recall";
    cfg.task.validate();
    set_threads(cfg.threads);
    run_table1(cfg);
    return kExitOk;
  };
  return c;
}

}  // namespace hax::cli
