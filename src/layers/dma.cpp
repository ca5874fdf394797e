#include "layers/dma.h"

#include "layers/project.h"
#include "ops/attention/attention.h"
#include "patterns/pattern.h"

namespace hax {

DynamicMaskWeights::DynamicMaskWeights(int64_t v_dim, int64_t heads) {
  delta = register_module("delta", torch::nn::Linear(torch::nn::LinearOptions(v_dim, heads).bias(false)));
  A = register_parameter("A", at::ones({heads}));
}

at::Tensor DynamicMaskWeights::forward(const at::Tensor& v) { return at::exp(at::softplus(project(delta, v)) * A); }

at::Tensor dma_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& delta,
                         int64_t w, const at::Tensor& seq_idx, double scale) {
  at::Tensor idx;
  {
    torch::NoGradGuard ng;
    idx = patterns::top_k_prefix(delta.detach(), w, seq_idx).idx;  // (B, H, L, w)
  }
  return std::get<0>(ops::sparse_attention(q, k, v, idx, delta.permute({0, 2, 1}).contiguous(), {}, {}, scale));
}

}  // namespace hax
