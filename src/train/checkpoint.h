// Checkpoints: one safetensors file holding the model's weights under their mamba_ssm names,
// optionally the optimizer state ("optim.*"), and metadata (format, step, best validation
// accuracy, the model/task/train configs as JSON and the resolved config text). Written
// atomically. A checkpoint is self-contained: `hax eval` rebuilds the model from it.
#pragma once
#include <string>

#include "core/safetensors.h"
#include "models/lm.h"
#include "tasks/task_config.h"
#include "train/adamw.h"
#include "train/train_config.h"

namespace hax {

inline constexpr const char* kCheckpointFormat = "hax-checkpoint-1";

struct CheckpointMeta {
  int64_t step = 0;              // optimizer steps completed
  double best_valid_acc = -1;    // best validation accuracy so far (-1: none yet)
  int64_t best_step = -1;        // step of that validation
  ModelConfig model;
  TaskConfig task;
  TrainConfig train;
  std::string config_text;       // the resolved config file of the run
};

// Writes model (+ optimizer if given) and metadata atomically to `path`.
// `extra` adds metadata entries (e.g. the trainer's logging window).
void save_checkpoint(const std::string& path, LanguageModel& model, const AdamW* optimizer, const CheckpointMeta& meta,
                     const std::map<std::string, std::string>& extra = {});

struct Checkpoint {
  SafetensorsFile file;
  CheckpointMeta meta;
  bool has_optimizer = false;
};

// Reads and validates a checkpoint; every problem (missing, corrupt, not a hax checkpoint) is a
// UsageError naming the path.
Checkpoint read_checkpoint(const std::string& path);

// Copies the checkpoint's weights into `model`; a missing tensor or a shape that differs from
// the model's config is a UsageError naming the tensor, both shapes and the path.
void load_weights(LanguageModel& model, const Checkpoint& ckpt, const std::string& path);

}  // namespace hax
