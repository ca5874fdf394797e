// Sparse attention patterns: each decides *which* keys every query attends to, as index lists.
// Patterns never compute attention (ops/attention does, over the lists they give).
//
// Every builder is causal (keys j <= i) and respects packed sequences: with seq_idx (B, L), a
// query only ever sees keys of its own sequence, and positions count from that sequence's start
// (so a packed row gives each sequence exactly the lists it would get alone).
//
// Every builder runs on the device of its inputs: CUDA inputs give lists built by the CUDA kernels
// (patterns/cuda/), on that device, equal to the CPU's lists for the same inputs (same keys, order,
// padding, q_order and ties). The builders that take only sizes build on `device` when given, else
// on seq_idx's device, else on the CPU.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "ops/attention/blocks.h"
#include <optional>
#include <string>

namespace hax::patterns {

struct KeyLists {
  at::Tensor idx;      // (B, H, L, K) int32: ascending key positions, -1 padding after the last key
  at::Tensor q_order;  // (B, H, L) int32: a permutation of the queries that puts queries sharing keys
                       // next to each other (the attention op computes them together), or undefined
};

// SW: the k most recent keys, self included: j in [max(start, i - k + 1), i].
KeyLists sliding_window(int64_t B, int64_t H, int64_t L, int64_t k, const at::Tensor& seq_idx,
                        std::optional<at::Device> device = std::nullopt);

// Sink: the first k keys of the query's sequence that are <= i.
KeyLists sink(int64_t B, int64_t H, int64_t L, int64_t k, const at::Tensor& seq_idx,
              std::optional<at::Device> device = std::nullopt);

// D (dilated, stride r): keys j <= i with (j - start) mod r = r - 1, the k most recent of them.
KeyLists dilated(int64_t B, int64_t H, int64_t L, int64_t k, int64_t stride, const at::Tensor& seq_idx,
                 std::optional<at::Device> device = std::nullopt);

// LSH bucketing rule: sign bits of the h projections read as a binary number (2^h buckets), or
// the argmax over the h projections (h buckets).
enum class Binning { kSign, kArgmax };
Binning binning_from_string(const std::string& s);  // "sign" | "argmax" (UsageError otherwise)

// The Gaussian projection H (N, h) of seed `seed`, drawn with hax's own generator (so a seed gives
// the same hash on every machine). float32.
at::Tensor lsh_projection(int64_t N, int64_t h, uint64_t seed);

// Bucket of every vector of x (B, L, H, N): x is centered by its causal running mean (the mean of
// x over positions start..i of its own sequence, never later ones), L2-normalized, projected by
// proj (N, h) and binned. Returns (B, L, H) int32.
at::Tensor lsh_buckets(const at::Tensor& x, const at::Tensor& proj, Binning binning, const at::Tensor& seq_idx);

// LSH attention: query i attends to the k most recent keys j <= i whose key bucket equals its
// query bucket. Found through a sort of the keys by (bucket, position): each query's keys are one
// contiguous slice of that order, located by binary search. q_order sorts queries by
// (bucket, position). q, k: (B, L, H, N).
KeyLists lsh(const at::Tensor& q, const at::Tensor& k, int64_t keys, const at::Tensor& proj, Binning binning,
             const at::Tensor& seq_idx);

// The same LSH pattern as a band over sorted rows (the fast form: no lists). Queries and keys of
// each (b, h) sorted by (sequence, bucket, position): q_order[b][h][t] is the position of sorted
// query t, k_order[b][h][s] that of sorted key s. Sorted query t sees the sorted keys
// [band[0][b][h][t], band[1][b][h][t]] (exactly lsh()'s list of query q_order[t], which is empty
// when band[1] < band[0]), and sorted key s is seen by the sorted queries
// [band[2][b][h][s], band[3][b][h][s]]. All four are non-decreasing along the row, so
// ops::causal_attention runs it as a band over rows permuted by ops::permute_rows
// (layers/lsh_attention.h).
struct LshBand {
  at::Tensor q_order;  // (B, H, L) int32
  at::Tensor k_order;  // (B, H, L) int32
  at::Tensor band;     // (4, B, H, L) int32
};
// key_side false: band[2] and band[3] may be left uncomputed (undefined values), for users of the
// query side only (ops::sparse_attention_union_band); on CUDA that skips a kernel.
LshBand lsh_band(const at::Tensor& q, const at::Tensor& k, int64_t keys, const at::Tensor& proj, Binning binning,
                 const at::Tensor& seq_idx, bool key_side = true);

// The keys of a's lists that the band's LSH pattern does not give the same query (ascending, -1
// padded, a's K slots; a's q_order): with the band's attention, a's part of a union such as HAX
// then runs on the other keys only, and the two attentions join by their log-sum-exps. On a's
// device (a kernel on CUDA, LibTorch ops elsewhere).
KeyLists exclude_band(const KeyLists& a, const LshBand& band);

// Key Selection: query i attends to the k keys of highest score among positions start..i (ties:
// the earlier position wins), computed incrementally (the set changes by at most one key per
// step). scores: (B, L, H).
KeyLists top_k_prefix(const at::Tensor& scores, int64_t k, const at::Tensor& seq_idx);

// The same pattern as intervals: a key that enters its sequence's top k does so at its own
// position and, once it leaves, never returns, so query i's list of top_k_prefix is exactly
// {key[t] : key[t] <= i < leave[t]} over its row's entries. Few keys ever enter (about
// k (1 + ln(L / k)) for random scores), so the pattern takes O(that) memory where the lists take
// O(L k): the form HAX's tile plan reads instead of hashing every list entry
// (ops::sparse_attention_union_band_intervals). CUDA scores with k < L and k <= kTopKMaxK: built
// by the kernels of patterns/cuda/top_k_intervals.cu, with M = L (no host synchronization) and the
// extras below, which merge_overflow_rows reads for the rows of blocks that overflow; otherwise
// the CPU loop (the definition), its tensors put on scores' device, the extras undefined.
struct KeyIntervals {
  at::Tensor count;  // (B, H) int32: entries of each row
  at::Tensor key;    // (B, H, M) int32: the keys that ever enter, ascending, -1 padded (M: the largest count)
  at::Tensor leave;  // (B, H, M) int32: the first query position whose set no longer holds key[t]
                     // (its sequence's end if none), -1 padded
  int64_t k = 0;     // the k they were built for
  // CUDA only (undefined from the CPU loop):
  at::Tensor leave_at;  // (B, H, L) int32: the leave of the key at each position; the position itself if it never enters
  at::Tensor prefix;    // (B, H, ceil(L / 64), k) int64: the top k of each block of 64 positions' prefix (the
                        // query before the block, in its sequence), as TopKPrefixParams::block_prefix
  at::Tensor start;     // (B, L) int32: the start of each position's sequence
};
KeyIntervals top_k_prefix_intervals(const at::Tensor& scores, int64_t k, const at::Tensor& seq_idx);

// HAX's union (LSH's band with band_keys a query, and Key Selection's intervals of ks_keys) in the
// tile path's block form over the ranks of band.q_order: block n holds the queries q_order[64 n ..
// 64 n + 63], its keys ascending, its mask bits as ops::tile_blocks_from_lists gives for the merged
// lists in that order (max_keys = band_keys + ks_keys). CPU, on band's device; the definition of a
// plan that takes each block's Key Selection keys from the intervals (a binary search and an
// interval test) instead of hashing every list entry (BENCHMARKS.md, thirty-third pass).
ops::TileBlocks hax_blocks(const LshBand& band, int64_t band_keys, const KeyIntervals& ks, int64_t ks_keys);

// The same pattern in the block form of ops/attention/blocks.h, for ops::sparse_attention_blocks
// (no lists): the keys of a block of 64 queries are its prefix's top k and its own positions, so
// its union fits when k <= kTopKBlocksMaxK = 448 (checked; also 1 <= k). CUDA scores: built by the
// query kernels directly; CPU: tile_blocks_from_lists of top_k_prefix's lists (the definition).
// max_keys = k. With `exclude` (an LSH band of the same B, H, L on scores' device), each query's
// keys that the band gives it are left out, as exclude_band does to lists: HAX's Key Selection part
// beside the band, the two joined by their log-sum-exps.
constexpr int64_t kTopKBlocksMaxK = ops::kAttentionTileMaxKeys - ops::kAttentionTileQueries;
ops::TileBlocks top_k_prefix_blocks(const at::Tensor& scores, int64_t k, const at::Tensor& seq_idx,
                                    const LshBand* exclude = nullptr);

// The union of two patterns' lists for each query (duplicates removed, ascending), K = Ka + Kb
// slots. q_order is a's if defined, else b's.
KeyLists merge(const KeyLists& a, const KeyLists& b);

// merge(a, b).idx where the CUDA tile path's per-query kernels read it, for
// ops::sparse_attention_union: the rows of the queries in the blocks (ops::kAttentionTileQueries
// consecutive queries in merge's q_order) whose count in block_count (B, H, nblk) int32 is
// negative. The other rows are -1 while ops::check_device_values() is on (the op then checks every
// entry) and not written otherwise. CUDA only; with Ka or Kb above 32, every row is merged.
at::Tensor merge_overflow_rows(const KeyLists& a, const KeyLists& b, const at::Tensor& block_count);
// The same with a given as an LSH band (ops::sparse_attention_union_band) of at most Ka keys a
// query, in the band's query order; Ka and b's K at most 32. CUDA only.
at::Tensor merge_overflow_rows(const LshBand& a, int64_t Ka, const KeyLists& b, const at::Tensor& block_count);
// The same with b given as Key Selection's intervals from CUDA scores (their extras defined;
// Kb = b.k <= 32): a row's Key Selection keys are its block prefix's keys and its own block's
// positions up to it whose leave_at is past it, ascending (ops::sparse_attention_union_band_intervals).
at::Tensor merge_overflow_rows(const LshBand& a, int64_t Ka, const KeyIntervals& b, const at::Tensor& block_count);

// The keys of a's lists that are not in b's, for each query (ascending, -1 padded, Ka slots);
// q_order is a's. With merge: merge(a, b) lists what b and exclude(a, b) list together, and the
// two have no key in common.
KeyLists exclude(const KeyLists& a, const KeyLists& b);

// Number of keys of each query (B, H, L) int32 (entries != -1).
at::Tensor key_counts(const KeyLists& lists);

}  // namespace hax::patterns

namespace hax::patterns {

// HSA's chunks (DESIGN.md section 2): every packed sequence [s, e) of a row is cut into chunks of
// `chunk` tokens from its start, s + m·chunk .. s + (m+1)·chunk - 1, complete ones only. Query i
// of that sequence may retrieve the chunks before its own, m < (i - s) / chunk (integer division):
// never the chunk it is in, never a future one.
struct ChunkLayout {
  int64_t chunk = 0;      // tokens per chunk
  at::Tensor start;       // (B, NC) int32, NC = L / chunk (the most a row can hold, so the shape depends on
                          // B and L only): first position of each chunk of the row, in order; -1 past the row's last chunk
  at::Tensor lo, hi;      // (B, L) int32: query i may retrieve the chunks [lo, hi) of its row
};
// On `device` when given, else on seq_idx's device, else on the CPU.
ChunkLayout chunk_layout(int64_t B, int64_t L, int64_t chunk, const at::Tensor& seq_idx,
                         std::optional<at::Device> device = std::nullopt);

// The top-k chunks of each query by retrieval score q_ret[b, i] · landmarks[b, c] among the chunks
// [lo, hi) it may retrieve (ties: the earlier chunk), ascending, -1 where fewer than k exist.
// q_ret (B, L, D), landmarks (B, NC, D), lo / hi (B, L) int32. Returns (B, L, k) int32. Computed
// query block by query block against the landmarks (memory O(L·k), no L x NC tensor).
at::Tensor top_k_chunks(const at::Tensor& q_ret, const at::Tensor& landmarks, const at::Tensor& lo,
                        const at::Tensor& hi, int64_t k);

// The attention lists of retrieved chunks: segment s of query i holds the `chunk` positions of
// chunk chunks[b, i, s] (all -1 when it is -1), the same for every head. chunks (B, L, k) int32,
// start from chunk_layout. Returns (B, H, L, k, chunk) int32.
at::Tensor chunk_lists(const at::Tensor& chunks, const at::Tensor& start, int64_t chunk, int64_t H);

}  // namespace hax::patterns
