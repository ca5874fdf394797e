// Dilated attention (D, SW+D): the lists path and the block-tile form (on the CPU too) against the
// dense float64 reference, the lists against the patterns' own union, the band against brute force,
// and the CUDA fast path forward and backward against float64 on awkward sizes, long rows,
// determinism, the model branch and bad inputs.
#include <cmath>
#include <functional>

#include "cuda_harness.h"
#include "layers/forward_context.h"
#include "layers/sparse_branch.h"
#include "models/model_config.h"
#include "ops/dilated_attention/dilated_attention.h"
#include "patterns/pattern.h"

using namespace hax::testing;
using hax::ops::dilated_attention;
using hax::ops::dilated_attention_native;
using hax::ops::dilated_attention_reference;
using hax::ops::dilated_attention_tiles;

namespace {

struct DSize {
  int64_t B, L, H, D, Dv, keys, stride, window;
};

std::string describe(const DSize& s) {
  return ::testing::PrintToString(std::vector<int64_t>{s.B, s.L, s.H, s.D, s.Dv}) + " keys=" + std::to_string(s.keys) +
         " stride=" + std::to_string(s.stride) + " window=" + std::to_string(s.window);
}

// lse with its -inf entries (queries without keys: D alone, i < r - 1) as 0, so that outputs compare.
at::Tensor finite_lse(const at::Tensor& lse) { return at::where(at::isinf(lse), at::zeros_like(lse), lse); }

using DFn = std::function<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              int64_t, int64_t, int64_t, double)>;

// The block-tile form on CUDA inputs, the lists path (dilated_attention on the CPU) elsewhere.
std::tuple<at::Tensor, at::Tensor> tiles_on_gpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                int64_t keys, int64_t stride, int64_t window, double scale) {
  return q.is_cuda() ? dilated_attention_tiles(q, k, v, keys, stride, window, scale)
                     : dilated_attention(q, k, v, keys, stride, window, scale);
}

OpCase d_case(DSize s, DFn fn = &dilated_attention, bool out_only = false) {
  return qkv_attention_case(
      "dilated_attention " + describe(s), s.B, s.L, s.H, s.D, s.Dv,
      [s, fn](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
        return fn(q, k, v, s.keys, s.stride, s.window, scale);
      },
      [s](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
        return dilated_attention_reference(q, k, v, s.keys, s.stride, s.window, scale);
      },
      out_only, &finite_lse);
}

// (keys, stride, window): D alone, stride 1 (a window), windows inside, across and past the
// dilated keys, strides past L.
const std::vector<std::array<int64_t, 3>> kShapes = {{1, 1, 0},  {4, 3, 0},   {5, 2, 3},   {32, 8, 32}, {3, 50, 0},
                                                     {64, 7, 200}, {2, 200, 5}, {16, 64, 16}, {6, 4, 1}};

// The error floor of the tensor-core kernels in bfloat16 (test_causal_attention.cpp), plus the
// join's rounding of the two parts' outputs.
constexpr double kTensorCoreFloor = 5e-3;

}  // namespace

// The lists path and the fast path's block-tile form (causal kernels over the window and the
// compacted keys' band, joined by lse), both on the CPU in float64: the band's formulas and the
// compaction, forward and backward.
TEST(DilatedAttention, ListsAndTilesFormMatchReferenceFloat64) {
  torch::manual_seed(91);
  int n = 0;
  for (int64_t L : {1, 63, 97, 130})
    for (auto [keys, stride, window] : kShapes) {
      const int64_t D = n % 2 ? 16 : 32, Dv = n % 3 ? D : 24;
      ++n;
      const DSize s{2, L, 2, D, Dv, keys, stride, window};
      SCOPED_TRACE(describe(s));
      expect_matches_reference(d_case(s), at::kDouble, 1e-11, 1e-9);
      expect_matches_reference(d_case(s, &dilated_attention_tiles), at::kDouble, 1e-11, 1e-9);
    }
}

TEST(DilatedAttention, ListsAreTheUnionOfTheWindowAndDilatedPatterns) {
  for (int64_t L : {1, 63, 97, 1025})
    for (auto [keys, stride, window] : kShapes) {
      const at::Tensor a = hax::ops::dilated_lists(1, 2, L, keys, stride, window, at::kCPU);
      hax::patterns::KeyLists m = hax::patterns::dilated(1, 2, L, keys, stride, {});
      if (window > 0) m = hax::patterns::merge(hax::patterns::sliding_window(1, 2, L, window, {}), m);
      // Both ascending with -1 after the last key: equal after padding to one width.
      const int64_t K = std::max(a.size(3), m.idx.size(3));
      auto pad = [K](const at::Tensor& t) { return at::constant_pad_nd(t.to(at::kLong), {0, K - t.size(3)}, -1); };
      EXPECT_TRUE(at::equal(pad(a), pad(m.idx))) << "L=" << L << " keys=" << keys << " stride=" << stride
                                                 << " window=" << window;
    }
}

// The band by brute force: query i sees compacted key m (row m r + r - 1) iff that row is in U(i)
// and not in the window, and the key-side bounds describe the same pairs.
TEST(DilatedAttention, BandAgreesWithBruteForce) {
  for (int64_t L : {1, 2, 63, 97, 300})
    for (auto [keys, stride, window] : kShapes) {
      const at::Tensor band = hax::ops::dilated_band(1, 1, L, keys, stride, window, at::kCPU).to(at::kLong);
      const auto b = band.accessor<int64_t, 4>();
      for (int64_t i = 0; i < L; ++i)
        for (int64_t m = 0; m < L; ++m) {
          const int64_t j = m * stride + stride - 1;
          // Dilated keys in [j, i]: floor((i + 1) / r) - m; j among the `keys` most recent iff <= keys.
          const bool want = j <= i && j <= i - window && (i + 1) / stride - m <= keys;
          const bool by_query = b[0][0][0][i] <= m && m <= b[1][0][0][i];
          const bool by_key = b[2][0][0][m] <= i && i <= b[3][0][0][m];
          ASSERT_EQ(by_query, want) << "L=" << L << " i=" << i << " m=" << m << " keys=" << keys << " stride=" << stride
                                    << " window=" << window;
          ASSERT_EQ(by_key, want) << "L=" << L << " i=" << i << " m=" << m << " keys=" << keys << " stride=" << stride
                                  << " window=" << window;
        }
      for (int64_t t = 1; t < L; ++t)
        for (int part = 0; part < 4; ++part)
          ASSERT_LE(b[part][0][0][t - 1], b[part][0][0][t]) << "part " << part << " must be non-decreasing";
    }
}

TEST(DilatedAttention, BadInputsNameTheOption) {
  at::Tensor q = at::randn({1, 6, 2, 8}), v = at::randn({1, 6, 2, 8});
  expect_usage_error([&] { dilated_attention(q, q, v, 0, 2, 0, 0.5); }, "keys 0 must be >= 1");
  expect_usage_error([&] { dilated_attention(q, q, v, 2, 0, 0, 0.5); }, "stride 0 must be >= 1");
  expect_usage_error([&] { dilated_attention(q, q, v, 2, 2, -1, 0.5); }, "window -1 must be >= 0");
  expect_usage_error([&] { dilated_attention(q, q, v, 2, 2, 0, 0.0); }, "scale 0 must be positive");
  expect_usage_error([&] { dilated_attention(q, q.narrow(1, 0, 5), v, 2, 2, 0, 0.5); }, "k has shape");
}

// The block-tile form: bfloat16 on the GPU against float64 on the same rounded inputs, forward and
// backward, every head-dim bucket, D alone and beside windows that overlap, nest and exceed it.
TEST(DilatedAttentionCuda, TilesFormMatchesFloat64) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(93);
  const int64_t dims[] = {8, 16, 32, 64, 128};
  int m = 0;
  for (int64_t L : {1, 63, 64, 65, 97, 1025})
    for (auto [keys, stride, window] : kShapes) {
      const int64_t D = dims[m % 5], Dv = m % 3 == 0 ? dims[(m + 2) % 5] : D;
      const DSize s{m % 2 ? 2 : 1, L, m % 2 ? 1 : 3, D, Dv, keys, stride, window};
      ++m;
      SCOPED_TRACE(describe(s));
      expect_cuda_bf16_close(d_case(s, &dilated_attention_tiles), kTensorCoreFloor);
    }
}

TEST(DilatedAttentionCuda, TilesWithoutLseCotangentAndListsInFloat32) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(94);
  expect_cuda_bf16_close(d_case({2, 300, 3, 64, 64, 32, 64, 32}, &dilated_attention_tiles, /*out_only=*/true),
                         kTensorCoreFloor);
  // float32 (the lists path on both devices).
  expect_cuda_matches_cpu(d_case({1, 97, 2, 32, 16, 5, 3, 4}), 5e-5, 1e-4);
}

// L = 65537 at the benchmark's sizes (D: k = 64, r = L / 64; SW+D: 32 + 32 keys, r = L / 32) and
// the model's (r = 2048 / k): the block-tile form on the GPU, forward and backward, against the
// lists path on the CPU in float64 on the same bfloat16-rounded inputs.
TEST(DilatedAttentionCuda, TilesAt65537) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(95);
  for (auto [keys, stride, window] :
       std::vector<std::array<int64_t, 3>>{{64, 1024, 0}, {32, 2048, 32}, {64, 32, 0}, {32, 64, 32}}) {
    const DSize s{1, 65537, 2, 64, 64, keys, stride, window};
    SCOPED_TRACE(describe(s));
    expect_cuda_bf16_close_to_cpu_float64(d_case(s, &tiles_on_gpu), 1e-2);
  }
}

TEST(DilatedAttentionCuda, TilesGradientsAreBitIdenticalAcrossRuns) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(96);
  expect_cuda_runs_bit_identical(d_case({2, 1000, 3, 64, 32, 32, 64, 32}, &dilated_attention_tiles), at::kBFloat16);
  expect_cuda_runs_bit_identical(d_case({1, 1000, 2, 64, 64, 64, 32, 0}, &dilated_attention_tiles), at::kBFloat16);
}

// dilated_attention takes the block-tile form from kDilatedTilesMinLength on, with or without
// gradients, and there equals the lists path (taken on the row one query shorter: the same keys for
// every other query).
TEST(DilatedAttentionCuda, RoutingTakesTilesForLongRows) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(98);
  const int64_t L = hax::ops::kDilatedTilesMinLength;
  const auto o = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const at::Tensor q = at::randn({1, L, 2, 64}, o), k = at::randn({1, L, 2, 64}, o), v = at::randn({1, L, 2, 64}, o);
  auto cut = [](const at::Tensor& t) { return t.narrow(1, 0, t.size(1) - 1); };
  EXPECT_TRUE(dilated_attention_native(q, v));
  EXPECT_TRUE(dilated_attention_native(q.clone().requires_grad_(), v)) << "training takes the block tiles too";
  EXPECT_FALSE(dilated_attention_native(cut(q), cut(v))) << "below kDilatedTilesMinLength: the lists";
  for (auto [keys, stride, window] : std::vector<std::array<int64_t, 3>>{{64, 512, 0}, {32, 1024, 32}}) {
    SCOPED_TRACE("keys=" + std::to_string(keys) + " stride=" + std::to_string(stride) + " window=" +
                 std::to_string(window));
    auto [tiles, tiles_lse] = dilated_attention(q, k, v, keys, stride, window, 0.125);
    auto [lists, lists_lse] = dilated_attention(cut(q), cut(k), cut(v), keys, stride, window, 0.125);
    EXPECT_LE(scaled_err(cut(tiles).to(at::kDouble), lists.to(at::kDouble)), 1e-2);
    EXPECT_LE(scaled_err(finite_lse(tiles_lse.narrow(2, 0, L - 1)).to(at::kDouble), finite_lse(lists_lse).to(at::kDouble)),
              1e-2);
  }
}

// The model's sparse branch with sparse = "d" and "sw+d" on the GPU in bfloat16 against the same
// branch on the CPU in float64 (the patterns' lists): with gradients at a short length (the GPU's
// lists), and at a long one (the block tiles) with and without.
TEST(DilatedAttentionCuda, ModelBranchMatchesCpuLists) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(97);
  for (const char* kind : {"d", "sw+d"})
    for (auto [L, infer] : std::vector<std::pair<int64_t, bool>>{{333, false}, {40000, true}, {40000, false}}) {
      SCOPED_TRACE(std::string(kind) + " L=" + std::to_string(L) + (infer ? " inference" : " with gradients"));
      hax::ModelConfig mc;
      mc.d_model = 32, mc.d_state = 32, mc.sparse = kind, mc.sparse_keys = 40, mc.attn_heads = 2, mc.qk_dim = 32;
      mc.dilated_span = 160;  // stride 4 (d: 160 / 40) or 8 (sw+d: 160 / 20)
      hax::SparseAttentionBranch branch(mc, 32, 64, 0);
      const int64_t B = 1, H = 2, D = 32;
      const bool tiles = L >= hax::ops::kDilatedTilesMinLength;
      at::Tensor x0 = at::randn({B, L, 32});
      auto fn = [&](const Tensors& in) {
        hax::ForwardContext ctx;
        return Tensors{branch.attend(x0.to(in[0].device()), in[0], in[1], in[2], {}, &ctx, nullptr)};
      };
      Tensors in = {at::randn({B, L, H, D}).requires_grad_(!infer),
                    (at::randn({B, L, H, D}) / std::sqrt(32.0)).requires_grad_(!infer),
                    at::randn({B, L, H, D}).requires_grad_(!infer)};
      Tensors gpu_in = to_device(in, at::Device(at::kCUDA, 0), at::kBFloat16);
      EXPECT_EQ(dilated_attention_native(gpu_in[0], gpu_in[2]), tiles);
      Tensors w = random_cotangents(fn(clone_leaves(in)));
      const auto gpu = run_on_device(fn, gpu_in, w);
      const auto cpu = run_on_device(fn, to_device(gpu_in, at::Device(at::kCPU), at::kDouble), w);
      expect_runs_close(gpu, cpu, 1e-2);
    }
}
