#include "layers/mamba2.h"
#include "layers/project.h"

#include <ATen/record_function.h>

#include <cmath>

#include "ops/conv1d/conv1d.h"
#include "ops/rmsnorm/rmsnorm.h"
#include "ops/ssd/ssd.h"
#include "ops/ssm_step/ssm_step.h"

namespace hax {

Mamba2Mixer::Mamba2Mixer(const ModelConfig& c, int64_t layer)
    : d_model_(c.d_model), d_inner_(c.d_inner()), H_(c.nheads()), P_(c.headdim), G_(c.ngroups), N_(c.d_state),
      W_(c.d_conv), chunk_(c.chunk_size), eps_(c.norm_eps), qk_from_xbc_(c.has_sparse() && c.qk_init == "bc") {
  const int64_t d_in_proj = 2 * d_inner_ + 2 * G_ * N_ + H_;
  in_proj = register_module("in_proj", torch::nn::Linear(torch::nn::LinearOptions(d_model_, d_in_proj).bias(false)));
  auto conv = param_group(*this, "conv1d");
  conv_weight = conv->add("weight", at::empty({conv_dim(), 1, W_}));
  conv_bias = conv->add("bias", at::empty({conv_dim()}));
  init_conv(conv_weight, conv_bias, W_);
  dt_bias = register_parameter("dt_bias", init_dt_bias(H_, c.dt_min, c.dt_max, c.dt_init_floor));
  // A ~ U(1, 16) per head, stored as log.
  A_log = register_parameter("A_log", at::log(at::rand({H_}) * 15.0 + 1.0));
  D = register_parameter("D", at::ones({H_}));
  norm_weight = param_group(*this, "norm")->add("weight", at::ones({d_inner_}));
  out_proj = register_module("out_proj", torch::nn::Linear(torch::nn::LinearOptions(d_inner_, d_model_).bias(false)));
  if (c.rescale_prenorm_residual) {
    torch::NoGradGuard ng;
    out_proj->weight.div_(std::sqrt((double)c.n_layers));
  }
  if (c.has_sparse()) {
    sparse = register_module(
        "sparse", std::make_shared<SparseAttentionBranch>(c, qk_from_xbc_ ? conv_dim() : d_inner_, d_inner_, layer));
    if (qk_from_xbc_) {
      // Q and K start as the SSM's C and B: the projection selects those coordinates of xBC
      // ([K; Q] rows; the branch scales K by 1/sqrt(N) like every key).
      torch::NoGradGuard ng;
      at::Tensor w = sparse->qk_proj->weight;  // (2N, conv_dim)
      w.zero_();
      for (int64_t n = 0; n < N_; ++n) {
        w[n][d_inner_ + n] = 1.0;            // K <- B
        w[N_ + n][d_inner_ + N_ + n] = 1.0;  // Q <- C
      }
    }
  }
}

Mamba2Mixer::Projected Mamba2Mixer::project_input(const at::Tensor& x) {
  at::Tensor zxbcdt = project(in_proj, x);
  auto parts = split_last(zxbcdt, {d_inner_, conv_dim(), H_});
  return {parts[0], parts[1], parts[2]};
}

at::Tensor Mamba2Mixer::qk_input(const at::Tensor& xBC, const at::Tensor& xflat) const {
  return qk_from_xbc_ ? xBC : xflat;
}

at::Tensor Mamba2Mixer::forward(const at::Tensor& x, const at::Tensor& seq_idx, MixerState* state,
                                ForwardContext* ctx) {
  RECORD_USER_SCOPE("hax::mamba2_mixer");
  const int64_t B = x.size(0), L = x.size(1);
  Projected pr = project_input(x);
  at::Tensor conv_init = state ? state->conv : at::Tensor();
  auto [xBC, conv_final] =
      ops::causal_conv1d(pr.xBC, conv_weight.view({conv_dim(), W_}), conv_bias, conv_init, seq_idx, /*silu=*/true);
  const auto xbc = split_last(xBC, {d_inner_, G_ * N_, G_ * N_});
  const at::Tensor& xflat = xbc[0];
  at::Tensor xs = xflat.view({B, L, H_, P_});
  at::Tensor Bm = xbc[1].view({B, L, G_, N_});
  at::Tensor Cm = xbc[2].view({B, L, G_, N_});
  at::Tensor dt = at::softplus(pr.dt + dt_bias);
  at::Tensor A = -at::exp(A_log);
  auto [y, ssm_final] = ops::ssd(xs, dt, A, Bm, Cm, state ? state->ssm : at::Tensor(), seq_idx, chunk_);
  y = (y + xs * D.view({1, 1, H_, 1})).reshape({B, L, d_inner_});
  if (sparse) y = y + sparse->forward(qk_input(xBC, xflat), xflat, seq_idx, ctx);
  y = ops::rmsnorm(y, pr.z, norm_weight, eps_, d_inner_ / G_);
  if (state) {
    state->conv = conv_final;
    state->ssm = ssm_final;
  }
  return project(out_proj, y);
}

MixerState Mamba2Mixer::zero_state(int64_t batch, const at::TensorOptions& opts) const {
  MixerState s;
  s.conv = at::zeros({batch, W_ - 1, conv_dim()}, opts);
  s.ssm = at::zeros({batch, H_, P_, N_}, opts);
  return s;
}

at::Tensor Mamba2Mixer::step(const at::Tensor& x, MixerState& st, const ForwardContext* ctx) {
  const int64_t B = x.size(0);
  Projected pr = project_input(x);  // (B, ·)
  // The fused steps update the states in place: contiguous, the conv window in x's dtype, the SSM
  // state in x's dtype or float32.
  const auto dtype = pr.xBC.scalar_type();
  if (!st.conv.is_contiguous() || st.conv.scalar_type() != dtype) st.conv = st.conv.to(dtype).contiguous();
  if (!st.ssm.is_contiguous() || (st.ssm.scalar_type() != dtype && st.ssm.scalar_type() != at::kFloat))
    st.ssm = st.ssm.to(dtype).contiguous();
  // Causal conv + SiLU over the window [last W-1 inputs, this input]; the window rolls.
  at::Tensor xBC = ops::conv1d_step(pr.xBC, st.conv, conv_weight.view({conv_dim(), W_}), conv_bias, /*silu=*/true);
  at::Tensor xflat = xBC.narrow(-1, 0, d_inner_);
  at::Tensor xs = xflat.view({B, H_, P_});
  at::Tensor Bm = xBC.narrow(-1, d_inner_, G_ * N_).view({B, G_, N_});
  at::Tensor Cm = xBC.narrow(-1, d_inner_ + G_ * N_, G_ * N_).view({B, G_, N_});
  // dt = softplus(dt_raw + dt_bias); state = exp(dt A) state + dt x B^T (B, H, P, N); y = state C + D x.
  at::Tensor y = ops::ssd_step(xs, pr.dt, -at::exp(A_log), Bm, Cm, D, dt_bias, /*dt_softplus=*/true, st.ssm)
                     .reshape({B, d_inner_});
  if (sparse) y = y + sparse->step(qk_input(xBC, xflat), xflat, st, ctx);
  y = ops::rmsnorm(y, pr.z, norm_weight, eps_, d_inner_ / G_);
  st.pos += 1;
  return project(out_proj, y);
}

}  // namespace hax
