#include "layers/attention_layer.h"

#include <cmath>

#include "layers/project.h"
#include "layers/rope.h"
#include "ops/attention/attention.h"
#include "ops/causal_attention/causal_attention.h"
#include "patterns/pattern.h"

namespace hax {
namespace {

torch::nn::Linear square(int64_t d) { return torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)); }

at::Tensor append(const at::Tensor& cache, const at::Tensor& x) { return cache.defined() ? at::cat({cache, x}, 1) : x; }

}  // namespace

AttentionLayer::AttentionLayer(const ModelConfig& c, const std::string& kind)
    : kind_(kind), d_(c.d_model), H_(c.swa_heads), Dh_(c.d_model / c.swa_heads), window_(c.swa_window),
      keys_(c.sparse_keys), theta_(c.rope_theta), scale_(1.0 / std::sqrt((double)(c.d_model / c.swa_heads))) {
  q_proj = register_module("q_proj", square(d_));
  k_proj = register_module("k_proj", square(d_));
  v_proj = register_module("v_proj", square(d_));
  o_proj = register_module("o_proj", square(d_));
  torch::NoGradGuard ng;
  o_proj->weight.div_(std::sqrt((double)c.n_layers));
  if (kind_ == "swa+hsa") {
    hq_proj = register_module("hq_proj", square(d_));
    hk_proj = register_module("hk_proj", square(d_));
    hv_proj = register_module("hv_proj", square(d_));
    ho_proj = register_module("ho_proj", square(d_));
    ho_proj->weight.div_(std::sqrt((double)c.n_layers));
    hsa = register_module("hsa", std::make_shared<HierarchicalSparseAttention>(d_, c.hsa_dim_for(d_), c.hsa_chunk,
                                                                                 c.hsa_topk, c.hsa_landmark));
  }
  if (kind_ == "dma") dma = register_module("dma", std::make_shared<DynamicMaskWeights>(d_, H_));
}

at::Tensor AttentionLayer::hsa_forward(const at::Tensor& x, const at::Tensor& seq_idx) {
  const int64_t B = x.size(0), L = x.size(1);
  at::Tensor q = project(hq_proj, x).view({B, L, H_, Dh_}), k = project(hk_proj, x).view({B, L, H_, Dh_});
  at::Tensor v = project(hv_proj, x).view({B, L, H_, Dh_});
  return project(ho_proj, hsa->forward(x, q, k, v, seq_idx, scale_).reshape({B, L, d_}));
}

at::Tensor AttentionLayer::forward(const at::Tensor& x, const at::Tensor& seq_idx, MixerState*, ForwardContext*) {
  const int64_t B = x.size(0), L = x.size(1);
  at::Tensor pos = positions_in_sequence(B, L, seq_idx, x.device());
  at::Tensor q = apply_rope(project(q_proj, x).view({B, L, H_, Dh_}), pos, theta_);
  at::Tensor k = apply_rope(project(k_proj, x).view({B, L, H_, Dh_}), pos, theta_);
  at::Tensor v = project(v_proj, x).view({B, L, H_, Dh_});
  at::Tensor o;
  if (kind_ == "dma") {
    o = dma_attention(q, k, v, dma->forward(v.reshape({B, L, d_})), keys_, seq_idx, scale_);
  } else {
    o = std::get<0>(ops::causal_attention(q, k, v, seq_idx, kind_ == "full" ? 0 : window_, scale_));
  }
  at::Tensor out = project(o_proj, o.reshape({B, L, d_}));
  if (hsa) out = out + hsa_forward(x, seq_idx);
  return out;
}

MixerState AttentionLayer::zero_state(int64_t, const at::TensorOptions&) const { return {}; }

at::Tensor AttentionLayer::step(const at::Tensor& x, MixerState& st, const ForwardContext*) {
  const int64_t B = x.size(0), t = st.pos;
  const auto i32 = at::TensorOptions().dtype(at::kInt).device(x.device());
  at::Tensor pos = at::full({B, 1}, t, at::TensorOptions().dtype(at::kLong).device(x.device()));
  at::Tensor q = apply_rope(project(q_proj, x).view({B, 1, H_, Dh_}), pos, theta_);
  at::Tensor k = apply_rope(project(k_proj, x).view({B, 1, H_, Dh_}), pos, theta_);
  at::Tensor v = project(v_proj, x).view({B, 1, H_, Dh_});
  st.keys = append(st.keys, k.detach());
  st.values = append(st.values, v.detach());
  at::Tensor idx, bias;
  if (kind_ == "dma") {
    st.key_scores = append(st.key_scores, dma->forward(v.reshape({B, 1, d_})).detach());  // δ of the new key
    idx = patterns::top_k_prefix(st.key_scores, keys_, {}).idx.narrow(2, t, 1).contiguous();
    bias = st.key_scores.permute({0, 2, 1}).contiguous();
  } else {
    // The sliding window keeps only its keys: the cache holds positions t - n + 1 .. t.
    if (kind_ != "full" && st.keys.size(1) > window_) {
      st.keys = st.keys.narrow(1, st.keys.size(1) - window_, window_).contiguous();
      st.values = st.values.narrow(1, st.values.size(1) - window_, window_).contiguous();
    }
    const int64_t n = st.keys.size(1);
    idx = at::arange(n, i32).view({1, 1, 1, n}).expand({B, H_, 1, n}).contiguous();
  }
  at::Tensor o = std::get<0>(ops::sparse_attention(q, st.keys, st.values, idx, bias, {}, {}, scale_));
  at::Tensor out = project(o_proj, o.reshape({B, d_}));
  if (hsa) {
    at::Tensor hq = project(hq_proj, x).view({B, 1, H_, Dh_});
    st.aux_keys = append(st.aux_keys, project(hk_proj, x).view({B, 1, H_, Dh_}).detach());
    st.aux_values = append(st.aux_values, project(hv_proj, x).view({B, 1, H_, Dh_}).detach());
    out = out + project(ho_proj, hsa->step(x, hq, st.aux_keys, st.aux_values, st, scale_).reshape({B, d_}));
  }
  st.pos += 1;
  return out;
}

}  // namespace hax
