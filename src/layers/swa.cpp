#include "layers/swa.h"
#include "layers/project.h"

#include <cmath>

#include "layers/rope.h"
#include "ops/attention/attention.h"
#include "ops/causal_attention/causal_attention.h"

namespace hax {

SlidingWindowAttention::SlidingWindowAttention(const ModelConfig& c)
    : d_(c.d_model), H_(c.swa_heads), Dh_(c.d_model / c.swa_heads), window_(c.swa_window), theta_(c.rope_theta) {
  using torch::nn::Linear;
  using torch::nn::LinearOptions;
  q_proj = register_module("q_proj", Linear(LinearOptions(d_, d_).bias(false)));
  k_proj = register_module("k_proj", Linear(LinearOptions(d_, d_).bias(false)));
  v_proj = register_module("v_proj", Linear(LinearOptions(d_, d_).bias(false)));
  o_proj = register_module("o_proj", Linear(LinearOptions(d_, d_).bias(false)));
  torch::NoGradGuard ng;
  o_proj->weight.div_(std::sqrt((double)c.n_layers));
}

at::Tensor SlidingWindowAttention::forward(const at::Tensor& x, const at::Tensor& seq_idx, MixerState*,
                                           ForwardContext*) {
  const int64_t B = x.size(0), L = x.size(1);
  at::Tensor pos = positions_in_sequence(B, L, seq_idx, x.device());
  at::Tensor q = apply_rope(project(q_proj, x).view({B, L, H_, Dh_}), pos, theta_);
  at::Tensor k = apply_rope(project(k_proj, x).view({B, L, H_, Dh_}), pos, theta_);
  at::Tensor v = project(v_proj, x).view({B, L, H_, Dh_});
  at::Tensor o = std::get<0>(ops::causal_attention(q, k, v, seq_idx, window_, 1.0 / std::sqrt((double)Dh_)));
  return project(o_proj, o.reshape({B, L, d_}));
}

MixerState SlidingWindowAttention::zero_state(int64_t, const at::TensorOptions&) const { return {}; }

at::Tensor SlidingWindowAttention::step(const at::Tensor& x, MixerState& st, const ForwardContext*) {
  const int64_t B = x.size(0), t = st.pos;
  at::Tensor pos = at::full({B, 1}, t, at::TensorOptions().dtype(at::kLong).device(x.device()));
  at::Tensor q = apply_rope(project(q_proj, x).view({B, 1, H_, Dh_}), pos, theta_);
  at::Tensor k = apply_rope(project(k_proj, x).view({B, 1, H_, Dh_}), pos, theta_);
  at::Tensor v = project(v_proj, x).view({B, 1, H_, Dh_});
  // Keep only the window's keys: the cache holds positions t - n + 1 .. t.
  st.keys = st.keys.defined() ? at::cat({st.keys, k.detach()}, 1) : k.detach();
  st.values = st.values.defined() ? at::cat({st.values, v.detach()}, 1) : v.detach();
  if (st.keys.size(1) > window_) {
    st.keys = st.keys.narrow(1, st.keys.size(1) - window_, window_).contiguous();
    st.values = st.values.narrow(1, st.values.size(1) - window_, window_).contiguous();
  }
  const int64_t n = st.keys.size(1);
  at::Tensor idx = at::arange(n, at::TensorOptions().dtype(at::kInt)).view({1, 1, 1, n}).expand({B, H_, 1, n});
  at::Tensor o = std::get<0>(
      ops::sparse_attention(q, st.keys, st.values, idx.contiguous(), {}, {}, {}, 1.0 / std::sqrt((double)Dh_)));
  st.pos += 1;
  return project(o_proj, o.reshape({B, d_}));
}

}  // namespace hax
