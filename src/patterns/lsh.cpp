// LSH attention: hash queries and keys into buckets (causal centering, L2 normalization, a
// Gaussian projection, sign-bit or argmax binning), then let every query see the most recent keys
// of its bucket. The keys are sorted by (bucket, position) per sequence, so each query's keys are
// one contiguous slice of that order, found by binary search: O(L log L + L·k), never all pairs.
// CUDA inputs: the same steps on the GPU (cuda/lsh_buckets.cu, cuda/lsh_lists.cu, cuda_paths.cpp).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "core/rng.h"
#include "core/small_gemm.h"
#include "patterns/internal.h"
#include "patterns/pattern.h"

namespace hax::patterns {
namespace {

int64_t num_buckets(Binning binning, int64_t h) { return binning == Binning::kSign ? (int64_t)1 << h : h; }

// Checks proj (N, h) against the last dimension N of x and the binning; returns h.
int64_t check_proj(const char* op, const at::Tensor& proj, int64_t N, Binning binning) {
  ops::check_rank(op, "proj", proj, 2, "(N, h)");
  // Bucketing computes in float64 on every device, so a float64 proj is taken on CUDA too (the
  // model uploads it so, saving a conversion on the device).
  if (!(proj.scalar_type() == at::kDouble && proj.device().is_cuda())) ops::check_floating(op, "proj", proj);
  HAX_CHECK(proj.size(0) == N, "{}: proj has shape {} but its dim 0 must be the vector width N = {}", op,
            ops::shape_str(proj.sizes()), N);
  const int64_t h = proj.size(1);
  if (binning == Binning::kSign)
    HAX_CHECK(h >= 1 && h <= 30,
              "{}: proj has h = {} columns but sign-bit binning needs 1..30 of them (2^h buckets, int32)", op, h);
  else
    HAX_CHECK(h >= 1 && h <= INT32_MAX, "{}: proj has h = {} columns but argmax binning needs 1..{}", op, h,
              INT32_MAX);
  return h;
}

void check_vectors(const char* op, const char* name, const at::Tensor& x) {
  ops::check_rank(op, name, x, 4, "(B, L, H, N)");
  ops::check_floating(op, name, x);
  HAX_CHECK(x.size(1) <= INT32_MAX, "{}: {} has L = {} positions but key positions are int32 (<= {})", op, name,
            x.size(1), INT32_MAX);
  HAX_CHECK(x.size(3) >= 1, "{}: {} has shape {} but its vector width N (dim 3) must be at least 1", op, name,
            ops::shape_str(x.sizes()));
}

// The projection of the centered, normalized vector decides the bucket. Normalizing scales it by
// a positive number, which changes neither its signs nor its argmax, so it is skipped; centering
// is linear, so (v_i - mean_{s..i} v)·P = v_i·P - mean_{s..i}(v·P): one GEMM of all vectors with
// P (parallel over positions, in double), then a running mean of h numbers per position.
constexpr int64_t kProjectRows = 256;  // positions per GEMM work item

template <class T>
void buckets_kernel(const at::Tensor& x, const at::Tensor& proj, Binning binning, const at::Tensor& seq,
                    at::Tensor& out) {
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2), N = x.size(3), h = proj.size(1);
  const int64_t rows = B * L * H;
  const T* xp = x.data_ptr<T>();
  const double* P = proj.data_ptr<double>();  // (N, h) row-major
  std::vector<double> xproj(rows * h);        // (B, L, H, h) = x · P
  at::parallel_for(0, (rows + kProjectRows - 1) / kProjectRows, 1, [&](int64_t s, int64_t e) {
    std::vector<double> xd;
    for (int64_t blk = s; blk < e; ++blk) {
      const int64_t r0 = blk * kProjectRows, m = std::min(kProjectRows, rows - r0);
      xd.assign(xp + r0 * N, xp + (r0 + m) * N);
      small_gemm<double>(m, h, N, xd.data(), N, P, h, xproj.data() + r0 * h, h, false);
    }
  });
  int32_t* op = out.data_ptr<int32_t>();  // (B, L, H)
  detail::for_each_row(B, H, L, seq, L * h * 2, [&](int64_t b, int64_t hd, const auto& segs) {
    std::vector<double> sum(h), p(h);
    for (const auto& [s, e] : segs) {
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t i = s; i < e; ++i) {
        const double* v = xproj.data() + ((b * L + i) * H + hd) * h;
        const double cnt = (double)(i - s + 1);
        for (int64_t j = 0; j < h; ++j) {
          sum[j] += v[j];
          p[j] = v[j] - sum[j] / cnt;  // centered by the causal running mean
        }
        int64_t bucket = 0;
        if (binning == Binning::kSign) {
          for (int64_t j = 0; j < h; ++j)
            if (p[j] > 0) bucket |= (int64_t)1 << j;
        } else {
          for (int64_t j = 1; j < h; ++j)
            if (p[j] > p[bucket]) bucket = j;
        }
        op[(b * L + i) * H + hd] = (int32_t)bucket;
      }
    }
  });
}

// Buckets (B, L, H) int32 on the CPU; x and proj already checked.
at::Tensor buckets_cpu(const at::Tensor& x0, const at::Tensor& proj0, Binning binning, const at::Tensor& seq) {
  at::Tensor x = x0.detach().to(at::kCPU).contiguous();
  at::Tensor proj = proj0.detach().to(at::kCPU, at::kDouble).contiguous();
  at::Tensor out = at::empty({x.size(0), x.size(1), x.size(2)}, at::TensorOptions().dtype(at::kInt));
  if (x.scalar_type() == at::kDouble)
    buckets_kernel<double>(x, proj, binning, seq, out);
  else
    buckets_kernel<float>(x, proj, binning, seq, out);
  return out;
}

// The sort key of (bucket, position): ordering keys orders by bucket, then position.
inline uint64_t pack(int64_t bucket, int64_t pos) { return ((uint64_t)bucket << 32) | (uint64_t)pos; }

// Positions s..e-1 of `bucket` (strided by `stride`) sorted by (bucket, position) into `keys` as
// packed sort keys: a stable counting sort when the buckets are few, else a comparison sort.
void sort_by_bucket(const int32_t* bucket, int64_t stride, int64_t s, int64_t e, int64_t nb,
                    std::vector<uint64_t>& keys, std::vector<int64_t>& counts) {
  const int64_t n = e - s;
  keys.resize(n);
  if (nb <= 2 * n + 1024) {
    counts.assign(nb + 1, 0);
    for (int64_t i = s; i < e; ++i) ++counts[bucket[i * stride] + 1];
    for (int64_t t = 0; t < nb; ++t) counts[t + 1] += counts[t];
    for (int64_t i = s; i < e; ++i) {
      const int64_t bk = bucket[i * stride];
      keys[counts[bk]++] = pack(bk, i);
    }
  } else {
    for (int64_t i = s; i < e; ++i) keys[i - s] = pack(bucket[i * stride], i);
    std::sort(keys.begin(), keys.end());
  }
}

}  // namespace

Binning binning_from_string(const std::string& s) {
  if (s == "sign") return Binning::kSign;
  if (s == "argmax") return Binning::kArgmax;
  fail("--lsh-binning \"{}\" is not a binning rule; it must be \"sign\" (2^h buckets) or \"argmax\" (h buckets)", s);
}

at::Tensor lsh_projection(int64_t N, int64_t h, uint64_t seed) {
  HAX_CHECK(N >= 1, "lsh_projection: the vector width N = {} must be at least 1", N);
  HAX_CHECK(h >= 1, "lsh_projection: the number of projections h = {} must be at least 1", h);
  at::Tensor out = at::empty({N, h}, at::TensorOptions().dtype(at::kFloat));
  float* p = out.data_ptr<float>();
  const int64_t n = N * h;
  Rng rng(seed);
  // Box-Muller: two uniforms give two independent N(0, 1) draws.
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  for (int64_t i = 0; i < n; i += 2) {
    const double u1 = 1.0 - rng.uniform();  // (0, 1]: log is finite
    const double u2 = rng.uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    p[i] = (float)(r * std::cos(kTwoPi * u2));
    if (i + 1 < n) p[i + 1] = (float)(r * std::sin(kTwoPi * u2));
  }
  return out;
}

at::Tensor lsh_buckets(const at::Tensor& x, const at::Tensor& proj, Binning binning, const at::Tensor& seq_idx) {
  constexpr const char* kOp = "lsh_buckets";
  check_vectors(kOp, "x", x);
  check_proj(kOp, proj, x.size(3), binning);
  if (x.is_cuda()) {
    const at::Tensor seq = ops::check_seq_idx(kOp, detail::on(seq_idx, x.device()), x.size(0), x.size(1));
    const auto bounds = detail::sequence_bounds_device(seq, x.size(0), x.size(1), x.device());
    return detail::lsh_buckets_device(x, proj, binning, bounds.start);
  }
  const at::Tensor seq = detail::on(ops::check_seq_idx(kOp, seq_idx, x.size(0), x.size(1)), at::kCPU);
  return detail::on(buckets_cpu(x, proj, binning, seq), x.device());
}

namespace {

// The checks of lsh() and lsh_band(): q, k (B, L, H, N) alike, keys > 0, proj (N, h). Returns h.
int64_t check_lsh_args(const char* op, const at::Tensor& q, const at::Tensor& k, int64_t keys, const at::Tensor& proj,
                       Binning binning) {
  check_vectors(op, "q", q);
  ops::check_shape(op, "k", k, q.sizes().vec(), "(B, L, H, N) like q");
  ops::check_floating(op, "k", k);
  detail::check_positive(op, "keys", keys);
  return check_proj(op, proj, q.size(3), binning);
}

}  // namespace

KeyLists lsh(const at::Tensor& q, const at::Tensor& k, int64_t keys, const at::Tensor& proj, Binning binning,
             const at::Tensor& seq_idx) {
  constexpr const char* kOp = "lsh";
  const int64_t h = check_lsh_args(kOp, q, k, keys, proj, binning);
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), K = keys;
  if (q.is_cuda())
    return detail::lsh_device(q.detach(), k.detach(), keys, proj, binning,
                              ops::check_seq_idx(kOp, detail::on(seq_idx, q.device()), B, L));
  const at::Tensor seq = detail::on(ops::check_seq_idx(kOp, seq_idx, B, L), at::kCPU);
  const at::Tensor bq = buckets_cpu(q, proj, binning, seq), bk = buckets_cpu(k, proj, binning, seq);
  const int64_t nb = num_buckets(binning, h);

  at::Tensor idx = detail::empty_lists(B, H, L, K);
  at::Tensor q_order = at::empty({B, H, L}, at::TensorOptions().dtype(at::kInt));
  const int32_t* bqp = bq.data_ptr<int32_t>();
  const int32_t* bkp = bk.data_ptr<int32_t>();
  int32_t* out = idx.data_ptr<int32_t>();
  int32_t* qo = q_order.data_ptr<int32_t>();
  detail::for_each_row(B, H, L, seq, L * (K + 16), [&](int64_t b, int64_t hd, const auto& segs) {
    const int32_t* qb = bqp + b * L * H + hd;  // bucket of query i: qb[i * H]
    const int32_t* kb = bkp + b * L * H + hd;
    int32_t* row = out + (b * H + hd) * L * K;
    int32_t* order = qo + (b * H + hd) * L;
    std::vector<uint64_t> keys_sorted, queries_sorted;
    std::vector<int64_t> counts;
    for (const auto& [s, e] : segs) {
      // Keys and queries of this sequence by (bucket, position). Query i's keys are the entries of
      // its bucket with position <= i: the slice [lower_bound(bucket, 0), upper_bound(bucket, i))
      // of the sorted keys; keep its last K. Taking the queries in their sorted order, that slice's
      // end only moves forward within a bucket, so a chunk of queries needs one binary search and
      // then a forward scan; chunks run in parallel (when the rows themselves do not).
      sort_by_bucket(kb, H, s, e, nb, keys_sorted, counts);
      sort_by_bucket(qb, H, s, e, nb, queries_sorted, counts);
      const int64_t n = e - s;
      for (int64_t t = 0; t < n; ++t) order[s + t] = (int32_t)(uint32_t)queries_sorted[t];
      const auto kbeg = keys_sorted.begin(), kend = keys_sorted.end();
      at::parallel_for(0, n, 2048, [&](int64_t t0, int64_t t1) {
        int64_t cur_bucket = -1;
        auto lo = kbeg, hi = kbeg;
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t i = (int64_t)(uint32_t)queries_sorted[t], bucket = (int64_t)(queries_sorted[t] >> 32);
          if (bucket != cur_bucket) {
            cur_bucket = bucket;
            lo = std::lower_bound(kbeg, kend, pack(bucket, 0));
            hi = lo;
          }
          const uint64_t last = pack(bucket, i);
          while (hi != kend && *hi <= last) ++hi;
          const int64_t m = std::min<int64_t>(K, hi - lo);
          int32_t* dst = row + i * K;
          for (auto it = hi - m; it != hi; ++it) *dst++ = (int32_t)(uint32_t)*it;
        }
      });
    }
  });
  return {detail::on(idx, q.device()), detail::on(q_order, q.device())};
}

LshBand lsh_band(const at::Tensor& q, const at::Tensor& k, int64_t keys, const at::Tensor& proj, Binning binning,
                 const at::Tensor& seq_idx, bool key_side) {
  constexpr const char* kOp = "lsh_band";
  check_lsh_args(kOp, q, k, keys, proj, binning);
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), K = keys, n = B * H * L;
  if (q.is_cuda())
    return detail::lsh_band_device(q.detach(), k.detach(), keys, proj, binning,
                                   ops::check_seq_idx(kOp, detail::on(seq_idx, q.device()), B, L), key_side);
  // The definition, plainly: rows sorted by (sequence, bucket, position); sorted query t at
  // position i of sequence [s, e) in bucket c sees the sorted keys of that sequence and bucket
  // with position <= i, the last K of them; the key side follows by binary search.
  const at::Tensor seq = detail::on(ops::check_seq_idx(kOp, seq_idx, B, L), at::kCPU);
  const at::Tensor bq = buckets_cpu(q, proj, binning, seq), bk = buckets_cpu(k, proj, binning, seq);
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  at::Tensor q_order = at::empty({B, H, L}, i32), k_order = at::empty({B, H, L}, i32);
  at::Tensor band = at::empty({4, B, H, L}, i32);
  int32_t *qo = q_order.data_ptr<int32_t>(), *ko = k_order.data_ptr<int32_t>(), *bd = band.data_ptr<int32_t>();
  const int32_t* bqp = bq.data_ptr<int32_t>();
  const int32_t* bkp = bk.data_ptr<int32_t>();
  detail::for_each_row(B, H, L, seq, 64 * L, [&](int64_t b, int64_t h, const auto& segs) {
    using Key = std::tuple<int64_t, int64_t, int64_t>;  // (sequence start, bucket, position)
    std::vector<Key> qk(L), kk(L);
    for (const auto& [s, e] : segs)
      for (int64_t i = s; i < e; ++i) {
        qk[i] = {s, bqp[(b * L + i) * H + h], i};
        kk[i] = {s, bkp[(b * L + i) * H + h], i};
      }
    std::sort(qk.begin(), qk.end());
    std::sort(kk.begin(), kk.end());
    const int64_t r = (b * H + h) * L;
    int32_t *first = bd + r, *last = bd + n + r, *kfirst = bd + 2 * n + r, *klast = bd + 3 * n + r;
    for (int64_t t = 0; t < L; ++t) {
      const auto [s, c, i] = qk[t];
      qo[r + t] = (int32_t)i;
      ko[r + t] = (int32_t)std::get<2>(kk[t]);
      const int64_t hi = std::upper_bound(kk.begin(), kk.end(), Key{s, c, i}) - kk.begin();
      const int64_t lo = std::lower_bound(kk.begin(), kk.end(), Key{s, c, 0}) - kk.begin();
      first[t] = (int32_t)std::max(lo, hi - K);
      last[t] = (int32_t)(hi - 1);
    }
    for (int64_t j = 0; j < L; ++j) {
      kfirst[j] = (int32_t)(std::lower_bound(last, last + L, (int32_t)j) - last);
      klast[j] = (int32_t)(std::upper_bound(first, first + L, (int32_t)j) - first - 1);
    }
  });
  return {detail::on(q_order, q.device()), detail::on(k_order, q.device()), detail::on(band, q.device())};
}

}  // namespace hax::patterns
