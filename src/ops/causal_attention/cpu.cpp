// CPU kernels of causal (sliding-window) attention, FlashAttention-2's algorithm on tiles of
// kBlockQ queries x kBlockK keys:
//
// forward, parallel over query blocks: for each key block the block can see, S = Q K^T, an online
//   softmax (running max m and sum l per row, the accumulator rescaled when m grows) and acc += P V;
//   out = acc / l, lse = m + log l.
// backward, recomputing P = exp(scale S - lse) from the saved lse, with Δ_i = dO_i · O_i - dlse_i:
//   dS = P ∘ (dO V^T - Δ);  dQ = scale dS K  parallel over query blocks;
//   dK = scale dS^T Q, dV = P^T dO  parallel over key blocks (each loops over the query blocks that
//   see it, computing the transposed tiles K Q^T and V dO^T directly).
// No atomics and a fixed summation order: results do not depend on the thread count.
//
// Query i sees keys j in [lo_i, i], lo_i = max(start of i's sequence, i - window + 1); key j is seen
// by queries i in [j, hi_j], hi_j = min(end of j's sequence, j + window - 1). Both bounds are
// non-decreasing, so a query block sees one contiguous range of key blocks and vice versa; blocks
// outside it are skipped, blocks on its edges are masked. A band (params.h) gives the four bounds
// per (b, h) instead; they are non-decreasing too. Q, K, V, dO are first packed per (b, h)
// into contiguous row-major copies and transposed blocks, so that every tile product is a
// small_gemm on contiguous memory.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/small_gemm.h"
#include "ops/attention/scratch.h"
#include "ops/attention/vec_exp.h"
#include "ops/causal_attention/causal_attention.h"

namespace hax::ops {
namespace {

constexpr int64_t kBlockQ = 128;  // queries per tile (a query tile is reused across its key tiles)
constexpr int64_t kBlockK = 64;   // keys per tile
constexpr int64_t kPadTo = 128;   // packed rows are padded to a multiple of both block sizes

// Visible ranges: query i sees keys [qlo_i, qhi_i], key j is seen by queries [klo_j, khi_j]; (B, L)
// each from the causal definition, (B·H, L) from a band (params.h). `at(b, h)` is the row of (b, h).
struct Ranges {
  std::vector<int64_t> qlo, qhi, klo, khi;
  int64_t H = 0;
  bool per_head = false;
  int64_t at(int64_t b, int64_t h, int64_t L) const { return (per_head ? b * H + h : b) * L; }
};

// The tiles [t0, t1] of width n that a tile of rows visits, from the first column its first row
// sees (a) and the last its last row sees (z); none (t1 < t0) when z < a.
inline void tile_span(int64_t a, int64_t z, int64_t n, int64_t& t0, int64_t& t1) {
  t0 = a / n;
  t1 = z < a ? t0 - 1 : z / n;
}

Ranges visible_ranges(const CausalAttentionParams& p) {
  const int64_t B = p.batch, L = p.seqlen, W = p.window, H = p.nheads;
  if (p.band) {
    const int64_t n = B * H * L;
    auto part = [&](int k) { return std::vector<int64_t>(p.band + k * n, p.band + (k + 1) * n); };
    return Ranges{part(0), part(1), part(2), part(3), H, true};
  }
  Ranges r{std::vector<int64_t>(B * L), std::vector<int64_t>(B * L), std::vector<int64_t>(B * L),
           std::vector<int64_t>(B * L), H, false};
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* s = p.seq_idx ? p.seq_idx + b * L : nullptr;
    int64_t start = 0;
    for (int64_t i = 0; i < L; ++i) {
      if (s && i > 0 && s[i] != s[i - 1]) start = i;
      r.qlo[b * L + i] = W > 0 ? std::max(start, i - W + 1) : start;
      r.qhi[b * L + i] = i;
      r.klo[b * L + i] = i;
    }
    int64_t end = L - 1;
    for (int64_t j = L - 1; j >= 0; --j) {
      if (s && j < L - 1 && s[j] != s[j + 1]) end = j;
      r.khi[b * L + j] = W > 0 ? std::min(end, j + W - 1) : end;
    }
  }
  return r;
}

// The t-th of n blocks in an order where any run of consecutive positions mixes early and late
// blocks (0, n-1, 1, n-2, ...): causal blocks have work growing (or shrinking) with the block
// index, and at::parallel_for hands each thread one contiguous run.
inline int64_t zigzag(int64_t t, int64_t n) { return (t % 2 == 0) ? t / 2 : n - 1 - t / 2; }

// Sets the entries of a tile row of width W outside [a, z] to -inf (exp gives 0 there).
template <int64_t W, class T>
inline void mask_outside(T* row, int64_t a, int64_t z) {
  const T ninf = -std::numeric_limits<T>::infinity();
  std::fill(row, row + a, ninf);
  std::fill(row + z + 1, row + W, ninf);
}

// Per-(b, h) packed copies of a (B, L, H, n) tensor, zero padded to Lp rows: rows (BH, Lp, n)
// and/or transposed blocks of `bw` rows (BH, Lp / bw, n, bw).
template <class T>
void pack(const T* src, int64_t B, int64_t L, int64_t H, int64_t n, int64_t Lp, T* rows, T* tblocks, int64_t bw) {
  const int64_t chunk = 64, nc = Lp / chunk;
  at::parallel_for(0, B * H * nc, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / nc, b = bh / H, h = bh % H;
      for (int64_t i = (it % nc) * chunk; i < (it % nc + 1) * chunk; ++i) {
        T* row = rows ? rows + (bh * Lp + i) * n : nullptr;
        T* tb = tblocks ? tblocks + (bh * Lp + i / bw * bw) * n + i % bw : nullptr;
        if (i < L) {
          const T* s = src + ((b * L + i) * H + h) * n;
          if (row) std::copy(s, s + n, row);
          if (tb)
            for (int64_t d = 0; d < n; ++d) tb[d * bw] = s[d];
        } else {
          if (row) std::fill(row, row + n, T(0));
          if (tb)
            for (int64_t d = 0; d < n; ++d) tb[d * bw] = T(0);
        }
      }
    }
  });
}

template <class T>
void forward_impl(const CausalAttentionParams& p) {
  const int64_t B = p.batch, L = p.seqlen, H = p.nheads, D = p.dim, Dv = p.vdim, BH = B * H;
  const int64_t nq = (L + kBlockQ - 1) / kBlockQ, Lp = (L + kPadTo - 1) / kPadTo * kPadTo;
  const Ranges rg = visible_ranges(p);
  detail::Scratch& scratch = detail::Scratch::local();
  T* Qp = scratch.get<T>(0, BH * Lp * D);
  T* KT = scratch.get<T>(1, BH * Lp * D);
  T* Vp = scratch.get<T>(2, BH * Lp * Dv);
  pack<T>((const T*)p.q, B, L, H, D, Lp, Qp, nullptr, 0);
  pack<T>((const T*)p.k, B, L, H, D, Lp, nullptr, KT, kBlockK);
  pack<T>((const T*)p.v, B, L, H, Dv, Lp, Vp, nullptr, 0);
  const T scale = T(p.scale), ninf = -std::numeric_limits<T>::infinity();

  at::parallel_for(0, BH * nq, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> S(kBlockQ * kBlockK), acc(kBlockQ * Dv), m(kBlockQ), l(kBlockQ);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / nq, qb = zigzag(it % nq, nq), b = bh / H, h = bh % H;
      const int64_t i0 = qb * kBlockQ, rows = std::min(kBlockQ, L - i0);
      const int64_t* lo = &rg.qlo[rg.at(b, h, L)];
      const int64_t* hi = &rg.qhi[rg.at(b, h, L)];
      std::fill(m.begin(), m.end(), ninf);
      std::fill(l.begin(), l.end(), T(0));
      std::fill(acc.begin(), acc.end(), T(0));
      int64_t kb0, kb1;
      tile_span(lo[i0], hi[i0 + rows - 1], kBlockK, kb0, kb1);
      for (int64_t kb = kb0; kb <= kb1; ++kb) {
        const int64_t j0 = kb * kBlockK;
        small_gemm<T>(rows, kBlockK, D, Qp + (bh * Lp + i0) * D, D, KT + (bh * Lp + j0) * D, kBlockK, S.data(),
                      kBlockK, false);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r, a = std::max(lo[i], j0) - j0, z = std::min(hi[i], j0 + kBlockK - 1) - j0;
          T* srow = &S[r * kBlockK];
          if (a > z) {  // this key block is outside the row's range
            std::fill(srow, srow + kBlockK, T(0));
            continue;
          }
          mask_outside<kBlockK>(srow, a, z);
          T mx = ninf;
#pragma omp simd reduction(max : mx)
          for (int64_t c = 0; c < kBlockK; ++c) mx = srow[c] > mx ? srow[c] : mx;
          const T m_new = std::max(m[r], mx * scale), alpha = detail::vexp(m[r] - m_new);
          T sum = 0;
#pragma omp simd reduction(+ : sum)
          for (int64_t c = 0; c < kBlockK; ++c) {
            srow[c] = detail::vexp(srow[c] * scale - m_new);
            sum += srow[c];
          }
          l[r] = l[r] * alpha + sum;
          m[r] = m_new;
          if (alpha != T(1)) {
            T* arow = &acc[r * Dv];
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) arow[d] *= alpha;
          }
        }
        small_gemm<T>(rows, Dv, kBlockK, S.data(), kBlockK, Vp + (bh * Lp + j0) * Dv, Dv, acc.data(), Dv, true);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        const T inv = l[r] > T(0) ? T(1) / l[r] : T(0);  // a row that sees no key (a band's) outputs 0
        T* orow = (T*)p.out + ((b * L + i) * H + h) * Dv;
        for (int64_t d = 0; d < Dv; ++d) orow[d] = acc[r * Dv + d] * inv;
        ((T*)p.lse)[bh * L + i] = l[r] > T(0) ? m[r] + std::log(l[r]) : ninf;
      }
    }
  });
  scratch.release_if_large();
}

template <class T>
void backward_impl(const CausalAttentionGradParams& gp) {
  const CausalAttentionParams& p = gp.fwd;
  const int64_t B = p.batch, L = p.seqlen, H = p.nheads, D = p.dim, Dv = p.vdim, BH = B * H;
  const int64_t nq = (L + kBlockQ - 1) / kBlockQ, nk = (L + kBlockK - 1) / kBlockK;
  const int64_t Lp = (L + kPadTo - 1) / kPadTo * kPadTo;
  const Ranges rg = visible_ranges(p);
  detail::Scratch& scratch = detail::Scratch::local();
  T* Qp = scratch.get<T>(0, BH * Lp * D);
  T* QT = scratch.get<T>(1, BH * Lp * D);
  T* Kp = scratch.get<T>(2, BH * Lp * D);
  T* KT = scratch.get<T>(3, BH * Lp * D);
  T* Vp = scratch.get<T>(4, BH * Lp * Dv);
  T* VT = scratch.get<T>(5, BH * Lp * Dv);
  T* dOp = scratch.get<T>(6, BH * Lp * Dv);
  T* dOT = scratch.get<T>(7, BH * Lp * Dv);
  T* delta = scratch.get<T>(8, BH * Lp);
  T* lsep = scratch.get<T>(9, BH * Lp);
  pack<T>((const T*)p.q, B, L, H, D, Lp, Qp, QT, kBlockQ);
  pack<T>((const T*)p.k, B, L, H, D, Lp, Kp, KT, kBlockK);
  pack<T>((const T*)p.v, B, L, H, Dv, Lp, Vp, VT, kBlockK);
  pack<T>((const T*)gp.dout, B, L, H, Dv, Lp, dOp, dOT, kBlockQ);
  const T* lse = (const T*)p.lse;
  // Δ_i = dO_i · O_i - dlse_i, and lse, both padded with zeros to Lp (the padding is masked).
  at::parallel_for(0, BH * Lp, 256, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / Lp, i = it % Lp, b = bh / H, h = bh % H;
      if (i >= L) {
        delta[it] = lsep[it] = T(0);
        continue;
      }
      const T* o = (const T*)p.out + ((b * L + i) * H + h) * Dv;
      const T* dO = (const T*)gp.dout + ((b * L + i) * H + h) * Dv;
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < Dv; ++d) s += o[d] * dO[d];
      delta[it] = s - (gp.dlse ? ((const T*)gp.dlse)[bh * L + i] : T(0));
      // A row that sees no key (a band's) has lse = -inf; it is masked everywhere, and a finite
      // stand-in keeps exp(-inf - lse) of its masked entries at 0 instead of NaN.
      lsep[it] = std::isinf(lse[bh * L + i]) ? T(0) : lse[bh * L + i];
    }
  });
  const T scale = T(p.scale);

  // dQ, parallel over query blocks.
  at::parallel_for(0, BH * nq, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> S(kBlockQ * kBlockK), dP(kBlockQ * kBlockK), dQ(kBlockQ * D);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / nq, qb = zigzag(it % nq, nq), b = bh / H, h = bh % H;
      const int64_t i0 = qb * kBlockQ, rows = std::min(kBlockQ, L - i0);
      const int64_t* lo = &rg.qlo[rg.at(b, h, L)];
      const int64_t* hi = &rg.qhi[rg.at(b, h, L)];
      std::fill(dQ.begin(), dQ.end(), T(0));
      int64_t kb0, kb1;
      tile_span(lo[i0], hi[i0 + rows - 1], kBlockK, kb0, kb1);
      for (int64_t kb = kb0; kb <= kb1; ++kb) {
        const int64_t j0 = kb * kBlockK;
        small_gemm<T>(rows, kBlockK, D, Qp + (bh * Lp + i0) * D, D, KT + (bh * Lp + j0) * D, kBlockK, S.data(),
                      kBlockK, false);
        small_gemm<T>(rows, kBlockK, Dv, dOp + (bh * Lp + i0) * Dv, Dv, VT + (bh * Lp + j0) * Dv, kBlockK, dP.data(),
                      kBlockK, false);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r, a = std::max(lo[i], j0) - j0, z = std::min(hi[i], j0 + kBlockK - 1) - j0;
          T* srow = &S[r * kBlockK];
          const T* dprow = &dP[r * kBlockK];
          if (a > z) {
            std::fill(srow, srow + kBlockK, T(0));
            continue;
          }
          mask_outside<kBlockK>(srow, a, z);
          const T li = lsep[bh * Lp + i], di = delta[bh * Lp + i];
#pragma omp simd
          for (int64_t c = 0; c < kBlockK; ++c) srow[c] = detail::vexp(srow[c] * scale - li) * (dprow[c] - di);
        }
        small_gemm<T>(rows, D, kBlockK, S.data(), kBlockK, Kp + (bh * Lp + j0) * D, D, dQ.data(), D, true);
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* dq = (T*)gp.dq + ((b * L + i0 + r) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) dq[d] = scale * dQ[r * D + d];
      }
    }
  });

  // dK and dV, parallel over key blocks, with transposed tiles (rows = keys, columns = queries).
  at::parallel_for(0, BH * nk, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> ST(kBlockK * kBlockQ), dPT(kBlockK * kBlockQ), dK(kBlockK * D), dV(kBlockK * Dv);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / nk, kb = zigzag(it % nk, nk), b = bh / H, h = bh % H;
      const int64_t j0 = kb * kBlockK, keys = std::min(kBlockK, L - j0);
      const int64_t* lo = &rg.klo[rg.at(b, h, L)];
      const int64_t* hi = &rg.khi[rg.at(b, h, L)];
      std::fill(dK.begin(), dK.end(), T(0));
      std::fill(dV.begin(), dV.end(), T(0));
      int64_t qb0, qb1;
      tile_span(lo[j0], hi[j0 + keys - 1], kBlockQ, qb0, qb1);
      for (int64_t qb = qb0; qb <= qb1; ++qb) {
        const int64_t i0 = qb * kBlockQ;
        small_gemm<T>(keys, kBlockQ, D, Kp + (bh * Lp + j0) * D, D, QT + (bh * Lp + i0) * D, kBlockQ, ST.data(),
                      kBlockQ, false);
        small_gemm<T>(keys, kBlockQ, Dv, Vp + (bh * Lp + j0) * Dv, Dv, dOT + (bh * Lp + i0) * Dv, kBlockQ, dPT.data(),
                      kBlockQ, false);
        const T* li = lsep + bh * Lp + i0;
        const T* di = delta + bh * Lp + i0;
        for (int64_t c = 0; c < keys; ++c) {
          const int64_t j = j0 + c, a = std::max(lo[j], i0) - i0, z = std::min(hi[j], i0 + kBlockQ - 1) - i0;
          T* prow = &ST[c * kBlockQ];
          T* dsrow = &dPT[c * kBlockQ];
          if (a > z) {
            std::fill(prow, prow + kBlockQ, T(0));
            std::fill(dsrow, dsrow + kBlockQ, T(0));
            continue;
          }
          mask_outside<kBlockQ>(prow, a, z);
#pragma omp simd
          for (int64_t r = 0; r < kBlockQ; ++r) {
            const T pr = detail::vexp(prow[r] * scale - li[r]);
            prow[r] = pr;
            dsrow[r] = pr * (dsrow[r] - di[r]);
          }
        }
        small_gemm<T>(keys, D, kBlockQ, dPT.data(), kBlockQ, Qp + (bh * Lp + i0) * D, D, dK.data(), D, true);
        small_gemm<T>(keys, Dv, kBlockQ, ST.data(), kBlockQ, dOp + (bh * Lp + i0) * Dv, Dv, dV.data(), Dv, true);
      }
      for (int64_t c = 0; c < keys; ++c) {
        T* dk = (T*)gp.dk + ((b * L + j0 + c) * H + h) * D;
        T* dv = (T*)gp.dv + ((b * L + j0 + c) * H + h) * Dv;
        for (int64_t d = 0; d < D; ++d) dk[d] = scale * dK[c * D + d];
        std::copy(&dV[c * Dv], &dV[c * Dv] + Dv, dv);
      }
    }
  });
  scratch.release_if_large();
}

}  // namespace

void causal_attention_forward_cpu(const CausalAttentionParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return forward_impl<double>(p);
  return forward_impl<float>(p);
}

void causal_attention_backward_cpu(const CausalAttentionGradParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return backward_impl<double>(p);
  return backward_impl<float>(p);
}

}  // namespace hax::ops
