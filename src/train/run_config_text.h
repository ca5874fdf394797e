// The configuration file of a run (config.toml): sections [model], [task], [train] with every
// option under its command-line name (with '_'), as `hax train --config` and `--resume` read it.
#pragma once
#include <functional>
#include <string>

#include "models/model_config.h"
#include "tasks/task_config.h"
#include "train/train_config.h"

namespace hax {

// `comment(key)` may give a one-line description written above each key ("" for none).
std::string run_config_text(const ModelConfig& model, const TaskConfig& task, const TrainConfig& train,
                            const std::function<std::string(const std::string& key)>& comment = {});

}  // namespace hax
