// Builds a task from its configuration.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "tasks/task.h"
#include "tasks/task_config.h"

namespace hax {

// Validates `config` (hax::UsageError naming the flag on bad input) and builds its task.
std::unique_ptr<Task> make_task(const TaskConfig& config);

// The names --task accepts: "joint_recall", "multilevel", "mqar", "niah".
std::vector<std::string> task_names();

}  // namespace hax
