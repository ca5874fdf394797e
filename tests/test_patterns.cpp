// Sparse attention patterns (index lists) against brute-force versions of their definitions:
// for every query, scan all keys j <= i, on fresh random inputs, with and without packed
// sequences. Also: list invariants, packed rows equal each sequence alone, LSH buckets from the
// float64 definition, causal centering, Key Selection ties, merge as a set union, the projection's
// determinism and moments, argument errors, and the speed at L = 65536. On a CUDA device: every
// builder's CUDA lists equal its CPU lists exactly (PatternCuda, skipped without a GPU).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <set>
#include <vector>

#include "cuda_harness.h"
#include "op_harness.h"
#include "ops/check.h"
#include "patterns/cuda_params.h"
#include "patterns/pattern.h"

using namespace hax::testing;
namespace pat = hax::patterns;

namespace {

const int64_t kLengths[] = {1, 63, 97, 1025};
const int64_t kKs[] = {1, 7, 32, 64};

// Random packing with a few sequences per row (about 4, of random lengths), or none.
at::Tensor packing(int64_t B, int64_t L, bool packed) {
  if (!packed) return at::Tensor();
  return random_packing(B, L, std::min(0.25, 4.0 / std::max<int64_t>(L, 1)));
}

// The sequence number of every position, looked up naively (the oracle must not share the
// builders' shortcuts).
struct SeqIds {
  std::vector<int32_t> id;  // (B, L)
  int64_t L;
  SeqIds(const at::Tensor& seq, int64_t B, int64_t L) : id(B * L, 0), L(L) {
    if (seq.defined()) {
      at::Tensor s = seq.to(at::kInt).contiguous();
      std::copy(s.data_ptr<int32_t>(), s.data_ptr<int32_t>() + B * L, id.begin());
    }
  }
  bool same(int64_t b, int64_t i, int64_t j) const { return id[b * L + i] == id[b * L + j]; }
  // The first position of i's sequence: the smallest j with the same sequence number.
  int64_t start(int64_t b, int64_t i) const {
    int64_t s = i;
    while (s > 0 && same(b, s - 1, i)) --s;
    return s;
  }
};

// (B, H, L, K) int32 lists from list_of(b, h, i) (ascending keys), -1 padded.
at::Tensor build_lists(int64_t B, int64_t H, int64_t L, int64_t K,
                       const std::function<std::vector<int64_t>(int64_t, int64_t, int64_t)>& list_of) {
  at::Tensor out = at::full({B, H, L, K}, -1, at::kInt);
  auto a = out.accessor<int32_t, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        std::vector<int64_t> keys = list_of(b, h, i);
        EXPECT_LE((int64_t)keys.size(), K);
        for (size_t t = 0; t < keys.size() && (int64_t)t < K; ++t) a[b][h][i][t] = (int32_t)keys[t];
      }
  return out;
}

// The last k entries of an ascending list.
std::vector<int64_t> last_k(const std::vector<int64_t>& v, int64_t k) {
  return std::vector<int64_t>(v.end() - std::min<int64_t>(k, v.size()), v.end());
}

// Every query has at most K keys, ascending without repeats, none in its future, none from
// another sequence, padding only at the end.
void expect_valid_lists(const at::Tensor& idx, const at::Tensor& seq, int64_t K) {
  ASSERT_EQ(idx.dim(), 4);
  ASSERT_EQ(idx.scalar_type(), at::kInt);
  ASSERT_EQ(idx.size(3), K);
  const int64_t B = idx.size(0), H = idx.size(1), L = idx.size(2);
  SeqIds ids(seq, B, L);
  auto a = idx.accessor<int32_t, 4>();
  int64_t bad = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        bool padding = false;
        int64_t prev = -1;
        for (int64_t t = 0; t < K; ++t) {
          const int64_t j = a[b][h][i][t];
          if (j == -1) {
            padding = true;
            continue;
          }
          const bool ok = !padding && j >= 0 && j <= i && j > prev && ids.same(b, i, j);
          if (!ok && bad++ < 5)
            ADD_FAILURE() << "bad key " << j << " in slot " << t << " of query " << i << " (b " << b << ", h " << h
                          << ")";
          prev = j;
        }
      }
  EXPECT_EQ(bad, 0);
}

// Calls fn(b, s, e) for every packed sequence [s, e) of every row b.
void for_each_sequence(const at::Tensor& seq, int64_t B, int64_t L,
                       const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  SeqIds ids(seq, B, L);
  for (int64_t b = 0; b < B; ++b) {
    int64_t s = 0;
    for (int64_t i = 1; i <= L; ++i) {
      if (i < L && ids.same(b, i, s)) continue;
      fn(b, s, i);
      s = i;
    }
  }
}

// Row b of a packed batch (B, H, L, K) equals running each of its sequences alone: alone(b, s, e)
// gives the lists (1, H, e - s, K) of positions s..e-1 run alone (positions from 0).
void expect_packed_equals_alone(const at::Tensor& packed, const at::Tensor& seq,
                                const std::function<at::Tensor(int64_t, int64_t, int64_t)>& alone) {
  for_each_sequence(seq, packed.size(0), packed.size(2), [&](int64_t b, int64_t s, int64_t e) {
    at::Tensor a = alone(b, s, e).select(0, 0);
    at::Tensor shifted = at::where(a >= 0, a + (int32_t)s, a);
    at::Tensor got = packed[b].narrow(1, s, e - s);
    EXPECT_TRUE(at::equal(got, shifted)) << "row " << b << ", sequence at " << s << ".." << e - 1;
  });
}

std::string trace(int64_t L, int64_t k, bool packed) {
  return "L=" + std::to_string(L) + " k=" + std::to_string(k) + " packed=" + std::to_string(packed);
}

// ---------------------------------------------------------------------------------------------
// Float64 LSH buckets from the definition: center by the mean of start..i, normalize, project,
// bin. Also returns each bucket's margin (how far the decision is from flipping).
struct BruteBuckets {
  at::Tensor bucket;  // (B, L, H) int32
  at::Tensor margin;  // (B, L, H) float64
};

BruteBuckets brute_buckets(const at::Tensor& x0, const at::Tensor& proj0, pat::Binning binning,
                           const at::Tensor& seq) {
  at::Tensor x = x0.to(at::kDouble).contiguous(), P = proj0.to(at::kDouble).contiguous();
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2), N = x.size(3), h = P.size(1);
  SeqIds ids(seq, B, L);
  auto xa = x.accessor<double, 4>();
  auto pa = P.accessor<double, 2>();
  BruteBuckets r{at::empty({B, L, H}, at::kInt), at::empty({B, L, H}, at::kDouble)};
  auto ba = r.bucket.accessor<int32_t, 3>();
  auto ma = r.margin.accessor<double, 3>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hd = 0; hd < H; ++hd)
      for (int64_t i = 0; i < L; ++i) {
        const int64_t s = ids.start(b, i);
        std::vector<double> c(N);
        double nrm = 0;
        for (int64_t n = 0; n < N; ++n) {
          double sum = 0;
          for (int64_t j = s; j <= i; ++j) sum += xa[b][j][hd][n];
          c[n] = xa[b][i][hd][n] - sum / (double)(i - s + 1);
          nrm += c[n] * c[n];
        }
        nrm = std::max(std::sqrt(nrm), 1e-12);
        std::vector<double> p(h, 0.0);
        for (int64_t j = 0; j < h; ++j)
          for (int64_t n = 0; n < N; ++n) p[j] += c[n] / nrm * pa[n][j];
        int64_t bucket = 0;
        double margin = std::numeric_limits<double>::infinity();
        if (binning == pat::Binning::kSign) {
          for (int64_t j = 0; j < h; ++j) {
            if (p[j] > 0) bucket += (int64_t)1 << j;
            margin = std::min(margin, std::abs(p[j]));
          }
        } else {
          for (int64_t j = 0; j < h; ++j)
            if (p[j] > p[bucket]) bucket = j;
          for (int64_t j = 0; j < h; ++j)
            if (j != bucket) margin = std::min(margin, p[bucket] - p[j]);
        }
        ba[b][i][hd] = (int32_t)bucket;
        ma[b][i][hd] = margin;
      }
  return r;
}

// Brute-force LSH lists from the buckets: for each query scan all j <= i of its sequence and keep
// the `keys` most recent with bucket_k(j) = bucket_q(i).
at::Tensor brute_lsh(const at::Tensor& bq, const at::Tensor& bk, int64_t keys, const at::Tensor& seq) {
  const int64_t B = bq.size(0), L = bq.size(1), H = bq.size(2);
  SeqIds ids(seq, B, L);
  auto qa = bq.accessor<int32_t, 3>();
  auto ka = bk.accessor<int32_t, 3>();
  return build_lists(B, H, L, keys, [&](int64_t b, int64_t h, int64_t i) {
    std::vector<int64_t> all;
    for (int64_t j = 0; j <= i; ++j)
      if (ids.same(b, i, j) && ka[b][j][h] == qa[b][i][h]) all.push_back(j);
    return last_k(all, keys);
  });
}

// Brute-force Key Selection: all j <= i of the sequence ranked by (score desc, position asc), the
// first k, ascending.
at::Tensor brute_top_k(const at::Tensor& scores0, int64_t k, const at::Tensor& seq) {
  at::Tensor scores = scores0.to(at::kDouble).contiguous();
  const int64_t B = scores.size(0), L = scores.size(1), H = scores.size(2);
  SeqIds ids(seq, B, L);
  auto sa = scores.accessor<double, 3>();
  return build_lists(B, H, L, k, [&](int64_t b, int64_t h, int64_t i) {
    std::vector<std::pair<double, int64_t>> all;  // (-score, j): ascending = best first
    for (int64_t j = 0; j <= i; ++j)
      if (ids.same(b, i, j)) all.emplace_back(-sa[b][j][h], j);
    const size_t n = std::min<size_t>(k, all.size());
    std::partial_sort(all.begin(), all.begin() + n, all.end());
    std::vector<int64_t> keys;
    for (size_t t = 0; t < n; ++t) keys.push_back(all[t].second);
    std::sort(keys.begin(), keys.end());
    return keys;
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Context-independent patterns.

TEST(PatternSlidingWindow, MatchesBruteForce) {
  torch::manual_seed(101);
  const int64_t B = 2, H = 2;
  for (int64_t L : kLengths)
    for (int64_t k : kKs)
      for (bool packed : {false, true}) {
        SCOPED_TRACE(trace(L, k, packed));
        at::Tensor seq = packing(B, L, packed);
        SeqIds ids(seq, B, L);
        at::Tensor want = build_lists(B, H, L, k, [&](int64_t b, int64_t, int64_t i) {
          std::vector<int64_t> keys;
          for (int64_t j = 0; j <= i; ++j)
            if (ids.same(b, i, j) && i - j < k) keys.push_back(j);
          return keys;
        });
        pat::KeyLists got = pat::sliding_window(B, H, L, k, seq);
        EXPECT_FALSE(got.q_order.defined());
        expect_valid_lists(got.idx, seq, k);
        EXPECT_TRUE(at::equal(got.idx, want));
        if (packed)
          expect_packed_equals_alone(got.idx, seq, [&](int64_t, int64_t s, int64_t e) {
            return pat::sliding_window(1, H, e - s, k, at::Tensor()).idx;
          });
      }
}

TEST(PatternSink, MatchesBruteForce) {
  torch::manual_seed(102);
  const int64_t B = 2, H = 2;
  for (int64_t L : kLengths)
    for (int64_t k : kKs)
      for (bool packed : {false, true}) {
        SCOPED_TRACE(trace(L, k, packed));
        at::Tensor seq = packing(B, L, packed);
        SeqIds ids(seq, B, L);
        at::Tensor want = build_lists(B, H, L, k, [&](int64_t b, int64_t, int64_t i) {
          std::vector<int64_t> keys;
          const int64_t s = ids.start(b, i);
          for (int64_t j = 0; j <= i; ++j)
            if (ids.same(b, i, j) && j - s < k) keys.push_back(j);
          return keys;
        });
        pat::KeyLists got = pat::sink(B, H, L, k, seq);
        expect_valid_lists(got.idx, seq, k);
        EXPECT_TRUE(at::equal(got.idx, want));
        if (packed)
          expect_packed_equals_alone(got.idx, seq, [&](int64_t, int64_t s, int64_t e) {
            return pat::sink(1, H, e - s, k, at::Tensor()).idx;
          });
      }
}

TEST(PatternDilated, MatchesBruteForce) {
  torch::manual_seed(103);
  const int64_t B = 2, H = 2;
  for (int64_t L : kLengths)
    for (int64_t k : kKs)
      for (int64_t r : {1, 2, 5})
        for (bool packed : {false, true}) {
          SCOPED_TRACE(trace(L, k, packed) + " stride=" + std::to_string(r));
          at::Tensor seq = packing(B, L, packed);
          SeqIds ids(seq, B, L);
          at::Tensor want = build_lists(B, H, L, k, [&](int64_t b, int64_t, int64_t i) {
            std::vector<int64_t> keys;
            const int64_t s = ids.start(b, i);
            for (int64_t j = 0; j <= i; ++j)
              if (ids.same(b, i, j) && (j - s) % r == r - 1) keys.push_back(j);
            return last_k(keys, k);
          });
          pat::KeyLists got = pat::dilated(B, H, L, k, r, seq);
          expect_valid_lists(got.idx, seq, k);
          EXPECT_TRUE(at::equal(got.idx, want));
          if (packed)
            expect_packed_equals_alone(got.idx, seq, [&](int64_t, int64_t s, int64_t e) {
              return pat::dilated(1, H, e - s, k, r, at::Tensor()).idx;
            });
        }
}

TEST(PatternDilated, StrideOneIsSlidingWindow) {
  at::Tensor seq = random_packing(2, 300, 0.02);
  EXPECT_TRUE(at::equal(pat::dilated(2, 3, 300, 16, 1, seq).idx, pat::sliding_window(2, 3, 300, 16, seq).idx));
}

TEST(PatternBasics, EmptyAndSmallShapes) {
  pat::KeyLists z = pat::sliding_window(2, 3, 0, 4, at::Tensor());
  EXPECT_EQ(z.idx.sizes().vec(), (std::vector<int64_t>{2, 3, 0, 4}));
  // K is always k, even where the sequence is shorter: the attention op sees a fixed K.
  pat::KeyLists s = pat::sink(1, 1, 3, 8, at::Tensor());
  EXPECT_EQ(s.idx.sizes().vec(), (std::vector<int64_t>{1, 1, 3, 8}));
  EXPECT_TRUE(at::equal(pat::key_counts(s).flatten(), at::tensor({1, 2, 3}, at::kInt)));
}

// ---------------------------------------------------------------------------------------------
// LSH.

TEST(PatternLshProjection, DeterministicBySeedAndStandardNormal) {
  at::Tensor a = pat::lsh_projection(256, 64, 7), b = pat::lsh_projection(256, 64, 7);
  at::Tensor c = pat::lsh_projection(256, 64, 8);
  EXPECT_EQ(a.scalar_type(), at::kFloat);
  EXPECT_EQ(a.sizes().vec(), (std::vector<int64_t>{256, 64}));
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_FALSE(at::equal(a, c));
  // An odd count (the last Box-Muller pair is half used) is fine too.
  EXPECT_EQ(pat::lsh_projection(3, 1, 1).sizes().vec(), (std::vector<int64_t>{3, 1}));
  EXPECT_TRUE(at::isfinite(a).all().item<bool>());
  // 16384 draws: loose moment checks of N(0, 1).
  at::Tensor d = a.to(at::kDouble);
  const double mean = d.mean().item<double>(), var = d.var().item<double>();
  const double skew = ((d - mean).pow(3).mean() / std::pow(var, 1.5)).item<double>();
  const double kurt = ((d - mean).pow(4).mean() / (var * var)).item<double>();
  EXPECT_NEAR(mean, 0.0, 0.05);
  EXPECT_NEAR(var, 1.0, 0.05);
  EXPECT_NEAR(skew, 0.0, 0.1);
  EXPECT_NEAR(kurt, 3.0, 0.2);
  const double within1 = (d.abs() < 1).to(at::kDouble).mean().item<double>();
  EXPECT_NEAR(within1, 0.6827, 0.02);
}

TEST(PatternLshBuckets, MatchFloat64Definition) {
  torch::manual_seed(111);
  const int64_t B = 2, H = 2, N = 8;
  struct Rule {
    pat::Binning binning;
    int64_t h;
  };
  for (Rule rule : {Rule{pat::Binning::kSign, 3}, Rule{pat::Binning::kSign, 12}, Rule{pat::Binning::kArgmax, 5},
                    Rule{pat::Binning::kArgmax, 1}})
    for (at::ScalarType dt : {at::kFloat, at::kDouble})
      for (int64_t L : kLengths)
        for (bool packed : {false, true}) {
          SCOPED_TRACE("L=" + std::to_string(L) + " h=" + std::to_string(rule.h) +
                       " packed=" + std::to_string(packed) +
                       (rule.binning == pat::Binning::kSign ? " sign " : " argmax ") + c10::toString(dt));
          at::Tensor seq = packing(B, L, packed);
          // A per-feature offset, so centering matters.
          at::Tensor x = (at::randn({B, L, H, N}, at::kDouble) + 3 * at::randn({N}, at::kDouble)).to(dt);
          at::Tensor proj = pat::lsh_projection(N, rule.h, 1000 + L);
          at::Tensor got = pat::lsh_buckets(x, proj, rule.binning, seq);
          ASSERT_EQ(got.sizes().vec(), (std::vector<int64_t>{B, L, H}));
          ASSERT_EQ(got.scalar_type(), at::kInt);
          BruteBuckets want = brute_buckets(x, proj, rule.binning, seq);
          // Equal, except where the decision is within rounding of flipping (never seen in practice).
          at::Tensor differ = got.ne(want.bucket);
          EXPECT_EQ(differ.logical_and(want.margin > 1e-9).sum().item<int64_t>(), 0);
          const int64_t nb = rule.binning == pat::Binning::kSign ? (1 << rule.h) : rule.h;
          EXPECT_TRUE((got >= 0).all().item<bool>());
          EXPECT_TRUE((got < nb).all().item<bool>());
          if (L > 60 && nb > 1) {
            EXPECT_LT(got.min().item<int32_t>(), got.max().item<int32_t>());
          }
          if (packed)
            for_each_sequence(seq, B, L, [&](int64_t b, int64_t s, int64_t e) {
              at::Tensor a = pat::lsh_buckets(x[b].narrow(0, s, e - s).unsqueeze(0), proj, rule.binning, at::Tensor());
              EXPECT_TRUE(at::equal(a[0], got[b].narrow(0, s, e - s))) << "row " << b << ", sequence at " << s;
            });
        }
}

TEST(PatternLshBuckets, CenteringIsCausal) {
  torch::manual_seed(112);
  const int64_t B = 2, L = 200, H = 2, N = 6;
  at::Tensor proj = pat::lsh_projection(N, 4, 3);
  for (pat::Binning binning : {pat::Binning::kSign, pat::Binning::kArgmax}) {
    at::Tensor x = at::randn({B, L, H, N}) + 2 * at::randn({N});
    at::Tensor b0 = pat::lsh_buckets(x, proj, binning, at::Tensor());
    int64_t changed_later = 0;
    for (int64_t t : {0, 1, 17, 100, 198}) {
      at::Tensor x2 = x.clone();
      x2.narrow(1, t + 1, L - t - 1).copy_(at::randn({B, L - t - 1, H, N}) * 5 + 7);
      at::Tensor b2 = pat::lsh_buckets(x2, proj, binning, at::Tensor());
      EXPECT_TRUE(at::equal(b2.narrow(1, 0, t + 1), b0.narrow(1, 0, t + 1))) << "changing x after " << t;
      changed_later += b2.narrow(1, t + 1, L - t - 1).ne(b0.narrow(1, t + 1, L - t - 1)).sum().item<int64_t>();
    }
    EXPECT_GT(changed_later, 0);  // the test itself can see a change
  }
  // The first position of every sequence centers to zero: sign bucket 0, argmax column 0.
  at::Tensor x = at::randn({1, 5, 1, N});
  at::Tensor seq = at::tensor({0, 0, 1, 1, 1}, at::kInt).view({1, 5});
  at::Tensor bs = pat::lsh_buckets(x, proj, pat::Binning::kSign, seq);
  EXPECT_EQ(bs[0][0][0].item<int32_t>(), 0);
  EXPECT_EQ(bs[0][2][0].item<int32_t>(), 0);
  at::Tensor ba = pat::lsh_buckets(x, proj, pat::Binning::kArgmax, seq);
  EXPECT_EQ(ba[0][0][0].item<int32_t>(), 0);
  EXPECT_EQ(ba[0][2][0].item<int32_t>(), 0);
}

TEST(PatternLshBuckets, SignBitsAreColumns) {
  // A two-position sequence: x1 - mean = (x1 - x0) / 2, so the bucket of position 1 is read off
  // the signs of (x1 - x0) · proj. With proj = identity, bit b = (x1 - x0)_b > 0.
  at::Tensor proj = at::eye(3, at::kFloat);
  at::Tensor x = at::tensor({0.f, 0.f, 0.f, 1.f, -1.f, 2.f}, at::kFloat).view({1, 2, 1, 3});
  at::Tensor b = pat::lsh_buckets(x, proj, pat::Binning::kSign, at::Tensor());
  EXPECT_EQ(b[0][1][0].item<int32_t>(), 1 + 4);
  at::Tensor a = pat::lsh_buckets(x, proj, pat::Binning::kArgmax, at::Tensor());
  EXPECT_EQ(a[0][1][0].item<int32_t>(), 2);
  // Argmax ties go to the lowest column.
  at::Tensor y = at::tensor({0.f, 0.f, 0.f, 1.f, -1.f, 1.f}, at::kFloat).view({1, 2, 1, 3});
  EXPECT_EQ(pat::lsh_buckets(y, proj, pat::Binning::kArgmax, at::Tensor())[0][1][0].item<int32_t>(), 0);
}

namespace {

// q_order of every (b, h) row is a permutation of 0..L-1, sorted by (sequence, bucket, position).
void expect_q_order(const at::Tensor& q_order, const at::Tensor& bq, const at::Tensor& seq) {
  const int64_t B = bq.size(0), L = bq.size(1), H = bq.size(2);
  ASSERT_EQ(q_order.sizes().vec(), (std::vector<int64_t>{B, H, L}));
  ASSERT_EQ(q_order.scalar_type(), at::kInt);
  SeqIds ids(seq, B, L);
  auto o = q_order.accessor<int32_t, 3>();
  auto q = bq.accessor<int32_t, 3>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<int64_t> seen(L, 0);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t i = o[b][h][t];
        ASSERT_TRUE(i >= 0 && i < L);
        ++seen[i];
        if (t > 0) {
          const int64_t p = o[b][h][t - 1];
          auto key = [&](int64_t x) { return std::make_tuple(ids.id[b * L + x], q[b][x][h], x); };
          EXPECT_LT(key(p), key(i)) << "q_order not sorted at " << t;
        }
      }
      EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), L) << "q_order is not a permutation";
    }
}

}  // namespace

TEST(PatternLsh, MatchesBruteForce) {
  torch::manual_seed(121);
  const int64_t B = 2, H = 2, N = 8;
  struct Rule {
    pat::Binning binning;
    int64_t h;
  };
  // 8 and 5 buckets (crowded buckets: the k-most-recent cut matters), and 2^20 buckets (the
  // comparison-sort path).
  for (Rule rule : {Rule{pat::Binning::kSign, 3}, Rule{pat::Binning::kArgmax, 5}, Rule{pat::Binning::kSign, 20}})
    for (int64_t L : kLengths)
      for (int64_t k : kKs)
        for (bool packed : {false, true}) {
          SCOPED_TRACE(trace(L, k, packed) + " h=" + std::to_string(rule.h));
          at::Tensor seq = packing(B, L, packed);
          at::Tensor q = at::randn({B, L, H, N});
          // Keys near the queries in half the positions, so buckets often agree.
          at::Tensor kk = at::where(at::rand({B, L, H, 1}) < 0.5, q + 0.1 * at::randn({B, L, H, N}),
                                    at::randn({B, L, H, N}));
          at::Tensor proj = pat::lsh_projection(N, rule.h, 77 + k);
          pat::KeyLists got = pat::lsh(q, kk, k, proj, rule.binning, seq);
          at::Tensor bq = pat::lsh_buckets(q, proj, rule.binning, seq);
          at::Tensor bk = pat::lsh_buckets(kk, proj, rule.binning, seq);
          expect_valid_lists(got.idx, seq, k);
          EXPECT_TRUE(at::equal(got.idx, brute_lsh(bq, bk, k, seq)));
          expect_q_order(got.q_order, bq, seq);
          if (packed) {
            auto alone = [&](int64_t b, int64_t s, int64_t e) {
              return pat::lsh(q[b].narrow(0, s, e - s).unsqueeze(0), kk[b].narrow(0, s, e - s).unsqueeze(0), k, proj,
                              rule.binning, at::Tensor());
            };
            expect_packed_equals_alone(got.idx, seq, [&](int64_t b, int64_t s, int64_t e) { return alone(b, s, e).idx; });
            expect_packed_equals_alone(got.q_order.unsqueeze(-1), seq, [&](int64_t b, int64_t s, int64_t e) {
              return alone(b, s, e).q_order.unsqueeze(-1);
            });
          }
          if (L == 1025 && k == 7 && rule.h == 3) {
            // Crowded buckets: many queries have exactly k keys, so the cut was exercised.
            EXPECT_GT(pat::key_counts(got).eq(k).sum().item<int64_t>(), B * H * L / 2);
          }
        }
}

TEST(PatternLsh, DoubleInputsAndThreads) {
  torch::manual_seed(122);
  at::Tensor q = at::randn({2, 500, 3, 16}, at::kDouble), k = at::randn({2, 500, 3, 16}, at::kDouble);
  at::Tensor proj = pat::lsh_projection(16, 4, 5);
  at::Tensor seq = random_packing(2, 500, 0.01);
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  pat::KeyLists a = pat::lsh(q, k, 16, proj, pat::Binning::kSign, seq);
  at::set_num_threads(2);
  pat::KeyLists b = pat::lsh(q, k, 16, proj, pat::Binning::kSign, seq);
  at::set_num_threads(before);
  EXPECT_TRUE(at::equal(a.idx, b.idx));
  EXPECT_TRUE(at::equal(a.q_order, b.q_order));
  at::Tensor bq = pat::lsh_buckets(q, proj, pat::Binning::kSign, seq);
  at::Tensor bk = pat::lsh_buckets(k, proj, pat::Binning::kSign, seq);
  EXPECT_TRUE(at::equal(a.idx, brute_lsh(bq, bk, 16, seq)));
  // Identical queries and keys: every query's own position is its last key.
  pat::KeyLists self = pat::lsh(q, q, 16, proj, pat::Binning::kArgmax, seq);
  at::Tensor cnt = pat::key_counts(self).to(at::kLong);
  at::Tensor last = self.idx.gather(3, (cnt - 1).unsqueeze(-1)).squeeze(-1);
  EXPECT_TRUE(at::equal(last, at::arange(500, at::kInt).expand({2, 3, 500})));
}

// ---------------------------------------------------------------------------------------------
// Key Selection (top-k over the causal prefix).

TEST(PatternTopKPrefix, MatchesBruteForce) {
  torch::manual_seed(131);
  const int64_t B = 2, H = 2;
  for (at::ScalarType dt : {at::kFloat, at::kDouble})
    for (bool ties : {false, true})
      for (int64_t L : kLengths)
        for (int64_t k : kKs)
          for (bool packed : {false, true}) {
            SCOPED_TRACE(trace(L, k, packed) + " ties=" + std::to_string(ties) + " " + c10::toString(dt));
            at::Tensor seq = packing(B, L, packed);
            // ties: integer scores 0..3, so most comparisons are ties.
            at::Tensor scores = ties ? at::randint(0, 4, {B, L, H}).to(dt) : at::randn({B, L, H}, dt);
            pat::KeyLists got = pat::top_k_prefix(scores, k, seq);
            EXPECT_FALSE(got.q_order.defined());
            expect_valid_lists(got.idx, seq, k);
            EXPECT_TRUE(at::equal(got.idx, brute_top_k(scores, k, seq)));
            if (packed)
              expect_packed_equals_alone(got.idx, seq, [&](int64_t b, int64_t s, int64_t e) {
                return pat::top_k_prefix(scores[b].narrow(0, s, e - s).unsqueeze(0), k, at::Tensor()).idx;
              });
          }
}

TEST(PatternTopKPrefix, TiesGoToTheEarlierPosition) {
  const int64_t L = 50, k = 6;
  at::Tensor seq = at::cat({at::zeros({20}, at::kInt), at::ones({30}, at::kInt)}).view({1, L});
  // All equal: the first k keys of each sequence (= sink).
  at::Tensor flat = at::full({1, L, 2}, 0.5);
  EXPECT_TRUE(at::equal(pat::top_k_prefix(flat, k, seq).idx, pat::sink(1, 2, L, k, seq).idx));
  // Increasing: the k most recent (= sliding window); decreasing: the first k.
  at::Tensor up = at::arange(L, at::kFloat).view({1, L, 1});
  EXPECT_TRUE(at::equal(pat::top_k_prefix(up, k, seq).idx, pat::sliding_window(1, 1, L, k, seq).idx));
  EXPECT_TRUE(at::equal(pat::top_k_prefix(-up, k, seq).idx, pat::sink(1, 1, L, k, seq).idx));
  // A hand example, k = 2: scores 1 3 3 2 3 -> {0}, {0,1}, {1,2}, {1,2}, {1,2}.
  at::Tensor s = at::tensor({1.0, 3.0, 3.0, 2.0, 3.0}, at::kDouble).view({1, 5, 1});
  at::Tensor got = pat::top_k_prefix(s, 2, at::Tensor()).idx.view({5, 2});
  at::Tensor want = at::tensor({0, -1, 0, 1, 1, 2, 1, 2, 1, 2}, at::kInt).view({5, 2});
  EXPECT_TRUE(at::equal(got, want)) << got;
  // A newcomer beating tied members evicts the later of them: 2 2 3, k = 2 -> {0}, {0,1}, {0,2}.
  at::Tensor t = at::tensor({2.0, 2.0, 3.0}, at::kDouble).view({1, 3, 1});
  at::Tensor gt = pat::top_k_prefix(t, 2, at::Tensor()).idx.view({3, 2});
  EXPECT_TRUE(at::equal(gt, at::tensor({0, -1, 0, 1, 0, 2}, at::kInt).view({3, 2}))) << gt;
  // NaN ranks lowest.
  at::Tensor n = at::tensor({NAN, 1.0, NAN, -5.0}, at::kDouble).view({1, 4, 1});
  at::Tensor gn = pat::top_k_prefix(n, 2, at::Tensor()).idx.view({4, 2});
  EXPECT_TRUE(at::equal(gn, at::tensor({0, -1, 0, 1, 0, 1, 1, 3}, at::kInt).view({4, 2}))) << gn;
}

// Key Selection as intervals: expanding each row's (key, leave) entries gives the brute-force
// top k of every prefix and top_k_prefix's lists exactly (random scores, mostly tied ones with NaNs, packed rows, awkward sizes); the keys
// ascend, every interval is non-empty and ends inside its key's sequence.
TEST(PatternTopKPrefix, IntervalsExpandToTheLists) {
  torch::manual_seed(133);
  const int64_t B = 2, H = 2;
  for (bool ties : {false, true})
    for (int64_t L : kLengths)
      for (int64_t k : kKs)
        for (bool packed : {false, true}) {
          SCOPED_TRACE(trace(L, k, packed) + " ties=" + std::to_string(ties));
          const at::Tensor seq = packing(B, L, packed);
          at::Tensor scores = ties ? at::randint(0, 4, {B, L, H}).to(at::kFloat) : at::randn({B, L, H});
          if (ties) scores.masked_fill_(at::rand({B, L, H}) < 0.05, NAN);
          const at::Tensor lists = pat::top_k_prefix(scores, k, seq).idx;  // (B, H, L, k)
          const pat::KeyIntervals iv = pat::top_k_prefix_intervals(scores, k, seq);
          EXPECT_EQ(iv.k, k);
          EXPECT_FALSE(iv.leave_at.defined() || iv.prefix.defined() || iv.start.defined()) << "CPU: no extras";
          ASSERT_EQ(iv.count.sizes(), (at::IntArrayRef{B, H}));
          ASSERT_EQ(iv.key.sizes(), iv.leave.sizes());
          at::Tensor want = at::full({B, H, L, k}, -1, at::kInt);
          auto w = want.accessor<int32_t, 4>();
          const auto c = iv.count.accessor<int32_t, 2>();
          const auto key = iv.key.accessor<int32_t, 3>();
          const auto leave = iv.leave.accessor<int32_t, 3>();
          const SeqIds ids(seq, B, L);
          for (int64_t b = 0; b < B; ++b) {
            for (int64_t h = 0; h < H; ++h) {
              std::vector<int64_t> filled(L, 0);
              for (int64_t t = 0; t < c[b][h]; ++t) {
                const int64_t j = key[b][h][t], e = leave[b][h][t];
                // (leave inside key j's sequence: query e - 1 shares it)
                ASSERT_TRUE(j >= 0 && j < e && e <= L && ids.same(b, j, e - 1))
                    << "entry " << t << ": key " << j << " leave " << e;
                if (t > 0) {
                  ASSERT_LT(key[b][h][t - 1], j);
                }
                for (int64_t i = j; i < e; ++i) {
                  ASSERT_LT(filled[i], k) << "query " << i << " holds more than k keys";
                  w[b][h][i][filled[i]++] = (int32_t)j;  // (keys ascending: each list ascending)
                }
              }
            }
          }
          // The definition, per query (NaN ranks lowest: -inf for the brute force's sort).
          const at::Tensor ranked = at::where(scores.isnan(), at::full({}, -INFINITY), scores);
          EXPECT_TRUE(at::equal(want, brute_top_k(ranked, k, seq)));
          EXPECT_TRUE(at::equal(want, lists));
        }
}

// merge_overflow_rows's intervals form names what it lacks: k above a lane per key, intervals
// without their CUDA extras (the CPU loop's), a band key count out of range.
TEST(PatternTopKPrefix, IntervalMergeErrors) {
  const at::Tensor scores = at::randn({1, 100, 2});
  const pat::LshBand band;
  const at::Tensor count = at::zeros({1, 2, 2}, at::kInt);
  const pat::KeyIntervals k40 = pat::top_k_prefix_intervals(scores, 40, at::Tensor());
  const pat::KeyIntervals k4 = pat::top_k_prefix_intervals(scores, 4, at::Tensor());
  expect_usage_error([&] { pat::merge_overflow_rows(band, 16, k40, count); }, "b.k = 40 must be in [1, 32]");
  expect_usage_error([&] { pat::merge_overflow_rows(band, 16, k4, count); }, "b.leave_at is undefined");
  pat::KeyIntervals no_prefix = k4;
  no_prefix.leave_at = at::full({1, 2, 100}, 0, at::kInt);
  expect_usage_error([&] { pat::merge_overflow_rows(band, 16, no_prefix, count); }, "b.prefix is undefined");
  expect_usage_error([&] { pat::merge_overflow_rows(band, 0, k4, count); }, "Ka = 0");
  expect_usage_error([&] { pat::merge_overflow_rows(band, 33, k4, count); }, "Ka = 33");
}

// ---------------------------------------------------------------------------------------------
// Merge and counts.

TEST(PatternMerge, IsASetUnion) {
  torch::manual_seed(141);
  const int64_t B = 2, H = 3, N = 8;
  for (int64_t L : kLengths)
    for (bool packed : {false, true}) {
      SCOPED_TRACE(trace(L, 0, packed));
      at::Tensor seq = packing(B, L, packed);
      at::Tensor q = at::randn({B, L, H, N}), k = at::randn({B, L, H, N});
      pat::KeyLists a = pat::lsh(q, k, 32, pat::lsh_projection(N, 3, 9), pat::Binning::kSign, seq);
      pat::KeyLists b = pat::top_k_prefix(at::randn({B, L, H}), 7, seq);
      pat::KeyLists m = pat::merge(a, b);
      ASSERT_EQ(m.idx.sizes().vec(), (std::vector<int64_t>{B, H, L, 39}));
      expect_valid_lists(m.idx, seq, 39);
      auto ai = a.idx.accessor<int32_t, 4>(), bi = b.idx.accessor<int32_t, 4>();
      at::Tensor want = build_lists(B, H, L, 39, [&](int64_t bb, int64_t h, int64_t i) {
        std::set<int64_t> u;
        for (int64_t t = 0; t < 32; ++t)
          if (ai[bb][h][i][t] >= 0) u.insert(ai[bb][h][i][t]);
        for (int64_t t = 0; t < 7; ++t)
          if (bi[bb][h][i][t] >= 0) u.insert(bi[bb][h][i][t]);
        return std::vector<int64_t>(u.begin(), u.end());
      });
      EXPECT_TRUE(at::equal(m.idx, want));
      EXPECT_TRUE(at::equal(m.q_order, a.q_order));
      EXPECT_TRUE(at::equal(pat::merge(b, a).idx, want));
      EXPECT_TRUE(at::equal(pat::merge(b, a).q_order, a.q_order));
      EXPECT_FALSE(pat::merge(b, b).q_order.defined());
      EXPECT_TRUE(at::equal(pat::key_counts(m), (want >= 0).sum(-1).to(at::kInt)));
    }
  // A = SW ∪ Sink, against its definition.
  at::Tensor seq = random_packing(1, 400, 0.01);
  SeqIds ids(seq, 1, 400);
  at::Tensor want = build_lists(1, 1, 400, 16, [&](int64_t, int64_t, int64_t i) {
    std::vector<int64_t> keys;
    const int64_t s = ids.start(0, i);
    for (int64_t j = 0; j <= i; ++j)
      if (ids.same(0, i, j) && (i - j < 8 || j - s < 8)) keys.push_back(j);
    return keys;
  });
  EXPECT_TRUE(at::equal(pat::merge(pat::sliding_window(1, 1, 400, 8, seq), pat::sink(1, 1, 400, 8, seq)).idx, want));
}

TEST(PatternExclude, IsASetDifference) {
  torch::manual_seed(142);
  const int64_t B = 2, H = 3, N = 8;
  for (int64_t L : kLengths)
    for (bool packed : {false, true}) {
      SCOPED_TRACE(trace(L, 0, packed));
      at::Tensor seq = packing(B, L, packed);
      at::Tensor q = at::randn({B, L, H, N}), k = at::randn({B, L, H, N});
      pat::KeyLists a = pat::lsh(q, k, 9, pat::lsh_projection(N, 2, 9), pat::Binning::kSign, seq);
      pat::KeyLists b = pat::top_k_prefix(at::randn({B, L, H}), 7, seq);
      pat::KeyLists d = pat::exclude(b, a);
      ASSERT_EQ(d.idx.sizes().vec(), (std::vector<int64_t>{B, H, L, 7}));
      EXPECT_FALSE(d.q_order.defined());
      EXPECT_TRUE(at::equal(pat::exclude(a, b).q_order, a.q_order));
      expect_valid_lists(d.idx, seq, 7);
      auto ai = a.idx.accessor<int32_t, 4>(), bi = b.idx.accessor<int32_t, 4>();
      at::Tensor want = build_lists(B, H, L, 7, [&](int64_t bb, int64_t h, int64_t i) {
        std::set<int64_t> in_a;
        for (int64_t t = 0; t < 9; ++t)
          if (ai[bb][h][i][t] >= 0) in_a.insert(ai[bb][h][i][t]);
        std::vector<int64_t> keys;
        for (int64_t t = 0; t < 7; ++t)
          if (bi[bb][h][i][t] >= 0 && !in_a.count(bi[bb][h][i][t])) keys.push_back(bi[bb][h][i][t]);
        return keys;
      });
      EXPECT_TRUE(at::equal(d.idx, want));
      // exclude(b, a) and a are disjoint, and together list what merge(a, b) lists.
      EXPECT_TRUE(at::equal(pat::key_counts(d) + pat::key_counts(a), pat::key_counts(pat::merge(a, b))));
      EXPECT_TRUE(at::equal(pat::exclude(b, b).idx, at::full({B, H, L, 7}, -1, at::kInt)));
    }
}

TEST(PatternKeyCounts, CountsNonPadding) {
  at::Tensor seq = random_packing(2, 100, 0.05);
  SeqIds ids(seq, 2, 100);
  at::Tensor c = pat::key_counts(pat::sliding_window(2, 2, 100, 10, seq));
  ASSERT_EQ(c.sizes().vec(), (std::vector<int64_t>{2, 2, 100}));
  EXPECT_EQ(c.scalar_type(), at::kInt);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(c[b][1][i].item<int32_t>(), std::min<int64_t>(10, i - ids.start(b, i) + 1));
}

// ---------------------------------------------------------------------------------------------
// Errors.

TEST(PatternErrors, BadArgumentsNameTheArgument) {
  at::Tensor none;
  expect_usage_error([&] { pat::sliding_window(1, 1, 8, 0, none); }, "k = 0");
  expect_usage_error([&] { pat::sink(1, 1, 8, -3, none); }, "k = -3");
  expect_usage_error([&] { pat::dilated(1, 1, 8, 0, 2, none); }, "k = 0");
  expect_usage_error([&] { pat::dilated(1, 1, 8, 4, 0, none); }, "stride = 0");
  expect_usage_error([&] { pat::sliding_window(1, 1, -1, 4, none); }, "L = -1");
  expect_usage_error([&] { pat::sliding_window(2, 1, 8, 4, at::zeros({2, 7}, at::kInt)); }, "seq_idx");
  expect_usage_error([&] { pat::sink(1, 1, 3, 4, at::tensor({0, 1, 0}, at::kInt).view({1, 3})); }, "non-decreasing");
  expect_usage_error([&] { pat::sink(1, 1, 3, 4, at::zeros({1, 3})); }, "seq_idx has dtype");
  // Lists go to the CPU or a CUDA device, the latter only in a build with the CUDA backend.
  expect_usage_error([&] { pat::sliding_window(1, 1, 8, 2, none, at::Device(at::kMeta)); }, "CUDA devices only");
  expect_usage_error([&] { pat::chunk_layout(1, 8, 2, none, at::Device(at::kMeta)); }, "CUDA devices only");
  if (!hax::ops::cuda_backend_built())
    expect_usage_error([&] { pat::sink(1, 1, 8, 2, none, at::Device(at::kCUDA)); }, "no CUDA kernels");

  at::Tensor q = at::randn({1, 10, 2, 4}), proj = pat::lsh_projection(4, 3, 1);
  expect_usage_error([&] { pat::lsh(q, q, 0, proj, pat::Binning::kSign, none); }, "keys = 0");
  expect_usage_error([&] { pat::lsh(q, at::randn({1, 10, 2, 5}), 4, proj, pat::Binning::kSign, none); },
                     "k has shape");
  expect_usage_error([&] { pat::lsh(q.view({10, 2, 4}), q, 4, proj, pat::Binning::kSign, none); }, "q has shape");
  expect_usage_error([&] { pat::lsh(q, q, 4, pat::lsh_projection(5, 3, 1), pat::Binning::kSign, none); }, "proj");
  expect_usage_error([&] { pat::lsh(q, q, 4, pat::lsh_projection(4, 31, 1), pat::Binning::kSign, none); }, "1..30");
  expect_usage_error([&] { pat::lsh(q, q, 4, proj.view({-1}), pat::Binning::kSign, none); }, "proj");
  expect_usage_error([&] { pat::lsh(q.to(at::kInt), q, 4, proj, pat::Binning::kSign, none); }, "q has dtype");
  expect_usage_error([&] { pat::lsh(q, q, 4, proj, pat::Binning::kSign, at::zeros({1, 9}, at::kInt)); }, "seq_idx");
  expect_usage_error([&] { pat::lsh_buckets(q.to(at::kLong), proj, pat::Binning::kArgmax, none); }, "x has dtype");
  expect_usage_error([&] { pat::lsh_buckets(q, at::empty({4, 0}), pat::Binning::kArgmax, none); }, "h = 0");
  expect_usage_error([&] { pat::lsh_projection(0, 4, 1); }, "N = 0");
  expect_usage_error([&] { pat::lsh_projection(4, 0, 1); }, "h = 0");

  expect_usage_error([&] { pat::top_k_prefix(at::randn({1, 10, 2}), 0, none); }, "k = 0");
  expect_usage_error([&] { pat::top_k_prefix(at::randn({10, 2}), 4, none); }, "scores");
  expect_usage_error([&] { pat::top_k_prefix(at::ones({1, 10, 2}, at::kInt), 4, none); }, "scores has dtype");

  pat::KeyLists a = pat::sliding_window(1, 2, 10, 4, none), b = pat::sliding_window(1, 2, 11, 4, none);
  expect_usage_error([&] { pat::merge(a, b); }, "b.idx");
  expect_usage_error([&] { pat::merge(a, pat::KeyLists{}); }, "b.idx");
  expect_usage_error([&] { pat::key_counts(pat::KeyLists{}); }, "idx");

  EXPECT_EQ(pat::binning_from_string("sign"), pat::Binning::kSign);
  EXPECT_EQ(pat::binning_from_string("argmax"), pat::Binning::kArgmax);
  expect_usage_error([&] { pat::binning_from_string("hamming"); }, "--lsh-binning");
  expect_usage_error([&] { pat::binning_from_string("hamming"); }, "hamming");
}

// ---------------------------------------------------------------------------------------------
// CUDA: every builder on CUDA inputs (or asked for CUDA lists) builds them on the GPU, equal to its
// CPU lists for the same inputs: same keys, order, -1 padding, q_order and ties. Outputs are
// poisoned while the GPU builds them, so a slot a kernel leaves unwritten fails.

namespace {

const at::Device kCuda(at::kCUDA, 0);

at::Tensor cuda(const at::Tensor& t) { return t.defined() ? t.to(kCuda) : t; }

// Poisons new outputs for the scope (ops::new_output fills them with INT_MIN / NaN).
struct PoisonOutputs {
  PoisonOutputs() { hax::ops::set_poison_outputs(true); }
  ~PoisonOutputs() { hax::ops::set_poison_outputs(false); }
};

// Where two equal-shaped int tensors first differ, and how often.
std::string first_difference(const at::Tensor& got, const at::Tensor& want) {
  if (got.sizes() != want.sizes())
    return "shape " + hax::ops::shape_str(got.sizes()) + " vs " + hax::ops::shape_str(want.sizes());
  const at::Tensor at_ = got.ne(want).flatten().nonzero();
  if (at_.numel() == 0) return "equal";
  const int64_t i = at_[0][0].item<int64_t>();
  return std::to_string(at_.size(0)) + " entries differ, the first at flat index " + std::to_string(i) + ": " +
         std::to_string(got.flatten()[i].item<int64_t>()) + " vs the CPU's " +
         std::to_string(want.flatten()[i].item<int64_t>());
}

// `got` is an int32 tensor on the GPU equal to the CPU's `want`.
void expect_cuda_lists(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  EXPECT_TRUE(got.is_cuda()) << what << " is on " << got.device().str();
  EXPECT_EQ(got.scalar_type(), at::kInt) << what;
  const at::Tensor g = got.cpu();
  EXPECT_TRUE(at::equal(g, want)) << what << ": " << first_difference(g, want);
}

const int64_t kCudaKs[] = {1, 7, 32, 33, 64, 2000};  // 2000 > every L of kLengths

}  // namespace

TEST(PatternCuda, SlidingWindowSinkDilatedEqualCpu) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(201);
  const int64_t B = 2, H = 3;
  for (int64_t L : kLengths)
    for (int64_t k : kCudaKs)
      for (bool packed : {false, true}) {
        SCOPED_TRACE(trace(L, k, packed));
        const at::Tensor seq = packing(B, L, packed), seq_gpu = cuda(seq);
        const auto dev =
            packed ? std::optional<at::Device>() : std::optional<at::Device>(kCuda);  // via seq_idx, or asked for
        expect_cuda_lists(pat::sliding_window(B, H, L, k, seq_gpu, dev).idx, pat::sliding_window(B, H, L, k, seq).idx,
                          "SW");
        expect_cuda_lists(pat::sink(B, H, L, k, seq_gpu, dev).idx, pat::sink(B, H, L, k, seq).idx, "sink");
        for (int64_t r : {1, 2, 5})
          expect_cuda_lists(pat::dilated(B, H, L, k, r, seq_gpu, dev).idx, pat::dilated(B, H, L, k, r, seq).idx,
                            "dilated r=" + std::to_string(r));
      }
}

TEST(PatternCuda, TheDeviceArgumentAndSeqIdxDecideTheDevice) {
  HAX_REQUIRE_CUDA();
  const at::Tensor seq = random_packing(2, 50, 0.1);
  const at::Tensor want = pat::sliding_window(2, 2, 50, 4, seq).idx;
  // No device: seq_idx's. A device: that one, wherever seq_idx is.
  expect_cuda_lists(pat::sliding_window(2, 2, 50, 4, cuda(seq)).idx, want, "CUDA seq_idx");
  expect_cuda_lists(pat::sliding_window(2, 2, 50, 4, seq, kCuda).idx, want, "CPU seq_idx, CUDA device");
  const at::Tensor back = pat::sliding_window(2, 2, 50, 4, cuda(seq), at::Device(at::kCPU)).idx;
  EXPECT_TRUE(back.device().is_cpu());
  EXPECT_TRUE(at::equal(back, want));
  expect_cuda_lists(pat::sink(1, 2, 50, 4, at::Tensor(), at::kCUDA).idx, pat::sink(1, 2, 50, 4, at::Tensor()).idx,
                    "no seq_idx, at::kCUDA");
  EXPECT_TRUE(pat::sliding_window(1, 1, 8, 2, at::Tensor()).idx.device().is_cpu());
}

TEST(PatternCuda, LongSlidingWindowAndDilatedEqualCpu) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(202);
  const int64_t L = 65537;
  for (bool packed : {false, true}) {
    const at::Tensor seq = packed ? random_packing(1, L, 0.0002) : at::Tensor();
    expect_cuda_lists(pat::sliding_window(1, 1, L, 64, cuda(seq), kCuda).idx, pat::sliding_window(1, 1, L, 64, seq).idx,
                      "SW at 65537");
    expect_cuda_lists(pat::dilated(1, 1, L, 16, 7, cuda(seq), kCuda).idx, pat::dilated(1, 1, L, 16, 7, seq).idx,
                      "dilated at 65537");
  }
}

TEST(PatternCuda, LshBucketsEqualCpu) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(211);
  const int64_t B = 2, H = 3, N = 8;
  struct Rule {
    pat::Binning binning;
    int64_t h;
  };
  // h = 40: argmax past the 32 lanes of a group (the centered values go through memory).
  for (Rule rule : {Rule{pat::Binning::kSign, 3}, Rule{pat::Binning::kSign, 8}, Rule{pat::Binning::kSign, 30},
                    Rule{pat::Binning::kArgmax, 1}, Rule{pat::Binning::kArgmax, 5}, Rule{pat::Binning::kArgmax, 32},
                    Rule{pat::Binning::kArgmax, 40}})
    for (int64_t L : kLengths)
      for (bool packed : {false, true})
        for (bool integers : {false, true}) {
          SCOPED_TRACE("L=" + std::to_string(L) + " h=" + std::to_string(rule.h) + " packed=" + std::to_string(packed) +
                       " integers=" + std::to_string(integers));
          const at::Tensor seq = packing(B, L, packed);
          // Integer values: sums exact in any order, and many exact zeros and ties after centering.
          const at::Tensor x = integers ? at::randint(-2, 3, {B, L, H, N}).to(at::kFloat) : at::randn({B, L, H, N});
          const at::Tensor proj =
              integers ? at::randint(-2, 3, {N, rule.h}).to(at::kFloat) : pat::lsh_projection(N, rule.h, 5 + rule.h);
          expect_cuda_lists(pat::lsh_buckets(cuda(x), cuda(proj), rule.binning, cuda(seq)),
                            pat::lsh_buckets(x, proj, rule.binning, seq), "float32 buckets");
          // bfloat16 on the GPU: the CPU's float32 of the same values.
          const at::Tensor xb = x.to(at::kBFloat16), pb = proj.to(at::kBFloat16);
          expect_cuda_lists(pat::lsh_buckets(cuda(xb), cuda(pb), rule.binning, cuda(seq)),
                            pat::lsh_buckets(xb.to(at::kFloat), pb.to(at::kFloat), rule.binning, seq),
                            "bfloat16 buckets");
        }
}

// The projection kernel's other paths: more than one pass of 512 (position, head) rows per tile
// (the first H = 12 pass ends inside a position), rows longer than one staged chunk (N = 40, 64,
// 70), N not a multiple of the 16-byte vector (element-wise copies), x a view of wider rows
// (padded heads), more than 8 columns (h = 12) and h > 64 (project_kernel).
TEST(PatternCuda, LshBucketsShapesEqualCpu) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(212);
  const int64_t B = 2;
  struct Case {
    int64_t H, N, pad;  // x = the first N of rows of N + pad
    pat::Binning binning;
    int64_t h;
  };
  for (Case c : {Case{12, 40, 0, pat::Binning::kSign, 5}, Case{16, 13, 0, pat::Binning::kSign, 3},
                 Case{9, 64, 8, pat::Binning::kSign, 7}, Case{5, 70, 3, pat::Binning::kArgmax, 12},
                 Case{2, 24, 0, pat::Binning::kArgmax, 65}})
    for (int64_t L : {130, 1025})
      for (bool packed : {false, true}) {
        SCOPED_TRACE("L=" + std::to_string(L) + " H=" + std::to_string(c.H) + " N=" + std::to_string(c.N) +
                     " pad=" + std::to_string(c.pad) + " h=" + std::to_string(c.h) +
                     " packed=" + std::to_string(packed));
        const at::Tensor seq = packing(B, L, packed);
        const at::Tensor wide = at::randn({B, L, c.H, c.N + c.pad});
        const at::Tensor x = wide.narrow(3, 0, c.N);
        const at::Tensor proj = pat::lsh_projection(c.N, c.h, 9 + c.h);
        expect_cuda_lists(pat::lsh_buckets(cuda(wide).narrow(3, 0, c.N), cuda(proj), c.binning, cuda(seq)),
                          pat::lsh_buckets(x, proj, c.binning, seq), "float32 buckets");
        const at::Tensor wb = wide.to(at::kBFloat16), pb = proj.to(at::kBFloat16);
        expect_cuda_lists(pat::lsh_buckets(cuda(wb).narrow(3, 0, c.N), cuda(pb), c.binning, cuda(seq)),
                          pat::lsh_buckets(wb.narrow(3, 0, c.N).to(at::kFloat), pb.to(at::kFloat), c.binning, seq),
                          "bfloat16 buckets");
      }
}

// Long rows (1025 tiles of 64 positions, one and two groups of heads): the carries of the column
// sums across many tiles (carry_kernel's runs of tiles), with no sequence start after position 0,
// a few, and starts inside most tiles; argmax and sign bits, h <= 8 and h = 12. Run twice: the
// result does not change between calls. (Written with a one-pass variant of the kernels, which
// measured slower and was not kept: experiments/lsh-onepass.patch.)
TEST(PatternCuda, LshBucketsLongRowsEqualCpu) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(213);
  const int64_t L = 65537;
  struct Case {
    int64_t B, H, N;
    pat::Binning binning;
    int64_t h;
  };
  for (Case c : {Case{1, 16, 32, pat::Binning::kSign, 8}, Case{2, 3, 8, pat::Binning::kArgmax, 5},
                 Case{1, 4, 16, pat::Binning::kSign, 12}})
    for (double rate : {0.0, 0.0002, 0.05})
      for (bool integers : {false, true}) {
        SCOPED_TRACE("B=" + std::to_string(c.B) + " H=" + std::to_string(c.H) + " h=" + std::to_string(c.h) +
                     " start rate=" + std::to_string(rate) + " integers=" + std::to_string(integers));
        const at::Tensor seq = rate > 0 ? random_packing(c.B, L, rate) : at::Tensor();
        const at::Tensor x = integers ? at::randint(-2, 3, {c.B, L, c.H, c.N}).to(at::kFloat)
                                      : at::randn({c.B, L, c.H, c.N}) + 2 * at::randn({c.N});
        const at::Tensor proj =
            integers ? at::randint(-2, 3, {c.N, c.h}).to(at::kFloat) : pat::lsh_projection(c.N, c.h, 31 + c.h);
        const at::Tensor xb = x.to(at::kBFloat16), pb = proj.to(at::kBFloat16);
        const at::Tensor want = pat::lsh_buckets(xb.to(at::kFloat), pb.to(at::kFloat), c.binning, seq);
        const at::Tensor xg = cuda(xb), pg = cuda(pb), sg = cuda(seq);
        const at::Tensor first = pat::lsh_buckets(xg, pg, c.binning, sg);
        expect_cuda_lists(first, want, "bfloat16 buckets");
        const at::Tensor second = pat::lsh_buckets(xg, pg, c.binning, sg);
        EXPECT_TRUE(at::equal(second, first)) << "a second call: " << first_difference(second.cpu(), first.cpu());
        if (c.h == 8)
          expect_cuda_lists(pat::lsh_buckets(cuda(x), cuda(proj), c.binning, sg),
                            pat::lsh_buckets(x, proj, c.binning, seq), "float32 buckets");
      }
}

TEST(PatternCuda, LshEqualCpu) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(221);
  const int64_t B = 2, H = 2, N = 8;
  struct Rule {
    pat::Binning binning;
    int64_t h;
  };
  // 2^20 and 2^30 buckets: int64 sort keys (nb·L > INT32_MAX) at the longer lengths.
  for (Rule rule : {Rule{pat::Binning::kSign, 3}, Rule{pat::Binning::kArgmax, 5}, Rule{pat::Binning::kSign, 20},
                    Rule{pat::Binning::kSign, 30}})
    for (int64_t L : kLengths)
      for (int64_t k : kCudaKs)
        for (bool packed : {false, true}) {
          SCOPED_TRACE(trace(L, k, packed) + " h=" + std::to_string(rule.h));
          const at::Tensor seq = packing(B, L, packed);
          const at::Tensor q = at::randn({B, L, H, N});
          const at::Tensor kk =
              at::where(at::rand({B, L, H, 1}) < 0.5, q + 0.1 * at::randn({B, L, H, N}), at::randn({B, L, H, N}));
          const at::Tensor proj = pat::lsh_projection(N, rule.h, 77 + k);
          const pat::KeyLists want = pat::lsh(q, kk, k, proj, rule.binning, seq);
          const pat::KeyLists got = pat::lsh(cuda(q), cuda(kk), k, cuda(proj), rule.binning, cuda(seq));
          expect_cuda_lists(got.idx, want.idx, "LSH lists");
          expect_cuda_lists(got.q_order, want.q_order, "LSH q_order");
          // The model uploads proj already in float64: the same lists.
          const pat::KeyLists got64 =
              pat::lsh(cuda(q), cuda(kk), k, cuda(proj.to(at::kDouble)), rule.binning, cuda(seq));
          expect_cuda_lists(got64.idx, want.idx, "LSH lists, float64 proj");
          expect_cuda_lists(got64.q_order, want.q_order, "LSH q_order, float64 proj");
        }
}

TEST(PatternCuda, TopKPrefixEqualCpu) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(231);
  const int64_t B = 2, H = 2;
  for (bool ties : {false, true})
    for (int64_t L : kLengths)
      for (int64_t k : {1, 2, 7, 32, 63, 64, 65, 100, 2000})
        for (bool packed : {false, true}) {
          SCOPED_TRACE(trace(L, k, packed) + " ties=" + std::to_string(ties));
          const at::Tensor seq = packing(B, L, packed);
          // ties: integer scores 0..3, so most comparisons are ties.
          const at::Tensor scores = ties ? at::randint(0, 4, {B, L, H}).to(at::kFloat) : at::randn({B, L, H});
          const at::Tensor want = pat::top_k_prefix(scores, k, seq).idx;
          const pat::KeyLists got = pat::top_k_prefix(cuda(scores), k, cuda(seq));
          EXPECT_FALSE(got.q_order.defined());
          expect_cuda_lists(got.idx, want, "float32 Key Selection");
          // bfloat16 scores of integers are the same numbers.
          if (ties)
            expect_cuda_lists(pat::top_k_prefix(cuda(scores.to(at::kBFloat16)), k, cuda(seq)).idx, want, "bfloat16");
        }
}

TEST(PatternCuda, TopKPrefixSpecialValuesAndLongRows) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  // NaN ranks as -inf (and ties with it), -0 ties with +0.
  const at::Tensor s =
      at::tensor({NAN, 1.f, NAN, -5.f, -INFINITY, 0.f, -0.f, 0.f, 3.f, -INFINITY, NAN, 2.f}, at::kFloat)
          .view({1, 12, 1});
  for (int64_t k : {1, 2, 3, 5})
    expect_cuda_lists(pat::top_k_prefix(cuda(s), k, at::Tensor()).idx, pat::top_k_prefix(s, k, at::Tensor()).idx,
                      "special values k=" + std::to_string(k));
  // Long rows: many blocks of 64 queries and super blocks of 32 blocks, sequences across them.
  torch::manual_seed(232);
  const int64_t L = 65537;
  for (bool packed : {false, true})
    for (int64_t k : {3, 64}) {
      SCOPED_TRACE(trace(L, k, packed));
      const at::Tensor seq = packed ? random_packing(1, L, 0.0005) : at::Tensor();
      const at::Tensor scores = at::randint(0, 50, {1, L, 2}).to(at::kFloat);
      expect_cuda_lists(pat::top_k_prefix(cuda(scores), k, cuda(seq)).idx, pat::top_k_prefix(scores, k, seq).idx,
                        "Key Selection at 65537");
    }
  // k too large for the kernels' shared memory (and < L): served by the CPU loop, still on the GPU.
  const at::Tensor big = at::randn({1, hax::patterns::kTopKMaxK + 100, 1});
  expect_cuda_lists(pat::top_k_prefix(cuda(big), hax::patterns::kTopKMaxK + 1, at::Tensor()).idx,
                    pat::top_k_prefix(big, hax::patterns::kTopKMaxK + 1, at::Tensor()).idx, "k above the kernels'");
}

TEST(PatternCuda, MergeAndKeyCountsEqualCpu) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(241);
  const int64_t B = 2, H = 3, N = 8;
  for (int64_t L : kLengths)
    for (bool packed : {false, true}) {
      SCOPED_TRACE(trace(L, 0, packed));
      const at::Tensor seq = packing(B, L, packed);
      const pat::KeyLists a = pat::lsh(at::randn({B, L, H, N}), at::randn({B, L, H, N}), 32,
                                       pat::lsh_projection(N, 3, 9), pat::Binning::kSign, seq);
      const pat::KeyLists b = pat::top_k_prefix(at::randn({B, L, H}), 7, seq);
      const pat::KeyLists wide = pat::sliding_window(B, H, L, 300, seq);  // past the staged kernel's tile
      auto on_gpu = [](const pat::KeyLists& l) { return pat::KeyLists{cuda(l.idx), cuda(l.q_order)}; };
      for (const auto& [x, y] :
           {std::make_pair(a, b), std::make_pair(b, a), std::make_pair(a, a), std::make_pair(wide, b)}) {
        const pat::KeyLists got = pat::merge(on_gpu(x), on_gpu(y));
        const pat::KeyLists want = pat::merge(x, y);
        expect_cuda_lists(got.idx, want.idx, "merge");
        EXPECT_EQ(got.q_order.defined(), want.q_order.defined());
        if (want.q_order.defined()) expect_cuda_lists(got.q_order, want.q_order, "merge q_order");
        expect_cuda_lists(pat::key_counts(got), pat::key_counts(want), "key_counts");
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Key Selection's intervals on the GPU (top_k_intervals.cu) and the overflowing rows' merge that
// reads them.

namespace {

// The 64-bit comparison key of Key Selection's kernels (patterns/cuda/top_k_keys.cuh), on the CPU.
uint64_t score_key_cpu(float v, int64_t pos) {
  if (std::isnan(v)) v = -INFINITY;
  if (v == 0.f) v = 0.f;
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((uint64_t)u << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)pos);
}

// Scores (B, L, H) float32 of a kind: 0 random, 1 integers 0..3 with 5% NaN (mostly ties), 2
// rising (every key enters), 3 falling (the first k of each sequence enter, none leaves).
at::Tensor interval_scores(int kind, int64_t B, int64_t L, int64_t H) {
  if (kind == 0) return at::randn({B, L, H});
  if (kind == 1) {
    at::Tensor s = at::randint(0, 4, {B, L, H}).to(at::kFloat);
    return s.masked_fill_(at::rand({B, L, H}) < 0.05, NAN);
  }
  const at::Tensor up = at::arange(L, at::kFloat).view({1, L, 1}) + at::arange(H, at::kFloat).view({1, 1, H});
  return (kind == 2 ? up : -up).expand({B, L, H}).contiguous();
}

// GPU intervals `got` of scores (B, L, H) float32 (the values the GPU saw) equal the CPU loop's;
// with the kernels (k < L, k <= kTopKMaxK) also the extras: leave_at from the CPU's entries, the
// prefix lists from top_k_prefix's list of each block's query t0 - 1, start from seq.
void expect_intervals_equal_cpu(const pat::KeyIntervals& got, const at::Tensor& scores, int64_t k,
                                const at::Tensor& seq) {
  const int64_t B = scores.size(0), L = scores.size(1), H = scores.size(2);
  const pat::KeyIntervals want = pat::top_k_prefix_intervals(scores, k, seq);
  EXPECT_EQ(got.k, k);
  expect_cuda_lists(got.count, want.count, "count");
  const bool kernels = k < L && k <= hax::patterns::kTopKMaxK;
  if (!kernels) {  // the CPU loop's, moved to the GPU
    expect_cuda_lists(got.key, want.key, "key (CPU loop)");
    expect_cuda_lists(got.leave, want.leave, "leave (CPU loop)");
    EXPECT_FALSE(got.leave_at.defined() || got.prefix.defined() || got.start.defined()) << "extras from the CPU loop";
    return;
  }
  // key and leave hold L slots: the CPU's entries, then -1.
  const int64_t M = want.key.size(2);
  ASSERT_LE(M, L);
  at::Tensor key = at::full({B, H, L}, -1, at::kInt), leave = at::full({B, H, L}, -1, at::kInt);
  key.narrow(2, 0, M).copy_(want.key), leave.narrow(2, 0, M).copy_(want.leave);
  expect_cuda_lists(got.key, key, "key");
  expect_cuda_lists(got.leave, leave, "leave");
  // leave_at: each entering key's leave, every other position itself.
  at::Tensor leave_at = at::arange(L, at::kInt).view({1, 1, L}).repeat({B, H, 1});
  {
    auto la = leave_at.accessor<int32_t, 3>();
    const auto c = want.count.accessor<int32_t, 2>();
    const auto kk = want.key.accessor<int32_t, 3>();
    const auto lv = want.leave.accessor<int32_t, 3>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < c[b][h]; ++t) la[b][h][kk[b][h][t]] = lv[b][h][t];
  }
  expect_cuda_lists(got.leave_at, leave_at, "leave_at");
  // start: the first position of each position's sequence.
  const SeqIds ids(seq, B, L);
  at::Tensor start = at::empty({B, L}, at::kInt);
  auto st = start.accessor<int32_t, 2>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i) st[b][i] = i > 0 && ids.same(b, i - 1, i) ? st[b][i - 1] : (int32_t)i;
  expect_cuda_lists(got.start, start, "start");
  // prefix: block blk's is the list of query 64 blk - 1 as keys, descending, 0-padded (none before block 0).
  const int64_t nblk = (L + 63) / 64;
  ASSERT_TRUE(got.prefix.defined());
  ASSERT_EQ(got.prefix.sizes(), (at::IntArrayRef{B, H, nblk, k}));
  EXPECT_EQ(got.prefix.scalar_type(), at::kLong);
  const at::Tensor lists = pat::top_k_prefix(scores, k, seq).idx;
  at::Tensor prefix = at::zeros({B, H, nblk, k}, at::kLong);
  {
    auto pa = prefix.accessor<int64_t, 4>();
    const auto li = lists.accessor<int32_t, 4>();
    const auto sc = scores.accessor<float, 3>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t blk = 1; blk < nblk; ++blk) {
          std::vector<uint64_t> keys;
          for (int64_t t = 0; t < k && li[b][h][64 * blk - 1][t] >= 0; ++t) {
            const int64_t j = li[b][h][64 * blk - 1][t];
            keys.push_back(score_key_cpu(sc[b][j][h], j));
          }
          std::sort(keys.rbegin(), keys.rend());
          for (size_t t = 0; t < keys.size(); ++t) pa[b][h][blk][t] = (int64_t)keys[t];
        }
  }
  const at::Tensor gp = got.prefix.cpu();
  EXPECT_TRUE(at::equal(gp, prefix)) << "prefix: " << first_difference(gp, prefix);
}

}  // namespace

// bfloat16 CUDA scores with k above the kernels' kTopKMaxK go to the CPU loop, which reads them as
// float32 (it read bfloat16 memory as float32 before and failed): the lists of their float32
// values, on the device.
TEST(PatternCuda, TopKPrefixPastTheKernelsLimitTakesBf16Scores) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(252);
  const int64_t L = pat::kTopKMaxK + 97, k = pat::kTopKMaxK + 1;
  const at::Tensor scores = at::randn({1, L, 1}).to(at::kBFloat16);
  const at::Tensor got = pat::top_k_prefix(scores.to(at::Device(at::kCUDA, 0)), k, at::Tensor()).idx;
  const at::Tensor want = pat::top_k_prefix(scores.to(at::kFloat), k, at::Tensor()).idx;
  ASSERT_TRUE(got.is_cuda());
  EXPECT_TRUE(at::equal(got.cpu(), want));
}

// The kernels' intervals equal the CPU loop's exactly, with their extras: awkward lengths (one
// position: the CPU loop; 5000: 79 blocks, three super blocks of 32), k on the register scans
// (<= 32) and the shared-memory ones (100), packed rows, random, tied-with-NaN, rising (every key
// enters: count = L) and falling scores, float32 and bfloat16.
TEST(PatternCuda, TopKIntervalsEqualCpu) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(251);
  const int64_t B = 2, H = 2;
  for (int kind : {0, 1, 2, 3})
    for (int64_t L : {1, 63, 97, 1025, 5000})
      for (int64_t k : {1, 13, 32, 100})
        for (bool packed : {false, true}) {
          SCOPED_TRACE(trace(L, k, packed) + " kind=" + std::to_string(kind));
          const at::Tensor seq = packing(B, L, packed);
          const at::Tensor scores = interval_scores(kind, B, L, H);
          {
            SCOPED_TRACE("float32");
            expect_intervals_equal_cpu(pat::top_k_prefix_intervals(cuda(scores), k, cuda(seq)), scores, k, seq);
          }
          {
            SCOPED_TRACE("bfloat16");
            const at::Tensor sb = scores.to(at::kBFloat16);
            expect_intervals_equal_cpu(pat::top_k_prefix_intervals(cuda(sb), k, cuda(seq)), sb.to(at::kFloat), k, seq);
          }
        }
}

// merge_overflow_rows with Key Selection as intervals equals its form over top_k_prefix's lists
// on the rows of the overflowing blocks (a random mix of blocks by count), with an LSH band, for
// packed and unpacked rows; with the device-value checks on (the other rows -1 in both) on every row.
TEST(PatternCuda, TopKIntervalsMergeOverflowRowsEqualLists) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(252);
  const int64_t B = 2, H = 2, N = 8;
  for (int64_t L : {97, 1025, 3000})
    for (int64_t k : {1, 13, 32})
      for (int64_t Ka : {16, 32})
        for (bool packed : {false, true})
          for (bool ties : {false, true}) {
            SCOPED_TRACE(trace(L, k, packed) + " Ka=" + std::to_string(Ka) + " ties=" + std::to_string(ties));
            const at::Tensor seq = cuda(packing(B, L, packed));
            const at::Tensor q = cuda(at::randn({B, L, H, N})), kk = cuda(at::randn({B, L, H, N}));
            const pat::LshBand band =
                pat::lsh_band(q, kk, Ka, cuda(pat::lsh_projection(N, 3, 7 + k)), pat::Binning::kSign, seq);
            const at::Tensor scores = cuda(interval_scores(ties ? 1 : 0, B, L, H));
            const pat::KeyIntervals iv = pat::top_k_prefix_intervals(scores, k, seq);
            const pat::KeyLists lists{pat::top_k_prefix(scores, k, seq).idx, at::Tensor()};
            const int64_t nblk = (L + 63) / 64;
            const at::Tensor count =
                at::where(at::rand({B, H, nblk}) < 0.5, at::full({}, -1, at::kInt), at::randint(0, 300, {B, H, nblk}))
                    .to(at::kInt);
            // The rows of the negative blocks' ranks.
            const at::Tensor neg_rank = (count < 0).repeat_interleave(64, 2).narrow(2, 0, L);
            const at::Tensor rows =
                at::zeros({B, H, L}, at::kBool).scatter_(2, band.q_order.cpu().to(at::kLong), neg_rank);
            ASSERT_TRUE(rows.any().item<bool>());
            const at::Tensor got = pat::merge_overflow_rows(band, Ka, iv, cuda(count)).cpu();
            const at::Tensor want = pat::merge_overflow_rows(band, Ka, lists, cuda(count)).cpu();
            ASSERT_EQ(got.sizes(), (at::IntArrayRef{B, H, L, Ka + k}));
            const at::Tensor g = got.index({rows}), w = want.index({rows});
            EXPECT_TRUE(at::equal(g, w)) << "overflowing rows: " << first_difference(g, w);
            ScopedSwitch checks(hax::ops::check_device_values, hax::ops::set_check_device_values, true);
            const at::Tensor gc = pat::merge_overflow_rows(band, Ka, iv, cuda(count)).cpu();
            const at::Tensor wc = pat::merge_overflow_rows(band, Ka, lists, cuda(count)).cpu();
            EXPECT_TRUE(at::equal(gc, wc)) << "every row, checked values: " << first_difference(gc, wc);
          }
  // Argument errors with CUDA intervals: k above a lane per key, a block_count of the wrong shape.
  const at::Tensor scores = cuda(at::randn({1, 200, 2}));
  const at::Tensor qk = cuda(at::randn({1, 200, 2, N}));
  const pat::LshBand band = pat::lsh_band(qk, qk, 8, cuda(pat::lsh_projection(N, 3, 1)), pat::Binning::kSign, {});
  const at::Tensor count = cuda(at::full({1, 2, 4}, -1, at::kInt));
  const pat::KeyIntervals k40 = pat::top_k_prefix_intervals(scores, 40, at::Tensor());
  ASSERT_TRUE(k40.leave_at.defined());
  expect_usage_error([&] { pat::merge_overflow_rows(band, 8, k40, count); }, "b.k = 40 must be in [1, 32]");
  const pat::KeyIntervals k4 = pat::top_k_prefix_intervals(scores, 4, at::Tensor());
  expect_usage_error([&] { pat::merge_overflow_rows(band, 8, k4, cuda(at::full({1, 2, 3}, -1, at::kInt))); },
                     "block_count");
  expect_usage_error([&] { pat::merge_overflow_rows(band, 8, k4, count.to(at::kLong)); }, "block_count must be int32");
  pat::KeyIntervals bad = k4;
  bad.prefix = bad.prefix.narrow(3, 0, 3);
  expect_usage_error([&] { pat::merge_overflow_rows(band, 8, bad, count); }, "b.prefix");
}
