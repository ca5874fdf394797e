// hax info: the resolved configuration and the model's parameter counts.
#include <fmt/format.h>

#include <map>

#include "commands.h"
#include "options.h"
#include "models/lm.h"
#include "tasks/registry.h"

namespace hax::cli {

std::string resolved_config(const CLI::App& sub, const ModelConfig& m, const TaskConfig& t, const TrainConfig& tr);

Command add_info_command(CLI::App& app) {
  auto* sub = app.add_subcommand("info", "print the resolved config and the model's parameter counts");
  struct State {
    ModelConfig model;
    TaskConfig task;
    TrainConfig train;
    std::string config;
  };
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
    auto task = make_task(st->task);
    fmt::print("{}", resolved_config(*sub, st->model, st->task, st->train));
    torch::manual_seed(st->train.seed);
    LanguageModel model(st->model);
    // Parameter counts per component: embedding, each layer's mixer parts, norms.
    std::map<std::string, int64_t> groups;
    int64_t total = 0;
    for (auto& [name, p] : model.state_tensors()) {
      std::string key = name;
      auto mix = key.find(".mixer.");
      if (mix != std::string::npos) {
        auto rest = key.substr(mix + 7);
        key = "mixer." + rest.substr(0, rest.find('.'));  // e.g. mixer.in_proj, summed over layers
      }
      groups[key] += p.numel();
      total += p.numel();
    }
    fmt::print("# task {}: max length {} tokens, ids < {}\n", task->name(), task->max_length(), task->min_vocab());
    fmt::print("# parameters (summed over the {} layers)\n", st->model.n_layers);
    for (auto& [k, n] : groups) fmt::print("#   {:<40} {:>12}\n", k, n);
    fmt::print("#   {:<40} {:>12}\n", "total", total);
    return kExitOk;
  };
  return c;
}

}  // namespace hax::cli
