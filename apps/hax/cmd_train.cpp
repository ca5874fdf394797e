// hax train: train a model on a task (the README's main job with no arguments).
#include "core/cuda_util.h"
#include "core/device.h"
#include <fmt/format.h>

#include "commands.h"
#include "core/threads.h"
#include "options.h"
#include "train/trainer.h"

namespace hax::cli {

Command add_train_command(CLI::App& app) {
  auto* sub = app.add_subcommand("train", "train a model on a recall task (defaults: the embedded quick-start config)");
  sub->footer(
      "Without --config, hax train starts from the embedded default config (configs/default.toml), which\n"
      "overrides some of the defaults shown above; `hax info` prints the resolved configuration.");
  auto st = add_run_options(sub);
  Command c;
  c.app = sub;
  c.embedded_default = true;
  c.run = [sub, st]() {
    st->validate();
    set_threads(st->train.threads);
    RunConfig run{st->model, st->task, st->train, resolved_config(*sub, *st)};
    const at::Device device = resolve_device(run.train.device);
    const std::string where = device.is_cuda() ? fmt::format("{} ({}, {})", device.str(), cuda_device_name(), run.train.precision)
                                               : fmt::format("the CPU, {} thread(s)", at::get_num_threads());
    fmt::print("hax train: {} model, {} layers, d_model {}, task {}, {} steps of batch {} on {}; run dir {}\n",
               run.model.mixer, run.model.n_layers, run.model.d_model, run.task.name, run.train.steps,
               run.train.batch_size, where, run.train.run_dir);
    std::fflush(stdout);
    TrainSummary s = train(run);
    if (s.interrupted) {
      fmt::print("interrupted at step {}: checkpoint written to {}/checkpoints/last.safetensors; continue with\n"
                 "  hax train --run-dir {} --resume\n",
                 s.steps_done, s.run_dir, s.run_dir);
      return kExitInterrupted;
    }
    fmt::print("done: {} steps in {:.1f}s this session; best validation accuracy {:.2f}% at step {}\n", s.steps_done,
               s.seconds, 100 * s.best_valid_acc, s.best_step);
    fmt::print("test accuracy: {:.2f}% (test loss {:.4f}); run dir {}\n", 100 * s.test_acc, s.test_loss, s.run_dir);
    return kExitOk;
  };
  return c;
}

}  // namespace hax::cli
