// Plain parameters of the A-shaped attention's CUDA sink kernels (no LibTorch: the .cu files
// include this). See a_shaped_attention.h for the definition.
//
// On CUDA the union is two disjoint parts: the sliding window, and the sink keys the window leaves
// out; query i's sink part is the keys
//   j in [0, e_i],   e_i = min(sink - 1, i - window)   (empty when i < window).
// The forward is the causal attention forward with its `sink` parameter (ops/causal_attention:
// the sink's key tile is one more tile of the online softmax). The backward runs the causal
// backward (the window's dq, dk, dv) with the union's out, lse and Δ, the same softmax as one
// attention, then the kernels here add the sink part's share to dq and to the sink keys' dk, dv.
#pragma once
#include <cstdint>

namespace hax::ops {

// The most sink keys the CUDA kernels take (one 64-key tile per block); more go to the lists.
constexpr int64_t kASinkCudaMaxKeys = 64;

struct ASinkParams {
  int64_t batch = 0, seqlen = 0, nheads = 0, dim = 0, vdim = 0;  // B, L, H, D, Dv (D, Dv multiples of 8, <= 128)
  int64_t window = 0;       // the window part's keys per query (>= 1)
  int64_t sink = 0;         // the first `sink` keys (1 .. kASinkCudaMaxKeys)
  double scale = 1.0;       // score multiplier
  const void* q = nullptr;  // (B, L, H, D) bfloat16, 16-byte aligned
  const void* k = nullptr;  // (B, L, H, D)
  const void* v = nullptr;  // (B, L, H, Dv)
  const float* lse = nullptr;  // (B, H, L) the union's lse (natural log; its out enters through Δ)
};

struct ASinkGradParams {
  ASinkParams fwd;               // q, k, v, and the union's lse
  const void* dout = nullptr;    // (B, L, H, Dv)
  const float* delta = nullptr;  // (B, H, L) Δ_i = dO_i · O_i - dlse_i (the causal backward's workspace)
  void* dq = nullptr;            // (B, L, H, D): in, the window part's gradient; out, plus the sink part's
  void* dk = nullptr;            // (B, L, H, D): rows j < sink get the sink part's share added
  void* dv = nullptr;            // (B, L, H, Dv): likewise
  float* workspace = nullptr;    // a_sink_cuda_workspace(fwd) float32 entries (per-chunk partial dK, dV)
};

// Query tiles (64 queries) per block of the sink backward: each block sums its chunk's dK, dV of
// the sink keys in registers and stores them once; a second kernel adds the chunks in order.
constexpr int64_t kASinkChunkTiles = 16;

inline int64_t a_sink_chunks(const ASinkParams& p) {
  const int64_t tiles = (p.seqlen + 63) / 64;
  return (tiles + kASinkChunkTiles - 1) / kASinkChunkTiles;
}
// Float32 entries of the backward's workspace: (chunks, B H, 2, sink, max(D, Dv)) partial sums
// of dK (scaled later) and dV per chunk.
inline int64_t a_sink_cuda_workspace(const ASinkParams& p) {
  return a_sink_chunks(p) * p.batch * p.nheads * 2 * p.sink * (p.dim > p.vdim ? p.dim : p.vdim);
}

// bfloat16 only (tensor cores); `stream` is a cudaStream_t. Deterministic.
void a_sink_backward_cuda(const ASinkGradParams& gp, void* stream);

}  // namespace hax::ops
