// AdamW (decoupled weight decay), exactly PyTorch's update rule, with its state exposed as named
// tensors so that checkpoints (safetensors) hold it and a resumed run continues bit for bit.
#pragma once
#include <torch/torch.h>

#include <map>
#include <string>

namespace hax {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
};

class AdamW {
 public:
  AdamW(std::map<std::string, at::Tensor> params, AdamWOptions opts);
  // One update with learning rate lr from the parameters' .grad (missing grads count as zero).
  void step(double lr);
  void zero_grad();
  int64_t steps_taken() const { return t_; }
  // "optim.exp_avg.<param>", "optim.exp_avg_sq.<param>" tensors, and the step count.
  std::map<std::string, at::Tensor> state_tensors() const;
  // Restores from state_tensors(); throws UsageError naming a missing or mis-shaped entry.
  void load_state(const std::map<std::string, at::Tensor>& tensors, int64_t steps, const std::string& what);

 private:
  std::map<std::string, at::Tensor> params_, m_, v_;
  AdamWOptions o_;
  int64_t t_ = 0;
};

// Scales gradients so that their global L2 norm is at most max_norm (if max_norm > 0), as
// torch.nn.utils.clip_grad_norm_; returns the norm before clipping.
double clip_grad_norm(const std::map<std::string, at::Tensor>& params, double max_norm);

}  // namespace hax
