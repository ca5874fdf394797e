// The naive sequential SSD recurrence, one LibTorch step per position (test oracle, baseline).
#include <torch/torch.h>

#include "ops/ssd/ssd.h"

namespace hax::ops {

std::tuple<at::Tensor, at::Tensor> ssd_reference(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                                                 const at::Tensor& Bm, const at::Tensor& Cm,
                                                 const at::Tensor& init_state, const at::Tensor& seq_idx) {
  const int64_t Bsz = x.size(0), L = x.size(1), H = x.size(2), P = x.size(3);
  const int64_t G = Bm.size(2), N = Bm.size(3);
  at::Tensor Bh = Bm.repeat_interleave(H / G, 2);  // (B, L, H, N)
  at::Tensor Ch = Cm.repeat_interleave(H / G, 2);
  at::Tensor h = init_state.defined() ? init_state : at::zeros({Bsz, H, P, N}, x.options());
  std::vector<at::Tensor> ys;
  for (int64_t t = 0; t < L; ++t) {
    if (seq_idx.defined() && t > 0) {
      at::Tensor same = (seq_idx.select(1, t) == seq_idx.select(1, t - 1)).to(x.scalar_type());
      h = h * same.view({Bsz, 1, 1, 1});
    }
    at::Tensor d = dt.select(1, t);                                   // (B, H)
    at::Tensor decay = at::exp(d * A).view({Bsz, H, 1, 1});
    at::Tensor xd = (d.unsqueeze(-1) * x.select(1, t)).unsqueeze(-1);  // (B, H, P, 1)
    h = h * decay + xd * Bh.select(1, t).unsqueeze(2);                // (B, H, P, N)
    ys.push_back((h * Ch.select(1, t).unsqueeze(2)).sum(-1));         // (B, H, P)
  }
  at::Tensor y = L > 0 ? at::stack(ys, 1) : at::zeros({Bsz, 0, H, P}, x.options());
  return {y, h};
}

}  // namespace hax::ops
