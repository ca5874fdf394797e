// A-shaped attention (the "A" pattern of the HAX paper: a sliding window plus attention sinks):
//
//   out[b,i,h] = Σ_{j ∈ A(i)} softmax_j( scale · q[b,i,h]·k[b,j,h] ) v[b,j,h],
//   A(i) = { j <= i : j > i - window  or  j < sink }
//
// the union (each key once) of the `window` most recent keys, self included, and the first `sink`
// keys of the row. Memory O(L·D); no list or L x L tensor on the fast path.
//
// On CUDA in bfloat16 (or under autocast) with head dims that are multiples of 8 up to 128 and
// 1 <= sink <= 64 (a_shaped_attention_native), it runs as two disjoint parts of one softmax: the
// window, and the sink keys outside it. The causal attention forward takes the sink as one more
// key tile; the backward runs the causal backward (the window) with the union's out and lse, then
// the kernels of cuda/sink.cu add the sink part's gradients (params.h). Elsewhere (the CPU,
// float32, other sizes) it runs ops::sparse_attention over the union's lists, the definition.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace hax::ops {

// Whether a_shaped_attention takes the CUDA fast path for these inputs and sizes.
bool a_shaped_attention_native(const at::Tensor& q, const at::Tensor& v, int64_t window, int64_t sink);

// Differentiable in q, k, v (through both outputs). q, k (B, L, H, D), v (B, L, H, Dv); window
// >= 1, sink >= 0, scale > 0. Returns (out (B, L, H, Dv), lse (B, H, L)); lse is float32 on
// CUDA and q's dtype on the CPU. Packed rows (seq_idx) are not taken: their sinks are per sequence
// (patterns::sink), which the caller builds as lists.
std::tuple<at::Tensor, at::Tensor> a_shaped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      int64_t window, int64_t sink, double scale);

// The union's lists: (B, H, L, K) int32, ascending, -1 padded, K = min(L, sink + window): for
// query i the sink keys [0, min(sink - 1, i - window)], then the window [max(0, i - window + 1), i].
at::Tensor a_shaped_lists(int64_t B, int64_t H, int64_t L, int64_t window, int64_t sink, const at::Device& device);

// Dense masked-softmax reference with LibTorch ops (test oracle; float64, small L).
std::tuple<at::Tensor, at::Tensor> a_shaped_attention_reference(const at::Tensor& q, const at::Tensor& k,
                                                                const at::Tensor& v, int64_t window, int64_t sink,
                                                                double scale);

}  // namespace hax::ops
