#include "layers/rope.h"

namespace hax {

at::Tensor positions_in_sequence(int64_t B, int64_t L, const at::Tensor& seq_idx, const at::Device& device) {
  at::Tensor pos = at::arange(L, at::TensorOptions().dtype(at::kLong).device(device)).expand({B, L});
  if (!seq_idx.defined()) return pos.contiguous();
  at::Tensor s = seq_idx.to(at::kLong).to(device);
  at::Tensor is_start = at::ones({B, L}, s.options().dtype(at::kBool));
  if (L > 1) is_start.narrow(1, 1, L - 1).copy_(s.narrow(1, 1, L - 1) != s.narrow(1, 0, L - 1));
  at::Tensor start = std::get<0>(at::where(is_start, pos, at::zeros_like(pos)).cummax(1));
  return pos - start;
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& positions, double theta) {
  const int64_t D = x.size(-1), half = D / 2;
  at::Tensor inv = at::pow(theta, -at::arange(half, x.options()) * 2.0 / (double)D);       // (D/2)
  at::Tensor ang = positions.to(x.scalar_type()).unsqueeze(-1) * inv;                      // (B, L, D/2)
  at::Tensor cos = ang.cos().unsqueeze(2), sin = ang.sin().unsqueeze(2);                    // (B, L, 1, D/2)
  at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return at::cat({x1 * cos - x2 * sin, x1 * sin + x2 * cos}, -1);
}

}  // namespace hax
