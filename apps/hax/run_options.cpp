#include "train/run_config_text.h"
#include "options.h"

namespace hax::cli {

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
  return run_config_text(run.model, run.task, run.train, [&app](const std::string& key) {
    std::string flag = "--" + key;
    for (auto& ch : flag)
      if (ch == '_') ch = '-';
    const CLI::Option* opt = app.get_option_no_throw(flag);
    return opt ? opt->get_description() : std::string();
  });
}

}  // namespace hax::cli
