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

}  // namespace hax::cli
