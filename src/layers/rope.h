// Rotary position embedding (RoPE) for attention layers, with positions counted from each packed
// sequence's start.
#pragma once
#include <torch/torch.h>

namespace hax {

// Position of every token within its sequence: (B, L) int64; seq_idx (B, L) or undefined.
at::Tensor positions_in_sequence(int64_t B, int64_t L, const at::Tensor& seq_idx, const at::Device& device);

// Rotates x (B, L, H, D) (D even) by angle pos · theta^(-2i/D) on the pairs (x_i, x_{i + D/2}).
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& positions, double theta);

}  // namespace hax
