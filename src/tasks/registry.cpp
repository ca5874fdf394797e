#include "tasks/registry.h"

#include "core/error.h"
#include "tasks/joint_recall.h"
#include "tasks/mqar.h"
#include "tasks/niah.h"

namespace hax {

std::unique_ptr<Task> make_task(const TaskConfig& config) {
  config.validate();
  if (config.name == "mqar") return std::make_unique<MqarTask>(config);
  if (config.name == "niah") return std::make_unique<NiahTask>(config);
  return std::make_unique<JointRecallTask>(config);  // joint_recall, multilevel
}

std::vector<std::string> task_names() { return {"joint_recall", "multilevel", "mqar", "niah"}; }

}  // namespace hax
