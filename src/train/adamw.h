// AdamW (decoupled weight decay), exactly PyTorch's update rule, with its state exposed as named
// tensors so that checkpoints (safetensors) hold it and a resumed run continues bit for bit.
//
// On the CPU every parameter is updated with the reference arithmetic below. With float32
// parameters on a CUDA device (and LibTorch >= 2.4) one fused multi-tensor kernel updates all of
// them (LibTorch's _fused_adamw_, the same rule in float32), and nothing waits on the device.
#pragma once
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

namespace hax {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  bool fused = true;  // use the fused CUDA kernel when the parameters allow it (see above)
};

// Whether this LibTorch has the fused CUDA optimizer and gradient-norm kernels (>= 2.4).
bool fused_optimizer_built();

class AdamW {
 public:
  AdamW(std::map<std::string, at::Tensor> params, AdamWOptions opts);
  // One update with learning rate lr from the parameters' .grad (missing grads count as zero).
  // skip: optional scalar on the parameters' device; when it is non-zero the update is not applied
  // (a non-finite step, after which the trainer stops). On the fused CUDA path this is decided on
  // the device, without waiting, and the device's step count still advances.
  void step(double lr, const at::Tensor& skip = {});
  // The same update on the fused path with the learning rate read on the device (lr: a float32
  // scalar tensor on the parameters' device), so that a captured CUDA graph replays it with each
  // step's rate. It does not advance steps_taken(): a replayed step calls note_step().
  void step_on_device(const at::Tensor& lr, const at::Tensor& skip);
  void note_step() { ++t_; }
  void zero_grad();
  // Updates applied (on the fused path a step skipped on the device counts too).
  int64_t steps_taken() const { return t_; }
  bool fused() const { return fused_; }
  // "optim.exp_avg.<param>", "optim.exp_avg_sq.<param>" tensors, and the step count.
  std::map<std::string, at::Tensor> state_tensors() const;
  // Restores from state_tensors(); throws UsageError naming a missing or mis-shaped entry.
  void load_state(const std::map<std::string, at::Tensor>& tensors, int64_t steps, const std::string& what);

 private:
  void fused_step(double lr, const at::Tensor& skip);
  void fused_update(double lr, const at::Tensor& lr_t, const at::Tensor& skip);
  std::map<std::string, at::Tensor> params_, m_, v_;
  AdamWOptions o_;
  int64_t t_ = 0;
  bool fused_ = false;
  std::vector<at::Tensor> ps_, ms_, vs_;  // fused path: params_, m_, v_ in the same (name) order
  std::vector<at::Tensor> step_counts_;   // fused path: (1) float32 step count per parameter, on its device
};

// Scales gradients so that their global L2 norm is at most max_norm (if max_norm > 0), as
// torch.nn.utils.clip_grad_norm_; returns the norm before clipping (this waits for the device).
double clip_grad_norm(const std::map<std::string, at::Tensor>& params, double max_norm);

// The same without waiting: returns the norm as a float64 scalar on the gradients' device. On the
// CPU the result equals clip_grad_norm's bit for bit; on CUDA (LibTorch >= 2.4) the norm comes from
// the fused multi-tensor kernels (float32 per-tensor norms) and the scaling is applied on the device.
at::Tensor clip_grad_norm_async(const std::map<std::string, at::Tensor>& params, double max_norm);

}  // namespace hax
