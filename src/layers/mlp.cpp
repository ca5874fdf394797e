#include "layers/mlp.h"
#include "layers/project.h"

#include <cmath>

namespace hax {

SwiGluMlp::SwiGluMlp(int64_t d, int64_t hidden, int64_t n_layers) {
  using torch::nn::Linear;
  using torch::nn::LinearOptions;
  w1 = register_module("w1", Linear(LinearOptions(d, hidden).bias(false)));
  w3 = register_module("w3", Linear(LinearOptions(d, hidden).bias(false)));
  w2 = register_module("w2", Linear(LinearOptions(hidden, d).bias(false)));
  torch::NoGradGuard ng;
  w2->weight.div_(std::sqrt((double)n_layers));
}

at::Tensor SwiGluMlp::forward(const at::Tensor& x) {
  return project(w2, at::silu(project(w1, x)) * project(w3, x));
}

}  // namespace hax
