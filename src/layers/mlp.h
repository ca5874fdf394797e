// SwiGLU MLP: w2(silu(w1 x) * w3 x), as the MLP of Samba's blocks.
#pragma once
#include <torch/torch.h>

namespace hax {

class SwiGluMlp : public torch::nn::Module {
 public:
  SwiGluMlp(int64_t d_model, int64_t hidden, int64_t n_layers);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear w1{nullptr}, w3{nullptr}, w2{nullptr};
};

}  // namespace hax
