// A torch::nn::Linear applied through hax's own linear op (ops/linear), which is faster than
// LibTorch's CPU path here and deterministic; the module only holds the parameters.
#pragma once
#include <torch/torch.h>

#include "ops/linear/linear.h"

namespace hax {

// x (..., in) -> (..., out)
inline at::Tensor project(const torch::nn::Linear& l, const at::Tensor& x) {
  return ops::linear(x, l->weight, l->bias);
}

// relu(project(l, x)), fused on the CPU.
inline at::Tensor project_relu(const torch::nn::Linear& l, const at::Tensor& x) {
  return ops::linear_relu(x, l->weight, l->bias);
}

}  // namespace hax
