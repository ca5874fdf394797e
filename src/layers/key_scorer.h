// Key Selection's scorer and its ranking loss (HAX paper section 4.2).
//
// score_j = MLP([k_j, normalize(Σ_{p<=j} q_p)]): three linear layers with ReLU between them
// (width 2·N in the reference). Its inputs are detached, so the scorer learns only from the
// ranking loss, never from the language-model loss. The ranking loss samples c candidate keys
// per row, targets y_a = Σ_{i>=pos_a} sigmoid(q_i · k_{pos_a}) (causal, same sequence, real
// tokens; detached), pairwise logits P_ab = x_a − x_b and targets T_ab = ([y_a > y_b] +
// [y_a >= y_b]) / 2 ∈ {1, 0.5, 0}; loss = mean BCE-with-logits over all pairs.
#pragma once
#include <torch/torch.h>

#include <cstdint>

namespace hax {

class KeyScorer : public torch::nn::Module {
 public:
  KeyScorer(int64_t qk_dim, int64_t hidden);
  // k, q: (B, L, H, N) -> scores (B, L, H). seq_idx restarts the running sum of q per sequence.
  at::Tensor forward(const at::Tensor& k, const at::Tensor& q, const at::Tensor& seq_idx);
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
};

// Σ_{p = start..j} x_p along dim 1 (B, L, ...), restarted at each packed sequence's start.
at::Tensor segment_cumsum(const at::Tensor& x, const at::Tensor& seq_idx);

constexpr double kDirectionEps = 1e-12;  // normalize divides by max(|v|, kDirectionEps)

// The scorer's query input, without gradient: normalize(segment_cumsum(q)) for q (B, L, H, N).
// One fused pass on the CPU (float32/float64); on CUDA (float32/bfloat16, N <= 256) the chunked
// scan of patterns/cuda/prefix_direction.cu (at most 3 launches); the tensor formula otherwise.
at::Tensor prefix_query_direction(const at::Tensor& q, const at::Tensor& seq_idx);

// The ranking loss of the scores (B, L, H) against q, k (B, L, H, N): `candidates` distinct
// positions per row drawn with hax::Rng(seed) among the valid ones (valid (B, L) bool or
// undefined; valid_host, when given, is the same mask on the CPU, read instead of valid so that a
// GPU step need not wait). Differentiable in scores only.
at::Tensor ranking_loss(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                        const at::Tensor& valid, int64_t candidates, uint64_t seed,
                        const at::Tensor& valid_host = at::Tensor());

// The loss for given candidate positions cand (B, C) int64 (all rows the same count): the
// formula above, through ops::ranking_loss_fused (fused kernels on CUDA, the LibTorch formula
// ops::ranking_loss_reference on the CPU). Exposed for tests.
at::Tensor ranking_loss_at(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                           const at::Tensor& valid, const at::Tensor& cand);

// The candidates ranking_loss draws: (B, C) int64 on the CPU, C = min(candidates, L, the fewest
// valid positions of any row that has one); a row with no valid position (a padding row) gets
// 0..C-1. valid_host (B, L) bool, or undefined (all valid).
at::Tensor ranking_candidates(const at::Tensor& valid_host, int64_t B, int64_t L, int64_t candidates, uint64_t seed);

// The rows the ranking loss keeps: valid.any(1) on valid's device when some row has no valid
// position (a padding row), or always with `always` (a captured step must fit every batch);
// undefined (every row) otherwise. The check reads valid_host (or valid) on the host.
at::Tensor ranking_rows(const at::Tensor& valid, const at::Tensor& valid_host, bool always);

// The loss for candidates on the scores' device (0 when C < 2), rows (B) bool or undefined: the
// rows kept in the mean (ops::ranking_loss_fused).
at::Tensor ranking_loss_of(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                           const at::Tensor& valid, const at::Tensor& cand, const at::Tensor& rows);

}  // namespace hax
