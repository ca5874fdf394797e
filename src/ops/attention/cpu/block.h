// Shared pieces of the CPU sparse-attention kernels (forward.cpp, backward.cpp, key_sums.cpp): the
// tensor layout, the work distribution over threads, and the state of one block of queries.
//
// Queries are taken in blocks of kBlockQ, consecutive in q_order. A block whose queries share keys
// (sliding windows, LSH buckets in q_order, Key Selection's popular keys) is computed as dense tiles
// over the union U of its keys: the rows of K and V in U are gathered once, S^T = K_U Q^T is one
// small matrix product (U x kBlockQ: a key per row, the block's queries along the vector lanes),
// and a multiplicity matrix C^T (U x kBlockQ, how often each query lists each key) masks it. With
// one segment per query the softmax then runs on whole rows of lanes; with several segments it
// runs entry by entry. A block whose union is large (queries that share little) is computed query
// by query, with dot products over the listed keys.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ops/attention/params.h"
#include "ops/attention/vec_exp.h"

namespace hax::ops::cpu_attention {

constexpr int64_t kBlockQ = 32;  // queries per block (the vector lanes of the dense softmax)

// Runs fn(state, it) for every item it in [0, n) on all threads, handing items out one at a time:
// their cost differs a lot (a block of popular keys, a block computed per query), and a static
// split left one thread with most of the work. Each thread makes one `state` with make_state().
// A thread claims its next item before it computes the current one and tells the state first,
// with ahead(state, next), so that the computation can prefetch the next item's rows as it goes
// (the gathers of these kernels wait on memory more than on arithmetic). Every item writes only
// its own outputs, so results do not depend on the schedule.
template <class MakeState, class F, class Ahead>
void parallel_items(int64_t n, MakeState make_state, F fn, Ahead ahead) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t it = next.fetch_add(1); it < n;) {
      const int64_t following = next.fetch_add(1);
      ahead(state, following < n ? following : -1);
      fn(state, it);
      it = following;
    }
  });
}

template <class MakeState, class F>
void parallel_items(int64_t n, MakeState make_state, F fn) {
  parallel_items(n, make_state, fn, [](auto&, int64_t) {});
}

// Asks for the bytes [p, p + bytes) to be brought into the cache.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
}

// Offsets into the contiguous layouts documented in attention.h.
struct Layout {
  int64_t L, Lk, H, D, Dv, S, K;
  int64_t q(int64_t b, int64_t i, int64_t h) const { return ((b * L + i) * H + h) * D; }
  int64_t k(int64_t b, int64_t j, int64_t h) const { return ((b * Lk + j) * H + h) * D; }
  int64_t v(int64_t b, int64_t j, int64_t h) const { return ((b * Lk + j) * H + h) * Dv; }
  int64_t o(int64_t b, int64_t i, int64_t h) const { return ((b * L + i) * H + h) * Dv; }
  int64_t seg(int64_t bh, int64_t i) const { return (bh * L + i) * S; }       // lse, seg_w: (B, H, L, S)
  int64_t list(int64_t bh, int64_t i) const { return (bh * L + i) * S * K; }  // idx, entries: (B, H, L, S, K)
};

inline Layout layout_of(const AttentionParams& p) {
  return {p.seqlen, p.keylen, p.nheads, p.dim, p.vdim, p.nseg, p.maxkeys};
}

// Largest key union a block computes as dense tiles (0: always per query). In kAuto, a block whose
// queries share little (union above ~4 lists' worth of keys) runs per query: its tiles would do
// mostly useless work.
inline int64_t union_limit(const AttentionParams& p) {
  const int64_t most = std::min<int64_t>(p.keylen, kBlockQ * p.nseg * p.maxkeys);
  switch (p.path) {
    case AttentionPath::kPerQuery: return 0;
    case AttentionPath::kTiles: return most;
    case AttentionPath::kAuto: break;
  }
  return std::min(most, 4 * p.nseg * p.maxkeys + kBlockQ);
}

template <class T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

template <class T>
inline void axpy(T alpha, const T* x, T* y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += alpha * x[d];
}

// Softmax over n scores x (in place: x becomes exp(x - max)); returns the log-sum-exp and the sum.
template <class T>
inline T softmax_terms(T* x, int64_t n, T& sum) {
  T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t t = 0; t < n; ++t) m = x[t] > m ? x[t] : m;
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t t = 0; t < n; ++t) {
    x[t] = detail::vexp(x[t] - m);
    s += x[t];
  }
  sum = s;
  return m + std::log(s);
}

// Backward of one segment's softmax over its n entries: x holds the scores, dp the dO·v of each
// entry. With a = exp(x - lse), dw = Σ a dp: leaves dscore = a (w (dp - dw) + dlse) in x and w a
// in dp, and returns dw (the gradient of the segment weight).
template <class T>
inline T segment_grads(T* x, T* dp, int64_t n, T lse, T w, T dlse) {
  T dw = 0;
#pragma omp simd reduction(+ : dw)
  for (int64_t t = 0; t < n; ++t) {
    x[t] = detail::vexp(x[t] - lse);
    dw += x[t] * dp[t];
  }
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) {
    const T a = x[t];
    x[t] = a * (w * (dp[t] - dw) + dlse);
    dp[t] = w * a;
  }
  return dw;
}

// dst[0, n) = src[0, n) for one gathered row: with the common widths as fixed-size copies, which
// the compiler turns into a few vector moves instead of a call to memmove.
template <class T>
inline void copy_row(const T* src, int64_t n, T* dst) {
  switch (n * sizeof(T)) {
    case 64: std::memcpy(dst, src, 64); return;
    case 128: std::memcpy(dst, src, 128); return;
    case 256: std::memcpy(dst, src, 256); return;
    case 512: std::memcpy(dst, src, 512); return;
    default: std::copy(src, src + n, dst);
  }
}

// Per-thread state for one block of queries: its rows, the union of their keys and the tiles.
// Tiles are row-major with kBlockQ columns (one per query of the block) unless noted.
template <class T>
struct Block {
  static constexpr int64_t R = kBlockQ;
  const AttentionParams& p;
  const Layout lay;
  const int64_t cap;              // union columns the tile buffers hold
  std::vector<int32_t> rows;      // (R) query of each row
  std::vector<int32_t> next_rows;  // (R) queries of the next block (set_next), next_n of them
  int64_t next_bh = 0, next_n = 0;
  const void* next_dout = nullptr;
  int64_t nq = 0;                 // rows in this block
  std::vector<int32_t> slot;      // (Lk) union row of each key, -1 if absent
  std::vector<int32_t> keys;      // (cap) key of each union row
  int64_t U = 0;                  // union size
  bool invalid = false;           // an idx entry outside [-1, Lk) was seen (and skipped)
  std::vector<int32_t> cols;      // (R, S, K) union row of each list entry of the block's queries, -1 if none
  // Per-entry scratch for one (query, segment): union row or key, slot in the list, score, dp.
  std::vector<int32_t> col, pos;
  std::vector<T> x, dp;
  // Tiles: multiplicities C^T, scores S^T (then softmax weights), P^T (w · softmax), dP^T, dS^T.
  std::vector<T> CT, ST, PT, dPT, dST;  // (cap, R) each; dS^T in the backward
  std::vector<T> QbT, Kc, Vc;           // (D, R) queries transposed, (cap, D), (cap, Dv) gathered keys
  std::vector<T> Ob, Qb, dOb, dObT, dQb;  // (R, Dv), (R, D); backward: (R, Dv), (Dv, R), (R, D)

  Block(const AttentionParams& p_, int64_t limit, bool backward)
      : p(p_), lay(layout_of(p_)), cap(limit), rows(R), next_rows(R) {
    const int64_t SK = lay.S * lay.K, D = lay.D, Dv = lay.Dv;
    col.resize(SK), pos.resize(SK), x.resize(SK), dp.resize(SK);
    if (limit > 0) {
      slot.assign(lay.Lk, -1);
      keys.resize(cap);
      cols.resize(R * SK);
      CT.assign(cap * R, T(0)), ST.resize(cap * R), PT.resize(cap * R);
      QbT.resize(D * R), Kc.resize(cap * D), Vc.resize(cap * Dv);
      Qb.resize(R * D);
      if (backward) dPT.resize(cap * R), dST.resize(cap * R), dOb.resize(R * Dv), dObT.resize(Dv * R), dQb.resize(R * D);
      else Ob.resize(R * Dv);
    }
  }

  // Block c of row bh: queries c*R.. of q_order (or of the natural order).
  void set_rows(int64_t bh, int64_t c) {
    const int64_t i0 = c * R;
    nq = std::min(R, lay.L - i0);
    for (int64_t r = 0; r < nq; ++r) rows[r] = p.q_order ? p.q_order[bh * lay.L + i0 + r] : int32_t(i0 + r);
  }

  // The next block this thread computes (block c of row bh; c < 0: none), whose lists and rows
  // of q (and dout, when given) collect_union prefetches one query at a time.
  void set_next(int64_t bh, int64_t c, const void* dout) {
    next_n = 0, next_dout = dout;
    if (c < 0) return;
    const int64_t i0 = c * R;
    next_bh = bh, next_n = std::min(R, lay.L - i0);
    for (int64_t r = 0; r < next_n; ++r)
      next_rows[r] = p.q_order ? p.q_order[bh * lay.L + i0 + r] : int32_t(i0 + r);
  }

  void prefetch_next(int64_t r) const {
    if (r >= next_n) return;
    const int64_t i = next_rows[r], b = next_bh / lay.H, h = next_bh % lay.H;
    prefetch_bytes(p.idx + lay.list(next_bh, i), lay.S * lay.K * sizeof(int32_t));
    prefetch_bytes((const T*)p.q + lay.q(b, i, h), lay.D * sizeof(T));
    if (next_dout) prefetch_bytes((const T*)next_dout + lay.o(b, i, h), lay.Dv * sizeof(T));
  }

  // Collects the union of the block's keys, each entry's union row (cols) and the multiplicities
  // C^T; false (nothing kept) when the union has more than `limit` keys.
  bool collect_union(int64_t bh, int64_t limit) {
    U = 0;
    const int64_t SK = lay.S * lay.K;
    for (int64_t r = 0; r < nq; ++r) {
      prefetch_next(r);
      const int32_t* li = p.idx + lay.list(bh, rows[r]);
      int32_t* cr = &cols[r * SK];
      for (int64_t e = 0; e < SK; ++e) {
        const int32_t j = li[e];
        if (uint32_t(j) >= uint32_t(lay.Lk)) {  // -1, or invalid
          invalid |= j != -1;
          cr[e] = -1;
          continue;
        }
        if (slot[j] < 0) {
          if (U == limit) {
            release_union();
            return false;
          }
          slot[j] = int32_t(U);
          keys[U++] = j;
          prefetch_key(bh, j);
        }
        cr[e] = slot[j];
        CT[slot[j] * R + r] += T(1);
      }
    }
    return true;
  }

  // Prefetches the rows of k and v of key j (gathered once the union is complete).
  void prefetch_key(int64_t bh, int64_t j) const {
    const int64_t b = bh / lay.H, h = bh % lay.H;
    prefetch_bytes((const T*)p.k + lay.k(b, j, h), lay.D * sizeof(T));
    prefetch_bytes((const T*)p.v + lay.v(b, j, h), lay.Dv * sizeof(T));
  }

  // Stores the union and its multiplicities as item `it` of the record in p (params.h); a block
  // whose multiplicities do not fit a byte is marked not recorded.
  void record_union(int64_t it) const {
    const int64_t lim = cap;
    uint8_t* mult = p.union_mult + it * lim * R;
    const T* ct = CT.data();
    T most = 0;
#pragma omp simd reduction(max : most)
    for (int64_t e = 0; e < U * R; ++e) {
      most = ct[e] > most ? ct[e] : most;
      mult[e] = uint8_t(ct[e] < T(255) ? ct[e] : T(255));
    }
    std::copy(keys.begin(), keys.begin() + U, p.union_keys + it * lim);
    p.union_count[it] = most <= T(255) ? int32_t(U) : -1;
  }

  // Takes item it's union from the record instead of collecting it (release_union forgets it).
  bool recorded_union(int64_t it) {
    const int32_t n = p.union_count ? p.union_count[it] : -1;
    if (n < 0) return false;
    U = n;
    std::copy(p.union_keys + it * cap, p.union_keys + it * cap + U, keys.begin());
    const uint8_t* mult = p.union_mult + it * cap * R;
    T* ct = CT.data();
#pragma omp simd
    for (int64_t e = 0; e < U * R; ++e) ct[e] = T(mult[e]);
    return true;
  }

  // Forgets the union (slot marks and multiplicities back to empty).
  void release_union() {
    for (int64_t u = 0; u < U; ++u) slot[keys[u]] = -1;
    std::fill(CT.begin(), CT.begin() + U * R, T(0));
    U = 0;
  }

  // Gathers rows `rows` of a (B, L, H, n) tensor of head h into tmp (R, n) and transposed into
  // dst (n, R): whole-row copies first (the rows are scattered, and a row's loads should go out
  // together), then a transpose in cache. Rows r >= nq are zero in both.
  void gather_rows_t(const T* src, int64_t b, int64_t h, int64_t n, T* tmp, T* dst) const {
    gather_rows(src, b, h, n, tmp);
    std::fill(tmp + nq * n, tmp + R * n, T(0));
    for (int64_t r = 0; r < R; ++r)
      for (int64_t d = 0; d < n; ++d) dst[d * R + r] = tmp[r * n + d];
  }

  // Gathers rows `rows` of a (B, L, H, n) tensor of head h into (nq, n), prefetching the next
  // block's rows as it goes.
  void gather_rows(const T* src, int64_t b, int64_t h, int64_t n, T* dst) const {
    for (int64_t r = 0; r < nq; ++r) {
      prefetch_next(r);
      const T* s = src + ((b * lay.L + rows[r]) * lay.H + h) * n;
      copy_row(s, n, dst + r * n);
    }
  }

  // Gathers the union's rows of a (B, Lk, H, n) tensor of head h into (U, n).
  void gather_keys(const T* src, int64_t b, int64_t h, int64_t n, T* dst) const {
    for (int64_t u = 0; u < U; ++u) {
      const T* s = src + ((b * lay.Lk + keys[u]) * lay.H + h) * n;
      copy_row(s, n, dst + u * n);
    }
  }

  // The per-key bias of union row u (0 without bias).
  T bias_of(int64_t bh, int64_t u) const { return p.bias ? ((const T*)p.bias)[bh * lay.Lk + keys[u]] : T(0); }

  // Scores of segment s of query row r from the tile S^T: fills col/pos/x, returns the entry count.
  int64_t tile_scores(int64_t bh, int64_t r, int64_t s) {
    const int32_t* cr = &cols[(r * lay.S + s) * lay.K];
    const T scale = T(p.scale);
    int64_t n = 0;
    for (int64_t t = 0; t < lay.K; ++t) {
      const int32_t c = cr[t];
      if (c < 0) continue;
      col[n] = c, pos[n] = int32_t(t);
      x[n] = scale * ST[c * R + r] + bias_of(bh, c);
      ++n;
    }
    return n;
  }

  // Scores of segment s of query i by dot products: fills col (= key), pos, x; returns the count.
  int64_t direct_scores(int64_t b, int64_t h, int64_t i, int64_t s) {
    const int64_t bh = b * lay.H + h;
    const int32_t* li = p.idx + lay.list(bh, i) + s * lay.K;
    const T* bias = p.bias ? (const T*)p.bias + bh * lay.Lk : nullptr;
    const T* qrow = (const T*)p.q + lay.q(b, i, h);
    const T scale = T(p.scale);
    int64_t n = 0;
    for (int64_t t = 0; t < lay.K; ++t) {
      const int32_t j = li[t];
      if (uint32_t(j) >= uint32_t(lay.Lk)) {  // -1, or invalid
        invalid |= j != -1;
        continue;
      }
      col[n] = j, pos[n] = int32_t(t);
      x[n] = scale * dot(qrow, (const T*)p.k + lay.k(b, j, h), lay.D) + (bias ? bias[j] : T(0));
      ++n;
    }
    return n;
  }

  T seg_weight(int64_t bh, int64_t i, int64_t s) const {
    return p.seg_w ? ((const T*)p.seg_w)[lay.seg(bh, i) + s] : T(1);
  }
};

}  // namespace hax::ops::cpu_attention
