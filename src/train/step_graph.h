// Training steps on a CUDA device replayed from captured CUDA graphs, so that a small model's
// step costs a handful of launches instead of a thousand (the host, not the GPU, bounds an eager
// step of the paper's joint-recall models).
//
// A graph needs fixed shapes and fixed addresses, so each step's batch is padded (pad_batch) to
// capacities: the most rows seen so far, the most positions per row (rounded up to 8) and the
// most supervised positions plus an eighth. The padding changes neither the loss nor the gradients (every model is causal
// within a row and independent across rows; padding rows are left out of the ranking loss). A
// batch that does not fit grows the capacities and the step is captured again. The batch and the
// host-made inputs (LSH projections, ranking-loss candidates: layers/host_inputs.h) are copied
// into the graph's buffers before each replay, and the learning rate into a device scalar that the
// fused AdamW reads. The first two steps run eagerly (lazy initialization must not happen inside
// a capture). A step the graph cannot take (a host input changed shape) returns no metrics and
// the caller runs it eagerly; a model whose step cannot be captured at all (it reads a device
// value on the host) turns graphs off with the reason. Graphs pay off where launches bound the
// step (small models and batches); where the GPU does, the padding makes them slower, which is
// why the adaptive mode (the trainer's --cuda-graphs auto) times both kinds of step and chooses.
#pragma once
#include <torch/torch.h>

#include <array>
#include <map>
#include <memory>
#include <string>

#include "models/lm.h"
#include "tasks/batch.h"
#include "train/adamw.h"
#include "train/train_step.h"

namespace hax {

// Whether steps of this optimizer on this device can run as CUDA graphs; if not, *why says so.
bool step_graphs_possible(const AdamW& opt, const at::Device& device, bool deterministic, std::string* why);

class StepGraph {
 public:
  // adaptive: after the two warm-up steps, time four eager steps and four replays, and keep the
  // graphs only when the replays are faster (else disabled(), with the times as the reason).
  StepGraph(LanguageModel& model, AdamW& opt, std::map<std::string, at::Tensor> params, StepSettings settings,
            bool adaptive = false, int32_t pad_id = 3);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // One step on `batch` (from make_batch, on the CPU) with the given seed and learning rate;
  // `variant` changes whenever the model's own state changes the step (the sliding-window
  // warm-up's window). Returns the metrics of device_train_step in a tensor of their own, or an
  // undefined tensor when the caller must run this step eagerly.
  at::Tensor run(const Batch& batch, uint64_t seed, double lr, int64_t variant);

  // The padded shape of the steps: rows, positions per row, supervised positions (0 before any).
  std::array<int64_t, 3> capacity() const;
  int64_t captures() const { return captures_; }  // graphs captured (one per capacity change)
  int64_t replays() const { return replays_; }    // steps run from a graph
  int64_t eager() const { return eager_; }        // steps run eagerly here (warm-up, timing)
  bool disabled() const { return !disabled_reason_.empty(); }
  const std::string& disabled_reason() const { return disabled_reason_; }  // why graphs stopped, if they did

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t captures_ = 0, replays_ = 0, eager_ = 0;
  std::string disabled_reason_;
};

}  // namespace hax
