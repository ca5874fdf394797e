// Sparse attention over a pattern given as query blocks instead of lists (the CUDA tile path's
// own form, params.h AttentionTilePlan): for every block of kAttentionTileQueries = 64
// consecutive queries, the union of the keys its queries see (ascending) and one bit per
// (query, union key). Patterns whose blocks come cheaply from their structure (Key Selection,
// DMA: a block's keys are its prefix top-k plus its own positions, patterns/top_k_prefix.cpp)
// build this form directly, and the attention runs on it without lists or a plan kernel.
//
// The form states the same thing as lists: query i of block n = i / 64 sees key keys[n][u] iff
// bit u % 64 of mask[n][u / 64][i % 64] is set. tile_blocks_to_lists and tile_blocks_from_lists
// convert between the two (the tests' definition).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ops/attention/params.h"

namespace hax::ops {

struct TileBlocks {
  at::Tensor count;  // (B, H, nblk) int32: keys in the block's union, or -1 when they do not fit
                     // kAttentionTileMaxKeys (the block then has no keys or mask here: lists only)
  at::Tensor keys;   // (B, H, nblk, kAttentionTileMaxKeys) int32: the union ascending, -1 padded
  at::Tensor mask;   // (B, H, nblk, kAttentionTilesPerBlock, kAttentionTileQueries) int64: bit c of
                     // mask[b][h][n][t][r] = query 64 n + r sees key keys[b][h][n][64 t + c];
                     // tiles t >= ceil(count / 64) are not read and may hold anything
  int64_t max_keys = 0;  // the most keys any query sees (the K of tile_blocks_to_lists)
};
// nblk = ceil(L / 64): tile_blocks_count(L).
inline int64_t tile_blocks_count(int64_t L) { return attention_tile_blocks(L); }

// The blocks of lists idx (B, H, L, K) (ascending or not, -1 padding, entries outside [0, Lk)
// ignored), on idx's device: plain loops on the CPU (the definition), the tile plan kernel
// (cuda/tile_plan.cu) on CUDA. Equal on both for every block that fits.
TileBlocks tile_blocks_from_lists(const at::Tensor& idx, int64_t Lk);

// CPU: block `item` of a block form (count, keys (items, kAttentionTileMaxKeys) -1 filled, mask
// (items, kAttentionTilesPerBlock, kAttentionTileQueries) zeroed) from its nq queries' keys:
// each_key(r, f) calls f(key) for every key query r sees (repeats allowed). The union is sorted
// and deduplicated into `u` (scratch); a union above kAttentionTileMaxKeys gives count -1.
template <class EachKey>
void fill_tile_block(int64_t item, int64_t nq, EachKey&& each_key, int32_t* count, int32_t* keys, uint64_t* mask,
                     std::vector<int32_t>& u) {
  constexpr int64_t Q = kAttentionTileQueries, U = kAttentionTileMaxKeys, T = kAttentionTilesPerBlock;
  u.clear();
  for (int64_t r = 0; r < nq; ++r) each_key(r, [&](int32_t key) { u.push_back(key); });
  std::sort(u.begin(), u.end());
  u.erase(std::unique(u.begin(), u.end()), u.end());
  if ((int64_t)u.size() > U) {
    count[item] = -1;
    return;
  }
  count[item] = (int32_t)u.size();
  std::copy(u.begin(), u.end(), keys + item * U);
  for (int64_t r = 0; r < nq; ++r)
    each_key(r, [&](int32_t key) {
      const int64_t c = std::lower_bound(u.begin(), u.end(), key) - u.begin();
      mask[(item * T + c / 64) * Q + r] |= 1ull << (c % 64);
    });
}

// The lists of blocks for L queries: (B, H, L, blocks.max_keys) int32, ascending, -1 padded, on
// the blocks' device (LibTorch ops; memory O(L · 64 · ceil(max count / 64))). Every block must fit
// (count >= 0) and no query may see more than max_keys keys (both checked).
at::Tensor tile_blocks_to_lists(const TileBlocks& blocks, int64_t L);

// Whether sparse_attention_blocks runs these inputs on the tile kernels (CUDA, bfloat16 or
// float32 under autocast, head dims <= 128, not deterministic, path not kPerQuery). Otherwise it
// expands the blocks to lists and calls sparse_attention, which is correct but no faster than
// building lists in the first place: patterns ask this first.
bool sparse_attention_blocks_native(const at::Tensor& q, const at::Tensor& v);

// sparse_attention (attention.h) with one segment, no segment weights and no q_order, over the
// keys of `blocks`: out (B, L, H, Dv), lse (B, H, L, 1) (float32 on CUDA). Differentiable in q, k,
// v and bias (B, H, Lk) (undefined = none). Checked: the shapes and dtypes of q, k, v, bias and the
// blocks (for B, H and nblk = ceil(L / 64)); on CUDA with check_device_values(), also that every
// block fits (count in [0, 512]).
std::tuple<at::Tensor, at::Tensor> sparse_attention_blocks(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, const TileBlocks& blocks,
                                                           const at::Tensor& bias, double scale);

}  // namespace hax::ops
