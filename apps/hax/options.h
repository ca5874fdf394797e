// Binds the config structs to command-line options. Option names are the struct field names
// with '-' for '_' (so config files may use either).
#pragma once
#include <CLI/CLI.hpp>

#include "models/model_config.h"
#include "tasks/task_config.h"
#include "train/train_config.h"

namespace hax::cli {

void add_model_options(CLI::App* app, ModelConfig* m);
void add_task_options(CLI::App* app, TaskConfig* t);
void add_train_options(CLI::App* app, TrainConfig* t);
// --threads only (for commands that do not train).
void add_threads_option(CLI::App* app, int* threads);

// Registers --config (handled before parsing, see main.cpp).
void add_config_option(CLI::App* app, std::string* path);

// Everything a training run is configured by, as `hax train` and `hax info` take it.
struct RunOptions {
  ModelConfig model;
  TaskConfig task;
  TrainConfig train;
  std::string config;  // --config path (already applied by main.cpp)
  void validate() const;
};
// Adds --config and the model, task and training options to `app`.
std::shared_ptr<RunOptions> add_run_options(CLI::App* app);

// The resolved configuration as a config file (sections [model], [task], [train]) that --config
// reads back; comments come from the options' descriptions in `app`.
std::string resolved_config(const CLI::App& app, const RunOptions& run);

}  // namespace hax::cli
