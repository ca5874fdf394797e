// Dilated attention (the "D" pattern of the HAX paper), alone or beside a sliding window ("SW+D"):
//
//   out[b,i,h] = Σ_{j ∈ U(i)} softmax_j( scale · q[b,i,h]·k[b,j,h] ) v[b,j,h],
//   U(i) = W(i) ∪ D(i),
//   W(i) = { j : i - window < j <= i }                          (empty for window 0: D alone)
//   D(i) = the `keys` most recent j <= i with j mod r = r - 1  (r = stride)
//
// each key once (DESIGN.md section 2: SW, D and their union; patterns::dilated and
// patterns::sliding_window build the same sets as lists). No L x L tensor anywhere; memory O(L·D)
// in the block-tile form, O(L·(keys + window)) in the lists path.
//
// The block-tile form (dilated_attention_tiles) runs the causal attention kernels' block tiles
// twice:
//   - the window W(i), as ops::causal_attention with that window;
//   - the dilated keys outside it, D(i) \ W(i), as ops::causal_attention with a band
//     (causal_attention.h) over the compacted keys k[:, r-1::r] (padded with zero rows to L):
//     compacted key m is row m r + r - 1, and with c(i) = floor((i + 1) / r) query i sees
//       m in [max(0, c(i) - keys), c(i - window) - 1]      (c(x) = 0 for x < 0)
//     and key m is seen by the queries
//       i in [(m + 1) r + window - 1, min(L - 1, (m + keys + 1) r - 2)];
//   - the two disjoint parts joined by their log-sum-exps (ops::join_by_lse).
// D alone is differentiable by autograd through the op and the compaction; SW+D's backward
// (WindowDilatedFunction, bfloat16 on CUDA) runs each part's causal backward with the union's out
// and lse, as ops/a_shaped_attention does, and adds the parts' gradients. The band's keys are each
// seen by about (keys + 64) r queries, all L of them when the dilation spans the sequence
// (r = L / keys, the benchmark's), so the causal dK/dV kernel splits each key tile's query tiles
// over several blocks (causal_attention's dkdv_splits) and gives blocks only to the compacted rows
// (key_rows). On an H100 (BENCHMARKS.md, twenty-fourth pass; 16 heads, head dim 64, k = 64), fwd /
// fwd+bwd ms, block tiles against the lists:
//   D     16K 0.328 / 0.680 against 0.265 / 0.535; 64K 0.354 / 0.944 against 0.941 / 1.893;
//         256K 1.094 / 3.372 against 3.658 / 7.365;
//   SW+D  16K 0.371 / 0.766 against 0.387 / 0.807; 64K 0.754 / 2.132 against 1.350 / 2.957;
//         256K 2.455 / 7.101 against 5.327 / 11.421.
// At 16K and below D's block tiles are host-bound (about 30 LibTorch operations a call), so
// dilated_attention takes them from L = kDilatedTilesMinLength on (dilated_attention_native); the
// lists path (ops::sparse_attention's tile plan over the union's lists, the definition) serves
// shorter rows, the CPU and float32. HAX_D_KERNELS=0 keeps the lists everywhere, 2 takes the block
// tiles wherever they run (for comparisons).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace hax::ops {

// The shortest L for which dilated_attention takes the block-tile form (see above).
constexpr int64_t kDilatedTilesMinLength = 32768;

// Whether dilated_attention takes the block-tile form (see above): CUDA, bfloat16 or autocast,
// head dims up to 128, L >= kDilatedTilesMinLength.
bool dilated_attention_native(const at::Tensor& q, const at::Tensor& v);

// Differentiable in q, k, v (through both outputs). q, k (B, L, H, D), v (B, L, H, Dv); keys >= 1,
// stride >= 1, window >= 0, scale > 0. Returns (out (B, L, H, Dv), lse (B, H, L)); lse is float32
// on CUDA and q's dtype on the CPU. A query whose set is empty (D alone, i < r - 1) outputs 0 with
// lse = -inf. Packed rows (seq_idx) are not taken: their phase restarts per sequence
// (patterns::dilated), which the caller builds as lists.
std::tuple<at::Tensor, at::Tensor> dilated_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     int64_t keys, int64_t stride, int64_t window, double scale);

// The block-tile form (the causal kernels twice, joined by lse) on any device and dtype, with
// gradients: dilated_attention takes it where dilated_attention_native holds; tests also run it on
// the CPU in float64 and on CUDA in bfloat16 with its backward.
std::tuple<at::Tensor, at::Tensor> dilated_attention_tiles(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, int64_t keys, int64_t stride,
                                                           int64_t window, double scale);

// The union's lists: (B, H, L, K) int32, ascending, -1 padded, K = max(1, min(L, keys + window)):
// for query i the dilated keys outside the window, then the window [max(0, i - window + 1), i].
at::Tensor dilated_lists(int64_t B, int64_t H, int64_t L, int64_t keys, int64_t stride, int64_t window,
                         const at::Device& device);

// The block-tile form's band over the compacted keys (see above): int32 (4, B, H, L) on `device`, parts
// first key, last key of each query, first query, last query of each compacted key (rows m >= L / r
// are padding no query sees).
at::Tensor dilated_band(int64_t B, int64_t H, int64_t L, int64_t keys, int64_t stride, int64_t window,
                        const at::Device& device);

// Dense masked-softmax reference with LibTorch ops (test oracle; float64, small L). Rows with an
// empty set output 0 and lse -inf.
std::tuple<at::Tensor, at::Tensor> dilated_attention_reference(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, int64_t keys, int64_t stride,
                                                               int64_t window, double scale);

}  // namespace hax::ops
