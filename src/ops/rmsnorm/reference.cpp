// The (gated) RMSNorm written with LibTorch ops (test oracle).
#include <torch/torch.h>

#include "ops/rmsnorm/rmsnorm.h"

namespace hax::ops {

at::Tensor rmsnorm_reference(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps,
                             int64_t group_size) {
  const int64_t D = x.size(-1), gs = group_size == 0 ? D : group_size;
  at::Tensor u = z.defined() ? x * (z * at::sigmoid(z)) : x;
  std::vector<int64_t> grouped = x.sizes().vec();
  grouped.back() = D / gs;
  grouped.push_back(gs);
  at::Tensor ug = u.reshape(grouped);  // (..., D / gs, gs)
  at::Tensor n = ug * at::rsqrt(ug.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return n.reshape(x.sizes()) * weight;
}

}  // namespace hax::ops
