// CPU forward of sparse attention over index lists (block.h describes the blocks and tiles).
//
// A tile block with one segment per query runs the softmax on rows of S^T, all of its queries at
// once along the vector lanes: x = scale s + bias where the multiplicity c > 0, m = max x,
// p = c exp(x - m), lse = m + log Σ p, and P^T = (w / Σ p) p; then O = (P^T)^T V_U. With several
// segments, each (query, segment) takes its softmax over exactly its listed entries of S^T.
#include "core/small_gemm.h"
#include "ops/attention/attention.h"
#include "ops/attention/cpu/block.h"

namespace hax::ops {
namespace cpu_attention {
namespace {

// P^T of a tile block with one segment per query: the dense masked softmax above. Writes lse.
template <class T>
void dense_softmax(Block<T>& blk, int64_t bh) {
  constexpr int64_t R = kBlockQ;
  const Layout& lay = blk.lay;
  const T scale = T(blk.p.scale), ninf = -std::numeric_limits<T>::infinity();
  T m[R], sum[R], f[R];
  std::fill(m, m + R, ninf);
  std::fill(sum, sum + R, T(0));
  for (int64_t u = 0; u < blk.U; ++u) {
    T* st = &blk.ST[u * R];
    const T* c = &blk.CT[u * R];
    const T bu = blk.bias_of(bh, u);
#pragma omp simd
    for (int64_t r = 0; r < R; ++r) {
      const T x = scale * st[r] + bu;
      st[r] = x;
      m[r] = (c[r] > T(0) && x > m[r]) ? x : m[r];
    }
  }
  for (int64_t u = 0; u < blk.U; ++u) {
    const T *st = &blk.ST[u * R], *c = &blk.CT[u * R];
    T* pt = &blk.PT[u * R];
#pragma omp simd
    for (int64_t r = 0; r < R; ++r) {
      const T e = detail::vexp(st[r] - m[r]);
      pt[r] = c[r] > T(0) ? c[r] * e : T(0);
      sum[r] += pt[r];
    }
  }
  for (int64_t r = 0; r < R; ++r) f[r] = 0;
  for (int64_t r = 0; r < blk.nq; ++r) {
    const int64_t i = blk.rows[r];
    T& l = ((T*)blk.p.lse)[lay.seg(bh, i)];
    l = sum[r] > T(0) ? m[r] + std::log(sum[r]) : ninf;
    f[r] = sum[r] > T(0) ? blk.seg_weight(bh, i, 0) / sum[r] : T(0);
  }
  for (int64_t u = 0; u < blk.U; ++u) {
    T* pt = &blk.PT[u * R];
#pragma omp simd
    for (int64_t r = 0; r < R; ++r) pt[r] *= f[r];
  }
}

// Turns the n scores of a segment in x into exp(x - max), writes the segment's log-sum-exp
// (-inf when empty) and returns the factor w_s / Σ exp that makes them its weighted softmax (0
// when empty).
template <class T>
T segment_softmax(Block<T>& blk, int64_t bh, int64_t i, int64_t s, int64_t n) {
  T& l = ((T*)blk.p.lse)[blk.lay.seg(bh, i) + s];
  if (n == 0) {
    l = -std::numeric_limits<T>::infinity();
    return T(0);
  }
  T sum;
  l = softmax_terms(blk.x.data(), n, sum);
  return blk.seg_weight(bh, i, s) / sum;
}

// P^T of a tile block with several segments per query, entry by entry. Writes lse.
template <class T>
void segment_softmaxes(Block<T>& blk, int64_t bh) {
  constexpr int64_t R = kBlockQ;
  std::fill(blk.PT.begin(), blk.PT.begin() + blk.U * R, T(0));
  for (int64_t r = 0; r < blk.nq; ++r) {
    const int64_t i = blk.rows[r];
    for (int64_t s = 0; s < blk.lay.S; ++s) {
      const int64_t n = blk.tile_scores(bh, r, s);
      const T f = segment_softmax(blk, bh, i, s, n);
      for (int64_t t = 0; t < n; ++t) blk.PT[blk.col[t] * R + r] += f * blk.x[t];
    }
  }
}

template <class T>
void forward_tiles(Block<T>& blk, int64_t b, int64_t h) {
  constexpr int64_t R = kBlockQ;
  const AttentionParams& p = blk.p;
  const Layout& lay = blk.lay;
  const int64_t bh = b * lay.H + h, D = lay.D, Dv = lay.Dv, nq = blk.nq, U = blk.U;
  blk.gather_rows_t((const T*)p.q, b, h, D, blk.Qb.data(), blk.QbT.data());
  blk.gather_keys((const T*)p.k, b, h, D, blk.Kc.data());
  blk.gather_keys((const T*)p.v, b, h, Dv, blk.Vc.data());
  small_gemm<T>(U, R, D, blk.Kc.data(), D, blk.QbT.data(), R, blk.ST.data(), R, false);
  if (lay.S == 1) dense_softmax(blk, bh);
  else segment_softmaxes(blk, bh);
  small_gemm_tn<T>(nq, Dv, U, blk.PT.data(), R, blk.Vc.data(), Dv, blk.Ob.data(), Dv, false);
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
      const T f = segment_softmax(blk, bh, i, s, n);
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
          if (p.union_count) blk.record_union(it);
          blk.release_union();
        } else {
          forward_per_query(blk, b, h);
          if (p.union_count) p.union_count[it] = -1;
        }
        if (blk.invalid && p.invalid) __atomic_store_n(p.invalid, 1, __ATOMIC_RELAXED);
      },
      [&](Block<T>& blk, int64_t it) { blk.set_next(it / nblk, it < 0 ? -1 : it % nblk, nullptr); });
}

}  // namespace
}  // namespace cpu_attention

CpuUnionShape sparse_attention_cpu_unions(const AttentionParams& p) {
  const int64_t blocks = (p.seqlen + cpu_attention::kBlockQ - 1) / cpu_attention::kBlockQ;
  return {p.batch * p.nheads * blocks, cpu_attention::union_limit(p), cpu_attention::kBlockQ};
}

void sparse_attention_forward_cpu(const AttentionParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return cpu_attention::forward_impl<double>(p);
  return cpu_attention::forward_impl<float>(p);
}

}  // namespace hax::ops
