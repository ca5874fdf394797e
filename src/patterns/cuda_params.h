// Plain parameters of the pattern builders' CUDA kernels and their launchers (no LibTorch: the .cu
// files of patterns/cuda/ include this). The tensor-level CUDA paths that fill these structs are
// declared in patterns/cuda_paths.h. Every pointer is to contiguous device memory; every launcher
// takes `stream`, a cudaStream_t.
#pragma once
#include <cstdint>

#include "ops/kernel_dtype.h"

namespace hax::patterns {

using ops::DType;

// ---------------------------------------------------------------------------------------------
// Packed sequences.

// The bounds of every position's packed sequence: [start, end) is the sequence of position i.
struct SequenceBoundsParams {
  int64_t B = 0, L = 0;          // rows, positions per row
  const int32_t* seq = nullptr;  // (B, L) non-decreasing sequence numbers, or null (one sequence per row)
  int32_t* start = nullptr;      // out (B, L): first position of i's sequence
  int32_t* end = nullptr;        // out (B, L): one past the last position of i's sequence
};
void sequence_bounds_cuda(const SequenceBoundsParams& p, void* stream);

// ---------------------------------------------------------------------------------------------
// SW, sink, dilated: every query's keys are an arithmetic progression within its sequence.

enum class ProgressionKind {
  kSlidingWindow,  // the k most recent keys, self included
  kSink,           // the first k keys of the sequence (<= i)
  kDilated,        // keys with (j - start) mod stride = stride - 1, the k most recent
};

struct ProgressionParams {
  int64_t B = 0, H = 0, L = 0, k = 0;  // batch, heads, positions, slots per query
  int64_t stride = 1;                  // the dilation r (kDilated only)
  ProgressionKind kind = ProgressionKind::kSlidingWindow;
  const int32_t* start = nullptr;  // (B, L) sequence start of each position
  int32_t* out = nullptr;          // out (B, H, L, k) int32 lists, -1 padded
};
void progression_lists_cuda(const ProgressionParams& p, void* stream);

// ---------------------------------------------------------------------------------------------
// LSH.

// Buckets of x (B, L, H, N): v = x·proj in float64 (products summed in order of n), centered by
// the causal running mean of v over the position's own sequence, binned by sign bits or argmax.
struct LshBucketsParams {
  int64_t B = 0, L = 0, H = 0, N = 0;  // x's shape (B, L, H, N)
  int64_t h = 0;                       // projections (columns of proj)
  bool argmax = false;                 // binning: argmax over the h columns (else sign bits)
  const void* x = nullptr;             // (B, L, H, N) float32 or bfloat16 (the launcher's dtype)
  int64_t x_sb = 0, x_sl = 0, x_sh = 0;  // x's strides (elements) of b, position and head; n's is 1
  const double* proj = nullptr;        // (N, h) float64
  const int32_t* start = nullptr;      // (B, L) sequence start of each position
  double* values = nullptr;            // workspace (B, L, H, h): x·proj, then (h > 32) the centered values
  double* tiles = nullptr;             // workspace (B, H·h, lsh_bucket_tiles(L)): tile sums, then carries
  int32_t* out = nullptr;              // out (B, L, H) int32 buckets
};
// Positions per tile of the running-mean scan, and the number of tiles of a row.
constexpr int64_t kLshTile = 64;
HAX_HOST_DEVICE inline int64_t lsh_bucket_tiles(int64_t L) { return (L + kLshTile - 1) / kLshTile; }
void lsh_buckets_cuda(const LshBucketsParams& p, DType dtype, void* stream);

// Sort keys of (sequence, bucket, position): for position i of sequence [s, e) (n = e - s) in
// bucket c, key = nb·s + c·n + (i - s), nb the number of buckets. Sequences occupy disjoint key
// ranges [nb·s, nb·e) in order, and within one the keys order by (bucket, position): sorting a
// (b, h) row's keys sorts it by (sequence, bucket, position), and the sequence [s, e) lands at
// sorted indices [s, e). Keys are unique and < nb·L. With row_stride = nb·L, row r = b·H + h adds
// r·nb·L: then one sort of all B·H·L keys sorts every row in place (rows in order).
struct LshSortKeysParams {
  int64_t B = 0, L = 0, H = 0;
  int64_t num_buckets = 0;          // nb: 2^h (sign) or h (argmax)
  const int32_t* bucket = nullptr;  // (B, L, H) buckets
  const int32_t* start = nullptr;   // (B, L)
  const int32_t* end = nullptr;     // (B, L)
  uint64_t row_stride = 0;          // added per row: r·row_stride (nb·L, or 0 for keys of each row alone)
  bool keys64 = true;               // keys are uint64 (else uint32: needs every key < 2^32)
  void* keys = nullptr;             // out (B, H, L) uint64 or uint32
  int32_t* pos = nullptr;           // out (B, H, L): position i of every key (the sort's values), or null
  // Rows of one sequence each ([0, L): no seq_idx) and row_stride nb·L: `keys` gets the uint32
  // short keys r·nb + c instead. Their stable sort (a radix sort is stable, and the keys come in
  // position order) orders the pairs as the full keys do, over fewer bits (12 for 16 rows of 256
  // buckets, against 28 for the full keys at L = 64K: 2 radix passes instead of 4); then
  // lsh_full_keys_cuda turns the sorted short keys into the full ones, (r·nb + c)·L + i.
  bool short_keys = false;
};
void lsh_sort_keys_cuda(const LshSortKeysParams& p, void* stream);

// The full sort keys (uint64 or uint32 as keys64) of sorted short keys (LshSortKeysParams::short_keys):
// full[e] = short_keys[e]·L + pos[e].
struct LshFullKeysParams {
  int64_t n = 0, L = 0;
  bool keys64 = true;
  const uint32_t* short_keys = nullptr;  // (n) sorted
  const int32_t* pos = nullptr;          // (n) their positions
  void* keys = nullptr;                  // out (n)
};
void lsh_full_keys_cuda(const LshFullKeysParams& p, void* stream);

// One radix sort of n (key, position) pairs by the keys' low `bits` bits (every key < 2^bits).
struct LshSortParams {
  int64_t n = 0;
  int bits = 64;
  bool keys64 = true;                // uint64 keys (else uint32)
  const void* keys_in = nullptr;     // (n) keys
  void* keys_out = nullptr;          // out (n) the keys, ascending
  const int32_t* pos_in = nullptr;   // (n) values
  int32_t* pos_out = nullptr;        // out (n) the values in the keys' order
  void* temp = nullptr;              // workspace of lsh_sort_temp_bytes(n, keys64, bits) bytes
  size_t temp_bytes = 0;
};
size_t lsh_sort_temp_bytes(int64_t n, bool keys64, int bits);
void lsh_sort_cuda(const LshSortParams& p, void* stream);

// The short-key case of the sort above (rows of one sequence each, row_stride nb·L) as a counting
// sort by bucket, stable in position, for nb <= kBucketSortMaxBuckets: every row's positions in
// (bucket, position) order, and the full keys (r·nb + c)·L + i of them (lsh_bucket_sort.cu).
constexpr int64_t kBucketSortMaxBuckets = 1024;
constexpr int64_t kBucketSortTile = 2048;  // positions a block counts and scatters
struct LshBucketSortParams {
  int64_t B = 0, L = 0, H = 0;
  int64_t num_buckets = 0;          // nb <= kBucketSortMaxBuckets
  const int32_t* bucket = nullptr;  // (B, L, H) buckets, each in [0, nb)
  int32_t* counts = nullptr;        // workspace: (2, B·H, nb, T) and (B·H, nb), T = ceil(L / kBucketSortTile)
  bool keys64 = true;               // keys are uint64 (else uint32: needs B·H·nb·L <= 2^32)
  void* keys = nullptr;             // out (B, H, L) the sorted full keys, or null
  int32_t* pos = nullptr;           // out (B, H, L) their positions
};
void lsh_bucket_sort_cuda(const LshBucketSortParams& p, void* stream);

// Query i's keys: the sorted key entries of its sequence and its query bucket with position <= i
// are one slice, ending at hi = the number of the row's sorted keys <= key(c, i) (found through a
// table of every S-th sorted key in shared memory, then one window of S entries); the last K of
// it, its entries those of [hi - K, hi) with key >= key(c, s).
struct LshListsParams {
  int64_t B = 0, L = 0, H = 0;
  int64_t K = 0;                        // slots per query
  int64_t num_buckets = 0;              // nb, as for the keys
  const int32_t* q_bucket = nullptr;    // (B, L, H) query buckets
  const int32_t* start = nullptr;       // (B, L)
  const int32_t* end = nullptr;         // (B, L)
  uint64_t row_stride = 0;              // the sort keys' row_stride
  bool keys64 = true;                   // sorted_keys are uint64 (else uint32)
  const void* sorted_keys = nullptr;    // (B, H, L) the key sort keys, ascending per (b, h)
  const int32_t* sorted_pos = nullptr;  // (B, H, L) the position of each sorted key
  int32_t* out = nullptr;               // out (B, H, L, K)
};
void lsh_lists_cuda(const LshListsParams& p, void* stream);

// LSH as a band over the sorted rows (pattern.h, LshBand): for sorted query t (position
// q_order[t]) the slice [hi - m, hi) of the sorted keys that lsh_lists_cuda lists, as band[0][t] =
// hi - m and band[1][t] = hi - 1; then for sorted key s the sorted queries that see it, band[2][s]
// = the first t with band[1][t] >= s and band[3][s] = the last t with band[0][t] <= s (both
// bounds are non-decreasing in t, so these are binary searches).
struct LshBandParams {
  LshListsParams lists;                 // as above; lists.out is unused
  const int32_t* q_order = nullptr;     // (B, H, L) positions of the queries in sorted order
  int32_t* band = nullptr;              // out (4, B, H, L)
  bool key_side = true;                 // false: band[2], band[3] are not written
};
void lsh_band_cuda(const LshBandParams& p, void* stream);

// exclude_band (pattern.h): a's lists without the keys the band gives the same query. The sorted
// rank of every query and key position first (the inverses of q_order and k_order, into the
// workspace), then a warp per (b, h, i) keeps the keys j of its list whose rank lies outside
// [band[0][t], band[1][t]], t the rank of i, in their order, and pads with -1.
struct ExcludeBandParams {
  int64_t B = 0, H = 0, L = 0, K = 0;
  const int32_t* idx = nullptr;      // (B, H, L, K) a's lists
  const int32_t* q_order = nullptr;  // (B, H, L)
  const int32_t* k_order = nullptr;  // (B, H, L)
  const int32_t* band = nullptr;     // (4, B, H, L)
  int32_t* q_rank = nullptr;         // workspace (B, H, L)
  int32_t* k_rank = nullptr;         // workspace (B, H, L)
  int32_t* out = nullptr;            // out (B, H, L, K)
};
void exclude_band_cuda(const ExcludeBandParams& p, void* stream);

// ---------------------------------------------------------------------------------------------
// Key Selection: top k scores of the causal prefix of the query's sequence.
//
// Candidates are compared by a 64-bit key, larger = better: the score (NaN as -inf, -0 as +0) in
// the high 32 bits as an order-preserving unsigned integer, the inverted position in the low 32
// bits (equal scores: the earlier position is larger). Keys are > 0; 0 marks an empty slot.
// Positions are cut into blocks of kTopKBlock queries, blocks into super blocks of kTopKSuper.
constexpr int64_t kTopKBlock = 64;
constexpr int64_t kTopKSuper = 32;
// The largest k the query kernel's shared memory holds (k < L; k >= L is the sliding window).
constexpr int64_t kTopKMaxK = 8192;
HAX_HOST_DEVICE inline int64_t top_k_blocks(int64_t L) { return (L + kTopKBlock - 1) / kTopKBlock; }
HAX_HOST_DEVICE inline int64_t top_k_supers(int64_t L) { return (top_k_blocks(L) + kTopKSuper - 1) / kTopKSuper; }

struct TopKPrefixParams {
  int64_t B = 0, L = 0, H = 0;       // scores' shape (B, L, H)
  int64_t k = 0;                     // keys per query, 1 <= k < L, k <= kTopKMaxK
  const void* scores = nullptr;      // (B, L, H) float32 or bfloat16
  const int32_t* start = nullptr;    // (B, L) sequence start of each position
  uint64_t* block_top = nullptr;     // workspace (B, H, top_k_blocks(L), k): each block's own top k (its last sequence)
  uint64_t* block_prefix = nullptr;  // workspace (B, H, top_k_blocks(L), k): top k of the sequence before each block
  uint64_t* super_top = nullptr;     // workspace (B, H, top_k_supers(L), k): each super block's top k
  uint64_t* super_prefix = nullptr;  // workspace (B, H, top_k_supers(L), k): top k before each super block
  int32_t* out = nullptr;            // out (B, H, L, k), or null with plan_count set
  // The block form of ops/attention/blocks.h instead of lists, when plan_count is set (then
  // k + kTopKBlock <= 512: a block's union is at most its prefix's k keys and its own 64):
  int32_t* plan_count = nullptr;     // out (B, H, top_k_blocks(L)) keys in each block's union
  int32_t* plan_keys = nullptr;      // out (B, H, top_k_blocks(L), 512) the union ascending, -1 padded
  uint64_t* plan_mask = nullptr;     // out (B, H, top_k_blocks(L), 8, 64) a bit per (query, union key)
  // Block form only, optional: keys to leave out (an LSH band's, patterns::LshBand): query i does
  // not see key j when ex_lo[i] <= ex_rank[j] <= ex_hi[i] (all (B, H, L) int32, by position).
  const int32_t* ex_lo = nullptr;
  const int32_t* ex_hi = nullptr;
  const int32_t* ex_rank = nullptr;
  // Only the scans, up to block_prefix (then out and the block form are unused and unwritten):
  // what the intervals below read.
  bool scans_only = false;
};
// The largest k of the block form.
constexpr int64_t kTopKPlanMaxK = 512 - kTopKBlock;
void top_k_prefix_cuda(const TopKPrefixParams& p, DType dtype, void* stream);

// Key Selection as intervals (patterns::KeyIntervals, patterns/cuda/top_k_intervals.cu): the scans
// above up to block_prefix, then for every position j whether its key enters (the top k of
// start(j)..j holds it) and, if so, its leave (the first query whose top k no longer holds it, or
// its sequence's end); then the entering keys compacted per (b, h), ascending.
struct TopKIntervalsParams {
  TopKPrefixParams scan;           // B, L, H, k (1 <= k < L, k <= kTopKMaxK), scores, start and the scans'
                                   // workspace; block_prefix is an output here (KeyIntervals::prefix);
                                   // out, the block form and scans_only are set by the launcher
  const int32_t* end = nullptr;    // (B, L) one past the last position of each position's sequence
  int32_t* block_count = nullptr;  // workspace (B, H, top_k_blocks(L)): the keys entering in each block,
                                   // then their exclusive scan along the row (the block's first slot)
  int32_t* leave_at = nullptr;     // out (B, H, L): the leave of the key at each position, the position
                                   // itself if it never enters
  int32_t* count = nullptr;        // out (B, H): keys that enter, per row
  int32_t* key = nullptr;          // out (B, H, L): the entering keys ascending, -1 from count on
  int32_t* leave = nullptr;        // out (B, H, L): their leaves, -1 from count on
};
void top_k_intervals_cuda(const TopKIntervalsParams& p, DType dtype, void* stream);

// ---------------------------------------------------------------------------------------------
// Merge: the union of two ascending lists per row, duplicates removed.

struct MergeListsParams {
  int64_t rows = 0;            // B·H·L
  int64_t Ka = 0, Kb = 0;      // slots of a and b; the output has Ka + Kb
  const int32_t* a = nullptr;  // (rows, Ka) ascending, -1 after the last key
  const int32_t* b = nullptr;  // (rows, Kb)
  int32_t* out = nullptr;      // out (rows, Ka + Kb)
  // Optional (Ka, Kb <= 32 only): merge only the rows of the query blocks whose count is negative
  // (the sparse attention tile plan's blocks that overflow). Rows are then taken by rank: rank t
  // of (b, h) is row bh·L + q_order[bh·L + t] (t if q_order is null), in block t / block; the
  // other rows are not written.
  const int32_t* block_count = nullptr;  // (B·H, ceil(L / block))
  const int32_t* q_order = nullptr;      // (B·H, L) or null
  int64_t L = 0, block = 0;
  // Optional, with block_count and q_order: a given as a band instead of lists (a is then unread):
  // rank t of (b, h) lists band_pos[bh·L + band[bh·L + t]] .. band_pos[bh·L + band[rows + bh·L + t]]
  // (none when the second is below the first; ascending, at most Ka; keys as many as queries).
  const int32_t* band = nullptr;      // (2, B·H, L)
  const int32_t* band_pos = nullptr;  // (B·H, L)
  // Optional, with block_count and q_order: b given as Key Selection's intervals with their CUDA
  // extras (patterns::KeyIntervals, built with k = Kb <= 32; b is then unread). Row i of (b, h)
  // lists, ascending, the positions of the entries of iv_prefix's list of i's block of kTopKBlock
  // positions whose leave_at is past i (only when i's sequence starts before the block), then the
  // positions j of the block from max(block start, iv_start[i]) to i with leave_at[j] > i: the
  // k keys of Key Selection's list of i.
  const int32_t* iv_leave_at = nullptr;  // (B·H, L) KeyIntervals::leave_at
  const uint64_t* iv_prefix = nullptr;   // (B·H, top_k_blocks(L), Kb) KeyIntervals::prefix
  const int32_t* iv_start = nullptr;     // (B, L) KeyIntervals::start
  int64_t H = 0;                         // heads: row bh's sequence starts are those of b = bh / H
};
void merge_lists_cuda(const MergeListsParams& p, void* stream);

// ---------------------------------------------------------------------------------------------
// HSA: the top-k chunks of every query by q_ret · landmark among the chunks [lo, hi) it may
// retrieve (scores in float32, products accumulated by fused multiply-adds in order of d).

struct TopKChunksParams {
  int64_t B = 0, L = 0, D = 0, NC = 0;  // q_ret (B, L, D), landmarks (B, NC, D)
  int64_t k = 0;                        // chunks per query
  const void* q = nullptr;              // (B, L, D) float32 or bfloat16
  const void* landmarks = nullptr;      // (B, NC, D) same dtype
  const int32_t* lo = nullptr;          // (B, L)
  const int32_t* hi = nullptr;          // (B, L)
  float* best = nullptr;                // workspace (B, L, k): the kept scores
  int32_t* out = nullptr;               // out (B, L, k) ascending chunk indices, -1 padded
};
void top_k_chunks_cuda(const TopKChunksParams& p, DType dtype, void* stream);

// ---------------------------------------------------------------------------------------------
// Key Selection's query direction: out[b, i, h] = normalize(Σ_{p = start..i} q[b, p, h]) with
// normalize(v) = v / max(|v|_2, eps) and start the first position of i's packed sequence (a run
// of equal seq numbers). A segmented scan in float32 over chunks of positions (see
// patterns/cuda/prefix_direction.cu).
constexpr int64_t kPrefixMaxN = 256;  // the largest N of the kernels (8 columns per lane of a warp)
// Positions per chunk: 64, or 32 or 16 where B·H·chunks would leave the GPU with few warps (a warp
// walks a chunk position by position).
HAX_HOST_DEVICE inline int64_t prefix_chunk(int64_t B, int64_t H, int64_t L) {
  int64_t T = 64;
  while (T > 16 && B * H * ((L + T - 1) / T) < 2048) T /= 2;
  return T;
}
HAX_HOST_DEVICE inline int64_t prefix_chunks(int64_t L, int64_t chunk) { return (L + chunk - 1) / chunk; }

struct PrefixDirectionParams {
  int64_t B = 0, L = 0, H = 0, N = 0;    // q's shape (B, L, H, N), N <= kPrefixMaxN
  int64_t chunk = 64;                    // positions per chunk: prefix_chunk(B, H, L)
  float eps = 0;                         // the norm's floor (1e-12)
  const void* q = nullptr;               // (B, L, H, N) float32 or bfloat16 (the launcher's dtype)
  int64_t q_sb = 0, q_sl = 0, q_sh = 0;  // q's strides (elements) of b, position and head; n's is 1
  const int32_t* seq = nullptr;          // (B, L) sequence numbers (a new sequence where they change), or null (one per row)
  // Workspace, with nC = prefix_chunks(L, chunk); null when nC = 1.
  float* totals = nullptr;    // (B, H, nC, N): each chunk's sum since its last sequence start (then, for
                              // long rows, the running sum before the chunk: its carry)
  int32_t* resets = nullptr;  // (B, nC): 1 where a sequence starts in the chunk
  void* out = nullptr;        // out (B, L, H, N) contiguous, q's dtype
};
void prefix_direction_cuda(const PrefixDirectionParams& p, DType dtype, void* stream);

}  // namespace hax::patterns
