// The decoding steps written with LibTorch ops, as the Mamba and Mamba-2 layers used to do them
// (test oracles).
#include <torch/torch.h>

#include "ops/ssm_step/ssm_step.h"

namespace hax::ops {

at::Tensor conv1d_step_reference(const at::Tensor& x, const at::Tensor& conv_state, const at::Tensor& weight,
                                 const at::Tensor& bias, bool silu) {
  const int64_t W = weight.size(1);
  at::Tensor window = at::cat({conv_state.to(x.scalar_type()), x.unsqueeze(1)}, 1);  // (B, W, C)
  at::Tensor pre = (window * weight.t().unsqueeze(0)).sum(1);
  if (bias.defined()) pre = pre + bias;
  conv_state.copy_(window.narrow(1, 1, W - 1));
  return silu ? at::silu(pre) : pre;
}

at::Tensor ssd_step_reference(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                              const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias, bool dt_softplus,
                              const at::Tensor& state) {
  const int64_t Bsz = x.size(0), H = x.size(1), G = B.size(1);
  at::Tensor dtv = dt_bias.defined() ? dt + dt_bias : dt;
  if (dt_softplus) dtv = at::softplus(dtv);                           // (B, H)
  at::Tensor Bh = B.unsqueeze(2).repeat_interleave(H / G, 1);        // (B, H, 1, N)
  at::Tensor Ch = C.unsqueeze(2).repeat_interleave(H / G, 1);
  at::Tensor decay = at::exp(dtv * A).view({Bsz, H, 1, 1});
  at::Tensor s = state.to(x.scalar_type()) * decay + (dtv.unsqueeze(-1) * x).unsqueeze(-1) * Bh;  // (B, H, P, N)
  at::Tensor y = (s * Ch).sum(-1);
  if (D.defined()) y = y + x * D.view({1, H, 1});
  state.copy_(s);
  return y;
}

at::Tensor selective_scan_step_reference(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& A,
                                         const at::Tensor& B, const at::Tensor& C, const at::Tensor& D,
                                         const at::Tensor& delta_bias, bool delta_softplus, const at::Tensor& state) {
  const int64_t Dm = x.size(1), G = B.size(1);
  at::Tensor dl = delta_bias.defined() ? delta + delta_bias : delta;
  if (delta_softplus) dl = at::softplus(dl);                          // (B, D)
  at::Tensor Bd = B.repeat_interleave(Dm / G, 1);                    // (B, D, N)
  at::Tensor Cd = C.repeat_interleave(Dm / G, 1);
  at::Tensor decay = at::exp(dl.unsqueeze(-1) * A);                  // (B, D, N)
  at::Tensor s = state.to(x.scalar_type()) * decay + (dl * x).unsqueeze(-1) * Bd;
  at::Tensor y = (s * Cd).sum(-1);
  if (D.defined()) y = y + x * D;
  state.copy_(s);
  return y;
}

}  // namespace hax::ops
