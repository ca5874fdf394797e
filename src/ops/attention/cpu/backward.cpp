// CPU backward of sparse attention over index lists, deterministic: every sum has an order fixed by
// the data, so the results do not depend on the thread count.
//
// Per entry e = (query i, segment s, slot t) with key j, a = softmax weight, w = w_s:
//   dp_e = dO_i · v_j,   dw_s = Σ_t a dp,   dscore_e = a (w (dp - dw_s) + dlse_s),
//   dq_i = scale Σ_e dscore_e k_j,   dk_j = scale Σ_{e -> j} dscore_e q_i,
//   dv_j = Σ_{e -> j} w a_e dO_i,   dbias_j = Σ_{e -> j} dscore_e.
// Phase 1, parallel over query blocks (the forward's blocks, block.h). A tile block recomputes S^T
// and dP^T = V_U dO^T as products, forms dS^T and (w a)^T over its union (with one segment per
// query on whole rows of lanes, as the forward), and gets dQ = (dS^T)^T K_U, and the union's
// partial sums dS^T Q, (w a)^T dO and the row sums of dS^T, as products again. A block computed per
// query gets dq by dot products and leaves dscore and w a per entry. Phase 2 (key_sums.cpp) sums
// both into dk, dv and dbias per key.
#include "core/small_gemm.h"
#include "ops/attention/attention.h"
#include "ops/attention/cpu/block.h"
#include "ops/attention/cpu/key_sums.h"
#include "ops/attention/scratch.h"

namespace hax::ops {
namespace cpu_attention {
namespace {

// Scratch slots of the calling thread (key_sums.cpp uses 5 and above).
enum : size_t { kPartRows = 0, kPartKeys, kEntryDscore, kEntryPw, kPartDb };

// dS^T and (w a)^T of a tile block with one segment per query, on whole rows of lanes; writes dw.
template <class T>
void dense_grads(const AttentionGradParams& gp, Block<T>& blk, int64_t bh) {
  constexpr int64_t R = kBlockQ;
  const Layout& lay = blk.lay;
  const T scale = T(blk.p.scale);
  T lse[R], w[R], dlse[R], dw[R];
  for (int64_t r = 0; r < R; ++r) lse[r] = w[r] = dlse[r] = dw[r] = T(0);
  for (int64_t r = 0; r < blk.nq; ++r) {
    const int64_t i = blk.rows[r], sg = lay.seg(bh, i);
    lse[r] = ((const T*)gp.fwd.lse)[sg];
    w[r] = blk.seg_weight(bh, i, 0);
    dlse[r] = gp.dlse ? ((const T*)gp.dlse)[sg] : T(0);
  }
  for (int64_t u = 0; u < blk.U; ++u) {  // a = c exp(x - lse), dw = Σ a dp
    T* st = &blk.ST[u * R];
    const T *c = &blk.CT[u * R], *dp = &blk.dPT[u * R];
    const T bu = blk.bias_of(bh, u);
#pragma omp simd
    for (int64_t r = 0; r < R; ++r) {
      const T e = detail::vexp(scale * st[r] + bu - lse[r]);
      st[r] = c[r] > T(0) ? c[r] * e : T(0);
      dw[r] += st[r] * dp[r];
    }
  }
  for (int64_t u = 0; u < blk.U; ++u) {  // dS = a (w (dp - dw) + dlse), (w a)
    const T *a = &blk.ST[u * R], *dp = &blk.dPT[u * R];
    T *ds = &blk.dST[u * R], *pw = &blk.PT[u * R];
#pragma omp simd
    for (int64_t r = 0; r < R; ++r) {
      ds[r] = a[r] * (w[r] * (dp[r] - dw[r]) + dlse[r]);
      pw[r] = w[r] * a[r];
    }
  }
  if (gp.dseg_w)
    for (int64_t r = 0; r < blk.nq; ++r) ((T*)gp.dseg_w)[lay.seg(bh, blk.rows[r])] = dw[r];
}

// dS^T and (w a)^T of a tile block with several segments per query, entry by entry; writes dw.
template <class T>
void segment_grads_of_block(const AttentionGradParams& gp, Block<T>& blk, int64_t bh) {
  constexpr int64_t R = kBlockQ;
  const Layout& lay = blk.lay;
  std::fill(blk.dST.begin(), blk.dST.begin() + blk.U * R, T(0));
  std::fill(blk.PT.begin(), blk.PT.begin() + blk.U * R, T(0));
  for (int64_t r = 0; r < blk.nq; ++r) {
    const int64_t i = blk.rows[r];
    for (int64_t s = 0; s < lay.S; ++s) {
      const int64_t n = blk.tile_scores(bh, r, s), sg = lay.seg(bh, i) + s;
      T dw = 0;
      if (n > 0) {
        for (int64_t t = 0; t < n; ++t) blk.dp[t] = blk.dPT[blk.col[t] * R + r];
        const T dlse = gp.dlse ? ((const T*)gp.dlse)[sg] : T(0);
        dw = segment_grads(blk.x.data(), blk.dp.data(), n, ((const T*)gp.fwd.lse)[sg], blk.seg_weight(bh, i, s), dlse);
        for (int64_t t = 0; t < n; ++t) {
          blk.dST[blk.col[t] * R + r] += blk.x[t];
          blk.PT[blk.col[t] * R + r] += blk.dp[t];
        }
      }
      if (gp.dseg_w) ((T*)gp.dseg_w)[sg] = dw;
    }
  }
}

// A tile block: dq of its queries, and its union's partial sums into rows (U, D + Dv) and db (U).
template <class T>
void backward_tiles(const AttentionGradParams& gp, Block<T>& blk, int64_t b, int64_t h, T* rows, T* db) {
  constexpr int64_t R = kBlockQ;
  const AttentionParams& p = blk.p;
  const Layout& lay = blk.lay;
  const int64_t bh = b * lay.H + h, D = lay.D, Dv = lay.Dv, nq = blk.nq, U = blk.U, W = D + Dv;
  blk.gather_rows_t((const T*)p.q, b, h, D, blk.Qb.data(), blk.QbT.data());
  blk.gather_rows_t((const T*)gp.dout, b, h, Dv, blk.dOb.data(), blk.dObT.data());
  blk.gather_keys((const T*)p.k, b, h, D, blk.Kc.data());
  blk.gather_keys((const T*)p.v, b, h, Dv, blk.Vc.data());
  small_gemm<T>(U, R, D, blk.Kc.data(), D, blk.QbT.data(), R, blk.ST.data(), R, false);
  small_gemm<T>(U, R, Dv, blk.Vc.data(), Dv, blk.dObT.data(), R, blk.dPT.data(), R, false);
  if (lay.S == 1) dense_grads(gp, blk, bh);
  else segment_grads_of_block(gp, blk, bh);
  small_gemm_tn<T>(nq, D, U, blk.dST.data(), R, blk.Kc.data(), D, blk.dQb.data(), D, false);
  const T scale = T(p.scale);
  for (int64_t r = 0; r < nq; ++r) {
    T* dq = (T*)gp.dq + lay.q(b, blk.rows[r], h);
    const T* src = &blk.dQb[r * D];
    for (int64_t d = 0; d < D; ++d) dq[d] = scale * src[d];
  }
  small_gemm<T>(U, D, nq, blk.dST.data(), R, blk.Qb.data(), D, rows, W, false);
  small_gemm<T>(U, Dv, nq, blk.PT.data(), R, blk.dOb.data(), Dv, rows + D, W, false);
  for (int64_t u = 0; u < U; ++u) {
    const T* ds = &blk.dST[u * R];
    T s = 0;
    for (int64_t r = 0; r < nq; ++r) s += ds[r];
    db[u] = s;
  }
}

// A block computed per query: dq, dw, and dscore, w a of every entry at its place in (dscore, pw).
template <class T>
void backward_per_query(const AttentionGradParams& gp, Block<T>& blk, int64_t b, int64_t h, T* dscore, T* pw) {
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
      const int64_t n = blk.direct_scores(b, h, i, s), sg = lay.seg(bh, i) + s, e0 = lay.list(bh, i) + s * lay.K;
      T dw = 0;
      if (n > 0) {
        for (int64_t t = 0; t < n; ++t) blk.dp[t] = dot(dorow, (const T*)p.v + lay.v(b, blk.col[t], h), Dv);
        const T dlse = gp.dlse ? ((const T*)gp.dlse)[sg] : T(0);
        dw = segment_grads(blk.x.data(), blk.dp.data(), n, ((const T*)gp.fwd.lse)[sg], blk.seg_weight(bh, i, s), dlse);
        for (int64_t t = 0; t < n; ++t) {
          axpy(blk.x[t], (const T*)p.k + lay.k(b, blk.col[t], h), dq, D);
          dscore[e0 + blk.pos[t]] = blk.x[t];
          pw[e0 + blk.pos[t]] = blk.dp[t];
        }
      }
      if (gp.dseg_w) ((T*)gp.dseg_w)[sg] = dw;
    }
    for (int64_t d = 0; d < D; ++d) dq[d] *= scale;
  }
}

template <class T>
void backward_impl(const AttentionGradParams& gp) {
  const AttentionParams& p = gp.fwd;
  const Layout lay = layout_of(p);
  const int64_t BH = p.batch * p.nheads, nblk = (lay.L + kBlockQ - 1) / kBlockQ, limit = union_limit(p);
  detail::Scratch& scratch = detail::Scratch::local();
  // Tile blocks' partial sums: `limit` rows reserved per block (pages beyond its union are never
  // touched); per-query blocks' entries: the layout of idx (only their queries' entries touched).
  std::vector<int32_t> count(BH * nblk);
  UnionPartials<T> parts;
  parts.blocks = nblk, parts.limit = limit, parts.width = lay.D + lay.Dv, parts.count = count.data();
  parts.rows = scratch.get<T>(kPartRows, BH * nblk * limit * parts.width);
  parts.db = scratch.get<T>(kPartDb, BH * nblk * limit);
  parts.keys = scratch.get<int32_t>(kPartKeys, BH * nblk * limit);
  T* edscore = scratch.get<T>(kEntryDscore, BH * lay.L * lay.S * lay.K);
  T* epw = scratch.get<T>(kEntryPw, BH * lay.L * lay.S * lay.K);

  parallel_items(
      BH * nblk, [&] { return Block<T>(p, limit, true); },
      [&](Block<T>& blk, int64_t it) {
        const int64_t bh = it / nblk, b = bh / p.nheads, h = bh % p.nheads;
        blk.set_rows(bh, it % nblk);
        if (limit > 0 && (blk.recorded_union(it) || blk.collect_union(bh, limit))) {
          backward_tiles(gp, blk, b, h, parts.rows + it * limit * parts.width, parts.db + it * limit);
          std::copy(blk.keys.begin(), blk.keys.begin() + blk.U, parts.keys + it * limit);
          count[it] = int32_t(blk.U);
          blk.release_union();
        } else {
          backward_per_query(gp, blk, b, h, edscore, epw);
          count[it] = -1;
        }
      },
      [&](Block<T>& blk, int64_t it) { blk.set_next(it / nblk, it < 0 ? -1 : it % nblk, gp.dout); });

  // Phase 2. The entries of per-query blocks first (writing every key), then the tile blocks'
  // partials (added, or written when there were no per-query blocks).
  std::vector<uint8_t> use;
  for (int64_t it = 0; it < BH * nblk; ++it) {
    if (count[it] >= 0) continue;
    if (use.empty()) use.assign(BH * lay.L, 0);
    const int64_t bh = it / nblk, i0 = (it % nblk) * kBlockQ;
    for (int64_t r = i0; r < std::min(lay.L, i0 + kBlockQ); ++r)
      use[bh * lay.L + (p.q_order ? p.q_order[bh * lay.L + r] : r)] = 1;
  }
  if (!use.empty()) key_grads_from_entries<T>(gp, {edscore, epw, use.data()});
  key_grads_from_partials<T>(gp, parts, !use.empty());
  scratch.release_if_large();
}

}  // namespace
}  // namespace cpu_attention

void sparse_attention_backward_cpu(const AttentionGradParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return cpu_attention::backward_impl<double>(p);
  return cpu_attention::backward_impl<float>(p);
}

}  // namespace hax::ops
