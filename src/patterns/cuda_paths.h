// The CUDA paths of the pattern builders (not part of the public API): the same lists as the CPU
// code, built by the kernels of patterns/cuda/ on the device of the given tensors, returned there.
// The public builders call them for CUDA inputs (or a CUDA `device`) after their argument checks;
// the arguments here are already checked. Defined only in builds with the CUDA kernels
// (HAX_CUDA_KERNELS). Every function works on whatever device its tensors are on: the kernels get
// the stream of stream_of(), so tests that emulate the kernels on the CPU can call these too.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "patterns/cuda_params.h"
#include "patterns/pattern.h"

namespace hax::patterns::detail {

// LibTorch's current stream on t's CUDA device (made current), or null for a CPU tensor.
void* stream_of(const at::Tensor& t);

// The sequence bounds of every position, (B, L) int32 on `device`: [start, end) is i's packed
// sequence. seq: the checked seq_idx (int32, any device) or undefined (one sequence per row).
struct SequenceBounds {
  at::Tensor start, end;
};
SequenceBounds sequence_bounds_device(const at::Tensor& seq, int64_t B, int64_t L, const at::Device& device);

// sliding_window / sink / dilated (stride r), (B, H, L, k) on `device`.
at::Tensor progression_lists_device(ProgressionKind kind, int64_t B, int64_t H, int64_t L, int64_t k, int64_t stride,
                                    const at::Tensor& seq, const at::Device& device);

// lsh_buckets of x (B, L, H, N) (float32 or bfloat16), with `start` from sequence_bounds_device.
at::Tensor lsh_buckets_device(const at::Tensor& x, const at::Tensor& proj, Binning binning, const at::Tensor& start);

// lsh_band: the sorted orders and the band on q's device.
LshBand lsh_band_device(const at::Tensor& q, const at::Tensor& k, int64_t keys, const at::Tensor& proj,
                        Binning binning, const at::Tensor& seq, bool key_side);

// exclude_band's lists, (B, H, L, K) int32 on idx's device.
at::Tensor exclude_band_device(const at::Tensor& idx, const LshBand& band);

// Tests: LSH's sort keys in 64 bits even where 32 bits hold them (normally only when
// B·H·nb·L > 2^32, e.g. L >= 1M at 16 heads and 256 buckets), so that the 64-bit forms of the
// key, sort and list kernels run at small sizes. Off by default; process-wide.
void set_lsh_wide_sort_keys(bool on);

// lsh: lists and q_order on q's device.
KeyLists lsh_device(const at::Tensor& q, const at::Tensor& k, int64_t keys, const at::Tensor& proj, Binning binning,
                    const at::Tensor& seq);

// top_k_prefix of scores (B, L, H) (float32 or bfloat16): (B, H, L, k) on its device.
at::Tensor top_k_prefix_device(const at::Tensor& scores, int64_t k, const at::Tensor& seq);

// top_k_prefix_blocks of scores (B, L, H) (float32 or bfloat16), k < L and k <= kTopKPlanMaxK: the
// block form on its device.
// With `exclude`, each query's keys in that LSH band are left out (exclude_band's lists).
ops::TileBlocks top_k_prefix_blocks_device(const at::Tensor& scores, int64_t k, const at::Tensor& seq,
                                           const LshBand* exclude);

// top_k_prefix_intervals of scores (B, L, H) (float32 or bfloat16), 1 <= k < L, k <= kTopKMaxK:
// count, key and leave (M = L), k and the extras (leave_at, prefix, start) on its device, with no
// host synchronization (top_k_intervals.cu).
KeyIntervals top_k_prefix_intervals_device(const at::Tensor& scores, int64_t k, const at::Tensor& seq);

// merge's lists: the union of a (B, H, L, Ka) and b (B, H, L, Kb) int32, on a's device.
at::Tensor merge_device(const at::Tensor& a, const at::Tensor& b);
// merge_overflow_rows's lists on a's device (q_order (B, H, L) or undefined, block_count (B, H, nblk)).
at::Tensor merge_overflow_device(const at::Tensor& a, const at::Tensor& b, const at::Tensor& q_order,
                                 const at::Tensor& block_count);
// The same with a as a band (merge_overflow_rows's band form): band (2+, B, H, L), band_pos (B, H, L).
at::Tensor merge_overflow_band_device(const at::Tensor& band, const at::Tensor& band_pos, int64_t Ka,
                                      const at::Tensor& b, const at::Tensor& q_order, const at::Tensor& block_count);

// The same with b as Key Selection's intervals with their extras (merge_overflow_rows's intervals
// form, Kb = b.k): row i's b list is computed from b.leave_at, b.prefix and b.start.
at::Tensor merge_overflow_intervals_device(const at::Tensor& band, const at::Tensor& band_pos, int64_t Ka,
                                           const KeyIntervals& b, const at::Tensor& q_order,
                                           const at::Tensor& block_count);

// chunk_layout on `device`.
ChunkLayout chunk_layout_device(int64_t B, int64_t L, int64_t chunk, const at::Tensor& seq, const at::Device& device);

// top_k_chunks of q_ret (B, L, D) against landmarks (B, NC, D) (float32 or bfloat16) among [lo, hi),
// (B, L, k) on q_ret's device.
at::Tensor top_k_chunks_device(const at::Tensor& q_ret, const at::Tensor& landmarks, const at::Tensor& lo,
                               const at::Tensor& hi, int64_t k);

// Key Selection's query direction normalize(Σ_{p = start..i} q_p) of q (B, L, H, N) (float32 or
// bfloat16, N <= kPrefixMaxN, any strides of b, position and head), with the norm floored at eps;
// seq: the checked seq_idx (int32, any device) or undefined. (B, L, H, N) in q's dtype on its device.
at::Tensor prefix_direction_device(const at::Tensor& q, const at::Tensor& seq, double eps);

}  // namespace hax::patterns::detail
