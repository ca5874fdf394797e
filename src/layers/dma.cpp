#include "layers/dma.h"

#include "layers/project.h"
#include "ops/attention/attention.h"
#include "ops/attention/blocks.h"
#include "patterns/pattern.h"

namespace hax {

DynamicMaskWeights::DynamicMaskWeights(int64_t v_dim, int64_t heads) {
  delta = register_module("delta", torch::nn::Linear(torch::nn::LinearOptions(v_dim, heads).bias(false)));
  A = register_parameter("A", at::ones({heads}));
}

at::Tensor DynamicMaskWeights::forward(const at::Tensor& v) { return at::exp(at::softplus(project(delta, v)) * A); }

at::Tensor dma_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& delta,
                         int64_t w, const at::Tensor& seq_idx, double scale) {
  const at::Tensor bias = delta.permute({0, 2, 1}).contiguous();  // (B, H, L)
  // The GPU's tile kernels take the pattern in its block form (no lists, no plan kernel).
  if (w <= patterns::kTopKBlocksMaxK && w < q.size(1) && ops::sparse_attention_blocks_native(q, v)) {
    ops::TileBlocks blocks;
    {
      torch::NoGradGuard ng;
      blocks = patterns::top_k_prefix_blocks(delta.detach(), w, seq_idx);
    }
    return std::get<0>(ops::sparse_attention_blocks(q, k, v, blocks, bias, scale));
  }
  at::Tensor idx;
  {
    torch::NoGradGuard ng;
    idx = patterns::top_k_prefix(delta.detach(), w, seq_idx).idx;  // (B, H, L, w)
  }
  return std::get<0>(ops::sparse_attention(q, k, v, idx, bias, {}, {}, scale));
}

}  // namespace hax
