#include "layers/mixer.h"

#include <cmath>

namespace hax {

at::Tensor init_dt_bias(int64_t n, double dt_min, double dt_max, double floor) {
  at::Tensor dt = at::exp(at::rand({n}) * (std::log(dt_max) - std::log(dt_min)) + std::log(dt_min));
  dt = at::clamp_min(dt, floor);
  return dt + at::log(-at::expm1(-dt));  // inverse of softplus
}

void init_conv(at::Tensor& weight, at::Tensor& bias, int64_t width) {
  const double bound = 1.0 / std::sqrt((double)width);
  torch::NoGradGuard ng;
  weight.uniform_(-bound, bound);
  bias.uniform_(-bound, bound);
}

}  // namespace hax
