#include "train/run_config_text.h"

#include <nlohmann/json.hpp>

namespace hax {
namespace {

// The task section under its option names (--task, --mqar-vocab).
nlohmann::ordered_json task_options_json(const TaskConfig& t) {
  nlohmann::json j = task_config_to_json(t);
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  out["task"] = j["name"];
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "name") continue;
    out[it.key() == "vocab_size" ? "mqar_vocab" : it.key()] = it.value();
  }
  return out;
}

}  // namespace

std::string run_config_text(const ModelConfig& model, const TaskConfig& task, const TrainConfig& train,
                            const std::function<std::string(const std::string& key)>& comment) {
  std::string out = "# hax resolved configuration (read back with --config)\n\n";
  for (const auto& [section, obj] : std::vector<std::pair<std::string, nlohmann::ordered_json>>{
           {"model", model.to_json()}, {"task", task_options_json(task)}, {"train", train.to_json()}}) {
    out += "[" + section + "]\n";
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      const std::string c = comment ? comment(it.key()) : "";
      if (!c.empty()) out += "# " + c + "\n";
      const auto& v = it.value();
      std::string val;
      if (v.is_array()) {
        val = "[";
        for (size_t i = 0; i < v.size(); ++i) val += (i ? ", " : "") + v[i].dump();
        val += "]";
      } else {
        val = v.dump();
      }
      out += it.key() + " = " + val + "\n";
    }
    out += "\n";
  }
  return out;
}

}  // namespace hax
