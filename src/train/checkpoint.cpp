#include "train/checkpoint.h"

#include "core/error.h"
#include "ops/check.h"

namespace hax {

void save_checkpoint(const std::string& path, LanguageModel& model, const AdamW* optimizer, const CheckpointMeta& m,
                     const std::map<std::string, std::string>& extra) {
  std::map<std::string, at::Tensor> tensors = model.state_tensors();
  if (optimizer)
    for (auto& [k, v] : optimizer->state_tensors()) tensors[k] = v;
  std::map<std::string, std::string> meta = {
      {"format", kCheckpointFormat},
      {"step", std::to_string(m.step)},
      {"best_valid_acc", nlohmann::json(m.best_valid_acc).dump()},
      {"best_step", std::to_string(m.best_step)},
      {"model_config", m.model.to_json().dump()},
      {"task_config", task_config_to_json(m.task).dump()},
      {"train_config", m.train.to_json().dump()},
      {"config", m.config_text},
      {"has_optimizer", optimizer ? "1" : "0"},
  };
  for (auto& [k, v] : extra) meta[k] = v;
  save_safetensors(path, tensors, meta);
}

Checkpoint read_checkpoint(const std::string& path) {
  Checkpoint c;
  c.file = load_safetensors(path, "checkpoint");
  auto& md = c.file.metadata;
  auto need = [&](const char* key) -> const std::string& {
    auto it = md.find(key);
    HAX_CHECK(it != md.end(), "checkpoint {} is not a hax checkpoint: its metadata has no \"{}\"", path, key);
    return it->second;
  };
  HAX_CHECK(need("format") == kCheckpointFormat, "checkpoint {} has format {} but this hax reads {}", path,
            need("format"), kCheckpointFormat);
  try {
    c.meta.step = std::stoll(need("step"));
    c.meta.best_valid_acc = nlohmann::json::parse(need("best_valid_acc")).get<double>();
    c.meta.best_step = std::stoll(need("best_step"));
    c.meta.model = model_config_from_json(nlohmann::json::parse(need("model_config")));
    c.meta.task = task_config_from_json(nlohmann::json::parse(need("task_config")));
    c.meta.config_text = need("config");
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    fail("checkpoint {} is corrupt: its metadata cannot be read ({})", path, e.what());
  }
  c.has_optimizer = md.count("has_optimizer") && md.at("has_optimizer") == "1";
  return c;
}

void load_weights(LanguageModel& model, const Checkpoint& ckpt, const std::string& path) {
  torch::NoGradGuard ng;
  for (auto& [name, p] : model.state_tensors()) {
    auto it = ckpt.file.tensors.find(name);
    HAX_CHECK(it != ckpt.file.tensors.end(), "checkpoint {} has no tensor {} that the model needs", path, name);
    HAX_CHECK(it->second.sizes() == p.sizes(),
              "checkpoint {}: tensor {} has shape {} but the configured model needs {} (the config does not match "
              "the checkpoint)",
              path, name, ops::shape_str(it->second.sizes()), ops::shape_str(p.sizes()));
    HAX_CHECK(at::isFloatingType(it->second.scalar_type()), "checkpoint {}: tensor {} has non-float dtype {}", path,
              name, c10::toString(it->second.scalar_type()));
    p.copy_(it->second);
  }
}

}  // namespace hax
