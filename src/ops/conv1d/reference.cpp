// The causal conv1d written with LibTorch ops: shifted slices of the input padded on the left
// with the initial state, masked where a tap crosses a sequence boundary (test oracle).
#include <torch/torch.h>

#include "ops/conv1d/conv1d.h"

namespace hax::ops {

std::tuple<at::Tensor, at::Tensor> causal_conv1d_reference(const at::Tensor& x, const at::Tensor& weight,
                                                           const at::Tensor& bias, const at::Tensor& init_state,
                                                           const at::Tensor& seq_idx, bool silu) {
  const int64_t Bsz = x.size(0), L = x.size(1), C = x.size(2), W = weight.size(1);
  at::Tensor init = init_state.defined() ? init_state : at::zeros({Bsz, W - 1, C}, x.options());
  at::Tensor padded = at::cat({init, x}, 1);  // (B, W-1+L, C): position s at index s + W-1
  // Sequence number of every padded position; the initial state counts as the first sequence.
  at::Tensor seq_pad;
  if (seq_idx.defined() && L > 0) {
    at::Tensor s = seq_idx.to(at::kLong);
    seq_pad = at::cat({s.narrow(1, 0, 1).expand({Bsz, W - 1}), s}, 1);  // (B, W-1+L)
  }
  at::Tensor pre = bias.defined() ? bias.expand({Bsz, L, C}) : at::zeros({Bsz, L, C}, x.options());
  for (int64_t k = 0; k < W; ++k) {
    at::Tensor tap = padded.narrow(1, k, L) * weight.select(1, k);  // reads s = t - (W-1) + k
    if (seq_pad.defined()) {
      at::Tensor same = (seq_pad.narrow(1, k, L) == seq_idx.to(at::kLong)).to(x.scalar_type());
      tap = tap * same.unsqueeze(-1);
    }
    pre = pre + tap;
  }
  at::Tensor out = silu ? pre * at::sigmoid(pre) : pre;
  // Final state: positions L-(W-1) .. L-1, zero where they precede the last sequence.
  at::Tensor fin = padded.narrow(1, L, W - 1);
  if (seq_pad.defined()) {
    at::Tensor same = (seq_pad.narrow(1, L, W - 1) == seq_idx.to(at::kLong).narrow(1, L - 1, 1)).to(x.scalar_type());
    fin = fin * same.unsqueeze(-1);
  }
  return {out, fin.detach()};
}

}  // namespace hax::ops
