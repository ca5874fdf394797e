// A torch::nn::Linear applied through hax's own linear op (ops/linear), which is faster than
// LibTorch's CPU path here and deterministic; the module only holds the parameters.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "ops/linear/linear.h"

namespace hax {

// x (..., in) -> (..., out)
inline at::Tensor project(const torch::nn::Linear& l, const at::Tensor& x) {
  return ops::linear(x, l->weight, l->bias);
}

// x split along its last dim into consecutive parts of the given sizes (views). Unlike one narrow
// per part, whose backward zero-fills a whole-size gradient per part and adds them up, the parts'
// gradients are joined by one concatenation.
inline std::vector<at::Tensor> split_last(const at::Tensor& x, std::vector<int64_t> sizes) {
  return at::split_with_sizes(x, sizes, -1);
}

// relu(project(l, x)), fused on the CPU.
inline at::Tensor project_relu(const torch::nn::Linear& l, const at::Tensor& x) {
  return ops::linear_relu(x, l->weight, l->bias);
}

}  // namespace hax
