// hax info: the resolved configuration and the model's parameter counts.
#include <fmt/format.h>

#include <map>

#include "commands.h"
#include "options.h"
#include "models/lm.h"
#include "tasks/registry.h"

namespace hax::cli {

Command add_info_command(CLI::App& app) {
  auto* sub = app.add_subcommand("info", "print the resolved config and the model's parameter counts");
  auto st = add_run_options(sub);
  Command c;
  c.app = sub;
  c.embedded_default = true;
  c.run = [sub, st]() {
    st->validate();
    auto task = make_task(st->task);
    fmt::print("{}", resolved_config(*sub, *st));
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
