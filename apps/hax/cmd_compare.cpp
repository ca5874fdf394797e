// hax compare: train a set of model variants on one long-context task under one budget and report
// accuracy at the training length and at multiples of it.
#include <fmt/format.h>

#include "commands.h"
#include "config_file.h"
#include "core/error.h"
#include "core/threads.h"
#include "eval/compare.h"
#include "options.h"

namespace hax::cli {
Command add_compare_command(CLI::App& app, int argc, char** argv) {
  auto* sub = app.add_subcommand(
      "compare",
      "train model variants (full attention, SWA, SWA+HSA, Mamba-2 and its HAX, DMA, HSA hybrids) on NIAH or MQAR "
      "under one budget; report accuracy at the training length and at multiples of it");
  struct State {
    CompareConfig cfg;
    std::string variants, factors = "1,4,16", depths, command;
    int threads = 0;
    bool list = false;
  };
  auto st = std::make_shared<State>();
  st->cfg.task.name = "niah";
  for (int i = 0; i < argc; ++i) st->cfg.command += (i ? " " : "") + std::string(argv[i]);
  add_task_options(sub, &st->cfg.task);
  const char* g = "Comparison";
  sub->add_option("--variants", st->variants, "comma-separated subset of full, swa, swa+hsa, mamba2, mamba2+hax, "
                                              "mamba2+dma, mamba2+hsa (default: all)")->group(g);
  sub->add_option("--seed", st->cfg.seed, "seed of models, data and evaluation samples")->group(g);
  sub->add_option("--steps", st->cfg.steps, "optimizer steps per variant")->group(g);
  sub->add_option("--batch-size", st->cfg.batch_size, "samples per step")->group(g);
  sub->add_option("--lr", st->cfg.lr, "peak learning rate")->group(g);
  sub->add_option("--warmup-steps", st->cfg.warmup_steps, "warmup steps")->group(g);
  sub->add_option("--eval-every", st->cfg.eval_every, "validation interval")->group(g);
  sub->add_option("--n-valid", st->cfg.n_valid, "validation samples")->group(g);
  sub->add_option("--n-test", st->cfg.n_test, "test samples")->group(g);
  sub->add_option("--d-model", st->cfg.d_model, "width of every variant")->group(g);
  sub->add_option("--n-layers", st->cfg.n_layers, "layers of every variant")->group(g);
  sub->add_option("--sparse-keys", st->cfg.sparse_keys, "k of HAX and DMA")->group(g);
  sub->add_option("--swa-window", st->cfg.swa_window, "sliding window of the Transformer variants")->group(g);
  sub->add_option("--hsa-chunk", st->cfg.hsa_chunk, "HSA chunk length")->group(g);
  sub->add_option("--hsa-topk", st->cfg.hsa_topk, "HSA chunks per query")->group(g);
  sub->add_option("--factors", st->factors, "evaluation lengths as multiples of --seq-len, e.g. 1,4,16")->group(g);
  sub->add_option("--depths", st->depths, "NIAH needle depths averaged per length, e.g. 0,0.5,1 (default: random)")
      ->group(g);
  sub->add_option("--eval-n", st->cfg.eval_n, "samples per evaluation length (and depth)")->group(g);
  sub->add_option("--runs-dir", st->cfg.runs_dir, "directory of the runs (finished ones are reused)")->group(g);
  sub->add_option("--out", st->cfg.out_md, "markdown output")->group(g);
  sub->add_option("--json", st->cfg.out_json, "JSON output")->group(g);
  sub->add_option("--command", st->command,
                  "the command line written into the table (default: this one; scripts/compare_parallel.sh passes its own)")
      ->group(g);
  sub->add_flag("--list-variants", st->list, "print the variant names, one per line, and exit")->group(g);
  add_threads_option(sub, &st->threads);
  Command c;
  c.app = sub;
  c.run = [st]() {
    if (st->list) {
      for (const auto& v : compare_variants()) fmt::print("{}\n", v);
      return kExitOk;
    }
    CompareConfig cfg = st->cfg;
    if (!st->command.empty()) cfg.command = st->command;
    if (!st->variants.empty()) cfg.variants = split_list(st->variants);
    cfg.factors = parse_size_list(st->factors, "--factors");
    if (!st->depths.empty()) cfg.depths = parse_number_list(st->depths, "--depths", 0, 1);
    HAX_CHECK(cfg.steps > 0, "--steps {} must be positive", cfg.steps);
    HAX_CHECK(cfg.batch_size > 0, "--batch-size {} must be positive", cfg.batch_size);
    HAX_CHECK(cfg.eval_n > 0, "--eval-n {} must be positive", cfg.eval_n);
    HAX_CHECK(cfg.task.name == "niah" || cfg.task.name == "mqar", "--task {}: hax compare runs niah or mqar",
              cfg.task.name);
    cfg.task.validate();
    set_threads(st->threads);
    run_compare(cfg);
    return kExitOk;
  };
  return c;
}

}  // namespace hax::cli
