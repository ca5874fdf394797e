// The plan of the sparse attention tile path (params.h, AttentionTilePlan): for every block of
// kAttentionTileQueries consecutive queries in q_order, the union of their key lists (ascending
// when `sorted`), and one bit per (query, union key) saying whether the query lists that key.
//
// One CTA of 8 warps per (b, h, block); warp w takes the block's queries w, w + 8, ...:
//   0. with at most kMaxStagedKeys keys per list, the block's lists are first copied into shared
//      memory, 16 bytes per load where K % 4 == 0, all loads of a thread issued together (the
//      lists are read twice below, and from global memory each read was one warp-wide load
//      waited on; measured alone on the H100 this gained ~6%, the rank lookup of step 3 the rest);
//   1. every list entry goes into a shared-memory hash set (open addressing; a plain read first,
//      atomicCAS only to claim an empty slot) that counts distinct keys; a warp stops inserting
//      once the count passes kAttentionTileMaxKeys (the block overflows: count -1, and the
//      per-query kernels take it). A warp inserts at most 32 keys after its last check, so the
//      set never holds more than 512 + 8·32 < 1024 keys and every probe sequence ends;
//   2. sorted: the keys are gathered into an array and sorted (bitonic over the next power of two
//      >= 64 of their count, two per thread), and each key's hash slot gets its rank in the sorted
//      union; not sorted (the attention's own plan): the union is the occupied slots in slot
//      order, each slot's rank an exclusive scan over the slots (no sort, no probes: the sort and
//      the rank probes were a quarter of the kernel's time);
//   3. each warp looks up the ranks of its query's keys in the hash set (a probe or two, where a
//      binary search over the union took 9 dependent steps: the kernel is bound by its instruction
//      count) and sets each key's bit in the block's mask words in shared memory (a 32-bit
//      atomicOr); the block then stores the words coalesced.
// With a band (AttentionParams::band, the plan of HAX's union: LSH's band beside Key Selection's
// lists in p.idx), the band's keys enter first. When a block's bands span at most kSpan sorted
// keys, a bitmap over that span marks them (each query's band is a run of consecutive bits), the
// marked keys take the union's first ranks in sorted order (a popcount prefix), and each query's
// plan bits for its band are one run of consecutive ranks, set without lookups; only the lists
// go through steps 1 and 3. (Listed, the band's keys cost 64 hash insertions and lookups per
// query where a block's bands hold ~100 distinct keys.) A wider span takes the band's keys as
// list entries, read from band_pos.
// With Key Selection as intervals beside the band (AttentionParams::iv_key, kIntervals; HAX's
// union without lists), a block takes its Key Selection keys from its row's intervals: those with
// key <= the block's last query position (the keys ascend: a thread stops at the first past it)
// whose leave is past its first are the candidates, and each thread tests one against the block's 64 query
// positions (key <= i < leave), giving the 64-bit set of queries that hold it. A held candidate
// goes into the hash set once (a band key already there keeps its rank) and is kept with its
// query bits; step 3 then probes its rank once and sets one bit per holding query. Where the
// block's intervals pass kMaxIntervalScan candidates or kMaxHeld held ones, it overflows (the
// per-query kernels take it). On the bench's HAX at 64K a block has about 107 candidates, where its
// lists had 2048 entries to stage, hash and look up (BENCHMARKS.md, thirty-third pass).
// With a band and plan.key_uses, the plan also counts for each key the blocks whose union holds it
// (AttentionTilePlan::key_uses): a block adds 1 for each key its hash set takes as new (list
// entries, and a band's keys past the span) and, at its end if it did not overflow, for each of
// its bitmap-marked band keys (a list entry that finds one of those is no new key); a block that
// overflows stores kAttentionKeyManyUses for each of its entries (the per-query kernels take it).
// Sorted, the result does not depend on the order of the atomics: the union is sorted and the
// masks are ORs of fixed bits. Not sorted, keys whose probe sequences collide may take their slots
// in either order, so the union's order (not its content) can differ between runs.
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ops/attention/params.h"
#include "ops/cuda/common.cuh"

namespace hax::ops {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kQ = (int)kAttentionTileQueries;
constexpr int kU = (int)kAttentionTileMaxKeys;
constexpr int kTiles = (int)kAttentionTilesPerBlock;
constexpr int kHash = 1024;  // hash slots: a power of two above kU + 32 kWarps
static_assert(kU == 2 * kThreads, "the bitonic sort gives two keys to each thread");
static_assert(kHash >= kU + 32 * kWarps, "the hash set must hold every key inserted before a warp sees the overflow");

// A bound on the kernel's static shared memory (table, keys, rank, qpos and a few ints), which
// counts with the staged lists against the default 48 KB (cuda::allow_smem).
constexpr int kSpan = (int)kAttentionPlanBandSpan;  // bits of the band bitmap
constexpr size_t kStaticSmem =
    4 * (kHash + kU) + 2 * kHash + 8 * kQ + 8 * kQ + 8 * (kSpan / 32) + 8 * kTiles * kQ + 256;
constexpr int kMaxStagedKeys = (int)kAttentionPlanMaxStagedKeys;  // K up to which the lists are staged (96 KB)
// kIntervals: the most interval entries a block scans (keys up to its last query) and the most
// held candidates it keeps; past either, the block overflows.
constexpr int kMaxIntervalScan = 4096;
constexpr int kMaxHeld = kU;

// Slot of a key: the top 10 bits of a multiplicative hash.
__device__ __forceinline__ int hash_slot(int32_t key) { return (int)(((uint32_t)key * 2654435761u) >> 22); }

template <bool kStaged, bool kSorted, bool kBand, bool kIntervals>
__global__ void __launch_bounds__(kThreads) tile_plan_kernel(AttentionParams p, AttentionTilePlan plan, int64_t nblk) {
  static_assert(!kBand || (kStaged != kIntervals && !kSorted),
                "a band's plan stages its lists or reads intervals, and is not sorted");
  static_assert(!kIntervals || kBand, "intervals join a band");
  __shared__ __align__(16) int32_t table[kHash];
  __shared__ int32_t keys[kU];
  __shared__ __align__(8) int16_t rank[kHash];  // rank[h]: the position of table[h] in the union (-1: not yet)
  __shared__ int64_t qpos[kQ];  // the block's query positions (-1: no list)
  __shared__ int count, filled;
  // kBand: query r's band is sorted keys band_lo[r] .. band_lo[r] + band_len[r] - 1; the block's
  // bands span [span_lo, span_hi); bit s of the bitmap `cov` marks sorted key span_lo + s, and
  // cov_before[w] counts the marks in words before w.
  __shared__ int32_t band_lo[kBand ? kQ : 1], band_len[kBand ? kQ : 1];
  __shared__ uint32_t cov[kBand ? kSpan / 32 : 1], cov_before[kBand ? kSpan / 32 : 1];
  __shared__ int span_lo, span_hi;
  // kIntervals: the block's first and last query positions; the held candidates (key, the sorted
  // ranks [held_lo, held_hi) of the queries that hold it) and their number.
  __shared__ int q_lo, q_hi;
  // The block's query positions ascending (spos; -1 for no query, first) and each one's query
  // (sperm).
  __shared__ int32_t spos[kIntervals ? kQ : 1];
  __shared__ int8_t sperm[kIntervals ? kQ : 1];
  __shared__ int32_t held_key[kIntervals ? kMaxHeld : 1];
  __shared__ int8_t held_lo[kIntervals ? kMaxHeld : 1], held_hi[kIntervals ? kMaxHeld : 1];
  __shared__ int n_held;
  __shared__ __align__(8) uint32_t smask[2 * kTiles * kQ];  // the plan's mask words (tile, query) as 32-bit halves
  extern __shared__ int4 staged_u4[];  // kStaged: (nq, K) the block's lists (with idx_b: a's, then b's)
  const int64_t bh = blockIdx.x / nblk, blk = blockIdx.x % nblk, L = p.seqlen;
  // (idx_b: staged only; with intervals no lists: K = 0)
  const int64_t Ka = kIntervals ? 0 : p.maxkeys, Kb = p.idx_b ? p.maxkeys_b : 0, K = Ka + Kb;
  const int64_t r0 = blk * kQ;
  const int nq = (int)(L - r0 < kQ ? L - r0 : kQ), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t* order = p.q_order ? p.q_order + bh * L : nullptr;
  const int32_t* idx = kIntervals ? nullptr : p.idx + bh * L * Ka;  // one segment: (L, Ka) per (b, h)
  int32_t* staged = reinterpret_cast<int32_t*>(staged_u4);
  if (kBand && threadIdx.x == 0) span_lo = INT_MAX, span_hi = INT_MIN, q_lo = INT_MAX, q_hi = -1, n_held = 0;
  // kBand: thread r < kQ (kThreads >= kQ) loads query r's band with its position, before the
  // barrier (one wait for both); kIntervals: each thread its first interval entry and the
  // row's count (the candidates below; most blocks need no other interval loads).
  static_assert(kThreads >= kQ, "a thread per query of the block");
  int band_first = 0, band_last = -1;
  const int32_t* iv_key = kIntervals ? p.iv_key + bh * p.iv_stride : nullptr;
  const int32_t* iv_leave = kIntervals ? p.iv_leave + bh * p.iv_stride : nullptr;
  int n_iv = 0;
  int32_t first_key = -1, first_leave = -1;
  if constexpr (kIntervals) {
    n_iv = p.iv_count[bh];
    if (threadIdx.x < p.iv_stride) first_key = iv_key[threadIdx.x], first_leave = iv_leave[threadIdx.x];
  }
  // (the tables are cleared while those loads are in flight)
  for (int i = threadIdx.x; i < kHash; i += kThreads) table[i] = -1, rank[i] = -1;
  for (int i = threadIdx.x; i < 2 * kTiles * kQ; i += kThreads) smask[i] = 0;
  if (threadIdx.x == 0) count = 0, filled = 0;
  if (threadIdx.x < nq) {
    const int r = threadIdx.x;
    const int64_t i = order ? order[r0 + r] : r0 + r;
    qpos[r] = i >= 0 && i < L ? i : -1;  // not a permutation entry: no keys
    if (kBand) band_first = p.band[bh * L + r0 + r], band_last = p.band[p.batch * p.nheads * L + bh * L + r0 + r];
  }
  __syncthreads();
  if constexpr (kBand) {
    if (threadIdx.x < kQ) {
      const int r = threadIdx.x;
      int lo = 0, len = 0;
      if (r < nq && qpos[r] >= 0) lo = band_first, len = band_last >= lo ? band_last - lo + 1 : 0;
      band_lo[r] = lo, band_len[r] = len;
      if (len > 0) atomicMin(&span_lo, lo), atomicMax(&span_hi, lo + len);
      if (kIntervals && r < nq && qpos[r] >= 0) atomicMin(&q_lo, (int)qpos[r]), atomicMax(&q_hi, (int)qpos[r]);
      if (kIntervals) {  // query r's rank among the block's (position, query) pairs
        const int64_t i = r < nq ? qpos[r] : -1;
        int at = 0;
        for (int o = 0; o < kQ; ++o) {
          const int64_t j = o < nq ? qpos[o] : -1;
          at += j < i || (j == i && o < r);
        }
        spos[at] = (int32_t)i, sperm[at] = (int8_t)r;
      }
    }
    for (int w = threadIdx.x; w < kSpan / 32; w += kThreads) cov[w] = 0;
  }
  if constexpr (kStaged) {
    // Rows of `src` (n entries a row) into columns off .. off + n of the staged rows (K wide).
    auto stage = [&](const int32_t* src, int n, int off) {
      const int k = (int)K;
      if (n % 4 == 0 && k % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
        const int per = n / 4;
#pragma unroll 4
        for (int x = threadIdx.x; x < nq * per; x += kThreads) {
          const int r = x / per, c = x - r * per;
          const int64_t i = qpos[r];
          staged_u4[(r * k + off) / 4 + c] =
              i >= 0 ? *reinterpret_cast<const int4*>(src + i * n + 4 * c) : make_int4(-1, -1, -1, -1);
        }
      } else {
#pragma unroll 4
        for (int x = threadIdx.x; x < nq * n; x += kThreads) {
          const int r = x / n;
          const int64_t i = qpos[r];
          staged[r * k + off + (x - r * n)] = i >= 0 ? src[i * n + (x - r * n)] : -1;
        }
      }
    };
    stage(idx, (int)Ka, 0);
    if (Kb > 0) stage(p.idx_b + bh * L * Kb, (int)Kb, (int)Ka);
  }
  auto list_of = [&](int r) -> const int32_t* {  // the list of the block's query r (rank r0 + r in q_order)
    if (kStaged) return staged + (int64_t)r * K;
    if (kIntervals) return nullptr;
    const int64_t i = qpos[r];
    return i >= 0 ? idx + i * Ka : nullptr;  // (no idx_b here: K = Ka)
  };
  __syncthreads();

  const int64_t Lk = p.keylen;
  // Inserts `key` into the hash set if absent; a new key takes rank `rk` (-1: ranked below).
  // Returns false when the key was there already.
  auto insert = [&](int32_t key, int rk) {
    for (int h = hash_slot(key);; h = (h + 1) & (kHash - 1)) {
      int32_t cur = *(volatile int32_t*)&table[h];
      if (cur == -1) {
        cur = atomicCAS(&table[h], -1, key);
        if (cur == -1) {
          rank[h] = (int16_t)rk;
          return true;
        }
      }
      if (cur == key) return false;
    }
  };
  int32_t* uses = kBand && plan.key_uses ? plan.key_uses + bh * Lk : nullptr;
  // kBand: whether the band's keys go by the bitmap (`covered`), and then how many there are.
  bool covered = false;
  int n_band = 0;
  const int32_t* band_pos = kBand ? p.band_pos + bh * Lk : nullptr;
  if constexpr (kBand) {
    const bool any = span_hi > span_lo;
    covered = !any || (int64_t)span_hi - span_lo <= kSpan;
    if (any && covered) {
      for (int r = threadIdx.x; r < nq; r += kThreads)
        for (int a = band_lo[r] - span_lo, e = a + band_len[r]; a < e;) {
          const int w = a / 32, stop = e < (w + 1) * 32 ? e : (w + 1) * 32;
          const uint32_t run = stop - a == 32 ? 0xffffffffu : ((1u << (stop - a)) - 1u) << (a % 32);
          atomicOr(&cov[w], run);
          a = stop;
        }
      __syncthreads();
      static_assert(kSpan / 32 == 32, "one warp scans the bitmap's words");
      if (warp == 0) {
        const int c = __popc(cov[lane]);
        int incl = c;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += y;
        }
        cov_before[lane] = incl - c;
        if (lane == 31) count = incl;
      }
      __syncthreads();
      n_band = count;
      if (n_band <= kU) {  // (else the block overflows: count > kU)
        // The marked keys' positions into keys[rank] (the loads issued together), then each into
        // the hash set by the thread that loaded it.
        static_assert(kSpan == 4 * kThreads, "four bits of the span a thread");
        int rks[4];  // this thread's bits' ranks (-1: not marked)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int sb = threadIdx.x + e * kThreads;
          const uint32_t word = sb < span_hi - span_lo ? cov[sb / 32] : 0u;
          rks[e] = (word >> (sb % 32)) & 1u ? (int)(cov_before[sb / 32] + __popc(word & ((1u << (sb % 32)) - 1u))) : -1;
          if (rks[e] < 0) continue;
          const int32_t key = band_pos[span_lo + sb];
          keys[rks[e]] = key >= 0 && key < Lk ? key : -1;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (rks[e] >= 0 && keys[rks[e]] >= 0) insert(keys[rks[e]], rks[e]);  // (positions of the row; unchecked input)
      }
      __syncthreads();
    }
  }
  // The entries a query lists one by one: a band's keys when not covered, then its list.
  auto band_entries = [&](int r) { return kBand && !covered && r < nq ? band_len[r] : 0; };
  auto entry = [&](int r, const int32_t* list, int na, int64_t t) -> int32_t {
    if (t < na) return band_pos[band_lo[r] + t];
    return list && t - na < K ? list[t - na] : -1;
  };

  for (int r = warp; r < nq; r += kWarps) {
    const int32_t* list = list_of(r);
    const int na = band_entries(r);
    const int64_t total = na + (list ? K : 0);
    for (int64_t t0 = 0; t0 < total; t0 += 32) {
      if (*(volatile int*)&count > kU) break;
      const int32_t key = t0 + lane < total ? entry(r, list, na, t0 + lane) : -1;
      if (key < 0 || key >= Lk) continue;  // -1, or out of range (unchecked input): no key
      if (insert(key, -1)) {
        atomicAdd(&count, 1);
        if (uses) atomicAdd(&uses[key], 1);  // (a key new to the block: one more block holds it)
      }
    }
  }
  // kIntervals: the candidates (interval entries with key <= q_hi, leave > q_lo) and the queries
  // that hold each: thread x takes the entries x, x + 256, ... (the first loaded at the start) and
  // stops at a key past q_hi (the keys ascend); a candidate's 64-bit set of holding queries comes
  // from testing key <= i < leave for each query position i. A held one goes into the hash set and
  // is kept. Like a list entry, a candidate goes in after a check of the count (a thread inserts
  // at most one key past its last check), so the hash set keeps its bound. Past kMaxIntervalScan
  // entries with keys <= q_hi, the block overflows without a scan. (A warp per candidate, lanes
  // over the queries with two ballots, issued ~3x the instructions: the plan took 557 us against
  // 485 at HAX's 64K, H200.)
  if constexpr (kIntervals) {
    const bool too_many = n_iv > kMaxIntervalScan && iv_key[kMaxIntervalScan] <= q_hi;
    if (too_many) {
      if (threadIdx.x == 0) atomicAdd(&count, kU + 1);  // (overflows)
    } else {
      // The sorted ranks of the first position >= x (spos ascends; -1 entries below every key).
      auto rank_of = [&](int32_t x) {
        int a = 0;
#pragma unroll
        for (int step = kQ / 2; step > 0; step /= 2)
          if (spos[a + step - 1] < x) a += step;
        return a + (spos[a] < x);
      };
      for (int t = threadIdx.x; t < n_iv; t += kThreads) {
        if (*(volatile int*)&count > kU) break;
        const bool first = t == (int)threadIdx.x;
        const int32_t key = first ? first_key : iv_key[t], leave = first ? first_leave : iv_leave[t];
        if (key > q_hi) break;
        if (leave <= q_lo || key < 0 || key >= Lk) continue;  // (out of range: unchecked input)
        const int lo = rank_of(key), hi = rank_of(leave);  // the queries key <= i < leave
        if (lo >= hi) continue;
        const int c = atomicAdd(&n_held, 1);
        if (c >= kMaxHeld) {
          atomicAdd(&count, kU + 1);  // (overflows)
          break;
        }
        held_key[c] = key, held_lo[c] = (int8_t)lo, held_hi[c] = (int8_t)hi;
        if (insert(key, -1)) {
          atomicAdd(&count, 1);
          if (uses) atomicAdd(&uses[key], 1);
        }
      }
    }
  }
  __syncthreads();
  const int u = count;
  if (u > kU) {
    if (threadIdx.x == 0) {
      plan.count[blockIdx.x] = -1;
      if (plan.overflow) atomicAdd(plan.overflow, 1);
    }
    if constexpr (kBand) {
      if (uses)  // the per-query kernels add every entry of the block in float32
        for (int r = warp; r < nq; r += kWarps) {
          const int32_t* list = list_of(r);
          const int nb = band_len[r];
          const int64_t total = nb + (list ? K : 0);
          for (int64_t t = lane; t < total; t += 32) {
            const int32_t key = entry(r, list, nb, t);
            if (key >= 0 && key < Lk) uses[key] = kAttentionKeyManyUses;
          }
        }
      if (kIntervals && uses)  // every candidate (held or not: more than the queries' keys, never fewer)
        for (int t = threadIdx.x; t < n_iv; t += kThreads) {
          const int32_t key = iv_key[t];
          if (key > q_hi) break;
          if (iv_leave[t] > q_lo && key >= 0 && key < Lk) uses[key] = kAttentionKeyManyUses;
        }
    }
    return;
  }
  if (uses && covered)  // each bitmap-marked band key (keys[0 .. n_band), fixed since the band's barrier): one more block
    for (int rk = threadIdx.x; rk < n_band; rk += kThreads)
      if (keys[rk] >= 0) atomicAdd(&uses[keys[rk]], 1);

  if constexpr (!kSorted) {
    // The keys not ranked yet (all of them without a band) in hash-slot order (not ascending; see
    // above): a block-wide exclusive scan of those slots, thread x owning slots 4x .. 4x + 3,
    // gives each its rank directly, after the band's.
    static_assert(kHash == 4 * kThreads, "four hash slots a thread");
    __shared__ int warp_sum[kWarps];
    const int4 slots = reinterpret_cast<const int4*>(table)[threadIdx.x];
    const int32_t sk[4] = {slots.x, slots.y, slots.z, slots.w};
    bool fresh[4];
    int mine = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) fresh[e] = sk[e] >= 0 && rank[4 * threadIdx.x + e] < 0, mine += fresh[e];
    int incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) warp_sum[warp] = incl;
    __syncthreads();
    int at = n_band + incl - mine;
    for (int w = 0; w < warp; ++w) at += warp_sum[w];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (fresh[e]) keys[at] = sk[e], rank[4 * threadIdx.x + e] = (int16_t)at, ++at;
    __syncthreads();
  } else {
    for (int i = threadIdx.x; i < kHash; i += kThreads)
      if (table[i] >= 0) keys[atomicAdd(&filled, 1)] = table[i];
    __syncthreads();
    int n2 = 64;  // the sort's length: a power of two >= u (the same in every thread)
    while (n2 < u) n2 <<= 1;
    for (int i = u + threadIdx.x; i < n2; i += kThreads) keys[i] = INT_MAX;  // padding sorts last
    __syncthreads();
    for (int size = 2; size <= n2; size <<= 1)
      for (int stride = size / 2; stride > 0; stride >>= 1) {
        const int pr = threadIdx.x, i = 2 * stride * (pr / stride) + pr % stride, j = i + stride;
        if (pr < n2 / 2) {
          const bool ascending = (i & size) == 0;
          const int32_t a = keys[i], b = keys[j];
          if ((a > b) == ascending) keys[i] = b, keys[j] = a;
        }
        __syncthreads();
      }

    for (int i = threadIdx.x; i < u; i += kThreads) {  // each key's slot gets its rank
      const int32_t key = keys[i];
      int h = hash_slot(key);
      while (table[h] != key) h = (h + 1) & (kHash - 1);
      rank[h] = (int16_t)i;
    }
    __syncthreads();
  }

  // Step 3: each key sets its bit in the block's mask words in shared memory (smask, zeroed with
  // the table), one 32-bit atomicOr on the word's half; a covered band sets its run of ranks, 32
  // bits at a time. Then the block writes its mask words out, coalesced. (Each warp ORing 8 tile
  // words per key in registers and reducing them across the warp made the kernel issue-bound.)
  for (int r = warp; r < nq; r += kWarps) {
    const int32_t* list = list_of(r);
    const int na = band_entries(r);
    const int64_t total = na + (list ? K : 0);
    uint32_t* row = smask + 2 * r;  // row[2 (tt kQ) + half]: query r's mask word of tile tt
    for (int64_t t0 = 0; t0 < total; t0 += 32) {
      const int32_t key = t0 + lane < total ? entry(r, list, na, t0 + lane) : -1;
      if (key < 0 || key >= Lk) continue;
      int h = hash_slot(key);  // the key is in the set (the block did not overflow)
      while (table[h] != key) h = (h + 1) & (kHash - 1);
      const int lo = rank[h];  // its position in the union
      atomicOr(row + 2 * kQ * (lo / 64) + (lo % 64) / 32, 1u << (lo % 32));
    }
  }
  // A covered band's keys: query r's are ranks lo .. hi - 1 (consecutive marks of the bitmap), one
  // run of bits, set by a thread per query a 32-bit word at a time.
  if (kBand && covered)
    for (int r = threadIdx.x; r < nq; r += kThreads) {
      if (band_len[r] == 0) continue;
      const int sb = band_lo[r] - span_lo;
      const int lo = cov_before[sb / 32] + __popc(cov[sb / 32] & ((1u << (sb % 32)) - 1u)), hi = lo + band_len[r];
      for (int w = lo / 32; w * 32 < hi; ++w) {
        const int a = lo > 32 * w ? lo : 32 * w, e = hi < 32 * w + 32 ? hi : 32 * w + 32;
        atomicOr(smask + 2 * r + 2 * kQ * (w / 2) + w % 2,
                 (e - a == 32 ? 0xffffffffu : (1u << (e - a)) - 1u) << (a - 32 * w));
      }
    }
  // A held candidate: a warp probes its rank, lane s sets the bit of the query of sorted rank s
  // (and s + 32) when it holds the key.
  if constexpr (kIntervals)
    for (int c = warp; c < n_held; c += kWarps) {
      const int32_t key = held_key[c];
      int h = hash_slot(key);
      while (table[h] != key) h = (h + 1) & (kHash - 1);
      const int lo = rank[h], a = held_lo[c], e = held_hi[c];
      uint32_t* col = smask + 2 * kQ * (lo / 64) + (lo % 64) / 32;
      if (a <= lane && lane < e) atomicOr(col + 2 * sperm[lane], 1u << (lo % 32));
      if (a <= lane + 32 && lane + 32 < e) atomicOr(col + 2 * sperm[lane + 32], 1u << (lo % 32));
    }
  __syncthreads();
  unsigned long long* mout = reinterpret_cast<unsigned long long*>(plan.mask) + (int64_t)blockIdx.x * kTiles * kQ;
  const unsigned long long* words = reinterpret_cast<const unsigned long long*>(smask);
  for (int i = threadIdx.x; i < (u + 63) / 64 * kQ; i += kThreads) mout[i] = words[i];  // (rows past L: zero)
  int32_t* kout = plan.keys + (int64_t)blockIdx.x * kU;
  for (int i = threadIdx.x; i < kU; i += kThreads) kout[i] = i < u ? keys[i] : -1;
  if (threadIdx.x == 0) plan.count[blockIdx.x] = u;
}

}  // namespace

void sparse_attention_tile_plan_cuda(const AttentionParams& p, const AttentionTilePlan& plan, void* stream,
                                     bool sorted) {
  const int64_t nblk = attention_tile_blocks(p.seqlen), grid = p.batch * p.nheads * nblk;
  if (grid == 0) return;
  if (p.nseg != 1) throw std::runtime_error("sparse_attention tile plan: needs one segment per query");
  const int64_t K = p.maxkeys + (p.idx_b ? p.maxkeys_b : 0);
  if (p.idx_b && K > kMaxStagedKeys)
    throw std::runtime_error("sparse_attention tile plan: two lists of " + std::to_string(p.maxkeys) + " + " +
                             std::to_string(p.maxkeys_b) + " keys exceed the " + std::to_string(kMaxStagedKeys) +
                             " a query the union's plan stages");
  const auto s = (cudaStream_t)stream;
  if (p.band && (p.idx_b || sorted || (!p.iv_key && K > kMaxStagedKeys) || !p.band_pos))
    throw std::runtime_error("sparse_attention tile plan: a band needs band_pos, no idx_b, an unsorted plan and a list "
                             "of at most " + std::to_string(kMaxStagedKeys) + " keys (has " + std::to_string(K) + ")");
  if (p.iv_key && (!p.band || !p.iv_count || !p.iv_leave || p.iv_stride < 0))
    throw std::runtime_error("sparse_attention tile plan: intervals need a band, iv_count, iv_leave and iv_stride >= 0");
  auto launch = [&](auto staged, auto sort, auto band, auto intervals) {
    constexpr bool kStaged = decltype(staged)::value, kSorted = decltype(sort)::value, kBand = decltype(band)::value;
    const auto kernel = tile_plan_kernel<kStaged, kSorted, kBand, decltype(intervals)::value>;
    const size_t smem = kStaged ? sizeof(int32_t) * kQ * (size_t)K : 0;
    if (kStaged) cuda::allow_smem(kernel, smem, "sparse_attention tile plan", kStaticSmem);
    kernel<<<(unsigned)grid, kThreads, smem, s>>>(p, plan, nblk);
  };
  using T = std::true_type;
  using F = std::false_type;
  const bool staged = K <= kMaxStagedKeys;
  if (p.band && p.iv_key) launch(F{}, F{}, T{}, T{});
  else if (p.band) launch(T{}, F{}, T{}, F{});
  else if (staged && sorted) launch(T{}, T{}, F{}, F{});
  else if (staged) launch(T{}, F{}, F{}, F{});
  else if (sorted) launch(F{}, T{}, F{}, F{});
  else launch(F{}, F{}, F{}, F{});
  cuda::check_launch("sparse_attention tile plan");
}

}  // namespace hax::ops
