// Sparse attention over index lists: the one op every sparse pattern runs through.
//
//   out[b,i,h] = Σ_s w[b,h,i,s] · Σ_{j ∈ S(b,h,i,s)} softmax_j( scale · q[b,i,h]·k[b,j,h] + bias[b,h,j] ) · v[b,j,h]
//
// A pattern decides *which* keys each query sees (the index lists); this op computes attention
// over the given keys and knows nothing of patterns. Segments s (several per query) each have their
// own softmax and are summed with weights w (HSA: one segment per retrieved chunk); every other
// pattern uses one segment of weight 1. An empty segment contributes 0 and has lse = -inf; a query
// with no keys at all outputs 0. Memory is O(L·S·K); no L x L tensor exists.
//
// Shapes: B batch, L queries, Lk keys, H heads, D query/key dim, Dv value dim, S segments, K keys
// per segment at most.
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <tuple>

#include "ops/attention/params.h"

namespace hax::ops {

void sparse_attention_forward_cpu(const AttentionParams& p, at::ScalarType dtype);
void sparse_attention_backward_cpu(const AttentionGradParams& p, at::ScalarType dtype);
// Sizes of the CPU forward's union record (params.h, union_*): items, rows per item, lanes.
struct CpuUnionShape {
  int64_t items = 0, limit = 0, lanes = 0;
};
CpuUnionShape sparse_attention_cpu_unions(const AttentionParams& p);

// Differentiable in q, k, v, bias and seg_w (undefined tensors = absent), through both outputs.
// idx may be (B, H, L, K) for one segment (lse is then still (B, H, L, 1)). q_order, when given,
// must be a permutation of 0..L-1 for every (b, h). scale > 0 (e.g. 1/sqrt(D)). Checked: shapes,
// dtypes (float32/float64 on the CPU, float32/bfloat16 on CUDA; idx and q_order int32 on q's
// device), idx values in [-1, Lk), q_order a permutation, L·S·K < 2^31, and on CUDA D, Dv <= 128;
// not checked: distinct keys within a segment (a repeated key counts twice, unlike in the
// reference). Returns (out (B, L, H, Dv), lse (B, H, L, S)); lse is float32 on CUDA. On CUDA, the
// backward sums dk, dv and dbias with float atomics, or in a fixed order under
// ops::set_deterministic(true).
std::tuple<at::Tensor, at::Tensor> sparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& idx, const at::Tensor& bias,
                                                    const at::Tensor& seg_w, const at::Tensor& q_order, double scale);

// sparse_attention (one segment, no bias or weights) over the union of two lists per query, on the
// CUDA tile path without merging the lists first: idx_a (B, H, L, Ka) and idx_b (B, H, L, Kb)
// int32, each without repeats (a key in both counts once), -1 padded; q_order as for
// sparse_attention. The tile plan is built from both lists at once. Its blocks whose union
// overflows go to the per-query kernels, which need merged lists: merge_overflow(count), with
// count (B, H, ceil(L / 64)) the plan's block counts, must return (B, H, L, Ka + Kb) int32 lists
// holding the union (ascending, -1 padded) at least for the queries of the blocks whose count is
// -1 (patterns::merge_overflow_rows). Needs sparse_attention_union_native(q, v, Ka, Kb) (checked).
// Differentiable in q, k and v; returns what sparse_attention returns on the merged lists.
using MergeOverflow = std::function<at::Tensor(const at::Tensor& count)>;
bool sparse_attention_union_native(const at::Tensor& q, const at::Tensor& v, int64_t Ka, int64_t Kb);
std::tuple<at::Tensor, at::Tensor> sparse_attention_union(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, const at::Tensor& idx_a,
                                                          const at::Tensor& idx_b, const at::Tensor& q_order,
                                                          double scale, const MergeOverflow& merge_overflow);

// sparse_attention_union with list a given as a band of sorted keys (HAX's LSH part in its band
// form, patterns::LshBand, without LSH lists): the query of rank t in q_order (B, H, L) lists
// the keys band_pos[b][h][band[0][b][h][t]], ..., band_pos[b][h][band[1][b][h][t]] (none when
// band[1] < band[0]), at most Ka of them, distinct. band (2 or more, B, H, L) int32 (rows past
// the second are not read), band_pos (B, H, Lk) int32, q's device; the op trusts that they agree
// (lsh_band builds them so). The plan marks each block's band keys in a bitmap instead of hashing
// them (params.h, kAttentionPlanBandSpan). merge_overflow(count) as above, (B, H, L, Ka + Kb).
// Needs sparse_attention_union_native(q, v, Ka, Kb) (checked).
std::tuple<at::Tensor, at::Tensor> sparse_attention_union_band(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& band,
                                                               const at::Tensor& band_pos, int64_t Ka,
                                                               const at::Tensor& idx_b, const at::Tensor& q_order,
                                                               double scale, const MergeOverflow& merge_overflow);

// sparse_attention_union_band with list b given as Key Selection's intervals (patterns::
// KeyIntervals, HAX without lists): the query at position i of row (b, h) lists every key
// iv_key[b][h][t] with iv_key[b][h][t] <= i < iv_leave[b][h][t], t < iv_count[b][h], at most Kb of
// them; iv_count (B, H), iv_key and iv_leave (B, H, M) int32 on q's device, keys ascending along a
// row (trusted, as the band). The plan tests each block's candidate intervals against its queries
// (params.h, AttentionParams::iv_key) instead of hashing Kb list entries a query. merge_overflow
// as above, (B, H, L, Ka + Kb) (patterns::merge_overflow_rows's interval form). Needs
// sparse_attention_union_native(q, v, Ka, Kb) (checked).
std::tuple<at::Tensor, at::Tensor> sparse_attention_union_band_intervals(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& band, const at::Tensor& band_pos,
    int64_t Ka, const at::Tensor& iv_count, const at::Tensor& iv_key, const at::Tensor& iv_leave, int64_t Kb,
    const at::Tensor& q_order, double scale, const MergeOverflow& merge_overflow);

// Attention over the union of two disjoint key sets from the attention over each: with (o_s, lse_s)
// the output and log-sum-exp of set s, softmax over the union = Σ_s exp(lse_s - lse) softmax over
// s, so out = o_2 + sigmoid(lse_1 - lse_2) (o_1 - o_2). o1, o2: (B, L, H, Dv); lse1, lse2:
// (B, H, L, 1), as sparse_attention returns them. Differentiable in all four (fused on the CPU).
at::Tensor join_by_lse(const at::Tensor& o1, const at::Tensor& lse1, const at::Tensor& o2, const at::Tensor& lse2);

// Dense reference written with LibTorch ops (masked softmax over an L x Lk score matrix per
// segment): the test oracle, differentiable by autograd. Use float64 and small L.
std::tuple<at::Tensor, at::Tensor> sparse_attention_reference(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& idx,
                                                              const at::Tensor& bias, const at::Tensor& seg_w,
                                                              double scale);

// The path that sparse_attention() uses (process-wide; default kAuto). For tests and benchmarks.
void set_sparse_attention_path(AttentionPath path);
AttentionPath sparse_attention_path();

// Whether the CUDA tile kernels (bfloat16, head dim 64, Hopper) run their tile products on wgmma
// (AttentionParams::wgmma_products; process-wide, default on). Off: on each warp's mma.sync, the
// form before, kept for comparison. For tests and benchmarks.
void set_sparse_attention_wgmma_products(bool on);
bool sparse_attention_wgmma_products();

// Whether the CUDA tile backward of a union with an LSH band (sparse_attention_union_band) writes
// the dk, dv rows of keys in at most two query blocks' unions in bfloat16 directly: the plan counts
// each key's blocks; a key of one block gets its block's sums stored (rounded once, as from a
// float32 accumulator), a key of two has both sums rounded and added with bfloat16 atomics, and
// only the keys of more blocks (Key Selection's popular keys) are summed in float32 accumulators.
// Most of the band's keys are of one or two blocks, so the accumulators' fill and cast of their
// whole size go. Off: every key in float32 (the form before). Process-wide; the first read takes
// HAX_TILE_KEY_SUMS (0 or 1, default 1). For tests and benchmarks.
void set_sparse_attention_few_key_sums(bool on);
bool sparse_attention_few_key_sums();

}  // namespace hax::ops
