// hax train: train a model on a task (the README's main job with no arguments).
#include <fmt/format.h>

#include "commands.h"
#include "config_file.h"
#include "core/threads.h"
#include "options.h"
#include "train/trainer.h"

namespace hax::cli {

// The task section under its option names (--task, --mqar-vocab).
nlohmann::json task_options_json(const TaskConfig& t) {
  nlohmann::json j = task_config_to_json(t), out = nlohmann::json::object();
  out["task"] = j["name"];
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "name") continue;
    out[it.key() == "vocab_size" ? "mqar_vocab" : it.key()] = it.value();
  }
  return out;
}

std::string resolved_config(const CLI::App& sub, const ModelConfig& m, const TaskConfig& t, const TrainConfig& tr) {
  return "# hax resolved configuration (read back with --config)\n\n" +
         config_text({{"model", m.to_json()}, {"task", task_options_json(t)}, {"train", tr.to_json()}}, sub);
}

Command add_train_command(CLI::App& app) {
  auto* sub = app.add_subcommand("train", "train a model on a recall task (defaults: the embedded quick-start config)");
  struct State {
    ModelConfig model;
    TaskConfig task;
    TrainConfig train;
    std::string config;
  };
  sub->footer(
      "Without --config, hax train starts from the embedded default config (configs/default.toml), which\n"
      "overrides some of the defaults shown above; `hax info` prints the resolved configuration.");
  auto st = std::make_shared<State>();
  add_config_option(sub, &st->config);
  add_model_options(sub, &st->model);
  add_task_options(sub, &st->task);
  add_train_options(sub, &st->train);
  Command c;
  c.app = sub;
  c.embedded_default = true;
  c.run = [sub, st]() {
    st->model.validate();
    st->task.validate();
    st->train.validate();
    set_threads(st->train.threads);
    RunConfig run{st->model, st->task, st->train, resolved_config(*sub, st->model, st->task, st->train)};
    fmt::print("hax train: {} model, {} layers, d_model {}, task {}, {} steps of batch {} on {} thread(s); run dir {}\n",
               run.model.mixer, run.model.n_layers, run.model.d_model, run.task.name, run.train.steps,
               run.train.batch_size, at::get_num_threads(), run.train.run_dir);
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
