#include "config_file.h"
#include "options.h"

namespace hax::cli {
namespace {

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

}  // namespace

void RunOptions::validate() const {
  model.validate();
  task.validate();
  train.validate();
}

std::shared_ptr<RunOptions> add_run_options(CLI::App* app) {
  auto run = std::make_shared<RunOptions>();
  add_config_option(app, &run->config);
  add_model_options(app, &run->model);
  add_task_options(app, &run->task);
  add_train_options(app, &run->train);
  return run;
}

std::string resolved_config(const CLI::App& app, const RunOptions& run) {
  return "# hax resolved configuration (read back with --config)\n\n" +
         config_text({{"model", run.model.to_json()}, {"task", task_options_json(run.task)},
                      {"train", run.train.to_json()}},
                     app);
}

}  // namespace hax::cli
