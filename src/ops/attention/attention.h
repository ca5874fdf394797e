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

#include <tuple>

namespace hax::ops {

// How the kernels compute a block of queries (consecutive in q_order). Every path gives the same
// result up to rounding; kAuto is the fast choice, the others exist for tests and benchmarks.
enum class AttentionPath {
  kAuto,      // dense tiles over the block's key union when it is small (queries share keys), else per query
  kTiles,     // always dense tiles (the union's size is then only bounded by the block's S·K per query)
  kPerQuery,  // always per-query gathers of the listed keys
};

struct AttentionParams {
  int64_t batch = 0, seqlen = 0, keylen = 0, nheads = 0, dim = 0, vdim = 0, nseg = 0, maxkeys = 0;
  double scale = 1.0;             // score multiplier, e.g. 1/sqrt(D) (double, so that float64 runs are exact)
  const void* q = nullptr;        // (B, L, H, D)
  const void* k = nullptr;        // (B, Lk, H, D)
  const void* v = nullptr;        // (B, Lk, H, Dv)
  const int32_t* idx = nullptr;   // (B, H, L, S, K) key positions in [0, Lk), -1 = none; no duplicates in a segment
  const void* bias = nullptr;     // (B, H, Lk) additive per-key score bias, or null
  const void* seg_w = nullptr;    // (B, H, L, S) segment weights, or null (all 1)
  const int32_t* q_order = nullptr;  // (B, H, L) permutation of queries: consecutive ones are computed
                                     // together and should share keys (speed only), or null (0..L-1)
  void* out = nullptr;            // out (B, L, H, Dv)
  void* lse = nullptr;            // out (B, H, L, S) log-sum-exp of each segment's scores (-inf if empty)
  AttentionPath path = AttentionPath::kAuto;
};

struct AttentionGradParams {
  AttentionParams fwd;            // inputs, and lse from the forward
  const void* dout = nullptr;     // (B, L, H, Dv)
  const void* dlse = nullptr;     // (B, H, L, S) gradient of lse, or null (zero)
  void* dq = nullptr;             // out (B, L, H, D)
  void* dk = nullptr;             // out (B, Lk, H, D)
  void* dv = nullptr;             // out (B, Lk, H, Dv)
  void* dbias = nullptr;          // out (B, H, Lk), or null when there is no bias
  void* dseg_w = nullptr;         // out (B, H, L, S), or null when there are no weights
};

void sparse_attention_forward_cpu(const AttentionParams& p, at::ScalarType dtype);
void sparse_attention_backward_cpu(const AttentionGradParams& p, at::ScalarType dtype);

// Differentiable in q, k, v, bias and seg_w (undefined tensors = absent), through both outputs.
// idx may be (B, H, L, K) for one segment (lse is then still (B, H, L, 1)). q_order, when given,
// must be a permutation of 0..L-1 for every (b, h). scale > 0 (e.g. 1/sqrt(D)). Checked: shapes,
// dtypes (float32/float64, idx and q_order int32), idx values in [-1, Lk), q_order a permutation,
// L·S·K < 2^31; not checked: distinct keys within a segment (a repeated key counts twice, unlike
// in the reference). Returns (out (B, L, H, Dv), lse (B, H, L, S)).
std::tuple<at::Tensor, at::Tensor> sparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& idx, const at::Tensor& bias,
                                                    const at::Tensor& seg_w, const at::Tensor& q_order, double scale);

// Dense reference written with LibTorch ops (masked softmax over an L x Lk score matrix per
// segment): the test oracle, differentiable by autograd. Use float64 and small L.
std::tuple<at::Tensor, at::Tensor> sparse_attention_reference(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& idx,
                                                              const at::Tensor& bias, const at::Tensor& seg_w,
                                                              double scale);

// The path that sparse_attention() uses (process-wide; default kAuto). For tests and benchmarks.
void set_sparse_attention_path(AttentionPath path);
AttentionPath sparse_attention_path();

}  // namespace hax::ops
