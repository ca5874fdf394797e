// The per-key half of the CPU sparse-attention backward: dk, dv and dbias of every key, summed in
// an order fixed by the data (never by the threads), so that results do not depend on the thread
// count. Two sources feed them (backward.cpp):
//   - tile blocks leave partial sums over their key union (UnionPartials): for union row u with
//     key j, Σ_i dscore_ij q_i, Σ_i w a_ij dO_i and Σ_i dscore_ij over the block's queries i;
//   - blocks computed per query leave dscore and w·a per list entry (EntryGrads).
// With the scale of the scores s = scale q·k: dk_j = scale Σ dscore q, dv_j = Σ w a dO,
// dbias_j = Σ dscore.
#pragma once
#include <cstdint>

#include "ops/attention/params.h"

namespace hax::ops::cpu_attention {

// Partial sums of the tile blocks, item it = bh * blocks + c (block c of row bh).
template <class T>
struct UnionPartials {
  int64_t blocks = 0;        // query blocks per (b, h)
  int64_t limit = 0;         // rows reserved per block (the union limit)
  int64_t width = 0;         // D + Dv
  T* rows = nullptr;         // (B*H*blocks, limit, width): Σ dscore q (D), Σ w a dO (Dv)
  T* db = nullptr;           // (B*H*blocks, limit): Σ dscore
  int32_t* keys = nullptr;   // (B*H*blocks, limit) key of each row
  const int32_t* count = nullptr;  // (B*H*blocks) union size, or -1 for a block computed per query
};

// dscore and w·a of every list entry (B, H, L, S, K) of the queries whose `use` flag (B, H, L) is
// set; other entries are not read.
template <class T>
struct EntryGrads {
  const T* dscore = nullptr;
  const T* pw = nullptr;
  const uint8_t* use = nullptr;
};

// Writes dk, dv (and dbias) of every key from the entries' gradients.
template <class T>
void key_grads_from_entries(const AttentionGradParams& gp, const EntryGrads<T>& e);

// Adds the tile blocks' partial sums to dk, dv (and dbias) of every key (block order within a
// key), or writes them (zero for keys in no union) when `accumulate` is false.
template <class T>
void key_grads_from_partials(const AttentionGradParams& gp, const UnionPartials<T>& parts, bool accumulate);

}  // namespace hax::ops::cpu_attention
