// Sparse attention over query blocks (ops/attention/blocks.h): the conversions between lists and
// blocks against each other and against plain loops, Key Selection's block form against its lists
// (also less an LSH band's keys, and HAX as the band joined with those blocks against the dense
// reference on the merged lists),
// and sparse_attention_blocks against the dense reference on the same keys (float64 on the CPU;
// on a CUDA device, float32 through the lists and bfloat16 on the tile kernels). On a GPU also: the
// tile plan kernel and the query kernels' block form equal the CPU's blocks exactly.
#include <algorithm>
#include <climits>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda_harness.h"
#include "layers/lsh_attention.h"
#include "ops/attention/attention.h"
#include "ops/attention/blocks.h"
#include "ops/check.h"
#include "patterns/pattern.h"

using namespace hax::testing;
namespace pat = hax::patterns;
using hax::ops::TileBlocks;

namespace {

// Lists with some entries dropped (-1), then put back into the canonical form: ascending, -1 after.
at::Tensor thinned(const at::Tensor& idx, double drop) {
  at::Tensor x = idx.masked_fill(at::rand(idx.sizes()) < drop, -1);
  x = at::where(x < 0, at::full({}, INT_MAX, at::kInt), x);
  x = std::get<0>(x.sort(-1));
  return at::where(x == INT_MAX, at::full({}, -1, at::kInt), x);
}

// Two block forms are equal: counts, keys, and the mask of every tile a block uses.
void expect_blocks_equal(const TileBlocks& a, const TileBlocks& b) {
  const at::Tensor ca = a.count.cpu(), cb = b.count.cpu();
  ASSERT_TRUE(at::equal(ca, cb)) << "counts differ";
  const at::Tensor fits = ca.ge(0);
  EXPECT_TRUE(at::equal(a.keys.cpu().index({fits}), b.keys.cpu().index({fits}))) << "keys differ";
  const at::Tensor ma = a.mask.cpu(), mb = b.mask.cpu();
  const at::Tensor tiles = (ca + 63).div(64, "floor").unsqueeze(-1);  // tiles used per block
  const at::Tensor used = at::arange(hax::ops::kAttentionTilesPerBlock, at::kInt).view({1, 1, 1, -1}) < tiles;
  const at::Tensor sel = used.logical_and(fits.unsqueeze(-1));  // (B, H, nblk, 8)
  EXPECT_TRUE(at::equal(ma.index({sel}), mb.index({sel}))) << "masks differ";
  EXPECT_EQ(a.max_keys, b.max_keys);
}

}  // namespace

TEST(TileBlocks, RoundTripsLists) {
  torch::manual_seed(91);
  for (int64_t L : {1, 63, 97, 1025})
    for (int64_t K : {1, 7, 40}) {
      SCOPED_TRACE("L " + std::to_string(L) + " K " + std::to_string(K));
      const int64_t B = 2, H = 2;
      const at::Tensor idx = thinned(pat::top_k_prefix(at::randn({B, L, H}), K, random_packing(B, L, 0.02)).idx, 0.2);
      const TileBlocks bl = hax::ops::tile_blocks_from_lists(idx, L);
      EXPECT_EQ(bl.count.min().item<int32_t>() >= 0, true);
      EXPECT_TRUE(at::equal(hax::ops::tile_blocks_to_lists(bl, L), idx));
    }
}

TEST(TileBlocks, OverflowingBlocksAreMarkedAndRefused) {
  torch::manual_seed(92);
  const int64_t B = 1, H = 1, L = 1025, K = 100;
  at::Tensor idx = at::randint(0, L, {B, H, L, K}, at::kInt);  // ~100 · 64 distinct keys a block
  const TileBlocks bl = hax::ops::tile_blocks_from_lists(idx, L);
  EXPECT_EQ(bl.count.narrow(2, 0, 16).max().item<int32_t>(), -1);  // full blocks overflow, the last (1 query) fits
  EXPECT_GE(bl.count[0][0][16].item<int32_t>(), 1);
  expect_usage_error([&] { hax::ops::tile_blocks_to_lists(bl, L); }, "key count is -1");
}

TEST(TileBlocks, TopKPrefixBlocksEqualItsLists) {
  torch::manual_seed(93);
  for (int64_t L : {1, 63, 97, 1025})
    for (int64_t k : {1, 5, 64, 448}) {
      if (k >= L && L > 1) continue;
      SCOPED_TRACE("L " + std::to_string(L) + " k " + std::to_string(k));
      const at::Tensor scores = at::randn({2, L, 3}), seq = random_packing(2, L, 0.03);
      const TileBlocks bl = pat::top_k_prefix_blocks(scores, k, seq);
      EXPECT_EQ(bl.max_keys, k);
      EXPECT_TRUE(at::equal(hax::ops::tile_blocks_to_lists(bl, L), pat::top_k_prefix(scores, k, seq).idx));
    }
  expect_usage_error([] { pat::top_k_prefix_blocks(at::randn({1, 1025, 1}), 449, {}); }, "must be at most 448");
}

TEST(TileBlocks, ChecksItsArguments) {
  const at::Tensor q = at::randn({1, 97, 2, 8}, at::kDouble);
  TileBlocks bl = hax::ops::tile_blocks_from_lists(pat::top_k_prefix(at::randn({1, 97, 2}), 4, {}).idx, 97);
  TileBlocks wrong = bl;
  wrong.count = bl.count.narrow(2, 0, 1);
  expect_usage_error([&] { hax::ops::sparse_attention_blocks(q, q, q, wrong, {}, 1.0); }, "blocks.count");
  wrong = bl;
  wrong.mask = bl.mask.to(at::kInt);
  expect_usage_error([&] { hax::ops::sparse_attention_blocks(q, q, q, wrong, {}, 1.0); }, "blocks.mask must be int64");
  expect_usage_error([&] { hax::ops::sparse_attention_blocks(q, q, q, bl, {}, -1.0); }, "scale");
}

namespace {

struct BlockCase {
  int64_t B, L, H, D, Dv, K;
  bool packed;
};

// sparse_attention_blocks over Key Selection's block form against the dense reference over its
// lists, with a per-key bias; both outputs (out, lse) get cotangents.
OpCase block_case(const BlockCase& s) {
  OpCase c;
  c.name = "blocks B" + std::to_string(s.B) + " L" + std::to_string(s.L) + " H" + std::to_string(s.H) + " D" +
           std::to_string(s.D) + " Dv" + std::to_string(s.Dv) + " K" + std::to_string(s.K) + (s.packed ? " packed" : "");
  const at::Tensor seq = s.packed ? random_packing(s.B, s.L, 0.02) : at::Tensor();
  c.make_inputs = [=](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    return Tensors{at::randn({s.B, s.L, s.H, s.D}, o).requires_grad_(), at::randn({s.B, s.L, s.H, s.D}, o).requires_grad_(),
                   at::randn({s.B, s.L, s.H, s.Dv}, o).requires_grad_(), at::randn({s.B, s.L, s.H}, o),
                   (at::randn({s.B, s.H, s.L}, o) * 0.5).requires_grad_()};
  };
  const double scale = 1.0 / std::sqrt((double)s.D);
  auto seq_on = [seq](const at::Tensor& like) { return seq.defined() ? seq.to(like.device()) : seq; };
  c.op = [=](const Tensors& in) {
    const TileBlocks bl = pat::top_k_prefix_blocks(in[3].detach(), s.K, seq_on(in[3]));
    auto [out, lse] = hax::ops::sparse_attention_blocks(in[0], in[1], in[2], bl, in[4], scale);
    return Tensors{out, lse.to(out.scalar_type())};
  };
  c.reference = [=](const Tensors& in) {
    const at::Tensor idx = pat::top_k_prefix(in[3].detach(), s.K, seq_on(in[3])).idx;
    auto [out, lse] = hax::ops::sparse_attention_reference(in[0], in[1], in[2], idx, in[4], {}, scale);
    return Tensors{out, lse};
  };
  return c;
}

const std::vector<BlockCase> kCases = {{1, 1, 1, 16, 16, 1, false},    {2, 63, 2, 64, 64, 8, true},
                                       {1, 97, 3, 32, 16, 5, false},   {2, 1025, 2, 64, 64, 64, true},
                                       {1, 1025, 2, 128, 64, 100, false}, {1, 4097, 2, 64, 64, 32, false}};

}  // namespace

// HAX's union from LSH's band and Key Selection's intervals (patterns::hax_blocks) equals the block
// form of the merged lists in LSH's query order: random queries and keys (awkward sizes, packed
// rows), random scores; and with scores that rise (Key Selection = the most recent keys), whose
// blocks of far-apart queries overflow. Then its checks.
TEST(TileBlocks, HaxBlocksFromBandAndIntervalsEqualMergedLists) {
  torch::manual_seed(92);
  for (int64_t L : {1, 63, 97, 1025})
    for (int64_t K : {1, 13, 32})
      for (bool packed : {false, true})
        for (bool rising : {false, true}) {
          SCOPED_TRACE("L " + std::to_string(L) + " K " + std::to_string(K) + (packed ? " packed" : "") +
                       (rising ? " rising scores" : ""));
          const int64_t B = 2, H = 2, N = 16;
          const at::Tensor seq = packed ? random_packing(B, L, 0.02) : at::Tensor();
          const at::Tensor q = at::randn({B, L, H, N}), k = at::randn({B, L, H, N});
          const at::Tensor proj = pat::lsh_projection(N, 3, 6);
          const at::Tensor scores = rising ? at::arange(L, at::kFloat).view({1, L, 1}).expand({B, L, H}).contiguous()
                                           : at::randn({B, L, H});
          const pat::KeyLists lsh = pat::lsh(q, k, K, proj, pat::Binning::kSign, seq);
          const pat::LshBand band = pat::lsh_band(q, k, K, proj, pat::Binning::kSign, seq);
          const pat::KeyLists ks = pat::top_k_prefix(scores, K, seq);
          const pat::KeyIntervals iv = pat::top_k_prefix_intervals(scores, K, seq);
          const at::Tensor merged = pat::merge(lsh, ks).idx;  // (B, H, L, 2K) by query position
          const at::Tensor ranked = merged.gather(2, band.q_order.to(at::kLong).unsqueeze(-1).expand_as(merged));
          const TileBlocks want = hax::ops::tile_blocks_from_lists(ranked.contiguous(), L);
          const TileBlocks got = pat::hax_blocks(band, K, iv, K);
          expect_blocks_equal(got, want);
          if (rising && !packed && L == 1025 && K == 32) {
            EXPECT_TRUE(got.count.lt(0).any().item<bool>()) << "no block overflowed";
          }
        }
  // Checks: a band run past L, an interval that leaves before it enters.
  const int64_t L = 97;
  const at::Tensor q = at::randn({1, L, 1, 8});
  const pat::LshBand band = pat::lsh_band(q, q, 4, pat::lsh_projection(8, 3, 1), pat::Binning::kSign, at::Tensor());
  const pat::KeyIntervals iv = pat::top_k_prefix_intervals(at::randn({1, L, 1}), 4, at::Tensor());
  pat::LshBand bad = band;
  bad.band = band.band.clone();
  bad.band[1][0][0][0] = (int32_t)L;
  bad.band[0][0][0][0] = (int32_t)L - 1;
  expect_usage_error([&] { pat::hax_blocks(bad, 4, iv, 4); }, "band run lists sorted keys outside [0, L = 97)");
  pat::KeyIntervals worse = iv;
  worse.leave = iv.leave.clone();
  worse.leave[0][0][0] = iv.key[0][0][0];
  expect_usage_error([&] { pat::hax_blocks(band, 4, worse, 4); }, "leave outside (key, L]");
}

TEST(TileBlocks, AttentionMatchesReferenceFloat64) {
  torch::manual_seed(94);
  for (const BlockCase& s : kCases) {
    if (s.L > 1100) continue;  // the dense reference is L x L
    const OpCase c = block_case(s);
    SCOPED_TRACE(c.name);
    expect_matches_reference(c, at::kDouble, 1e-10, 1e-9);
  }
}

TEST(TileBlocksCuda, FromListsEqualsCpu) {
  // The tile plan kernel against the plain loops, overflowing blocks included.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(95);
  const at::Device cuda(at::kCUDA, 0);
  for (int64_t L : {1, 63, 97, 1025, 65537})
    for (int64_t K : {1, 9, 64, 100}) {
      SCOPED_TRACE("L " + std::to_string(L) + " K " + std::to_string(K));
      const int64_t B = L > 2000 ? 1 : 2, H = 2;
      const at::Tensor idx = K == 100 ? at::randint(-1, L, {B, H, L, K}, at::kInt)
                                      : thinned(pat::top_k_prefix(at::randn({B, L, H}), K, {}).idx, 0.1);
      expect_blocks_equal(hax::ops::tile_blocks_from_lists(idx.to(cuda), L), hax::ops::tile_blocks_from_lists(idx, L));
    }
}

TEST(TileBlocksCuda, TopKPrefixBlocksEqualCpu) {
  // The query kernels' block form (k <= 32 in registers, larger in shared memory), with ties
  // (scores rounded to a few values) and packed sequences, float32 and bfloat16 scores.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(96);
  const at::Device cuda(at::kCUDA, 0);
  for (int64_t L : {1, 63, 97, 1025, 65537})
    for (int64_t k : {1, 5, 32, 33, 64, 200, 448})
      for (bool packed : {false, true}) {
        if (L == 65537 && (packed || (k != 32 && k != 64))) continue;
        const int64_t B = L > 2000 ? 1 : 2, H = 3;
        SCOPED_TRACE("L " + std::to_string(L) + " k " + std::to_string(k) + (packed ? " packed" : ""));
        const at::Tensor seq = packed ? random_packing(B, L, 0.01) : at::Tensor();
        for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
          const at::Tensor scores = (at::randn({B, L, H}) * 4).round().to(dt);  // many ties
          const TileBlocks gpu = pat::top_k_prefix_blocks(scores.to(cuda), k, packed ? seq.to(cuda) : seq);
          const TileBlocks cpu = hax::ops::tile_blocks_from_lists(pat::top_k_prefix(scores.to(at::kFloat), k, seq).idx, L);
          expect_blocks_equal(gpu, cpu);
        }
      }
}

TEST(TileBlocksCuda, AttentionMatchesFloat32AndBf16) {
  // float32 on the GPU goes through the lists (sparse_attention); bfloat16 runs the tile kernels.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(97);
  hax::ops::set_check_device_values(true);
  for (const BlockCase& s : kCases) {
    const OpCase c = block_case(s);
    SCOPED_TRACE(c.name);
    if (s.L <= 1100) expect_cuda_matches_cpu(c, 5e-5, 1e-4);
    // The tile products on wgmma (the default; head dim 64 on Hopper), then on mma.sync with the
    // same cotangents.
    with_same_draws([&] { expect_cuda_bf16_close(c, 5e-3); },
                    [&] {
                      ScopedSwitch w(hax::ops::sparse_attention_wgmma_products,
                                     hax::ops::set_sparse_attention_wgmma_products, false);
                      SCOPED_TRACE("tile products on mma.sync");
                      expect_cuda_bf16_close(c, 5e-3);
                    });
  }
  hax::ops::set_check_device_values(false);
}

namespace {

// HAX in its split form: LSH's band attention and Key Selection's blocks less the band's keys,
// joined by their log-sum-exps, against the dense reference over merge(lsh, top_k_prefix) lists.
OpCase hax_case(const BlockCase& s) {
  OpCase c;
  c.name = "hax split B" + std::to_string(s.B) + " L" + std::to_string(s.L) + " K" + std::to_string(s.K) +
           (s.packed ? " packed" : "");
  const at::Tensor seq = s.packed ? random_packing(s.B, s.L, 0.02) : at::Tensor();
  const at::Tensor hq = at::randn({s.B, s.L, s.H, 16}, at::kDouble), hk = at::randn({s.B, s.L, s.H, 16}, at::kDouble);
  const at::Tensor proj = pat::lsh_projection(16, 3, 5), scores = at::randn({s.B, s.L, s.H});
  const pat::LshBand band = pat::lsh_band(hq, hk, s.K, proj, pat::Binning::kSign, seq);
  const at::Tensor merged =
      pat::merge(pat::lsh(hq, hk, s.K, proj, pat::Binning::kSign, seq), pat::top_k_prefix(scores, s.K, seq)).idx;
  const double scale = 1.0 / std::sqrt((double)s.D);
  c.make_inputs = [=](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    return Tensors{at::randn({s.B, s.L, s.H, s.D}, o).requires_grad_(), at::randn({s.B, s.L, s.H, s.D}, o).requires_grad_(),
                   at::randn({s.B, s.L, s.H, s.Dv}, o).requires_grad_()};
  };
  c.op = [=](const Tensors& in) {
    const at::Device dev = in[0].device();
    const pat::LshBand bd{band.q_order.to(dev), band.k_order.to(dev), band.band.to(dev)};
    auto [o1, lse1] = hax::lsh_band_attention(in[0], in[1], in[2], bd, scale);
    const TileBlocks bl = pat::top_k_prefix_blocks(scores.to(dev), s.K, seq.defined() ? seq.to(dev) : seq, &bd);
    auto [o2, lse2] = hax::ops::sparse_attention_blocks(in[0], in[1], in[2], bl, {}, scale);
    return Tensors{hax::ops::join_by_lse(o1, lse1.unsqueeze(-1), o2, lse2)};
  };
  c.reference = [=](const Tensors& in) {
    return Tensors{std::get<0>(hax::ops::sparse_attention_reference(in[0], in[1], in[2], merged, {}, {}, scale))};
  };
  return c;
}

const std::vector<BlockCase> kHaxCases = {{1, 63, 2, 32, 32, 4, false}, {2, 97, 2, 64, 64, 8, true},
                                          {1, 1025, 2, 64, 64, 32, false}, {2, 1025, 2, 64, 64, 64, true}};

}  // namespace

TEST(TileBlocks, TopKPrefixBlocksLessABandEqualExcludeBand) {
  torch::manual_seed(98);
  for (int64_t L : {63, 97, 1025})
    for (int64_t k : {5, 32, 64}) {
      if (k >= L) continue;
      SCOPED_TRACE("L " + std::to_string(L) + " k " + std::to_string(k));
      const int64_t B = 2, H = 2;
      const at::Tensor seq = random_packing(B, L, 0.02), scores = at::randn({B, L, H});
      const pat::LshBand band = pat::lsh_band(at::randn({B, L, H, 8}), at::randn({B, L, H, 8}), k,
                                              pat::lsh_projection(8, 3, 1), pat::Binning::kSign, seq);
      const TileBlocks bl = pat::top_k_prefix_blocks(scores, k, seq, &band);
      EXPECT_TRUE(at::equal(hax::ops::tile_blocks_to_lists(bl, L),
                            pat::exclude_band(pat::top_k_prefix(scores, k, seq), band).idx));
    }
}

TEST(TileBlocks, HaxSplitMatchesReferenceFloat64) {
  torch::manual_seed(99);
  for (const BlockCase& s : kHaxCases) {
    const OpCase c = hax_case(s);
    SCOPED_TRACE(c.name);
    expect_matches_reference(c, at::kDouble, 1e-10, 1e-9);
  }
}

TEST(TileBlocksCuda, TopKPrefixBlocksLessABandEqualCpu) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(100);
  const at::Device cuda(at::kCUDA, 0);
  for (int64_t L : {63, 97, 1025, 65537})
    for (int64_t k : {5, 32, 64, 100})
      for (bool packed : {false, true}) {
        if (k >= L || (L == 65537 && (packed || k == 5))) continue;
        SCOPED_TRACE("L " + std::to_string(L) + " k " + std::to_string(k) + (packed ? " packed" : ""));
        const int64_t B = L > 2000 ? 1 : 2, H = 2;
        const at::Tensor seq = packed ? random_packing(B, L, 0.01) : at::Tensor(), scores = at::randn({B, L, H});
        const at::Tensor hq = at::randn({B, L, H, 8}), hk = at::randn({B, L, H, 8}), proj = pat::lsh_projection(8, 4, 2);
        const pat::LshBand band = pat::lsh_band(hq, hk, k, proj, pat::Binning::kSign, seq);
        const pat::LshBand gband{band.q_order.to(cuda), band.k_order.to(cuda), band.band.to(cuda)};
        const TileBlocks gpu = pat::top_k_prefix_blocks(scores.to(cuda), k, packed ? seq.to(cuda) : seq, &gband);
        const TileBlocks cpu = pat::top_k_prefix_blocks(scores, k, seq, &band);
        expect_blocks_equal(gpu, cpu);
      }
}

TEST(TileBlocksCuda, HaxSplitMatchesFloat32AndBf16) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(101);
  for (const BlockCase& s : kHaxCases) {
    const OpCase c = hax_case(s);
    SCOPED_TRACE(c.name);
    expect_cuda_matches_cpu(c, 5e-5, 1e-4);
    expect_cuda_bf16_close(c, 5e-3);
  }
}

namespace {

// Sorted lists of K distinct random keys from [0, range) for every (b, h, i), some dropped (-1).
at::Tensor random_lists(int64_t B, int64_t H, int64_t L, int64_t K, int64_t range) {
  const at::Tensor keys = at::rand({B * H * L, range}).argsort(int64_t{-1}, false).narrow(1, 0, K).to(at::kInt);
  return thinned(std::get<0>(keys.sort(-1)).reshape({B, H, L, K}), 0.2);
}

// The frame both union cases share: q (B, L, H, D), k and v (B, Lk, H, D), the dense reference
// over `merged`, and `op` (the union op under test) where sparse_attention_union_native takes
// parts of Ka and Kb keys, else the plain op over the merged lists.
using UnionOp = std::function<at::Tensor(const Tensors&, double scale)>;
OpCase union_frame(const std::string& name, const pat::KeyLists& merged, int64_t Lk, int64_t D, int64_t Ka, int64_t Kb,
                   const UnionOp& op) {
  OpCase c;
  c.name = name;
  const int64_t B = merged.idx.size(0), H = merged.idx.size(1), L = merged.idx.size(2);
  const double scale = 1.0 / std::sqrt((double)D);
  c.make_inputs = [=](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    return Tensors{at::randn({B, L, H, D}, o).requires_grad_(), at::randn({B, Lk, H, D}, o).requires_grad_(),
                   at::randn({B, Lk, H, D}, o).requires_grad_()};
  };
  c.op = [=](const Tensors& in) {
    const at::Device dev = in[0].device();
    if (!hax::ops::sparse_attention_union_native(in[0], in[2], Ka, Kb)) {
      EXPECT_FALSE(dev.is_cuda() && in[0].scalar_type() == at::kBFloat16) << "the union op should apply";
      const at::Tensor order = merged.q_order.defined() ? merged.q_order.to(dev) : merged.q_order;
      return Tensors{std::get<0>(hax::ops::sparse_attention(in[0], in[1], in[2], merged.idx.to(dev), {}, {}, order,
                                                             scale))};
    }
    return Tensors{op(in, scale)};
  };
  c.reference = [=](const Tensors& in) {
    return Tensors{std::get<0>(hax::ops::sparse_attention_reference(in[0], in[1], in[2], merged.idx, {}, {}, scale))};
  };
  return c;
}

// sparse_attention_union over lists a and b (q_order a's, or b's) with patterns::merge_overflow_rows
// for the blocks that overflow, against the dense reference over merge(a, b). Where the union op
// does not apply (float32, the CPU), the op is sparse_attention on merge(a, b).
OpCase union_case(const std::string& name, const pat::KeyLists& a, const pat::KeyLists& b, int64_t Lk, int64_t D) {
  return union_frame(name, pat::merge(a, b), Lk, D, a.idx.size(3), b.idx.size(3), [=](const Tensors& in, double scale) {
    const at::Device dev = in[0].device();
    auto on = [&](const pat::KeyLists& x) {
      return pat::KeyLists{x.idx.to(dev), x.q_order.defined() ? x.q_order.to(dev) : x.q_order};
    };
    const pat::KeyLists ga = on(a), gb = on(b);
    const at::Tensor order = ga.q_order.defined() ? ga.q_order : gb.q_order;
    const auto merge_overflow = [&](const at::Tensor& count) { return pat::merge_overflow_rows(ga, gb, count); };
    return std::get<0>(hax::ops::sparse_attention_union(in[0], in[1], in[2], ga.idx, gb.idx, order, scale,
                                                        merge_overflow));
  });
}

// sparse_attention_union_band over a band (list a; `a` holds the same lists, for the reference)
// and lists b, with patterns::merge_overflow_rows's band form for the blocks that overflow,
// against the dense reference over merge(a, b).
OpCase union_band_case(const std::string& name, const pat::LshBand& band, int64_t Ka, const pat::KeyLists& a,
                       const pat::KeyLists& b, int64_t D) {
  return union_frame(name, pat::merge(a, b), b.idx.size(2), D, Ka, b.idx.size(3), [=](const Tensors& in, double scale) {
    const at::Device dev = in[0].device();
    const pat::LshBand g{band.q_order.to(dev), band.k_order.to(dev), band.band.to(dev)};
    const pat::KeyLists gb{b.idx.to(dev), at::Tensor()};
    const auto merge_overflow = [&](const at::Tensor& count) { return pat::merge_overflow_rows(g, Ka, gb, count); };
    return std::get<0>(hax::ops::sparse_attention_union_band(in[0], in[1], in[2], g.band, g.k_order, Ka, gb.idx,
                                                             g.q_order, scale, merge_overflow));
  });
}

// sparse_attention_union_band_intervals over a band (as union_band_case) and Key Selection's
// intervals of `scores` (k keys a query; built on the GPU from the scores), with
// patterns::merge_overflow_rows's interval form for the blocks that overflow, against the dense
// reference over merge(a, top_k_prefix(scores)).
OpCase union_band_intervals_case(const std::string& name, const pat::LshBand& band, int64_t Ka, const pat::KeyLists& a,
                                 const at::Tensor& scores, int64_t k, const at::Tensor& seq, int64_t D) {
  const pat::KeyLists ks = pat::top_k_prefix(scores, k, seq);
  return union_frame(name, pat::merge(a, ks), ks.idx.size(2), D, Ka, k, [=](const Tensors& in, double scale) {
    const at::Device dev = in[0].device();
    const pat::LshBand g{band.q_order.to(dev), band.k_order.to(dev), band.band.to(dev)};
    const pat::KeyIntervals iv = pat::top_k_prefix_intervals(scores.to(dev), k, seq.defined() ? seq.to(dev) : seq);
    const auto merge_overflow = [&](const at::Tensor& count) { return pat::merge_overflow_rows(g, Ka, iv, count); };
    return std::get<0>(hax::ops::sparse_attention_union_band_intervals(in[0], in[1], in[2], g.band, g.k_order, Ka,
                                                                       iv.count, iv.key, iv.leave, k, g.q_order, scale,
                                                                       merge_overflow));
  });
}

// A synthetic band over L keys in nb buckets (sorted by (bucket, position)) for a random query
// order, and the lists it stands for. Query blocks (64 ranks) take turns: `near` (every band of
// the block in one bucket, starts within 16 sorted keys: the bitmap path, fits), `apart` (two
// buckets far apart, starts within 8 of two points: the bands' span passes the bitmap's
// kAttentionPlanBandSpan, yet the union fits) and `spread` (any bucket, any start: overflows).
// Bands hold 0..Ka keys.
std::pair<pat::LshBand, pat::KeyLists> synthetic_band(int64_t B, int64_t H, int64_t L, int64_t Ka, int64_t nb) {
  const at::Tensor bucket = at::randint(nb, {B, H, L}, at::kLong);
  const at::Tensor k_order = (bucket * L + at::arange(L).view({1, 1, L})).argsort(int64_t{-1}, false).to(at::kInt);
  const at::Tensor q_order = at::rand({B, H, L}).argsort(int64_t{-1}, false).to(at::kInt);
  const at::Tensor counts = at::bincount(bucket.reshape({-1}) + nb * at::arange(B * H).repeat_interleave(L), {}, B * H * nb)
                                .reshape({B * H, nb});
  at::Tensor band = at::empty({4, B, H, L}, at::kInt), idx = at::full({B, H, L, Ka}, -1, at::kInt);
  auto bnd = band.accessor<int32_t, 4>();
  auto ix = idx.accessor<int32_t, 4>();
  auto ko = k_order.accessor<int32_t, 3>();
  auto qo = q_order.accessor<int32_t, 3>();
  auto cn = counts.accessor<int64_t, 2>();
  std::mt19937 rng(7);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<int64_t> start(nb + 1, 0);
      for (int64_t c = 0; c < nb; ++c) start[c + 1] = start[c] + cn[b * H + h][c];
      for (int64_t t = 0; t < L; ++t) {
        const int64_t mode = (t / 64) % 3;
        int64_t c = mode == 2 ? rng() % nb : mode == 1 ? ((t % 2) ? nb - 1 : 0) : (t / 64 / 3) % nb;
        const int64_t size = start[c + 1] - start[c];
        int64_t len = rng() % (Ka + 1), lo = start[c];
        if (mode == 2) lo += size > len ? rng() % (size - len + 1) : 0;
        else lo += std::min<int64_t>(size > len ? size - len : 0, (int64_t)(rng() % (mode == 0 ? 16 : 8)));
        len = std::min(len, start[c + 1] - lo);
        bnd[0][b][h][t] = (int32_t)lo, bnd[1][b][h][t] = (int32_t)(lo + len - 1);
        bnd[2][b][h][t] = bnd[3][b][h][t] = 0;  // (the key side is not read here)
        for (int64_t e = 0; e < len; ++e) ix[b][h][qo[b][h][t]][e] = ko[b][h][lo + e];
      }
    }
  return {pat::LshBand{q_order, k_order, band}, pat::KeyLists{idx, q_order}};
}

}  // namespace

// The random cases of UnionOfTwoListsMatchesMergedLists (below) do what it says of them: with
// keys from a range of 150 every block's union fits in 512 keys; with keys from all of [0, 1100)
// in a random query order every block overflows but the last (query 1024 alone); half and half,
// the blocks of the first 512 queries fit and the others overflow, the last again excepted.
// Counted by the plan's definition (tile_blocks_from_lists, CPU) on the merged lists in the
// attention's query order.
TEST(TileBlocks, UnionTestCasesFitAndOverflowAsIntended) {
  torch::manual_seed(105);
  const int64_t B = 1, H = 2, L = 1025, Lk = 1100, nblk = 17;
  for (auto [Ka, Kb] : {std::pair<int64_t, int64_t>{32, 32}, {13, 20}, {48, 16}})
    for (int mix : {0, 1, 2}) {
      SCOPED_TRACE("Ka " + std::to_string(Ka) + " Kb " + std::to_string(Kb) + " mix " + std::to_string(mix));
      const at::Tensor order = at::rand({B, H, L}).argsort(int64_t{-1}, false).to(at::kInt);
      const pat::KeyLists a{random_lists(B, H, L, Ka, mix == 1 ? Lk : 150), mix == 1 ? order : at::Tensor()};
      at::Tensor bi = random_lists(B, H, L, Kb, 150);
      if (mix > 0) {
        const at::Tensor wide = random_lists(B, H, L, Kb, Lk);
        bi = mix == 1 ? wide : at::cat({bi.narrow(2, 0, 512), wide.narrow(2, 512, L - 512)}, 2);
      }
      const pat::KeyLists merged = pat::merge(a, pat::KeyLists{bi, at::Tensor()});
      at::Tensor idx = merged.idx;  // rows in the attention's query order
      if (merged.q_order.defined())
        idx = idx.gather(2, merged.q_order.to(at::kLong).unsqueeze(-1).expand({B, H, L, idx.size(3)}));
      const at::Tensor over = hax::ops::tile_blocks_from_lists(idx, Lk).count.lt(0).reshape({B * H, nblk});
      const at::Tensor blk = at::arange(nblk);
      const at::Tensor want = (mix == 0 ? blk.lt(0) : mix == 1 ? blk.lt(16) : blk.ge(8).logical_and(blk.lt(16)))
                                  .unsqueeze(0)
                                  .expand({B * H, nblk});
      EXPECT_TRUE(at::equal(over, want)) << over;
    }
}

// HAX's two lists on the tile path without merging them first (sparse_attention_union): LSH's in
// bucket order with Key Selection's, and random lists whose blocks all fit (keys from a range of
// 150), overflow (keys from all of [0, Lk) in a random query order), or half and half (as
// UnionTestCasesFitAndOverflowAsIntended checks); list
// widths that the plan stages 16 bytes at a time (32 + 32) or one entry at a time (13 + 20), and
// one (48 + 16) whose overflow rows come from the full merge. Against the dense float64 reference
// over the merged lists, in bfloat16 (and float32 through the merged lists).
TEST(TileBlocksCuda, UnionOfTwoListsMatchesMergedLists) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(103);
  for (const BlockCase& s : kHaxCases) {
    const at::Tensor seq = s.packed ? random_packing(s.B, s.L, 0.02) : at::Tensor();
    const at::Tensor hq = at::randn({s.B, s.L, s.H, 16}), hk = at::randn({s.B, s.L, s.H, 16});
    const pat::KeyLists lsh = pat::lsh(hq, hk, s.K, pat::lsh_projection(16, 3, 6), pat::Binning::kSign, seq);
    const pat::KeyLists ks = pat::top_k_prefix(at::randn({s.B, s.L, s.H}), s.K, seq);
    const OpCase c = union_case("hax lists B" + std::to_string(s.B) + " L" + std::to_string(s.L) + " K" +
                                    std::to_string(s.K) + (s.packed ? " packed" : ""),
                                lsh, ks, s.L, s.D);
    SCOPED_TRACE(c.name);
    if (s.L <= 100) expect_cuda_matches_cpu(c, 5e-5, 1e-4);
    expect_cuda_bf16_close(c, 5e-3);
  }
  const int64_t B = 1, H = 2, L = 1025, Lk = 1100;
  for (auto [Ka, Kb] : {std::pair<int64_t, int64_t>{32, 32}, {13, 20}, {48, 16}})
    for (int mix : {0, 1, 2}) {  // blocks that fit, that overflow, half and half
      const at::Tensor order = at::rand({B, H, L}).argsort(int64_t{-1}, false).to(at::kInt);
      pat::KeyLists a{random_lists(B, H, L, Ka, mix == 1 ? Lk : 150), mix == 1 ? order : at::Tensor()};
      at::Tensor bi = random_lists(B, H, L, Kb, 150);
      if (mix > 0) {
        const at::Tensor wide = random_lists(B, H, L, Kb, Lk);
        bi = mix == 1 ? wide : at::cat({bi.narrow(2, 0, 512), wide.narrow(2, 512, L - 512)}, 2);
      }
      const OpCase c = union_case("random Ka " + std::to_string(Ka) + " Kb " + std::to_string(Kb) + " mix " +
                                      std::to_string(mix),
                                  a, pat::KeyLists{bi, at::Tensor()}, Lk, 64);
      SCOPED_TRACE(c.name);
      expect_cuda_bf16_close(c, 5e-3);
    }
  hax::ops::set_check_device_values(true);  // the rows merge_overflow_rows leaves out are then -1
  const pat::KeyLists a{random_lists(1, 2, 97, 32, 97), at::Tensor()}, b{random_lists(1, 2, 97, 32, 97), at::Tensor()};
  expect_cuda_bf16_close(union_case("checked values", a, b, 97, 32), 5e-3);
  hax::ops::set_check_device_values(false);
}

// A band union's bfloat16 check in both forms of the backward's key sums, on the same draws: the
// keys of at most two blocks summed in bfloat16 (the default), then every key in float32.
void expect_union_band_close(const OpCase& c) {
  with_same_draws([&] { expect_cuda_bf16_close(c, 5e-3); },
                  [&] {
                    ScopedSwitch w(hax::ops::sparse_attention_few_key_sums, hax::ops::set_sparse_attention_few_key_sums,
                                   false);
                    SCOPED_TRACE("every key summed in float32");
                    expect_cuda_bf16_close(c, 5e-3);
                  });
}

// HAX's plan with LSH as a band (sparse_attention_union_band): LSH's band from patterns::lsh_band
// beside Key Selection's lists, and synthetic bands whose blocks take the plan's bitmap, pass its
// span (the band's keys then go as list entries) or overflow (per-query kernels on merged rows
// from the band), with lists b of keys near or anywhere; band widths 32, 13 and 1. Against the
// dense float64 reference over lsh's (or the synthetic) lists merged with b, in bfloat16, with
// both forms of the key sums (the synthetic bands' blocks of the first two kinds share keys of
// their buckets' starts, so keys of many blocks meet keys of one or two there).
TEST(TileBlocksCuda, UnionWithBandMatchesMergedLists) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(106);
  for (const BlockCase& s : kHaxCases) {
    if (s.K > 32) continue;  // (the band's merge of overflowing rows takes up to 32 keys a part)
    const at::Tensor seq = s.packed ? random_packing(s.B, s.L, 0.02) : at::Tensor();
    const at::Tensor hq = at::randn({s.B, s.L, s.H, 16}), hk = at::randn({s.B, s.L, s.H, 16});
    const at::Tensor proj = pat::lsh_projection(16, 3, 6);
    const pat::KeyLists lsh = pat::lsh(hq, hk, s.K, proj, pat::Binning::kSign, seq);
    const pat::LshBand band = pat::lsh_band(hq, hk, s.K, proj, pat::Binning::kSign, seq);
    const pat::KeyLists ks = pat::top_k_prefix(at::randn({s.B, s.L, s.H}), s.K, seq);
    {  // the query side alone (key_side false) is the full band's
      const at::Device cuda(at::kCUDA, 0);
      const at::Tensor gseq = s.packed ? seq.to(cuda) : seq;
      const pat::LshBand full = pat::lsh_band(hq.to(cuda), hk.to(cuda), s.K, proj.to(cuda), pat::Binning::kSign, gseq);
      const pat::LshBand qs = pat::lsh_band(hq.to(cuda), hk.to(cuda), s.K, proj.to(cuda), pat::Binning::kSign, gseq,
                                            /*key_side=*/false);
      EXPECT_TRUE(at::equal(qs.band.narrow(0, 0, 2), full.band.narrow(0, 0, 2)));
      EXPECT_TRUE(at::equal(qs.q_order, full.q_order) && at::equal(qs.k_order, full.k_order));
    }
    const OpCase c = union_band_case("hax band B" + std::to_string(s.B) + " L" + std::to_string(s.L) + " K" +
                                         std::to_string(s.K) + (s.packed ? " packed" : ""),
                                     band, s.K, lsh, ks, s.D);
    SCOPED_TRACE(c.name);
    expect_union_band_close(c);
  }
  const int64_t B = 1, H = 2, L = 3000;
  for (int64_t Ka : {32, 13, 1})
    for (int64_t range : {int64_t{150}, L}) {
      const auto [band, a] = synthetic_band(B, H, L, Ka, 4);
      const pat::KeyLists b{random_lists(B, H, L, 16, range), at::Tensor()};
      const OpCase c = union_band_case("synthetic Ka " + std::to_string(Ka) + " b keys < " + std::to_string(range),
                                       band, Ka, a, b, 64);
      SCOPED_TRACE(c.name);
      expect_union_band_close(c);
    }
}

// HAX's plan with Key Selection as intervals (sparse_attention_union_band_intervals): LSH's band
// beside the intervals of random scores (awkward sizes, packed rows) and of rising scores (each
// query's keys are its k latest: blocks of far-apart queries overflow, and their rows come from
// the intervals' merge), synthetic bands (bitmap, past its span, overflowing) beside random and
// rising scores, and rows of more than 4096 intervals (rising scores over 4200 keys: the blocks of
// late queries pass the plan's scan of candidates and overflow). Against the dense float64
// reference over the merged lists, in bfloat16, with both forms of the key sums; then the op's
// checks.
TEST(TileBlocksCuda, UnionWithBandAndIntervalsMatchesMergedLists) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(108);
  auto rising = [](int64_t B, int64_t L, int64_t H) {
    return (at::arange(L, at::kFloat).view({1, L, 1}) + 0.1 * at::rand({B, L, H})).contiguous();
  };
  for (const BlockCase& s : kHaxCases) {
    if (s.K > 32 || s.K >= s.L) continue;
    for (bool rise : {false, true}) {
      const at::Tensor seq = s.packed ? random_packing(s.B, s.L, 0.02) : at::Tensor();
      const at::Tensor hq = at::randn({s.B, s.L, s.H, 16}), hk = at::randn({s.B, s.L, s.H, 16});
      const at::Tensor proj = pat::lsh_projection(16, 3, 6);
      const pat::KeyLists lsh = pat::lsh(hq, hk, s.K, proj, pat::Binning::kSign, seq);
      const pat::LshBand band = pat::lsh_band(hq, hk, s.K, proj, pat::Binning::kSign, seq);
      const at::Tensor scores = rise ? rising(s.B, s.L, s.H) : at::randn({s.B, s.L, s.H});
      const OpCase c = union_band_intervals_case("hax intervals B" + std::to_string(s.B) + " L" + std::to_string(s.L) +
                                                     " K" + std::to_string(s.K) + (s.packed ? " packed" : "") +
                                                     (rise ? " rising" : ""),
                                                 band, s.K, lsh, scores, s.K, seq, s.D);
      SCOPED_TRACE(c.name);
      expect_union_band_close(c);
    }
  }
  for (int64_t Ka : {32, 13, 1})
    for (bool rise : {false, true}) {
      const int64_t B = 1, H = 2, L = 3000;
      const auto [band, a] = synthetic_band(B, H, L, Ka, 4);
      const at::Tensor scores = rise ? rising(B, L, H) : at::randn({B, L, H});
      const OpCase c = union_band_intervals_case(
          "synthetic intervals Ka " + std::to_string(Ka) + (rise ? " rising" : ""), band, Ka, a, scores, 16, {}, 64);
      SCOPED_TRACE(c.name);
      expect_union_band_close(c);
    }
  {
    const int64_t B = 1, H = 1, L = 4200;
    const auto [band, a] = synthetic_band(B, H, L, 8, 4);
    const OpCase c = union_band_intervals_case("more than 4096 intervals", band, 8, a, rising(B, L, H), 4, {}, 32);
    SCOPED_TRACE(c.name);
    expect_union_band_close(c);
  }
  // Checks: intervals of another shape, dtype or device; a count past M (value checks on).
  const at::Device cuda(at::kCUDA, 0);
  const int64_t B = 1, H = 2, L = 97;
  const auto o = at::TensorOptions().dtype(at::kBFloat16).device(cuda);
  const at::Tensor q = at::randn({B, L, H, 32}, o), kv = at::randn({B, L, H, 32}, o);
  const pat::LshBand band = pat::lsh_band(q, q, 8, pat::lsh_projection(32, 3, 1).to(cuda), pat::Binning::kSign, {});
  const pat::KeyIntervals iv = pat::top_k_prefix_intervals(at::randn({B, L, H}, o), 8, {});
  const auto none = [](const at::Tensor&) -> at::Tensor { ADD_FAILURE() << "no merge expected"; return {}; };
  auto run = [&](const at::Tensor& count, const at::Tensor& key, const at::Tensor& leave) {
    hax::ops::sparse_attention_union_band_intervals(q, kv, kv, band.band, band.k_order, 8, count, key, leave, 8,
                                                    band.q_order, 1.0, none);
  };
  expect_usage_error([&] { run(iv.count.view({B * H}), iv.key, iv.leave); }, "iv_count has shape");
  expect_usage_error([&] { run(iv.count, iv.key, iv.leave.narrow(2, 0, 5)); }, "iv_leave has shape");
  expect_usage_error([&] { run(iv.count, iv.key.to(at::kLong), iv.leave); }, "iv_key must be int32");
  expect_usage_error([&] { run(iv.count.cpu(), iv.key, iv.leave); }, "iv_count must be int32 on cuda:0");
  hax::ops::set_check_device_values(true);
  expect_usage_error([&] { run(iv.count + (int32_t)L + 1, iv.key, iv.leave); }, "iv_count holds a count outside");
  hax::ops::set_check_device_values(false);
}

// A small instance of the interval plan (blocks that fit, blocks that overflow through rising
// scores' intervals), with the value checks on, quick enough for compute-sanitizer; at head dims
// 32 and 30 (the key sums' row kernel four entries at a time, and one).
TEST(TileBlocksCuda, UnionBandIntervalsSmallInstance) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(109);
  hax::ops::set_check_device_values(true);
  const auto [band, a] = synthetic_band(1, 1, 300, 8, 3);
  const at::Tensor scores = at::cat({at::randn({1, 150, 1}), at::arange(150, at::kFloat).view({1, 150, 1}) + 10}, 1);
  for (int64_t D : {32, 30})
    expect_union_band_close(union_band_intervals_case("small intervals union D " + std::to_string(D), band, 8, a,
                                                      scores, 8, {}, D));
  hax::ops::set_check_device_values(false);
}

// A small instance of the band's union path (blocks on the bitmap, past its span, overflowing),
// with the value checks on (and -1 in the rows the merge leaves out), quick enough for
// compute-sanitizer.
TEST(TileBlocksCuda, UnionBandSmallInstance) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(107);
  hax::ops::set_check_device_values(true);
  const auto [band, a] = synthetic_band(1, 1, 1100, 8, 3);
  const pat::KeyLists b{random_lists(1, 1, 1100, 8, 1100), at::Tensor()};
  expect_union_band_close(union_band_case("small band union", band, 8, a, b, 32));
  hax::ops::set_check_device_values(false);
}

// More (b, h) rows than a grid's y dimension takes (B·H = 65552 > 65535): the key-sum row kernel
// (keys of no block get their gradient rows zeroed there; the outputs are poisoned) covers them all.
TEST(TileBlocksCuda, UnionBandOverManyHeads) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(108);
  const auto [band, a] = synthetic_band(4097, 16, 3, 2, 2);
  const pat::KeyLists b{random_lists(4097, 16, 3, 1, 3), at::Tensor()};
  expect_union_band_close(union_band_case("B*H 65552", band, 2, a, b, 16));
}

// A small instance of the union path (the plan of two lists, blocks that fit and blocks that
// overflow, the merge of the overflowing rows), quick enough for compute-sanitizer.
TEST(TileBlocksCuda, UnionSmallInstance) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(104);
  const int64_t B = 1, H = 1, L = 130, Lk = 600;
  const at::Tensor wide = random_lists(B, H, L, 32, Lk);
  const pat::KeyLists a{random_lists(B, H, L, 32, 100), at::Tensor()};
  const pat::KeyLists b{at::cat({random_lists(B, H, 64, 32, 100), wide.narrow(2, 64, L - 64)}, 2), at::Tensor()};
  expect_cuda_bf16_close(union_case("small union", a, b, Lk, 64), 5e-3);
}

TEST(TileBlocksCuda, SmallInstances) {
  // Small sizes of every kernel path above (register lists for k <= 32 and <= 64, shared memory
  // above; a band left out or not; the tile kernels on the blocks), for the sanitizers.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(102);
  const at::Device cuda(at::kCUDA, 0);
  for (int64_t k : {5, 33, 100}) {
    const int64_t B = 1, H = 2, L = 193;
    SCOPED_TRACE("k " + std::to_string(k));
    const at::Tensor seq = random_packing(B, L, 0.02), scores = at::randn({B, L, H});
    const pat::LshBand band = pat::lsh_band(at::randn({B, L, H, 8}), at::randn({B, L, H, 8}), k,
                                            pat::lsh_projection(8, 3, 3), pat::Binning::kSign, seq);
    const pat::LshBand gband{band.q_order.to(cuda), band.k_order.to(cuda), band.band.to(cuda)};
    expect_blocks_equal(pat::top_k_prefix_blocks(scores.to(cuda), k, seq.to(cuda)), pat::top_k_prefix_blocks(scores, k, seq));
    expect_blocks_equal(pat::top_k_prefix_blocks(scores.to(cuda), k, seq.to(cuda), &gband),
                        pat::top_k_prefix_blocks(scores, k, seq, &band));
  }
  const OpCase c = block_case({1, 97, 2, 64, 64, 8, true});
  expect_cuda_bf16_close(c, 5e-3);
}
