// The training loop: AdamW, warmup + constant/cosine schedule, gradient clipping, masked
// cross-entropy, periodic validation with a best-validation checkpoint, final test accuracy.
//
// Run directory layout:
//   config.toml                  the resolved configuration
//   metrics.jsonl                one JSON object per line: "train", "valid" and "test" events
//   checkpoints/last.safetensors model + optimizer + progress (what --resume continues from)
//   checkpoints/best.safetensors model at the best validation accuracy
//   summary.json                 the final numbers
//
// Everything a step does is a pure function of (seed, step) and the saved state, so a resumed
// run reproduces the loss curve of an uninterrupted one exactly.
#pragma once
#include <stdexcept>
#include <string>

#include "models/model_config.h"
#include "tasks/task_config.h"
#include "train/train_config.h"

namespace hax {

struct RunConfig {
  ModelConfig model;
  TaskConfig task;
  TrainConfig train;
  std::string config_text;  // resolved config file text, written to config.toml
};

struct TrainSummary {
  int64_t steps_done = 0;
  double best_valid_acc = -1;
  int64_t best_step = -1;
  double test_acc = -1;       // -1 when the run was interrupted before testing
  double test_loss = 0;
  double seconds = 0;
  bool interrupted = false;   // stopped by Ctrl-C / SIGTERM after writing a checkpoint
  int64_t graph_replays = 0;  // steps run from a CUDA graph (--cuda-graphs), this session
  int64_t graph_captures = 0; // graphs captured (one per growth of the padded shape)
  std::string graphs_off;     // why CUDA graphs did not run or stopped, if they did not
  std::string run_dir;
};

// The loss became NaN or Inf: training stopped, the last good checkpoint was kept.
class NonFiniteLoss : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

TrainSummary train(const RunConfig& run);

// Paths inside a run directory.
std::string last_checkpoint_path(const std::string& run_dir);
std::string best_checkpoint_path(const std::string& run_dir);

}  // namespace hax
