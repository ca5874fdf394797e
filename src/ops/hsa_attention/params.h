// Plain parameters of HSA attention's CUDA kernels (no LibTorch: the .cu files include this). See
// hsa_attention.h for the definition.
//
// The CUDA path works on (query, slot) pairs: pair p = (b L + i) S + s, chunk c = chunks[p].
// The binding sorts the valid pairs by their key u = b NC + c (the plan below), so that the pairs
// of one chunk are one run of the sorted order; a run is cut into tiles of 64 pairs. Then:
//   forward   one block per (tile, head): the tile's 64 query rows (gathered) against the chunk's
//             C <= 64 keys, one softmax per pair; each pair's output o_p (bfloat16) and lse_p;
//   combine   out[b,i,h] = Σ_s w_p o_p over the query's valid slots (0 without any);
//   dots      d_p,h = dout[b,i,h] · o_p,h: Δ of the pair's softmax (its cotangent is w_p dout),
//             and dw_p = Σ_h d_p,h;
//   backward  one block per (group of up to kHsaGroupTiles tiles of one chunk, head): each tile's
//             P = exp(S - lse_p), dS = w_p P (dout V^T - d_p), dq_p = scale dS K (stored per pair,
//             then summed per query as `combine` does), and the group's dK, dV of the chunk keys
//             (scale Σ dS^T Q, Σ w_p P^T dout) summed in registers; a chunk of one group stores them,
//             a chunk of several stores each group's sums in a slot of the workspace;
//   reduce    the slots of each chunk of several groups, added in group order.
// No atomics: the backward is deterministic.
#pragma once
#include <cstdint>

namespace hax::ops {

constexpr int64_t kHsaCudaMaxChunk = 64;  // keys per chunk the CUDA kernels take (one tile)
constexpr int64_t kHsaTilePairs = 64;     // pairs per tile
constexpr int64_t kHsaGroupTiles = 16;    // tiles per block of the backward (a chunk's tiles are split in groups)

// The plan (all on the device, built by the binding without host synchronization); U = B NC.
struct HsaPlan {
  const int32_t* order = nullptr;      // (P) pair ids sorted by key (stable), the valid ones first
  const int32_t* pair_key = nullptr;   // (P) key u of each pair, U when the pair is invalid
  const int32_t* first = nullptr;      // (U) index in `order` of the key's first pair
  const int32_t* count = nullptr;      // (U) the key's pairs
  const int32_t* tile_end = nullptr;   // (U) inclusive prefix sum of ceil(count / 64)
  const int32_t* group_end = nullptr;  // (U) inclusive prefix sum of ceil(tiles / kHsaGroupTiles)
  const int32_t* slot_end = nullptr;   // (U) inclusive prefix sum of the groups of keys with more than one
  int64_t max_tiles = 0;               // bounds of the grids (the sums are known on the device only)
  int64_t max_groups = 0;
  int64_t max_slots = 0;
};

// Upper bounds of the plan's sums for P pairs and U keys (no host synchronization needed).
inline int64_t hsa_max_tiles(int64_t P, int64_t U) { return (P + kHsaTilePairs - 1) / kHsaTilePairs + U; }
inline int64_t hsa_max_groups(int64_t P, int64_t U) {
  return (hsa_max_tiles(P, U) + kHsaGroupTiles - 1) / kHsaGroupTiles + U;
}
// A key of g > 1 groups has more than (g - 1) kHsaGroupTiles tiles, so g < 2 tiles / kHsaGroupTiles.
inline int64_t hsa_max_slots(int64_t P, int64_t U) {
  return (2 * hsa_max_tiles(P, U) + kHsaGroupTiles - 1) / kHsaGroupTiles;
}

struct HsaParams {
  int64_t batch = 0, seqlen = 0, nheads = 0, dim = 0, vdim = 0;  // B, L, H, D, Dv (multiples of 8, <= 128)
  int64_t nslots = 0;        // S: chunks per query
  int64_t nchunks = 0;       // NC: chunks per row
  int64_t chunk = 0;         // C: keys per chunk (1 .. kHsaCudaMaxChunk)
  double scale = 1.0;        // score multiplier
  const void* q = nullptr;   // (B, L, H, D) bfloat16, 16-byte aligned
  const void* k = nullptr;   // (B, L, H, D)
  const void* v = nullptr;   // (B, L, H, Dv)
  const int32_t* start = nullptr;  // (B, NC) first key of each chunk
  const float* w = nullptr;  // (B, L, S) the slots' weights
  void* o_pair = nullptr;    // (P, H, Dv) bfloat16: out, each pair's softmax output (forward); in (backward)
  float* lse_pair = nullptr; // (P, H): out (forward), in (backward); natural log
};

struct HsaGradParams {
  HsaParams fwd;                 // the forward's inputs, o_pair and lse_pair
  const void* dout = nullptr;    // (B, L, H, Dv)
  float* delta = nullptr;        // (P, H) scratch: d_p,h
  float* dw = nullptr;           // (B, L, S) out: float32
  void* dq_pair = nullptr;       // (P, H, D) bfloat16 scratch: each pair's dq
  void* dq = nullptr;            // (B, L, H, D) out
  void* dk = nullptr;            // (B, L, H, D) out: must be zero on entry (rows outside retrieved chunks stay 0)
  void* dv = nullptr;            // (B, L, H, Dv) out: likewise
  float* workspace = nullptr;    // hsa_cuda_workspace entries: the slots' partial dK, dV
};

// Float32 entries of the backward's workspace: (max_slots, H, 2, 64, max(D, Dv)).
inline int64_t hsa_cuda_workspace(const HsaParams& p, const HsaPlan& plan) {
  return plan.max_slots * p.nheads * 2 * kHsaCudaMaxChunk * (p.dim > p.vdim ? p.dim : p.vdim);
}

// bfloat16 only (tensor cores); `stream` is a cudaStream_t.
void hsa_forward_cuda(const HsaParams& p, const HsaPlan& plan, void* out, void* stream);
void hsa_backward_cuda(const HsaGradParams& gp, const HsaPlan& plan, void* stream);

}  // namespace hax::ops
