// Hierarchical sparse attention's attention step (HSA; seed 003, DESIGN.md section 2): each query
// attends inside the k chunks it retrieved, one softmax per chunk, and sums the k results with
// its retrieval weights:
//
//   out[b,i,h] = Σ_{s < S, chunk c = chunks[b,i,s] valid} w[b,i,s] · Σ_{j < C} softmax_j(scale · q[b,i,h]·k[b,t_j,h]) v[b,t_j,h],
//   t_j = start[b,c] + j   (the chunk's C keys),
//
// where a slot is valid when 0 <= c < NC and start[b,c] >= 0; a query without a valid slot outputs
// 0. The retrieval itself (landmarks, scores, top-k, the weights' softmax) is layers/hsa.h's.
// Gradients flow to q, k, v and w (the retrieval is trained through w).
//
// On CUDA in bfloat16 (or under autocast) with head dims that are multiples of 8 up to 128 and
// 1 <= C <= 64 (hsa_attention_native) it runs per chunk, without lists: the (query, slot) pairs
// are sorted by chunk, and a block attends 64 pairs of one chunk to its C keys (params.h has the
// plan and cuda/hsa.cu the kernels). Elsewhere it runs ops::sparse_attention over the (query, slot)
// lists with w as segment weights, the definition.
#pragma once
#include <ATen/ATen.h>

namespace hax::ops {

// Whether hsa_attention takes the CUDA fast path for these inputs and sizes.
bool hsa_attention_native(const at::Tensor& q, const at::Tensor& v, int64_t chunk);

// q, k (B, L, H, D), v (B, L, H, Dv); chunks (B, L, S) int32 chunk numbers (-1: no chunk);
// start (B, NC) int32 first key of each chunk (-1: missing); w (B, L, S) floating weights; chunk
// C >= 1 (every chunk's keys start .. start + C - 1 must lie below L); scale > 0.
// Returns out (B, L, H, Dv), differentiable in q, k, v and w.
at::Tensor hsa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& chunks,
                         const at::Tensor& start, const at::Tensor& w, int64_t chunk, double scale);

// The (query, slot) lists of the definition: (B, H, L, S, C) int32 key positions, -1 for invalid
// slots (the same lists as patterns::chunk_lists; ops may not depend on patterns).
at::Tensor hsa_lists(const at::Tensor& chunks, const at::Tensor& start, int64_t chunk, int64_t H);

// Dense reference with LibTorch ops (test oracle; float64, small sizes): gathers each slot's C
// keys and values and takes the per-slot softmax, differentiable by autograd.
at::Tensor hsa_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& chunks, const at::Tensor& start, const at::Tensor& w,
                                   int64_t chunk, double scale);

}  // namespace hax::ops
