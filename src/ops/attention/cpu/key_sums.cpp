// Per-key sums of the CPU sparse-attention backward (key_sums.h).
//
// From union partials: the (block, row) pairs of every key are found by a counting sort (in block
// order), and each key sums its rows in that order.
//
// From entries: the entries of the flagged queries are grouped by key (a counting sort of idx per
// (b, h) that keeps ascending (i, s, t) order within a key) with their dscore and w·a copied into
// that order, so that the key sums read them sequentially. The sums then run per block of kBlockK
// keys: as tiles (dense keys x query-union matrices of dscore and w a, times the gathered rows of Q
// and dO) when the keys' queries overlap, else per key. Key blocks follow the query order when there
// is one (keys ranked by the first query that lists them), and a key in very many lists is summed
// in fixed chunks of entries.
#include "ops/attention/cpu/key_sums.h"

#include "core/small_gemm.h"
#include "ops/attention/cpu/block.h"
#include "ops/attention/scratch.h"

namespace hax::ops::cpu_attention {
namespace {

constexpr int64_t kBlockK = 32;          // keys per block of the entry sums
constexpr int64_t kHeavyEntries = 2048;  // a key listed more often is summed in chunks of this many entries
constexpr int64_t kKeysPerItem = 64;     // keys per work item of the partial sums

// Scratch slots of the calling thread (backward.cpp uses 0..4).
enum : size_t { kStart = 5, kRef, kByKeyStart, kByKeyQuery, kByKeyDscore, kByKeyPw };

// Writes key j's gradients from its sums Σ dscore q (dk, unscaled), Σ w a dO (dv), Σ dscore (db),
// or adds them to what is there.
template <class T>
void put_key_grads(const AttentionGradParams& gp, const Layout& lay, int64_t b, int64_t h, int64_t j, const T* dk,
                   const T* dv, T db, bool accumulate) {
  T* dkr = (T*)gp.dk + lay.k(b, j, h);
  T* dvr = (T*)gp.dv + lay.v(b, j, h);
  const T scale = T(gp.fwd.scale);
  T* dbr = gp.dbias ? (T*)gp.dbias + (b * lay.H + h) * lay.Lk + j : nullptr;
  if (accumulate) {
    for (int64_t d = 0; d < lay.D; ++d) dkr[d] += scale * dk[d];
    for (int64_t d = 0; d < lay.Dv; ++d) dvr[d] += dv[d];
    if (dbr) *dbr += db;
  } else {
    for (int64_t d = 0; d < lay.D; ++d) dkr[d] = scale * dk[d];
    std::copy(dv, dv + lay.Dv, dvr);
    if (dbr) *dbr = db;
  }
}

// ---------------------------------------------------------------------------------------------
// Entries grouped by key.

// For each (b, h): the grouped entries of key j are at positions start[j] .. start[j+1] - 1;
// query[n] is the query of position n, dscore[n] and pw[n] its values.
template <class T>
struct ByKey {
  int64_t Lk = 0, entries = 0;
  int64_t* start = nullptr;   // (B*H, Lk + 1)
  int32_t* query = nullptr;   // (B*H, L*S*K) by position
  T *dscore = nullptr, *pw = nullptr;  // (B*H, L*S*K) by position
  const int64_t* starts(int64_t bh) const { return start + bh * (Lk + 1); }
  int64_t base(int64_t bh) const { return bh * entries; }
};

template <class T>
ByKey<T> group_by_key(const AttentionParams& p, const Layout& lay, const EntryGrads<T>& eg, detail::Scratch& scratch) {
  const int64_t BH = p.batch * p.nheads, L = lay.L, Lk = lay.Lk, SK = lay.S * lay.K, entries = L * SK;
  ByKey<T> g;
  g.Lk = Lk, g.entries = entries;
  g.start = scratch.get<int64_t>(kByKeyStart, BH * (Lk + 1));
  g.query = scratch.get<int32_t>(kByKeyQuery, BH * entries);
  g.dscore = scratch.get<T>(kByKeyDscore, BH * entries);
  g.pw = scratch.get<T>(kByKeyPw, BH * entries);
  // Chunks of queries per (b, h): parallelism inside a (b, h) when there are fewer of them than
  // threads, with per-chunk counters (nch x Lk) kept below the size of the lists themselves.
  const int64_t nch = BH >= at::get_num_threads()
                          ? 1
                          : std::max<int64_t>(1, std::min<int64_t>(16, entries / (4 * std::max<int64_t>(Lk, 1))));
  const int64_t per = (L + nch - 1) / nch;
  auto count = [&](int64_t bh, int64_t i0, int64_t i1, int64_t* cnt) {
    const int32_t* idx = p.idx + bh * entries;
    for (int64_t i = i0; i < i1; ++i) {
      if (!eg.use[bh * L + i]) continue;
      for (int64_t e = i * SK; e < (i + 1) * SK; ++e)
        if (idx[e] >= 0) ++cnt[idx[e]];
    }
  };
  auto place = [&](int64_t bh, int64_t i0, int64_t i1, int64_t* cur) {
    const int64_t o = bh * entries;
    const int32_t* idx = p.idx + o;
    int32_t* qry = g.query + o;
    T *ds = g.dscore + o, *pw = g.pw + o;
    for (int64_t i = i0; i < i1; ++i) {
      if (!eg.use[bh * L + i]) continue;
      for (int64_t e = i * SK; e < (i + 1) * SK; ++e) {
        const int32_t j = idx[e];
        if (j < 0) continue;
        const int64_t n = cur[j]++;
        qry[n] = int32_t(i), ds[n] = eg.dscore[o + e], pw[n] = eg.pw[o + e];
      }
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

// Largest query union a key block computes as dense tiles (0: always per key).
int64_t query_union_limit(const AttentionParams& p) {
  switch (p.path) {
    case AttentionPath::kPerQuery: return 0;
    case AttentionPath::kTiles: return p.seqlen;
    case AttentionPath::kAuto: break;
  }
  return std::min<int64_t>(p.seqlen, 4 * p.nseg * p.maxkeys + kBlockK);
}

// Per-thread state for one block of kBlockK keys: as tiles, the union of the queries whose entries
// reference the block's keys, dense (keys x union) matrices dS^T and (w a)^T summed from the
// entries, and dK = dS^T Q_U, dV = (w a)^T dO_U; or, when the union is large (keys shared by many
// queries), per key over its entries.
template <class T>
struct KeyBlock {
  const AttentionGradParams& gp;
  const Layout& lay;
  const ByKey<T>& g;
  const int64_t cap;
  int64_t bh = 0, j0 = 0, nk = 0, U = 0;
  const int32_t* order = nullptr;  // (B*H, Lk) the keys in block order, or null (0..Lk-1)
  std::vector<int32_t> slot, qs;                  // (L) column of each query, -1; (cap) query of each column
  std::vector<T> dST, PT, Qg, dOg, dKb, dVb, db;  // (kBlockK, cap) x2, (cap, D), (cap, Dv), (kBlockK, D), (kBlockK, Dv), (kBlockK)

  KeyBlock(const AttentionGradParams& gp_, const Layout& lay_, const ByKey<T>& g_, int64_t limit)
      : gp(gp_), lay(lay_), g(g_), cap(limit), db(kBlockK) {
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

  // Key jj of the block is summed by the heavy-key chunks instead (see key_grads_from_entries).
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
    return true;
  }

  void release_union() {
    for (int64_t u = 0; u < U; ++u) slot[qs[u]] = -1;
    U = 0;
  }

  void write(int64_t b, int64_t h, int64_t jj, const T* dk, const T* dv) const {
    put_key_grads(gp, lay, b, h, key(jj), dk, dv, db[jj], false);
  }

  void tiles(int64_t b, int64_t h) {
    const int64_t D = lay.D, Dv = lay.Dv, *st = g.starts(bh), o = g.base(bh);
    const int32_t* qry = g.query + o;
    const T *ds = g.dscore + o, *pw = g.pw + o;
    std::fill(dST.begin(), dST.begin() + nk * U, T(0));
    std::fill(PT.begin(), PT.begin() + nk * U, T(0));
    for (int64_t jj = 0; jj < nk; ++jj) {
      if (heavy(jj)) continue;
      T* dsrow = &dST[jj * U];
      T* prow = &PT[jj * U];
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
    small_gemm<T>(nk, D, U, dST.data(), U, Qg.data(), D, dKb.data(), D, false);
    small_gemm<T>(nk, Dv, U, PT.data(), U, dOg.data(), Dv, dVb.data(), Dv, false);
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

// With a query order (LSH, HAX: queries grouped by bucket), the key blocks take the keys in the
// order of the earliest-ranked query that lists them, which groups the keys of one bucket as the
// query order groups its queries: a block's keys then share their queries and run as tiles.
// Returns the (B*H, Lk) order, or nothing without a query order (keys in position order).
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

}  // namespace

template <class T>
void key_grads_from_entries(const AttentionGradParams& gp, const EntryGrads<T>& eg) {
  const AttentionParams& p = gp.fwd;
  const Layout lay = layout_of(p);
  const int64_t BH = p.batch * p.nheads;
  detail::Scratch& scratch = detail::Scratch::local();
  const ByKey<T> g = group_by_key<T>(p, lay, eg, scratch);
  // A key listed by more than kHeavyEntries entries (a sink, Key Selection's favourites: in every
  // query's list) would make its block one long item that the other threads wait for; its entries
  // are summed instead in fixed chunks, each an item of its own, and the chunks' partial sums are
  // added in order (fixed by the data, not the threads) at the end.
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
    put_key_grads(gp, lay, c0.bh / p.nheads, c0.bh % p.nheads, c0.j, sum.data(), sum.data() + lay.D, sum[width - 1],
                  false);
  }
}

template <class T>
void key_grads_from_partials(const AttentionGradParams& gp, const UnionPartials<T>& pt, bool accumulate) {
  const AttentionParams& p = gp.fwd;
  const Layout lay = layout_of(p);
  const int64_t BH = p.batch * p.nheads, Lk = lay.Lk, W = pt.width, per_bh = pt.blocks * pt.limit;  // W = D + Dv
  detail::Scratch& scratch = detail::Scratch::local();
  // For each (b, h), the rows of key j are ref[start[j]] .. ref[start[j+1] - 1] (row numbers
  // within the (b, h)), in block order: a counting sort over the blocks' unions.
  int64_t* start = scratch.get<int64_t>(kStart, BH * (Lk + 1));
  int32_t* ref = scratch.get<int32_t>(kRef, BH * per_bh);
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      int64_t* st = start + bh * (Lk + 1);
      int32_t* rf = ref + bh * per_bh;
      std::fill(st, st + Lk + 1, int64_t(0));
      for (int64_t c = 0; c < pt.blocks; ++c) {
        const int64_t it = bh * pt.blocks + c;
        for (int64_t u = 0; u < std::max(0, pt.count[it]); ++u) ++st[pt.keys[it * pt.limit + u] + 1];
      }
      for (int64_t j = 0; j < Lk; ++j) st[j + 1] += st[j];
      std::vector<int64_t> cur(st, st + Lk);
      for (int64_t c = 0; c < pt.blocks; ++c) {
        const int64_t it = bh * pt.blocks + c;
        for (int64_t u = 0; u < std::max(0, pt.count[it]); ++u)
          rf[cur[pt.keys[it * pt.limit + u]]++] = int32_t(c * pt.limit + u);
      }
    }
  });
  const int64_t per = (Lk + kKeysPerItem - 1) / kKeysPerItem;
  parallel_items(
      BH * per, [&] { return std::vector<T>(W); },
      [&](std::vector<T>& acc, int64_t it) {
        const int64_t bh = it / per, b = bh / p.nheads, h = bh % p.nheads;
        const int64_t* st = start + bh * (Lk + 1);
        const int32_t* rf = ref + bh * per_bh;
        const T* rows = pt.rows + bh * per_bh * W;
        const T* dbs = pt.db + bh * per_bh;
        T* a = acc.data();
        for (int64_t j = (it % per) * kKeysPerItem; j < std::min(Lk, (it % per + 1) * kKeysPerItem); ++j) {
          if (accumulate && st[j] == st[j + 1]) continue;
          std::fill(acc.begin(), acc.end(), T(0));
          T db = 0;
          for (int64_t n = st[j]; n < st[j + 1]; ++n) {
            if (n + 8 < st[Lk]) prefetch_bytes(rows + int64_t(rf[n + 8]) * W, W * sizeof(T));  // the rows are scattered
            const T* row = rows + int64_t(rf[n]) * W;
#pragma omp simd
            for (int64_t x = 0; x < W; ++x) a[x] += row[x];
            db += dbs[rf[n]];
          }
          put_key_grads(gp, lay, b, h, j, a, a + lay.D, db, accumulate);
        }
      });
}

template void key_grads_from_entries<float>(const AttentionGradParams&, const EntryGrads<float>&);
template void key_grads_from_entries<double>(const AttentionGradParams&, const EntryGrads<double>&);
template void key_grads_from_partials<float>(const AttentionGradParams&, const UnionPartials<float>&, bool);
template void key_grads_from_partials<double>(const AttentionGradParams&, const UnionPartials<double>&, bool);

}  // namespace hax::ops::cpu_attention
