// Plain parameters of the sparse attention kernels and the CUDA launchers (no LibTorch: the .cu
// files include this). See attention.h for the definition of the op.
#pragma once
#include <cstdint>

#include "ops/kernel_dtype.h"

namespace hax::ops {

// How the kernels compute a block of queries (consecutive in q_order). Every path gives the same
// result up to rounding; kAuto is the fast choice, the others exist for tests and benchmarks.
// (The CPU kernels read it; the CUDA kernels have one path.)
enum class AttentionPath {
  kAuto,      // dense tiles over the block's key union when it is small (queries share keys), else per query
  kTiles,     // always dense tiles (the union's size is then only bounded by the block's S·K per query)
  kPerQuery,  // always per-query gathers of the listed keys
};

// Raw-pointer parameters of the forward (all tensors contiguous; q, k, v, bias, seg_w, out of one
// floating dtype: float32/float64 on the CPU, float32/bfloat16 on CUDA).
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
  void* lse = nullptr;            // out (B, H, L, S) log-sum-exp of each segment's scores (-inf if empty);
                                  // float32 on CUDA, the input dtype on the CPU
  AttentionPath path = AttentionPath::kAuto;
  // CUDA tile kernels at head dim 64 on sm_90a: every tile product on wgmma (false: mma.sync, the
  // form before; tests run both). HAX_TILE_WGMMA picks a form for timing comparisons when on.
  bool wgmma_products = true;
  // CPU only: the forward sets *invalid to 1 when idx holds an entry outside [-1, Lk), which the
  // kernels treat as absent (the binding then reports it); checking there costs no extra pass.
  int32_t* invalid = nullptr;
  // CPU only, one segment: when set, the forward records each tile block's key union (item it =
  // bh * blocks + block, sizes from sparse_attention_cpu_unions()), and the backward takes it
  // from there instead of collecting it again from idx.
  int32_t* union_count = nullptr;  // (items) union size U, or -1: not recorded (computed per query)
  int32_t* union_keys = nullptr;   // (items, limit) key of union row u
  uint8_t* union_mult = nullptr;   // (items, limit, lanes) how often query lane r lists key u
  // CUDA only: when set, the blocks of kAttentionTileQueries queries (in q_order) whose plan
  // entry is >= 0 are computed by the tile kernels, and the per-query kernels skip their queries.
  const int32_t* tile_count = nullptr;  // (B*H, ceil(L / kAttentionTileQueries)), see AttentionTilePlan
  // With tile_count, optional: how many of its blocks overflow (AttentionTilePlan::overflow); when
  // 0, the per-query kernels return at once instead of checking every block's count.
  const int32_t* tile_overflow = nullptr;
  // CUDA tile plan only: a second list per query whose keys join idx's (the plan of the union of
  // two lists; keys in both count once), (B, H, L, maxkeys_b), or null. Needs maxkeys + maxkeys_b
  // <= kAttentionPlanMaxStagedKeys.
  const int32_t* idx_b = nullptr;
  int64_t maxkeys_b = 0;
  // CUDA tile plan only, instead of idx_b: a band of sorted keys (an LSH band, patterns::LshBand)
  // whose keys join idx's. The query of rank t in q_order (one (b, h) row) lists the keys
  // band_pos[band[t]], ..., band_pos[band[n + t]] (none when band[n + t] < band[t]; n = B*H*L, rows
  // L apart), at most band_keys of them; their positions are distinct within a row. Not checked
  // against anything: the caller states that the band and these lists agree.
  const int32_t* band = nullptr;      // (2, B, H, L): first and last sorted key of each ranked query
  const int32_t* band_pos = nullptr;  // (B, H, Lk) the key position of each sorted key
  int64_t band_keys = 0;
  // CUDA tile plan only, with a band, instead of idx: Key Selection's keys as intervals
  // (patterns::KeyIntervals): the query at position i of row (b, h) lists every key iv_key[bh][t]
  // with iv_key[bh][t] <= i < iv_leave[bh][t], t < iv_count[bh]; keys ascend along a row. idx is
  // then not read by the plan (the per-query kernels read the merged rows of blocks that overflow).
  const int32_t* iv_count = nullptr;  // (B*H)
  const int32_t* iv_key = nullptr;    // (B*H, iv_stride)
  const int32_t* iv_leave = nullptr;  // (B*H, iv_stride)
  int64_t iv_stride = 0;
};

// Raw-pointer parameters of the backward. On the CPU every gradient has the input dtype. On CUDA,
// dq and dseg_w have the input dtype, while dk, dv and dbias are float32 accumulators (the binding
// casts them): zeroed by the binding unless `deterministic`, in which case the kernels write every
// element.
struct AttentionGradParams {
  AttentionParams fwd;            // inputs, and lse from the forward
  const void* dout = nullptr;     // (B, L, H, Dv)
  const void* dlse = nullptr;     // (B, H, L, S) gradient of lse (float32 on CUDA), or null (zero)
  void* dq = nullptr;             // out (B, L, H, D)
  void* dk = nullptr;             // out (B, Lk, H, D)
  void* dv = nullptr;             // out (B, Lk, H, Dv)
  void* dbias = nullptr;          // out (B, H, Lk), or null when there is no bias
  void* dseg_w = nullptr;         // out (B, H, L, S), or null when there are no weights
  // CUDA only.
  bool deterministic = false;     // sum dk, dv, dbias per key in a fixed order (key_entries) instead
                                  // of with float atomics
  const int32_t* key_entries = nullptr;  // deterministic: (B*H, L*S*K) for each (b, h), the list entries
                                         // e = (i*S + s)*K + t sorted by their key, stable (ascending e
                                         // within a key); padding entries (-1) come first
  const int32_t* key_start = nullptr;    // deterministic: (B*H, Lk + 1) position in key_entries of
                                         // the first entry of key j; key_start[Lk] = end of key Lk-1
  // Deterministic: the key pass splits each key's entries into work chunks of at most
  // kAttentionKeyChunk entries (a key every list names would otherwise be one long serial sum).
  const int64_t* key_chunk_start = nullptr;    // (B*H*Lk + 1) first chunk of key (b, h, j) at [bh*Lk + j]:
                                               // exclusive prefix sum of max(1, ceil(entries / kAttentionKeyChunk))
  const int64_t* key_partial_start = nullptr;  // (B*H*Lk + 1) first partial row of a key of several chunks
                                               // (exclusive prefix sum of its chunk count, 0 for one chunk)
  int64_t key_chunks = 0;                      // key_chunk_start[B*H*Lk]
  float* key_partials = nullptr;               // (key_partial_start[B*H*Lk], D + Dv + 1) per-chunk sums
                                               // Σ dscore q, Σ w a dO, Σ dscore of keys of several chunks
  float* workspace = nullptr;     // float32 scratch of sparse_attention_cuda_workspace(*this) entries
  // CUDA tile path with a plan's key_uses (AttentionTilePlan): a key of one block has its tile's
  // sums stored into dk_bf16, dv_bf16 (input dtype), a key of two blocks adds them there with
  // bfloat16 atomics; only the other keys' rows of dk, dv are used. sparse_attention_many_use_rows_cuda
  // zeroes the rows that get added to (and those of keys of no block) and casts the float32 ones,
  // so that neither the float32 accumulators nor dk_bf16, dv_bf16 need a fill of their whole size,
  // nor the accumulators a cast. Null: every key is summed in dk, dv.
  const int32_t* key_uses = nullptr;  // (B*H, Lk)
  void* dk_bf16 = nullptr;            // (B, Lk, H, D)
  void* dv_bf16 = nullptr;            // (B, Lk, H, Dv)
};

// ---------------------------------------------------------------------------------------------
// CUDA tile path (bfloat16, one segment, not deterministic): a block of kAttentionTileQueries
// consecutive queries in q_order shares its keys, so the kernels gather the block's key union
// (at most kAttentionTileMaxKeys keys, ascending) into shared-memory tiles of
// kAttentionTileKeys rows and run tensor-core tile products over it, masking each (query, key)
// pair by a bit of the plan. Blocks with a larger union keep the per-query kernels.
constexpr int64_t kAttentionTileQueries = 64;
constexpr int64_t kAttentionTileKeys = 64;
constexpr int64_t kAttentionTileMaxKeys = 512;
constexpr int64_t kAttentionTilesPerBlock = kAttentionTileMaxKeys / kAttentionTileKeys;
// Keys a query up to which the plan kernel stages a block's lists in shared memory (the plan of
// two lists, AttentionParams::idx_b, is staged only).
constexpr int64_t kAttentionPlanMaxStagedKeys = 384;
// Sorted keys from the first to the last of a block's band (AttentionParams::band) up to which
// the plan marks the band's keys in a bitmap (else it takes them one by one, as list entries).
constexpr int64_t kAttentionPlanBandSpan = 1024;

// The plan of every query block, built on the device from idx and q_order (tile_plan.cu).
struct AttentionTilePlan {
  int32_t* count = nullptr;  // (B*H, nblk) size of the block's key union, or -1 if it exceeds
                             // kAttentionTileMaxKeys (the per-query kernels take the block)
  int32_t* keys = nullptr;   // (B*H, nblk, kAttentionTileMaxKeys) the union (ascending if built
                             // sorted, see sparse_attention_tile_plan_cuda), -1 padded
  uint64_t* mask = nullptr;  // (B*H, nblk, kAttentionTilesPerBlock, kAttentionTileQueries): bit c of
                             // mask[..., t, r] = query r of the block lists key keys[t*64 + c]
  // Optional, plans with a band (AttentionParams::band) only: (B*H, Lk) how many planned blocks
  // hold each key in their union (so add to its dk and dv), zeroed by the caller; a key of a block
  // that overflows gets kAttentionKeyManyUses or more. The backward then stores the sums of a key
  // of one block directly and adds those of a key of two blocks in bfloat16
  // (AttentionGradParams::key_uses).
  int32_t* key_uses = nullptr;
  // Optional: the number of blocks whose union overflows (count -1), counted by the plan (zeroed by
  // the caller), for AttentionParams::tile_overflow.
  int32_t* overflow = nullptr;
};
// A key_uses value that marks a key of an overflowing block (a store, never reached by the counts:
// a key is in at most L / 64 < 2^30 blocks' unions).
constexpr int32_t kAttentionKeyManyUses = 1 << 30;
// The most blocks whose sums of a key's dk and dv the tile backward adds in bfloat16: a key of one
// block gets its sum stored (rounded once, as from a float32 accumulator); of two, each sum is
// rounded to bfloat16 and added to the zeroed bfloat16 row with atomics (two roundings of sums and
// one of their total, against one rounding of a float32 total).
constexpr int32_t kAttentionKeyFewUses = 2;
HAX_HOST_DEVICE inline int64_t attention_tile_blocks(int64_t L) { return (L + kAttentionTileQueries - 1) / kAttentionTileQueries; }

// Whether the CUDA tile path applies: bfloat16, one segment, no segment weights, not
// deterministic, head dims <= 128 and not forced onto the per-query path.
inline bool attention_tiles_apply(const AttentionParams& p, DType dtype, bool deterministic) {
  return dtype == DType::kBF16 && p.nseg == 1 && p.seg_w == nullptr && !deterministic &&
         p.path != AttentionPath::kPerQuery && p.dim <= 128 && p.vdim <= 128 && p.maxkeys > 0;
}

// Builds the plan (needs p.idx, p.q_order and the sizes; with p.idx_b or p.band, the union of
// both lists, unsorted only, Kb or band_keys plus maxkeys <= kAttentionPlanMaxStagedKeys). A band's
// keys come first in the union, in sorted order, where a block's band keys span at most
// kAttentionPlanBandSpan sorted keys; each query's band then covers consecutive union entries,
// whose plan bits are set as ranges without lookups. sorted: the union ascending (the
// documented form of TileBlocks); otherwise in the kernel's hash-slot order, which skips the
// sort: the attention's result is the same up to the order of its float sums, which may then
// differ between runs when keys collide in the hash set (the tile path is not the deterministic mode).
void sparse_attention_tile_plan_cuda(const AttentionParams& p, const AttentionTilePlan& plan, void* stream,
                                     bool sorted = true);
// Forward of the planned blocks (bfloat16): out and lse of their queries.
void sparse_attention_tile_forward_cuda(const AttentionParams& p, const AttentionTilePlan& plan, void* stream);
// Backward of the planned blocks: dq (bfloat16) of their queries, and their contributions to the
// float32 accumulators dk, dv, dbias (atomics). Needs gp.fwd.out, the forward's output.
void sparse_attention_tile_backward_cuda(const AttentionGradParams& gp, const AttentionTilePlan& plan, void* stream);

// With gp.key_uses (params.h): finish false, before the backward's kernels, zeroes the float32
// rows of dk, dv (gp.dk / gp.dv) of the keys of more than kAttentionKeyFewUses blocks and the rows
// of dk_bf16, dv_bf16 of the keys of 0 or of 2 to kAttentionKeyFewUses blocks; finish true, after
// them, casts those float32 rows into dk_bf16, dv_bf16.
void sparse_attention_many_use_rows_cuda(const AttentionGradParams& gp, bool finish, void* stream);

// Entries per work chunk of the deterministic key pass.
constexpr int64_t kAttentionKeyChunk = 256;

// CUDA launch shape shared by the launchers and the workspace size: a group of G lanes (4, 8, 16
// or 32) computes one query (or, in the backward's key pass, one key); each lane holds 4 of the
// head's max(D, Dv) <= 4·G dims. A CTA has kAttentionCudaThreads threads.
constexpr int kAttentionCudaThreads = 256;
inline int attention_cuda_group(int64_t dim, int64_t vdim) {
  const int64_t m = dim > vdim ? dim : vdim;
  return m <= 16 ? 4 : m <= 32 ? 8 : m <= 64 ? 16 : 32;
}
// The largest head dim (D and Dv) the CUDA kernels take.
constexpr int64_t kAttentionCudaMaxDim = 128;

// Whether the CUDA backward keeps each group's per-entry (softmax weight, dp) of one segment in
// shared memory (K·8 bytes per group), rather than in the global workspace.
inline bool attention_cuda_entries_in_smem(const AttentionParams& p) {
  const int64_t groups = kAttentionCudaThreads / attention_cuda_group(p.dim, p.vdim);
  return groups * p.maxkeys * 8 <= 48 * 1024;
}

// Float32 entries of scratch the CUDA backward needs: two per list entry (2·B·H·L·S·K) in
// deterministic mode (each entry's dscore and w·a for the per-key pass) or when a segment's
// entries do not fit in shared memory; otherwise none.
inline int64_t sparse_attention_cuda_workspace(const AttentionGradParams& gp) {
  const AttentionParams& p = gp.fwd;
  if (!gp.deterministic && attention_cuda_entries_in_smem(p)) return 0;
  return 2 * p.batch * p.nheads * p.seqlen * p.nseg * p.maxkeys;
}

// CUDA kernels (float32 or bfloat16 storage, float32 math; D, Dv <= 128); `stream` is a
// cudaStream_t. See cuda/forward.cu and cuda/backward.cu.
// join_by_lse (attention.h) on CUDA: o1, o2, out, dout, do1, do2 (B, L, H, Dv) of the dtype;
// lse1, lse2 (B, H, L) and w (B, L, H), dlse1 (B, H, L) float32. Forward: w = sigmoid(lse1 - lse2)
// (1/2 when both are -inf), out = o2 + w (o1 - o2). Backward: do1 = w dout, do2 = dout - do1,
// dlse1 = (dout · (o1 - o2)) w (1 - w) (dlse2 = -dlse1).
struct JoinParams {
  int64_t batch = 0, seqlen = 0, nheads = 0, vdim = 0;
  const void* o1 = nullptr;
  const void* o2 = nullptr;
  const float* lse1 = nullptr;
  const float* lse2 = nullptr;
  void* out = nullptr;     // forward
  float* w = nullptr;      // forward: out; backward: in
  const void* dout = nullptr;
  void* do1 = nullptr;
  void* do2 = nullptr;
  float* dlse1 = nullptr;
};
void join_by_lse_forward_cuda(const JoinParams& p, DType dtype, void* stream);
void join_by_lse_backward_cuda(const JoinParams& p, DType dtype, void* stream);

void sparse_attention_forward_cuda(const AttentionParams& p, DType dtype, void* stream);
void sparse_attention_backward_cuda(const AttentionGradParams& p, DType dtype, void* stream);

}  // namespace hax::ops
