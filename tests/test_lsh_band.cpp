// LSH in its band form: patterns::lsh_band against lsh()'s lists (the same keys for every query,
// and the key side by brute force), ops::permute_rows, causal attention with a band against the
// dense reference, lsh_band_attention against sparse_attention on lsh()'s lists (float64), and
// exclude_band against exclude on lists. On a CUDA device: the band equals the CPU's exactly, and
// the band attention matches the CPU (float32) and the float64 definition (bfloat16).
#include <cmath>
#include <limits>
#include <vector>

#include "cuda_harness.h"
#include "layers/lsh_attention.h"
#include "ops/attention/attention.h"
#include "ops/causal_attention/causal_attention.h"
#include "ops/permute_rows/permute_rows.h"
#include "patterns/cuda_paths.h"
#include "patterns/pattern.h"

using namespace hax::testing;
namespace pat = hax::patterns;
using hax::ops::causal_attention;
using hax::ops::causal_attention_reference;
using hax::ops::permute_rows;

namespace {

// Every row of a (B, H, L) int32 tensor is non-decreasing.
void expect_rows_non_decreasing(const at::Tensor& t, const char* what) {
  if (t.size(-1) < 2) return;
  const at::Tensor d = t.narrow(-1, 1, t.size(-1) - 1) - t.narrow(-1, 0, t.size(-1) - 1);
  EXPECT_GE(d.min().item<int64_t>(), 0) << what << " decreases somewhere";
}

// The band describes exactly lsh()'s lists, and its key side is the transpose of its query side.
void expect_band_equals_lists(const pat::LshBand& band, const pat::KeyLists& lists) {
  const at::Tensor bd = band.band.cpu(), qo = band.q_order.cpu(), ko = band.k_order.cpu(), idx = lists.idx.cpu();
  const int64_t B = idx.size(0), H = idx.size(1), L = idx.size(2), K = idx.size(3);
  ASSERT_TRUE(at::equal(qo, lists.q_order.cpu())) << "q_order differs from lsh()'s";
  for (int k = 0; k < 4; ++k) expect_rows_non_decreasing(bd[k], "a part of the band");
  auto a = bd.accessor<int32_t, 4>();
  auto q = qo.accessor<int32_t, 3>();
  auto o = ko.accessor<int32_t, 3>();
  auto x = idx.accessor<int32_t, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < L; ++t) {
        const int64_t i = q[b][h][t], first = a[0][b][h][t], last = a[1][b][h][t];
        std::vector<int32_t> from_band, from_lists;
        for (int64_t s = first; s <= last; ++s) from_band.push_back(o[b][h][s]);
        for (int64_t c = 0; c < K && x[b][h][i][c] >= 0; ++c) from_lists.push_back(x[b][h][i][c]);
        ASSERT_EQ(from_band, from_lists) << "b " << b << " h " << h << " sorted query " << t << " (position " << i << ")";
      }
      for (int64_t s = 0; s < L; ++s) {  // brute force: the sorted queries whose range holds s
        int64_t lo = L, hi = -1;
        for (int64_t t = 0; t < L; ++t)
          if (a[0][b][h][t] <= s && s <= a[1][b][h][t]) lo = std::min(lo, t), hi = std::max(hi, t);
        if (hi < 0) {
          EXPECT_GT(a[2][b][h][s], a[3][b][h][s]) << "sorted key " << s << " is seen by no query";
        } else {
          EXPECT_EQ(a[2][b][h][s], lo) << "sorted key " << s;
          EXPECT_EQ(a[3][b][h][s], hi) << "sorted key " << s;
        }
      }
    }
}

// An op case: LSH attention over a band built once from separate hash vectors (so the pattern is
// fixed while q, k, v vary), against sparse_attention on lsh()'s lists of the same vectors.
struct BandCase {
  int64_t B, L, H, D, Dv, K;
  bool packed;
};

OpCase band_case(const BandCase& s) {
  const at::Tensor seq = s.packed ? random_packing(s.B, s.L, 0.02) : at::Tensor();
  const at::Tensor hq = at::randn({s.B, s.L, s.H, 16}, at::kDouble), hk = at::randn({s.B, s.L, s.H, 16}, at::kDouble);
  const at::Tensor proj = pat::lsh_projection(16, 3, 5);
  const pat::LshBand band = pat::lsh_band(hq, hk, s.K, proj, pat::Binning::kSign, seq);
  const pat::KeyLists lists = pat::lsh(hq, hk, s.K, proj, pat::Binning::kSign, seq);
  const double scale = 1.0 / std::sqrt((double)s.D);
  OpCase c;
  c.name = "lsh_band_attention B" + std::to_string(s.B) + " L" + std::to_string(s.L) + " H" + std::to_string(s.H) +
           " D" + std::to_string(s.D) + " Dv" + std::to_string(s.Dv) + " K" + std::to_string(s.K) +
           (s.packed ? " packed" : "");
  c.make_inputs = [s](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    return Tensors{at::randn({s.B, s.L, s.H, s.D}, o).requires_grad_(), at::randn({s.B, s.L, s.H, s.D}, o).requires_grad_(),
                   at::randn({s.B, s.L, s.H, s.Dv}, o).requires_grad_()};
  };
  // lse of a query without keys is -inf on both sides; clamped, so that errors are finite.
  c.op = [band, scale](const Tensors& in) {
    const at::Device dev = in[0].device();
    const pat::LshBand bd{band.q_order.to(dev), band.k_order.to(dev), band.band.to(dev)};
    auto [out, lse] = hax::lsh_band_attention(in[0], in[1], in[2], bd, scale);
    return Tensors{out, lse.clamp_min(-1e4)};
  };
  c.reference = [lists, scale](const Tensors& in) {
    auto [out, lse] = hax::ops::sparse_attention(in[0], in[1], in[2], lists.idx, {}, {}, {}, scale);
    return Tensors{out, lse.squeeze(-1).to(in[0].scalar_type()).clamp_min(-1e4)};
  };
  return c;
}

}  // namespace

TEST(LshBand, EqualsLshLists) {
  torch::manual_seed(70);
  int n = 0;
  for (int64_t L : {1, 63, 97, 1025})
    for (bool packed : {false, true})
      for (pat::Binning binning : {pat::Binning::kSign, pat::Binning::kArgmax}) {
        const int64_t K = std::vector<int64_t>{1, 5, 32}[n++ % 3], B = 2, H = 2, N = 8;
        SCOPED_TRACE("L " + std::to_string(L) + " K " + std::to_string(K) + (packed ? " packed" : ""));
        const at::Tensor q = at::randn({B, L, H, N}), k = at::randn({B, L, H, N});
        const at::Tensor seq = packed ? random_packing(B, L, 0.01) : at::Tensor();
        const at::Tensor proj = pat::lsh_projection(N, binning == pat::Binning::kSign ? 3 : 4, 9);
        expect_band_equals_lists(pat::lsh_band(q, k, K, proj, binning, seq), pat::lsh(q, k, K, proj, binning, seq));
      }
}

TEST(PermuteRows, GatherScatterAndGradients) {
  torch::manual_seed(71);
  for (int64_t L : {1, 63, 97}) {
    const int64_t B = 2, H = 3, D = 5;
    const at::Tensor x = at::randn({B, L, H, D}, at::kDouble).requires_grad_();
    const at::Tensor order = std::get<1>(at::sort(at::rand({B, H, L}), -1)).to(at::kInt);
    const at::Tensor g = permute_rows(x, order, false);
    auto o = order.accessor<int32_t, 3>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < L; ++t)
          ASSERT_TRUE(at::equal(g[b][t][h], x[b][o[b][h][t]][h])) << "gather row " << t;
    EXPECT_TRUE(at::equal(permute_rows(g, order, true), x)) << "scatter undoes gather";
    const at::Tensor w = at::randn_like(g);
    (g * w).sum().backward();
    EXPECT_TRUE(at::equal(x.grad(), permute_rows(w, order, true))) << "the gradient of a gather is a scatter";
  }
  const at::Tensor x = at::randn({1, 4, 1, 2});
  expect_usage_error([&] { permute_rows(x, at::zeros({1, 1, 4}, at::kInt), false); }, "must be a permutation");
  expect_usage_error([&] { permute_rows(x, at::zeros({1, 4, 1}, at::kInt), false); }, "order");
  expect_usage_error([&] { permute_rows(x, at::arange(4).view({1, 1, 4}), false); }, "int32");
}

TEST(CausalAttention, BandMatchesReferenceFloat64) {
  // Bands from LSH (rows with no keys included: K = 1 and many buckets) and the checks on `band`.
  torch::manual_seed(72);
  for (int64_t L : {1, 63, 97, 200})
    for (int64_t K : {1, 9, 64}) {
      const int64_t B = 2, H = 2, D = 16, Dv = 8;
      const pat::LshBand band =
          pat::lsh_band(at::randn({B, L, H, 8}), at::randn({B, L, H, 8}), K, pat::lsh_projection(8, 4, 3), pat::Binning::kSign, {});
      OpCase c;
      c.name = "causal_attention band L" + std::to_string(L) + " K" + std::to_string(K);
      c.make_inputs = [=](at::ScalarType dt) {
        auto o = at::TensorOptions().dtype(dt);
        return Tensors{at::randn({B, L, H, D}, o).requires_grad_(), at::randn({B, L, H, D}, o).requires_grad_(),
                       at::randn({B, L, H, Dv}, o).requires_grad_()};
      };
      c.op = [band](const Tensors& in) {
        auto [out, lse] = causal_attention(in[0], in[1], in[2], {}, 0, 0.3, band.band);
        return Tensors{out, lse.clamp_min(-1e4)};
      };
      c.reference = [band](const Tensors& in) {
        auto [out, lse] = causal_attention_reference(in[0], in[1], in[2], {}, 0, 0.3, band.band);
        return Tensors{out, lse.clamp_min(-1e4)};
      };
      SCOPED_TRACE(c.name);
      expect_matches_reference(c, at::kDouble, 1e-11, 1e-9);
    }
  const at::Tensor q = at::randn({1, 4, 1, 2}), band = at::zeros({4, 1, 1, 4}, at::kInt);
  causal_attention(q, q, q, {}, 0, 1.0, band);  // valid (each query sees key 0)
  expect_usage_error([&] { causal_attention(q, q, q, {}, 2, 1.0, band); }, "window 2 must be 0 with a band");
  expect_usage_error([&] { causal_attention(q, q, q, at::zeros({1, 4}, at::kInt), 0, 1.0, band); },
                     "seq_idx must be absent with a band");
  expect_usage_error([&] { causal_attention(q, q, q, {}, 0, 1.0, at::zeros({4, 1, 1, 3}, at::kInt)); }, "band");
  expect_usage_error([&] { causal_attention(q, q, q, {}, 0, 1.0, at::zeros({4, 1, 1, 4}, at::kLong)); },
                     "band must be int32");
}

TEST(LshBandAttention, EqualsSparseAttentionOnLshListsFloat64) {
  torch::manual_seed(73);
  for (int64_t L : {1, 63, 97, 1025})
    for (bool packed : {false, true}) {
      const OpCase c = band_case({2, L, 2, 16, 8, L > 100 ? 32 : 5, packed});
      SCOPED_TRACE(c.name);
      expect_matches_reference(c, at::kDouble, 1e-11, 1e-9);
    }
}

TEST(LshBand, ExcludeBandEqualsExcludeOnLists) {
  torch::manual_seed(74);
  for (int64_t L : {1, 97, 1025})
    for (bool packed : {false, true}) {
      const int64_t B = 2, H = 2, N = 8;
      const at::Tensor q = at::randn({B, L, H, N}), k = at::randn({B, L, H, N});
      const at::Tensor seq = packed ? random_packing(B, L, 0.01) : at::Tensor();
      const at::Tensor proj = pat::lsh_projection(N, 2, 4);
      const pat::KeyLists ks = pat::top_k_prefix(at::randn({B, L, H}), 16, seq);
      const pat::KeyLists lsh = pat::lsh(q, k, 16, proj, pat::Binning::kSign, seq);
      const pat::KeyLists a = pat::exclude_band(ks, pat::lsh_band(q, k, 16, proj, pat::Binning::kSign, seq));
      EXPECT_TRUE(at::equal(a.idx, pat::exclude(ks, lsh).idx)) << "L " << L;
    }
}

TEST(LshBandCuda, BandEqualsCpu) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(75);
  const at::Device cuda(at::kCUDA, 0);
  for (int64_t L : {1, 63, 97, 1025, 65537})
    for (bool packed : {false, true}) {
      if (L == 65537 && packed) continue;
      const int64_t B = L > 2000 ? 1 : 2, H = 2, N = 16, K = L > 2000 ? 32 : 7;
      SCOPED_TRACE("L " + std::to_string(L) + (packed ? " packed" : ""));
      const at::Tensor q = at::randn({B, L, H, N}), k = at::randn({B, L, H, N});
      const at::Tensor seq = packed ? random_packing(B, L, 0.01) : at::Tensor();
      const at::Tensor proj = pat::lsh_projection(N, 8, 11).to(at::kDouble);
      const pat::LshBand cpu = pat::lsh_band(q, k, K, proj, pat::Binning::kSign, seq);
      const pat::LshBand gpu = pat::lsh_band(q.to(cuda), k.to(cuda), K, proj.to(cuda), pat::Binning::kSign,
                                             seq.defined() ? seq.to(cuda) : seq);
      EXPECT_TRUE(at::equal(gpu.q_order.cpu(), cpu.q_order)) << "q_order";
      EXPECT_TRUE(at::equal(gpu.k_order.cpu(), cpu.k_order)) << "k_order";
      EXPECT_TRUE(at::equal(gpu.band.cpu(), cpu.band)) << "band";
      const pat::KeyLists ks = pat::top_k_prefix(at::randn({B, L, H}), K, seq);
      const pat::KeyLists ks_gpu{ks.idx.to(cuda), at::Tensor()};
      EXPECT_TRUE(at::equal(pat::exclude_band(ks_gpu, gpu).idx.cpu(), pat::exclude_band(ks, cpu).idx))
          << "exclude_band";
    }
}

// LSH's sort keys in 64 bits, which the GPU path takes only when B·H·nb·L > 2^32 (L >= 1M at 16
// heads and 256 buckets), forced at small sizes: the lists, q_order and the band still equal the
// CPU's. One sequence a row with at most 1024 buckets takes the counting sort (its 64-bit keys);
// packed rows, and 2^12 buckets, take the radix sort of 64-bit keys.
TEST(LshBandCuda, WideSortKeysEqualCpu) {
  HAX_REQUIRE_CUDA();
  struct Wide {  // on for this test only, off again however it ends
    Wide() { pat::detail::set_lsh_wide_sort_keys(true); }
    ~Wide() { pat::detail::set_lsh_wide_sort_keys(false); }
  } wide;
  torch::manual_seed(78);
  const at::Device cuda(at::kCUDA, 0);
  for (int64_t L : {1, 63, 97, 1025, 65537})
    for (bool packed : {false, true})
      for (int64_t h : {8, 12}) {
        if (L == 65537 && (packed || h == 12)) continue;
        const int64_t B = L > 2000 ? 1 : 2, H = 2, N = 16, K = L > 2000 ? 32 : 7;
        SCOPED_TRACE("L " + std::to_string(L) + (packed ? " packed" : "") + " h " + std::to_string(h));
        const at::Tensor q = at::randn({B, L, H, N});
        const at::Tensor k =
            at::where(at::rand({B, L, H, 1}) < 0.5, q + 0.1 * at::randn({B, L, H, N}), at::randn({B, L, H, N}));
        const at::Tensor seq = packed ? random_packing(B, L, 0.01) : at::Tensor();
        const at::Tensor seq_gpu = seq.defined() ? seq.to(cuda) : seq;
        const at::Tensor proj = pat::lsh_projection(N, h, 12).to(at::kDouble);
        const pat::LshBand cpu = pat::lsh_band(q, k, K, proj, pat::Binning::kSign, seq);
        const pat::LshBand gpu =
            pat::lsh_band(q.to(cuda), k.to(cuda), K, proj.to(cuda), pat::Binning::kSign, seq_gpu);
        EXPECT_TRUE(at::equal(gpu.q_order.cpu(), cpu.q_order)) << "q_order";
        EXPECT_TRUE(at::equal(gpu.k_order.cpu(), cpu.k_order)) << "k_order";
        EXPECT_TRUE(at::equal(gpu.band.cpu(), cpu.band)) << "band";
        const pat::KeyLists want = pat::lsh(q, k, K, proj, pat::Binning::kSign, seq);
        const pat::KeyLists got = pat::lsh(q.to(cuda), k.to(cuda), K, proj.to(cuda), pat::Binning::kSign, seq_gpu);
        EXPECT_TRUE(at::equal(got.idx.cpu(), want.idx)) << "lists";
        EXPECT_TRUE(at::equal(got.q_order.cpu(), want.q_order)) << "lists' q_order";
      }
}

TEST(JoinByLseCuda, MatchesCpu) {
  // Rows where one set, the other or both are empty (lse -inf) included.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(77);
  for (int64_t Dv : {1, 7, 64})
    for (int64_t L : {1, 97, 1025}) {
      const int64_t B = 2, H = 3;
      OpCase c;
      c.name = "join_by_lse L" + std::to_string(L) + " Dv" + std::to_string(Dv);
      c.make_inputs = [=](at::ScalarType dt) {
        auto o = at::TensorOptions().dtype(dt);
        auto lse = [&] {
          at::Tensor l = at::randn({B, H, L, 1}, o) * 3;
          return l.masked_fill(at::rand({B, H, L, 1}) < 0.2, -std::numeric_limits<double>::infinity());
        };
        return Tensors{at::randn({B, L, H, Dv}, o).requires_grad_(), lse().requires_grad_(),
                       at::randn({B, L, H, Dv}, o).requires_grad_(), lse().requires_grad_()};
      };
      auto run = [](const Tensors& in) {
        const at::ScalarType lt = in[0].is_cuda() ? at::kFloat : in[0].scalar_type();  // CUDA: float32 lse
        return Tensors{hax::ops::join_by_lse(in[0], in[1].to(lt), in[2], in[3].to(lt))};
      };
      c.op = run;
      c.reference = run;
      SCOPED_TRACE(c.name);
      expect_cuda_matches_cpu(c, 1e-6, 1e-5);
      expect_cuda_bf16_close(c, 5e-3);
    }
}

TEST(LshBandCuda, AttentionMatchesCpuFloat32AndBf16) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(76);
  const std::vector<BandCase> cases = {{1, 1, 2, 64, 64, 8, false},   {2, 63, 3, 64, 64, 8, true},
                                       {1, 97, 2, 32, 16, 5, false},  {2, 1025, 2, 64, 64, 32, true},
                                       {1, 1025, 2, 128, 64, 64, false}, {1, 4097, 2, 64, 64, 32, false}};
  for (const BandCase& s : cases) {
    const OpCase c = band_case(s);
    SCOPED_TRACE(c.name);
    expect_cuda_matches_cpu(c, 5e-5, 1e-4);
    expect_cuda_bf16_close(c, 5e-3);
  }
}
