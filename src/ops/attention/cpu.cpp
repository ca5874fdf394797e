// CPU kernels of sparse attention over index lists: forward and a deterministic backward.
//
// Queries are taken in blocks of kBlockQ, consecutive in q_order. A block whose queries share
// keys (sliding windows, LSH buckets sorted by q_order, HSA chunks) is computed as dense tiles
// over the union U of its keys: the rows of K and V in U are gathered once into contiguous
// buffers, S^T = K_U Q_blk^T is one small matrix product, every (query, segment) takes a softmax
// over exactly its listed entries of S, and O = P V_U is another product, with P (rows x U) holding
// w_s · softmax for listed entries and 0 elsewhere. A block whose union is large (queries that
// share nothing) is computed query by query, with dot products over the listed keys.
//
// Backward, per entry e = (query i, segment s, slot t) with key j, a = softmax weight, w = w_s:
//   dp_e = dO_i · v_j,   dw_s = Σ_t a dp,   dscore_e = a (w (dp - dw_s) + dlse_s),
//   dq_i = scale Σ_e dscore_e k_j,   dk_j = scale Σ_{e -> j} dscore_e q_i,
//   dv_j = Σ_{e -> j} w a_e dO_i,   dbias_j = Σ_{e -> j} dscore_e.
// Phase 1 (parallel over query blocks, the forward's tiles) computes dq and dw, and dscore_e and
// w a_e of every entry, which it stores grouped by key (the grouping, a counting sort of idx per
// (b, h) that keeps entry order within a key, is computed first). Phase 2, parallel over blocks of
// keys, sums dk, dv and dbias over each key's entries in that fixed order: as tiles again (dense
// keys x query-union matrices of dscore and w a, times the gathered rows of Q and dO) when the
// keys' queries overlap, else per key. Key blocks follow the query order when there is one (keys
// ranked by the first query that lists them), and a key in very many lists is summed in fixed
// chunks of entries. Work items go to threads one at a time. Every sum has an order fixed by the
// data, so the results do not depend on the thread count. Large temporaries live in a per-thread
// scratch (scratch.h).
// Memory O(B H L S K).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "core/small_gemm.h"
#include "ops/attention/attention.h"
#include "ops/attention/scratch.h"
#include "ops/attention/vec_exp.h"

namespace hax::ops {
namespace {

constexpr int64_t kBlockQ = 32;  // queries per block
constexpr int64_t kBlockK = 32;  // keys per block in the backward's phase 2
constexpr int64_t kHeavyEntries = 2048;  // a key listed more often is summed in chunks of this many entries
constexpr int64_t kPad = 16;     // union columns are padded (with zero keys) to a multiple of this

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Runs fn(state, it) for every item it in [0, n) on all threads, handing items out one at a time:
// their cost differs a lot (a block of popular keys, a block computed per query), and a static
// split left one thread with most of the work (Key Selection's early keys are everyone's). Each
// thread makes one `state` with make_state(). Every item writes only its own outputs, so results
// do not depend on the schedule.
template <class MakeState, class F>
void parallel_items(int64_t n, MakeState make_state, F fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t it = next.fetch_add(1); it < n; it = next.fetch_add(1)) fn(state, it);
  });
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

Layout layout_of(const AttentionParams& p) {
  return {p.seqlen, p.keylen, p.nheads, p.dim, p.vdim, p.nseg, p.maxkeys};
}

// Largest key union a block computes as dense tiles (0: always per query). In kAuto, a block whose
// queries share little (union above ~4 lists' worth of keys) runs per query: its tiles would do
// mostly useless work.
int64_t union_limit(const AttentionParams& p) {
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

// Per-thread state for one block of queries: its rows, the union of their keys and the tiles.
template <class T>
struct Block {
  const AttentionParams& p;
  const Layout lay;
  const int64_t cap;              // union columns the tile buffers hold (padded)
  std::vector<int32_t> rows;      // (kBlockQ) query of each row
  int64_t nq = 0;                 // rows in this block
  std::vector<int32_t> slot;      // (Lk) column of each key in the union, -1 if absent
  std::vector<int32_t> keys;      // (cap) key of each column
  int64_t U = 0, Up = 0;          // union size, padded
  std::vector<int32_t> cols;      // (kBlockQ, S, K) union column of each list entry of the rows, -1 if none
  // Per-entry scratch for one (query, segment): column or key, score / softmax weight, dp, slot.
  std::vector<int32_t> col, pos;
  std::vector<T> x, dp;
  // Tiles, row-major ("T" = transposed; scores are kept as S^T = K_U Q^T, so that K and V are
  // gathered as whole rows and only the block's queries are transposed).
  std::vector<T> QbT, Kc, Vc, ST, P, Ob;  // (D, kBlockQ) (Up, D) (Up, Dv) (Up, kBlockQ) (nq, Up) (nq, Dv)
  std::vector<T> dObT, dPT, dQb;          // backward: (Dv, kBlockQ) (Up, kBlockQ) (nq, D); P holds dS

  Block(const AttentionParams& p_, int64_t limit, bool backward)
      : p(p_), lay(layout_of(p_)), cap(round_up(limit, kPad)), rows(kBlockQ) {
    const int64_t SK = lay.S * lay.K, D = lay.D, Dv = lay.Dv;
    col.resize(SK), pos.resize(SK), x.resize(SK), dp.resize(SK);
    if (limit > 0) {
      slot.assign(lay.Lk, -1);
      keys.resize(cap);
      cols.resize(kBlockQ * SK);
      QbT.resize(D * kBlockQ), Kc.resize(cap * D), Vc.resize(cap * Dv), ST.resize(cap * kBlockQ);
      P.resize(kBlockQ * cap);
      if (backward) dObT.resize(Dv * kBlockQ), dPT.resize(cap * kBlockQ), dQb.resize(kBlockQ * D);
      else Ob.resize(kBlockQ * Dv);
    }
  }

  // Block c of row bh: queries c*kBlockQ.. of q_order (or of the natural order).
  void set_rows(int64_t bh, int64_t c) {
    const int64_t i0 = c * kBlockQ;
    nq = std::min(kBlockQ, lay.L - i0);
    for (int64_t r = 0; r < nq; ++r) rows[r] = p.q_order ? p.q_order[bh * lay.L + i0 + r] : int32_t(i0 + r);
  }

  // Collects the union of the block's keys; false (nothing kept) when it has more than `limit`.
  bool collect_union(int64_t bh, int64_t limit) {
    U = 0;
    const int64_t SK = lay.S * lay.K;
    for (int64_t r = 0; r < nq; ++r) {
      const int32_t* li = p.idx + lay.list(bh, rows[r]);
      int32_t* cr = &cols[r * SK];
      for (int64_t e = 0; e < SK; ++e) {
        const int32_t j = li[e];
        if (j < 0) {
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
        }
        cr[e] = slot[j];
      }
    }
    Up = round_up(U, kPad);
    return true;
  }

  void release_union() {
    for (int64_t u = 0; u < U; ++u) slot[keys[u]] = -1;
    U = 0;
  }

  // Gathers rows `rows` of a (B, L, H, n) tensor of head h, transposed into (n, kBlockQ).
  void gather_rows_t(const T* src, int64_t b, int64_t h, int64_t n, T* dst) const {
    for (int64_t r = 0; r < nq; ++r) {
      const T* s = src + ((b * lay.L + rows[r]) * lay.H + h) * n;
      for (int64_t d = 0; d < n; ++d) dst[d * kBlockQ + r] = s[d];
    }
  }

  // Gathers the union's rows of a (B, Lk, H, n) tensor of head h into (Up, n), zero padded.
  void gather_keys(const T* src, int64_t b, int64_t h, int64_t n, T* dst) const {
    for (int64_t u = 0; u < U; ++u) {
      const T* s = src + ((b * lay.Lk + keys[u]) * lay.H + h) * n;
      std::copy(s, s + n, dst + u * n);
    }
    std::fill(dst + U * n, dst + Up * n, T(0));
  }

  // Scores of segment s of query row r from the tile S^T: fills col/pos/x, returns the entry count.
  int64_t tile_scores(int64_t bh, int64_t r, int64_t s) {
    const int32_t* cr = &cols[(r * lay.S + s) * lay.K];
    const T* bias = p.bias ? (const T*)p.bias + bh * lay.Lk : nullptr;
    const T* st = &ST[r];
    const T scale = T(p.scale);
    int64_t n = 0;
    for (int64_t t = 0; t < lay.K; ++t) {
      const int32_t c = cr[t];
      if (c < 0) continue;
      col[n] = c, pos[n] = int32_t(t);
      x[n] = scale * st[c * kBlockQ] + (bias ? bias[keys[c]] : T(0));
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
      if (j < 0) continue;
      col[n] = j, pos[n] = int32_t(t);
      x[n] = scale * dot(qrow, (const T*)p.k + lay.k(b, j, h), lay.D) + (bias ? bias[j] : T(0));
      ++n;
    }
    return n;
  }

  // Forward: turns the n scores of segment s of query i in x into exp(x - max), writes the
  // segment's log-sum-exp (-inf when empty) and returns the factor w_s / Σ exp that makes them
  // the segment's weighted softmax (0 when empty).
  T segment_softmax(int64_t bh, int64_t i, int64_t s, int64_t n) {
    T& l = ((T*)p.lse)[lay.seg(bh, i) + s];
    if (n == 0) {
      l = -std::numeric_limits<T>::infinity();
      return T(0);
    }
    T sum;
    l = softmax_terms(x.data(), n, sum);
    return seg_weight(bh, i, s) / sum;
  }

  T seg_weight(int64_t bh, int64_t i, int64_t s) const {
    return p.seg_w ? ((const T*)p.seg_w)[lay.seg(bh, i) + s] : T(1);
  }
};

// ---------------------------------------------------------------------------------------------
// Forward.

template <class T>
void forward_tiles(Block<T>& blk, int64_t b, int64_t h) {
  const AttentionParams& p = blk.p;
  const Layout& lay = blk.lay;
  const int64_t bh = b * lay.H + h, D = lay.D, Dv = lay.Dv, nq = blk.nq, Up = blk.Up;
  blk.gather_rows_t((const T*)p.q, b, h, D, blk.QbT.data());
  blk.gather_keys((const T*)p.k, b, h, D, blk.Kc.data());
  blk.gather_keys((const T*)p.v, b, h, Dv, blk.Vc.data());
  small_gemm<T>(Up, nq, D, blk.Kc.data(), D, blk.QbT.data(), kBlockQ, blk.ST.data(), kBlockQ, false);
  std::fill(blk.P.begin(), blk.P.begin() + nq * Up, T(0));
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t i = blk.rows[r];
    T* prow = &blk.P[r * Up];
    for (int64_t s = 0; s < lay.S; ++s) {
      const int64_t n = blk.tile_scores(bh, r, s);
      const T f = blk.segment_softmax(bh, i, s, n);
      for (int64_t t = 0; t < n; ++t) prow[blk.col[t]] += f * blk.x[t];
    }
  }
  small_gemm<T>(nq, Dv, Up, blk.P.data(), Up, blk.Vc.data(), Dv, blk.Ob.data(), Dv, false);
  for (int64_t r = 0; r < nq; ++r)
    std::copy(&blk.Ob[r * Dv], &blk.Ob[r * Dv] + Dv, (T*)p.out + lay.o(b, blk.rows[r], h));
}

template <class T>
void forward_per_query(Block<T>& blk, int64_t b, int64_t h) {
  const AttentionParams& p = blk.p;
  const Layout& lay = blk.lay;
  const int64_t bh = b * lay.H + h, Dv = lay.Dv;
  for (int64_t r = 0; r < blk.nq; ++r) {
    const int64_t i = blk.rows[r];
    T* orow = (T*)p.out + lay.o(b, i, h);
    std::fill(orow, orow + Dv, T(0));
    for (int64_t s = 0; s < lay.S; ++s) {
      const int64_t n = blk.direct_scores(b, h, i, s);
      const T f = blk.segment_softmax(bh, i, s, n);
      for (int64_t t = 0; t < n; ++t) axpy(f * blk.x[t], (const T*)p.v + lay.v(b, blk.col[t], h), orow, Dv);
    }
  }
}

template <class T>
void forward_impl(const AttentionParams& p) {
  const int64_t nblk = (p.seqlen + kBlockQ - 1) / kBlockQ, limit = union_limit(p);
  parallel_items(
      p.batch * p.nheads * nblk, [&] { return Block<T>(p, limit, false); },
      [&](Block<T>& blk, int64_t it) {
        const int64_t bh = it / nblk, b = bh / p.nheads, h = bh % p.nheads;
        blk.set_rows(bh, it % nblk);
        if (limit > 0 && blk.collect_union(bh, limit)) {
          forward_tiles(blk, b, h);
          blk.release_union();
        } else {
          forward_per_query(blk, b, h);
        }
      });
}

// ---------------------------------------------------------------------------------------------
// Backward.

// The backward's entries grouped by key, for each (b, h): the entries (i, s, t) that list key j
// get positions start[j] .. start[j+1] - 1, in ascending (i, s, t) order; pos[e] is the position
// of entry e (-1 for padding), query[n] the query at position n. Built from idx alone by a counting
// sort before phase 1, which then writes each entry's dscore and w·a straight to its position, so
// that phase 2 reads the entries of a key sequentially. One (b, h) can be split into chunks of
// queries that are counted and placed in parallel, which gives the same order.
template <class T>
struct ByKey {
  int64_t Lk = 0, entries = 0;
  int64_t* start = nullptr;   // (B*H, Lk + 1)
  int32_t* pos = nullptr;     // (B*H, L*S*K), like idx; L*S*K < 2^31 (checked by the binding)
  int32_t* query = nullptr;   // (B*H, L*S*K) by position
  T *dscore = nullptr, *pw = nullptr;  // (B*H, L*S*K) by position, written by phase 1
  const int64_t* starts(int64_t bh) const { return start + bh * (Lk + 1); }
  int64_t base(int64_t bh) const { return bh * entries; }
};

template <class T>
ByKey<T> group_by_key(const AttentionParams& p, const Layout& lay, detail::Scratch& scratch) {
  const int64_t BH = p.batch * p.nheads, L = lay.L, Lk = lay.Lk, SK = lay.S * lay.K, entries = L * SK;
  ByKey<T> g;
  g.Lk = Lk, g.entries = entries;
  g.start = scratch.get<int64_t>(0, BH * (Lk + 1));
  g.pos = scratch.get<int32_t>(1, BH * entries);
  g.query = scratch.get<int32_t>(2, BH * entries);
  g.dscore = scratch.get<T>(3, BH * entries);
  g.pw = scratch.get<T>(4, BH * entries);
  // Chunks of queries per (b, h): parallelism inside a (b, h) when there are fewer of them than
  // threads, with per-chunk counters (nch x Lk) kept below the size of the lists themselves.
  const int64_t nch = BH >= at::get_num_threads()
                          ? 1
                          : std::max<int64_t>(1, std::min<int64_t>(16, entries / (4 * std::max<int64_t>(Lk, 1))));
  const int64_t per = (L + nch - 1) / nch;
  auto count = [&](int64_t bh, int64_t i0, int64_t i1, int64_t* cnt) {
    const int32_t* idx = p.idx + bh * entries;
    for (int64_t e = i0 * SK; e < i1 * SK; ++e)
      if (idx[e] >= 0) ++cnt[idx[e]];
  };
  auto place = [&](int64_t bh, int64_t i0, int64_t i1, int64_t* cur) {
    const int64_t o = bh * entries;
    const int32_t* idx = p.idx + o;
    int32_t *pos = g.pos + o, *qry = g.query + o;
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t e = i * SK; e < (i + 1) * SK; ++e) {
        const int32_t j = idx[e];
        if (j < 0) {
          pos[e] = -1;
          continue;
        }
        const int32_t n = int32_t(cur[j]++);
        pos[e] = n, qry[n] = int32_t(i);
      }
  };
  if (nch == 1) {
    at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> cur(Lk);
      for (int64_t bh = begin; bh < end; ++bh) {
        int64_t* st = g.start + bh * (Lk + 1);
        std::fill(st, st + Lk + 1, int64_t(0));
        count(bh, 0, L, st + 1);
        for (int64_t j = 0; j < Lk; ++j) st[j + 1] += st[j];
        std::copy(st, st + Lk, cur.begin());
        place(bh, 0, L, cur.data());
      }
    });
    return g;
  }
  std::vector<int64_t> offs(nch * Lk), run(Lk);
  for (int64_t bh = 0; bh < BH; ++bh) {
    std::fill(offs.begin(), offs.end(), int64_t(0));
    at::parallel_for(0, nch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) count(bh, c * per, std::min(L, (c + 1) * per), &offs[c * Lk]);
    });
    // start[j] = entries of the keys before j; chunk c of key j follows the chunks c' < c of key j.
    int64_t* st = g.start + bh * (Lk + 1);
    std::fill(run.begin(), run.end(), int64_t(0));
    for (int64_t c = 0; c < nch; ++c)
      for (int64_t j = 0; j < Lk; ++j) run[j] += offs[c * Lk + j];
    st[0] = 0;
    for (int64_t j = 0; j < Lk; ++j) st[j + 1] = st[j] + run[j];
    std::copy(st, st + Lk, run.begin());
    for (int64_t c = 0; c < nch; ++c)
      for (int64_t j = 0; j < Lk; ++j) {
        const int64_t n = offs[c * Lk + j];
        offs[c * Lk + j] = run[j];
        run[j] += n;
      }
    at::parallel_for(0, nch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) place(bh, c * per, std::min(L, (c + 1) * per), &offs[c * Lk]);
    });
  }
  return g;
}

// dscore and w·a of the n entries of one (query, segment) whose weights are a = exp(x - lse)
// (x in place) and dp = dO · v; stores them at the entries' positions (pos: the segment's slots)
// in g, leaves dscore in x and returns dw = Σ a dp.
template <class T>
T segment_backward(Block<T>& blk, int64_t n, T lse, T w, T dlse, const int32_t* pos, T* dscore, T* pw) {
  T* x = blk.x.data();
  const T* dp = blk.dp.data();
  T dw = 0;
#pragma omp simd reduction(+ : dw)
  for (int64_t t = 0; t < n; ++t) {
    x[t] = detail::vexp(x[t] - lse);
    dw += x[t] * dp[t];
  }
  for (int64_t t = 0; t < n; ++t) {
    const T a = x[t];
    const T ds = a * (w * (dp[t] - dw) + dlse);
    x[t] = ds;
    const int32_t m = pos[blk.pos[t]];
    dscore[m] = ds;
    pw[m] = w * a;
  }
  return dw;
}

// Phase 1 for one (query, segment) whose n entries have scores in blk.x and dp in blk.dp.
template <class T>
T phase1_segment(const AttentionGradParams& gp, Block<T>& blk, ByKey<T>& g, int64_t bh, int64_t i, int64_t s,
                 int64_t n) {
  const Layout& lay = blk.lay;
  const int64_t sg = lay.seg(bh, i) + s, o = g.base(bh);
  const T dlse = gp.dlse ? ((const T*)gp.dlse)[sg] : T(0);
  return segment_backward(blk, n, ((const T*)gp.fwd.lse)[sg], blk.seg_weight(bh, i, s), dlse,
                          g.pos + lay.list(bh, i) + s * lay.K, g.dscore + o, g.pw + o);
}

template <class T>
void backward_tiles(const AttentionGradParams& gp, Block<T>& blk, int64_t b, int64_t h, ByKey<T>& g) {
  const AttentionParams& p = blk.p;
  const Layout& lay = blk.lay;
  const int64_t bh = b * lay.H + h, D = lay.D, Dv = lay.Dv, nq = blk.nq, Up = blk.Up;
  blk.gather_rows_t((const T*)p.q, b, h, D, blk.QbT.data());
  blk.gather_rows_t((const T*)gp.dout, b, h, Dv, blk.dObT.data());
  blk.gather_keys((const T*)p.k, b, h, D, blk.Kc.data());
  blk.gather_keys((const T*)p.v, b, h, Dv, blk.Vc.data());
  small_gemm<T>(Up, nq, D, blk.Kc.data(), D, blk.QbT.data(), kBlockQ, blk.ST.data(), kBlockQ, false);
  small_gemm<T>(Up, nq, Dv, blk.Vc.data(), Dv, blk.dObT.data(), kBlockQ, blk.dPT.data(), kBlockQ, false);
  std::fill(blk.P.begin(), blk.P.begin() + nq * Up, T(0));  // P holds dS here
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t i = blk.rows[r];
    T* dsrow = &blk.P[r * Up];
    const T* dpcol = &blk.dPT[r];
    for (int64_t s = 0; s < lay.S; ++s) {
      const int64_t n = blk.tile_scores(bh, r, s);
      T dw = 0;
      if (n > 0) {
        for (int64_t t = 0; t < n; ++t) blk.dp[t] = dpcol[blk.col[t] * kBlockQ];
        dw = phase1_segment(gp, blk, g, bh, i, s, n);
        for (int64_t t = 0; t < n; ++t) dsrow[blk.col[t]] += blk.x[t];
      }
      if (gp.dseg_w) ((T*)gp.dseg_w)[lay.seg(bh, i) + s] = dw;
    }
  }
  small_gemm<T>(nq, D, Up, blk.P.data(), Up, blk.Kc.data(), D, blk.dQb.data(), D, false);
  const T scale = T(p.scale);
  for (int64_t r = 0; r < nq; ++r) {
    T* dq = (T*)gp.dq + lay.q(b, blk.rows[r], h);
    const T* src = &blk.dQb[r * D];
    for (int64_t d = 0; d < D; ++d) dq[d] = scale * src[d];
  }
}

template <class T>
void backward_per_query(const AttentionGradParams& gp, Block<T>& blk, int64_t b, int64_t h, ByKey<T>& g) {
  const AttentionParams& p = blk.p;
  const Layout& lay = blk.lay;
  const int64_t bh = b * lay.H + h, D = lay.D, Dv = lay.Dv;
  const T scale = T(p.scale);
  for (int64_t r = 0; r < blk.nq; ++r) {
    const int64_t i = blk.rows[r];
    const T* dorow = (const T*)gp.dout + lay.o(b, i, h);
    T* dq = (T*)gp.dq + lay.q(b, i, h);
    std::fill(dq, dq + D, T(0));
    for (int64_t s = 0; s < lay.S; ++s) {
      const int64_t n = blk.direct_scores(b, h, i, s);
      T dw = 0;
      if (n > 0) {
        for (int64_t t = 0; t < n; ++t) blk.dp[t] = dot(dorow, (const T*)p.v + lay.v(b, blk.col[t], h), Dv);
        dw = phase1_segment(gp, blk, g, bh, i, s, n);
        for (int64_t t = 0; t < n; ++t) axpy(blk.x[t], (const T*)p.k + lay.k(b, blk.col[t], h), dq, D);
      }
      if (gp.dseg_w) ((T*)gp.dseg_w)[lay.seg(bh, i) + s] = dw;
    }
    for (int64_t d = 0; d < D; ++d) dq[d] *= scale;
  }
}

// Largest query union a key block computes as dense tiles in phase 2 (0: always per key).
int64_t query_union_limit(const AttentionParams& p) {
  switch (p.path) {
    case AttentionPath::kPerQuery: return 0;
    case AttentionPath::kTiles: return p.seqlen;
    case AttentionPath::kAuto: break;
  }
  return std::min<int64_t>(p.seqlen, 4 * p.nseg * p.maxkeys + kBlockK);
}

// Writes key j's gradients from its sums Σ dscore q (dk, unscaled), Σ w a dO (dv), Σ dscore (db).
template <class T>
void write_key_grads(const AttentionGradParams& gp, const Layout& lay, int64_t b, int64_t h, int64_t j, const T* dk,
                     const T* dv, T db) {
  T* dkr = (T*)gp.dk + lay.k(b, j, h);
  const T scale = T(gp.fwd.scale);
  for (int64_t d = 0; d < lay.D; ++d) dkr[d] = scale * dk[d];
  std::copy(dv, dv + lay.Dv, (T*)gp.dv + lay.v(b, j, h));
  if (gp.dbias) ((T*)gp.dbias)[(b * lay.H + h) * lay.Lk + j] = db;
}

// Per-thread state for phase 2 on one block of kBlockK consecutive keys. As tiles: the union of
// the queries whose entries reference the block's keys, dense (keys x union) matrices dS^T and
// (w a)^T summed from the entries, and dK = scale dS^T Q_U, dV = (w a)^T dO_U; or, when the union
// is large (keys shared by many queries), per key over its entries.
template <class T>
struct KeyBlock {
  const AttentionGradParams& gp;
  const Layout& lay;
  const ByKey<T>& g;
  const int64_t cap;
  int64_t bh = 0, j0 = 0, nk = 0, U = 0, Up = 0;
  const int32_t* order = nullptr;  // (B*H, Lk) the keys in block order, or null (0..Lk-1)
  std::vector<int32_t> slot, qs;                  // (L) column of each query, -1; (cap) query of each column
  std::vector<T> dST, PT, Qg, dOg, dKb, dVb, db;  // (kBlockK, cap) x2, (cap, D), (cap, Dv), (kBlockK, D), (kBlockK, Dv), (kBlockK)

  KeyBlock(const AttentionGradParams& gp_, const Layout& lay_, const ByKey<T>& g_, int64_t limit)
      : gp(gp_), lay(lay_), g(g_), cap(round_up(limit, kPad)), db(kBlockK) {
    if (limit > 0) {
      slot.assign(lay.L, -1);
      qs.resize(cap);
      dST.resize(kBlockK * cap), PT.resize(kBlockK * cap), Qg.resize(cap * lay.D), dOg.resize(cap * lay.Dv);
      dKb.resize(kBlockK * lay.D), dVb.resize(kBlockK * lay.Dv);
    }
  }

  // Keys j0 .. j0 + kBlockK - 1 of row bh's key order.
  void set_keys(int64_t bh_, int64_t j0_, const int32_t* key_order) {
    bh = bh_, j0 = j0_, nk = std::min(kBlockK, lay.Lk - j0), order = key_order;
  }
  // The key of block row jj.
  int64_t key(int64_t jj) const { return order ? order[bh * lay.Lk + j0 + jj] : j0 + jj; }

  // Key jj of the block is summed by the heavy-key chunks instead (see backward_impl).
  bool heavy(int64_t jj) const {
    const int64_t* st = g.starts(bh);
    return st[key(jj) + 1] - st[key(jj)] > kHeavyEntries;
  }

  bool collect_union(int64_t limit) {
    U = 0;
    const int64_t* st = g.starts(bh);
    const int32_t* qry = g.query + g.base(bh);
    for (int64_t jj = 0; jj < nk; ++jj) {
      if (heavy(jj)) continue;
      for (int64_t n = st[key(jj)]; n < st[key(jj) + 1]; ++n) {
        const int32_t i = qry[n];
        if (slot[i] >= 0) continue;
        if (U == limit) {
          release_union();
          return false;
        }
        slot[i] = int32_t(U);
        qs[U++] = i;
      }
    }
    Up = round_up(U, kPad);
    return true;
  }

  void release_union() {
    for (int64_t u = 0; u < U; ++u) slot[qs[u]] = -1;
    U = 0;
  }

  void write(int64_t b, int64_t h, int64_t jj, const T* dk, const T* dv) const {
    write_key_grads(gp, lay, b, h, key(jj), dk, dv, db[jj]);
  }

  void tiles(int64_t b, int64_t h) {
    const int64_t D = lay.D, Dv = lay.Dv, *st = g.starts(bh), o = g.base(bh);
    const int32_t* qry = g.query + o;
    const T *ds = g.dscore + o, *pw = g.pw + o;
    std::fill(dST.begin(), dST.begin() + nk * Up, T(0));
    std::fill(PT.begin(), PT.begin() + nk * Up, T(0));
    for (int64_t jj = 0; jj < nk; ++jj) {
      if (heavy(jj)) continue;
      T* dsrow = &dST[jj * Up];
      T* prow = &PT[jj * Up];
      T s = 0;
      for (int64_t n = st[key(jj)]; n < st[key(jj) + 1]; ++n) {
        const int32_t c = slot[qry[n]];
        dsrow[c] += ds[n];
        prow[c] += pw[n];
        s += ds[n];
      }
      db[jj] = s;
    }
    for (int64_t u = 0; u < U; ++u) {
      const T* q = (const T*)gp.fwd.q + lay.q(b, qs[u], h);
      const T* dO = (const T*)gp.dout + lay.o(b, qs[u], h);
      std::copy(q, q + D, &Qg[u * D]);
      std::copy(dO, dO + Dv, &dOg[u * Dv]);
    }
    std::fill(&Qg[U * D], &Qg[Up * D], T(0));
    std::fill(&dOg[U * Dv], &dOg[Up * Dv], T(0));
    small_gemm<T>(nk, D, Up, dST.data(), Up, Qg.data(), D, dKb.data(), D, false);
    small_gemm<T>(nk, Dv, Up, PT.data(), Up, dOg.data(), Dv, dVb.data(), Dv, false);
    for (int64_t jj = 0; jj < nk; ++jj)
      if (!heavy(jj)) write(b, h, jj, &dKb[jj * D], &dVb[jj * Dv]);
  }

  void direct(int64_t b, int64_t h) {
    const int64_t D = lay.D, Dv = lay.Dv, *st = g.starts(bh), o = g.base(bh);
    const int32_t* qry = g.query + o;
    const T *ds = g.dscore + o, *pw = g.pw + o;
    std::vector<T> dk(D), dv(Dv);
    for (int64_t jj = 0; jj < nk; ++jj) {
      if (heavy(jj)) continue;
      std::fill(dk.begin(), dk.end(), T(0));
      std::fill(dv.begin(), dv.end(), T(0));
      T s = 0;
      for (int64_t n = st[key(jj)]; n < st[key(jj) + 1]; ++n) {
        const int64_t i = qry[n];
        axpy(ds[n], (const T*)gp.fwd.q + lay.q(b, i, h), dk.data(), D);
        axpy(pw[n], (const T*)gp.dout + lay.o(b, i, h), dv.data(), Dv);
        s += ds[n];
      }
      db[jj] = s;
      write(b, h, jj, dk.data(), dv.data());
    }
  }
};

// With a query order (LSH, HAX: queries grouped by bucket), phase 2 takes the keys in the order of
// the earliest-ranked query that lists them, which groups the keys of one bucket as the query
// order groups its queries: a block's keys then share their queries and run as tiles. Returns the
// (B*H, Lk) order, or nothing without a query order (keys in position order).
template <class T>
std::vector<int32_t> key_block_order(const AttentionParams& p, const Layout& lay, const ByKey<T>& g) {
  if (!p.q_order) return {};
  const int64_t BH = p.batch * p.nheads, L = lay.L, Lk = lay.Lk;
  std::vector<int32_t> order(BH * Lk);
  parallel_items(
      BH, [] { return 0; },
      [&](int, int64_t bh) {
        const int64_t* st = g.starts(bh);
        const int32_t* qo = p.q_order + bh * L;
        const int32_t* qry = g.query + g.base(bh);
        std::vector<int32_t> rank(L), first(Lk);
        for (int64_t r = 0; r < L; ++r) rank[qo[r]] = int32_t(r);
        std::vector<int64_t> count(L + 2, 0);  // a counting sort by first rank, stable
        for (int64_t j = 0; j < Lk; ++j) {
          int32_t f = int32_t(L);  // keys nobody lists go last
          for (int64_t n = st[j]; n < st[j + 1]; ++n) f = std::min(f, rank[qry[n]]);
          first[j] = f;
          ++count[f + 1];
        }
        for (int64_t r = 0; r <= L; ++r) count[r + 1] += count[r];
        int32_t* out = &order[bh * Lk];
        for (int64_t j = 0; j < Lk; ++j) out[count[first[j]]++] = int32_t(j);
      });
  return order;
}

template <class T>
void backward_impl(const AttentionGradParams& gp) {
  const AttentionParams& p = gp.fwd;
  const Layout lay = layout_of(p);
  const int64_t BH = p.batch * p.nheads;
  detail::Scratch& scratch = detail::Scratch::local();
  ByKey<T> g = group_by_key<T>(p, lay, scratch);

  // Phase 1: dq, dseg_w, and dscore, w·a of every entry (at its position in g); parallel over
  // query blocks.
  const int64_t nblk = (lay.L + kBlockQ - 1) / kBlockQ, limit = union_limit(p);
  parallel_items(
      BH * nblk, [&] { return Block<T>(p, limit, true); },
      [&](Block<T>& blk, int64_t it) {
        const int64_t bh = it / nblk, b = bh / p.nheads, h = bh % p.nheads;
        blk.set_rows(bh, it % nblk);
        if (limit > 0 && blk.collect_union(bh, limit)) {
          backward_tiles(gp, blk, b, h, g);
          blk.release_union();
        } else {
          backward_per_query(gp, blk, b, h, g);
        }
      });

  // Phase 2: dk, dv, dbias per block of keys, from the entries grouped by key. A key listed by more
  // than kHeavyEntries entries (a sink, Key Selection's favourites: in every query's list) would
  // make its block one long item that the other threads wait for; its entries are summed instead
  // in fixed chunks, each an item of its own, and the chunks' partial sums are added in order
  // (fixed by the data, not the threads) at the end.
  struct Chunk {
    int64_t bh, j, n0, n1;
  };
  std::vector<Chunk> chunks;
  std::vector<int64_t> heavy_first;  // index of each heavy key's first chunk; chunks.size() at the end
  for (int64_t bh = 0; bh < BH; ++bh) {
    const int64_t* st = g.starts(bh);
    for (int64_t j = 0; j < lay.Lk; ++j) {
      if (st[j + 1] - st[j] <= kHeavyEntries) continue;
      heavy_first.push_back((int64_t)chunks.size());
      for (int64_t n0 = st[j]; n0 < st[j + 1]; n0 += kHeavyEntries)
        chunks.push_back({bh, j, n0, std::min(n0 + kHeavyEntries, st[j + 1])});
    }
  }
  heavy_first.push_back((int64_t)chunks.size());
  const int64_t width = lay.D + lay.Dv + 1, nchunks = (int64_t)chunks.size();
  std::vector<T> partial(nchunks * width);  // per chunk: Σ dscore q (D), Σ w a dO (Dv), Σ dscore
  const std::vector<int32_t> key_order = key_block_order(p, lay, g);
  const int32_t* korder = key_order.empty() ? nullptr : key_order.data();
  const int64_t nkb = (lay.Lk + kBlockK - 1) / kBlockK, klimit = query_union_limit(p);
  parallel_items(
      nchunks + BH * nkb, [&] { return KeyBlock<T>(gp, lay, g, klimit); },
      [&](KeyBlock<T>& kb, int64_t it) {
        if (it < nchunks) {  // the longest items first
          const Chunk& c = chunks[it];
          const int64_t b = c.bh / p.nheads, h = c.bh % p.nheads, o = g.base(c.bh);
          std::vector<T> acc(width, T(0));  // not in `partial` itself: neighbouring chunks share cache lines
          for (int64_t n = o + c.n0; n < o + c.n1; ++n) {
            const int64_t i = g.query[n];
            axpy(g.dscore[n], (const T*)p.q + lay.q(b, i, h), acc.data(), lay.D);
            axpy(g.pw[n], (const T*)gp.dout + lay.o(b, i, h), acc.data() + lay.D, lay.Dv);
            acc[width - 1] += g.dscore[n];
          }
          std::copy(acc.begin(), acc.end(), &partial[it * width]);
          return;
        }
        it -= nchunks;
        const int64_t bh = it / nkb, b = bh / p.nheads, h = bh % p.nheads, j0 = (it % nkb) * kBlockK;
        kb.set_keys(bh, j0, korder);
        if (klimit > 0 && kb.collect_union(klimit)) {
          kb.tiles(b, h);
          kb.release_union();
        } else {
          kb.direct(b, h);
        }
      });
  for (size_t hk = 0; hk + 1 < heavy_first.size(); ++hk) {  // the heavy keys: chunks summed in order
    const Chunk& c0 = chunks[heavy_first[hk]];
    std::vector<T> sum(width, T(0));
    for (int64_t c = heavy_first[hk]; c < heavy_first[hk + 1]; ++c)
      for (int64_t x = 0; x < width; ++x) sum[x] += partial[c * width + x];
    write_key_grads(gp, lay, c0.bh / p.nheads, c0.bh % p.nheads, c0.j, sum.data(), sum.data() + lay.D,
                    sum[width - 1]);
  }
  scratch.release_if_large();
}

}  // namespace

void sparse_attention_forward_cpu(const AttentionParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return forward_impl<double>(p);
  return forward_impl<float>(p);
}

void sparse_attention_backward_cpu(const AttentionGradParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return backward_impl<double>(p);
  return backward_impl<float>(p);
}

}  // namespace hax::ops
