// What a forward pass needs besides its inputs: whether it trains, the seed of its randomness
// (LSH projections, Key Selection candidates), which positions are real tokens, and where the
// auxiliary losses and (for inspection) the attention patterns go.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "patterns/pattern.h"

namespace hax {

// What a sparse layer used, for inspection (hax patterns).
struct PatternRecord {
  patterns::KeyLists lists;       // the key lists (idx (B, H, L, K))
  at::Tensor q_bucket, k_bucket;  // (B, L, H) int32 LSH buckets, when the pattern hashes
  at::Tensor scores;              // (B, L, H) Key Selection scores, when the pattern selects
};

struct HostInputs;  // layers/host_inputs.h

struct ForwardContext {
  bool training = false;   // compute Key Selection ranking losses
  uint64_t seed = 0;       // per training step (LSH hash resampled every step), fixed for evaluation
  at::Tensor valid;        // (B, L) bool: real tokens (false at padding), or undefined (all real)
  at::Tensor valid_host;   // valid on the CPU when valid lives on a GPU (the ranking loss samples its
                           // candidates on the host: reading valid back would stall the step), or undefined
  std::vector<at::Tensor> ranking_losses;              // one scalar per layer with Key Selection (training)
  std::vector<PatternRecord>* record = nullptr;   // if set, each sparse layer appends what it used
  HostInputs* host_inputs = nullptr;  // set while a CUDA graph of the step is captured (host_inputs.h)
};

}  // namespace hax
