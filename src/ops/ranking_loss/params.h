// Plain parameters of the fused ranking-loss kernels and the CUDA launchers (no LibTorch: the .cu
// file includes this). See ranking_loss.h for the definition.
#pragma once
#include <cstdint>

#include "ops/kernel_dtype.h"

namespace hax::ops {

// Raw-pointer parameters of the ranking-loss kernels. q and k are read through their strides (the
// last dim contiguous: q is a view of the Q/K projection); the other tensors are contiguous.
struct RankingLossParams {
  int64_t batch = 0;       // B
  int64_t seqlen = 0;      // L
  int64_t nheads = 0;      // H
  int64_t dim = 0;         // N, the q/k head dim
  int64_t ncand = 0;       // C, candidates per row
  int64_t q_stride[3] = {0, 0, 0};  // q's strides (elements) along B, L, H
  int64_t k_stride[3] = {0, 0, 0};  // k's strides (elements) along B, L, H
  const void* scores = nullptr;     // (B, L, H), dtype `score_dtype`
  const void* q = nullptr;          // (B, L, H, N), dtype `qk_dtype`
  const void* k = nullptr;          // (B, L, H, N), dtype `qk_dtype`
  const int32_t* seq_idx = nullptr; // (B, L) non-decreasing sequence numbers, or null (one sequence)
  const bool* valid = nullptr;      // (B, L) real tokens, or null (all real)
  const int64_t* cand = nullptr;    // (B, C) distinct positions in [0, L) (others are read as absent)
  const bool* rows = nullptr;       // (B) rows that count, or null (all): a false row adds no loss and
                                    // gets dx = 0; the loss divides by R C C H, R = its true rows
                                    // (counted on the device)
  float* y = nullptr;               // scratch (B, C, H): the targets' sums
  float* partial = nullptr;         // scratch (B * H * ranking_loss_tiles(C)): per-block loss sums
  float* dx = nullptr;              // out (B, C, H): d loss / d x (saved for the backward), 0 on false rows
  void* loss = nullptr;             // out (): the loss (the mean over the true rows), dtype `score_dtype`
};

// Gradient parameters: the forward's sizes and saved dx, the incoming gradient.
struct RankingLossGradParams {
  int64_t batch = 0, seqlen = 0, nheads = 0, ncand = 0;  // B, L, H, C
  const int64_t* cand = nullptr;  // (B, C)
  const float* dx = nullptr;      // (B, C, H) from the forward
  const void* dloss = nullptr;    // (): the incoming gradient, read on the device, dtype `score_dtype`
  void* dscores = nullptr;        // in/out (B, L, H): zero on entry; the candidates' entries are written
};

// Candidates per block of the pair kernel; the forward's partial sums number B * H * tiles.
constexpr int64_t kRankingLossTile = 256;
inline int64_t ranking_loss_tiles(int64_t ncand) { return (ncand + kRankingLossTile - 1) / kRankingLossTile; }

// CUDA kernels (float32 or bfloat16 storage, float32 math); `stream` is a cudaStream_t. The forward
// is three launches (targets, pairs, final sum in a fixed order: deterministic, no atomics); the
// backward one launch (a scatter into dscores).
void ranking_loss_forward_cuda(const RankingLossParams& p, DType score_dtype, DType qk_dtype, void* stream);
void ranking_loss_backward_cuda(const RankingLossGradParams& p, DType score_dtype, void* stream);

}  // namespace hax::ops
