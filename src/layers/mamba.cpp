#include "layers/mamba.h"
#include "layers/project.h"

#include <cmath>

#include "ops/conv1d/conv1d.h"
#include "ops/selective_scan/selective_scan.h"
#include "ops/ssm_step/ssm_step.h"

namespace hax {

MambaMixer::MambaMixer(const ModelConfig& c, int64_t layer)
    : d_model_(c.d_model), d_inner_(c.d_inner()), N_(c.d_state), W_(c.d_conv), R_(c.dt_rank_resolved()) {
  using torch::nn::Linear;
  using torch::nn::LinearOptions;
  in_proj = register_module("in_proj", Linear(LinearOptions(d_model_, 2 * d_inner_).bias(false)));
  auto conv = param_group(*this, "conv1d");
  conv_weight = conv->add("weight", at::empty({d_inner_, 1, W_}));
  conv_bias = conv->add("bias", at::empty({d_inner_}));
  init_conv(conv_weight, conv_bias, W_);
  x_proj = register_module("x_proj", Linear(LinearOptions(d_inner_, R_ + 2 * N_).bias(false)));
  dt_proj = register_module("dt_proj", Linear(LinearOptions(R_, d_inner_).bias(true)));
  {
    torch::NoGradGuard ng;
    const double s = 1.0 / std::sqrt((double)R_);
    dt_proj->weight.uniform_(-s, s);
    dt_proj->bias.copy_(init_dt_bias(d_inner_, c.dt_min, c.dt_max, c.dt_init_floor));
  }
  // S4D-real initialization: A[d, n] = n + 1.
  A_log = register_parameter("A_log", at::log(at::arange(1, N_ + 1, at::kFloat)).repeat({d_inner_, 1}));
  D = register_parameter("D", at::ones({d_inner_}));
  out_proj = register_module("out_proj", Linear(LinearOptions(d_inner_, d_model_).bias(false)));
  if (c.rescale_prenorm_residual) {
    torch::NoGradGuard ng;
    out_proj->weight.div_(std::sqrt((double)c.n_layers));
  }
  if (c.has_sparse()) {
    sparse = register_module("sparse", std::make_shared<SparseAttentionBranch>(c, d_inner_, d_inner_, layer));
    if (c.qk_init == "bc") {
      // Q and K start as the SSM's C and B: the x_proj rows that produce them ([K; Q] rows).
      torch::NoGradGuard ng;
      sparse->qk_proj->weight.narrow(0, 0, N_).copy_(x_proj->weight.narrow(0, R_, N_));
      sparse->qk_proj->weight.narrow(0, N_, N_).copy_(x_proj->weight.narrow(0, R_ + N_, N_));
    }
  }
}

at::Tensor MambaMixer::forward(const at::Tensor& x, const at::Tensor& seq_idx, MixerState* state,
                               ForwardContext* ctx) {
  const int64_t B = x.size(0), L = x.size(1);
  const auto xz = split_last(project(in_proj, x), {d_inner_, d_inner_});
  const at::Tensor &xin = xz[0], &z = xz[1];
  auto [xc, conv_final] = ops::causal_conv1d(xin, conv_weight.view({d_inner_, W_}), conv_bias,
                                             state ? state->conv : at::Tensor(), seq_idx, /*silu=*/true);
  const auto xdbl = split_last(project(x_proj, xc), {R_, N_, N_});
  at::Tensor delta = at::softplus(project(dt_proj, xdbl[0]));
  at::Tensor Bm = xdbl[1].reshape({B, L, 1, N_});
  at::Tensor Cm = xdbl[2].reshape({B, L, 1, N_});
  auto [y, ssm_final] =
      ops::selective_scan(xc, delta, -at::exp(A_log), Bm, Cm, state ? state->ssm : at::Tensor(), seq_idx);
  y = y + xc * D;
  if (sparse) y = y + sparse->forward(xc, xc, seq_idx, ctx);
  y = y * at::silu(z);
  if (state) {
    state->conv = conv_final;
    state->ssm = ssm_final;
  }
  return project(out_proj, y);
}

MixerState MambaMixer::zero_state(int64_t batch, const at::TensorOptions& opts) const {
  MixerState s;
  s.conv = at::zeros({batch, W_ - 1, d_inner_}, opts);
  s.ssm = at::zeros({batch, d_inner_, N_}, opts);
  return s;
}

at::Tensor MambaMixer::step(const at::Tensor& x, MixerState& st, const ForwardContext* ctx) {
  at::Tensor xz = project(in_proj, x);
  at::Tensor xin = xz.narrow(-1, 0, d_inner_), z = xz.narrow(-1, d_inner_, d_inner_);
  // The fused steps update the states in place: contiguous, the conv window in x's dtype, the SSM
  // state in x's dtype or float32.
  const auto dtype = xin.scalar_type();
  if (!st.conv.is_contiguous() || st.conv.scalar_type() != dtype) st.conv = st.conv.to(dtype).contiguous();
  if (!st.ssm.is_contiguous() || (st.ssm.scalar_type() != dtype && st.ssm.scalar_type() != at::kFloat))
    st.ssm = st.ssm.to(dtype).contiguous();
  // Causal conv + SiLU over the window [last W-1 inputs, this input]; the window rolls.
  at::Tensor xc = ops::conv1d_step(xin, st.conv, conv_weight.view({d_inner_, W_}), conv_bias, /*silu=*/true);
  at::Tensor xdbl = project(x_proj, xc);
  at::Tensor dt = project(dt_proj, xdbl.narrow(-1, 0, R_));  // (B, d_inner), before the softplus
  at::Tensor Bm = xdbl.narrow(-1, R_, N_).unsqueeze(1), Cm = xdbl.narrow(-1, R_ + N_, N_).unsqueeze(1);  // (B, 1, N)
  // delta = softplus(dt); state = exp(delta A) state + delta x B (B, d_inner, N); y = state C + D x.
  at::Tensor y = ops::selective_scan_step(xc, dt, -at::exp(A_log), Bm, Cm, D, at::Tensor(), /*delta_softplus=*/true,
                                          st.ssm);
  if (sparse) y = y + sparse->step(xc, xc, st, ctx);
  st.pos += 1;
  return project(out_proj, y * at::silu(z));
}

}  // namespace hax
