// The naive selective-scan recurrence, one LibTorch step per position (test oracle, baseline).
#include <torch/torch.h>

#include "ops/selective_scan/selective_scan.h"

namespace hax::ops {

std::tuple<at::Tensor, at::Tensor> selective_scan_reference(const at::Tensor& x, const at::Tensor& delta,
                                                            const at::Tensor& A, const at::Tensor& Bm,
                                                            const at::Tensor& Cm, const at::Tensor& init_state,
                                                            const at::Tensor& seq_idx) {
  const int64_t Bsz = x.size(0), L = x.size(1), D = x.size(2);
  const int64_t G = Bm.size(2), N = Bm.size(3);
  at::Tensor Bd = Bm.repeat_interleave(D / G, 2);  // (B, L, D, N)
  at::Tensor Cd = Cm.repeat_interleave(D / G, 2);
  at::Tensor h = init_state.defined() ? init_state : at::zeros({Bsz, D, N}, x.options());
  std::vector<at::Tensor> ys;
  for (int64_t t = 0; t < L; ++t) {
    if (seq_idx.defined() && t > 0) {
      at::Tensor same = (seq_idx.select(1, t) == seq_idx.select(1, t - 1)).to(x.scalar_type());
      h = h * same.view({Bsz, 1, 1});
    }
    at::Tensor d = delta.select(1, t).unsqueeze(-1);                    // (B, D, 1)
    at::Tensor xd = d * x.select(1, t).unsqueeze(-1);                   // (B, D, 1)
    h = at::exp(d * A) * h + xd * Bd.select(1, t);                      // (B, D, N)
    ys.push_back((h * Cd.select(1, t)).sum(-1));                        // (B, D)
  }
  at::Tensor y = L > 0 ? at::stack(ys, 1) : at::zeros({Bsz, 0, D}, x.options());
  return {y, h};
}

}  // namespace hax::ops
