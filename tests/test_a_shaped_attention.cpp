// A-shaped attention (window plus sink): the lists path against the dense float64 reference, the
// lists against the patterns' own union, and the CUDA fast path (causal kernels + sink kernels)
// forward and backward against float64 on awkward sizes, long rows, determinism, the model branch
// and bad inputs.
#include <cmath>

#include "cuda_harness.h"
#include "layers/forward_context.h"
#include "layers/sparse_branch.h"
#include "models/model_config.h"
#include "ops/a_shaped_attention/a_shaped_attention.h"
#include "patterns/pattern.h"

using namespace hax::testing;
using hax::ops::a_shaped_attention;
using hax::ops::a_shaped_attention_native;
using hax::ops::a_shaped_attention_reference;

namespace {

struct ASize {
  int64_t B, L, H, D, Dv, window, sink;
};

std::string describe(const ASize& s) {
  return ::testing::PrintToString(std::vector<int64_t>{s.B, s.L, s.H, s.D, s.Dv}) +
         " window=" + std::to_string(s.window) + " sink=" + std::to_string(s.sink);
}

OpCase a_case(ASize s, bool out_only = false) {
  return qkv_attention_case(
      "a_shaped_attention " + describe(s), s.B, s.L, s.H, s.D, s.Dv,
      [s](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
        return a_shaped_attention(q, k, v, s.window, s.sink, scale);
      },
      [s](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
        return a_shaped_attention_reference(q, k, v, s.window, s.sink, scale);
      },
      out_only);
}

// The error floor of the tensor-core kernels in bfloat16 (P and dS rounded before their second
// products; see test_causal_attention.cpp), plus the sink part's second rounding of the merged
// output and of the gradients it adds to.
constexpr double kTensorCoreFloor = 5e-3;

}  // namespace

TEST(AShapedAttention, ListsPathMatchesReferenceFloat64) {
  torch::manual_seed(81);
  const std::vector<std::pair<int64_t, int64_t>> ws = {{1, 1}, {5, 17}, {32, 32}, {64, 3}, {200, 8}};
  int n = 0;
  for (int64_t L : {1, 63, 97, 130})
    for (auto [window, sink] : ws) {
      const int64_t D = n % 2 ? 16 : 32, Dv = n % 3 ? D : 24;
      ++n;
      ASize s{2, L, 2, D, Dv, window, sink};
      SCOPED_TRACE(describe(s));
      expect_matches_reference(a_case(s), at::kDouble, 1e-11, 1e-9);
    }
}

TEST(AShapedAttention, ListsAreTheUnionOfTheWindowAndSinkPatterns) {
  for (int64_t L : {1, 63, 97, 1025})
    for (auto [window, sink] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {5, 17}, {32, 32}, {300, 2}}) {
      const at::Tensor a = hax::ops::a_shaped_lists(1, 2, L, window, sink, at::kCPU);
      const hax::patterns::KeyLists m = hax::patterns::merge(hax::patterns::sliding_window(1, 2, L, window, {}),
                                                             hax::patterns::sink(1, 2, L, sink, {}));
      // Both ascending with -1 after the last key: equal after padding to one width.
      const int64_t K = std::max(a.size(3), m.idx.size(3));
      auto pad = [K](const at::Tensor& t) {
        return at::constant_pad_nd(t.to(at::kLong), {0, K - t.size(3)}, -1);
      };
      EXPECT_TRUE(at::equal(pad(a), pad(m.idx))) << "L=" << L << " window=" << window << " sink=" << sink;
    }
}

TEST(AShapedAttention, BadInputsNameTheOption) {
  at::Tensor q = at::randn({1, 6, 2, 8}), v = at::randn({1, 6, 2, 8});
  expect_usage_error([&] { a_shaped_attention(q, q, v, 0, 2, 0.5); }, "window 0 must be >= 1");
  expect_usage_error([&] { a_shaped_attention(q, q, v, 2, -1, 0.5); }, "sink -1 must be >= 0");
  expect_usage_error([&] { a_shaped_attention(q, q, v, 2, 2, 0.0); }, "scale 0 must be positive");
  expect_usage_error([&] { a_shaped_attention(q, q.narrow(1, 0, 5), v, 2, 2, 0.5); }, "k has shape");
}

// The fast path: bfloat16 on the GPU against float64 on the same rounded inputs, forward and
// backward, every head-dim bucket, windows and sinks that overlap, nest and exceed L.
TEST(AShapedAttentionCuda, FastPathMatchesFloat64) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(82);
  const int64_t dims[] = {8, 16, 32, 64, 128};
  const std::vector<std::pair<int64_t, int64_t>> ws = {{32, 32}, {1, 1}, {5, 17}, {64, 64}, {100, 50}, {2000, 8}, {3, 64}};
  int m = 0;
  for (int64_t L : {1, 63, 64, 65, 97, 1025})
    for (auto [window, sink] : ws) {
      const int64_t D = dims[m % 5], Dv = m % 3 == 0 ? dims[(m + 2) % 5] : D;
      const ASize s{m % 2 ? 2 : 1, L, m % 2 ? 1 : 3, D, Dv, window, sink};
      ++m;
      SCOPED_TRACE(describe(s));
      const at::Tensor probe = at::zeros({1, 1, 1, D}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
      const at::Tensor probe_v = at::zeros({1, 1, 1, Dv}, probe.options());
      ASSERT_TRUE(a_shaped_attention_native(probe, probe_v, window, sink)) << "this case must take the fast path";
      expect_cuda_bf16_close(a_case(s), kTensorCoreFloor);
    }
}

TEST(AShapedAttentionCuda, WithoutLseCotangentAndFloat32) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(83);
  const ASize s{2, 300, 3, 64, 64, 32, 32};
  expect_cuda_bf16_close(a_case(s, /*out_only=*/true), kTensorCoreFloor);
  // float32 (the lists path on both devices).
  expect_cuda_matches_cpu(a_case({1, 97, 2, 32, 16, 5, 17}), 5e-5, 1e-4);
}

// L = 65537 at the model's sizes: the fast path against the CPU op in float64 on the same
// bfloat16-rounded inputs (the dense reference has no room for an L x L matrix here).
TEST(AShapedAttentionCuda, At65537) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(84);
  for (auto [window, sink] : std::vector<std::pair<int64_t, int64_t>>{{32, 32}, {64, 64}}) {
    const ASize s{1, 65537, 2, 64, 64, window, sink};
    SCOPED_TRACE(describe(s));
    expect_cuda_bf16_close_to_cpu_float64(a_case(s), 1e-2);
  }
}

TEST(AShapedAttentionCuda, GradientsAreBitIdenticalAcrossRuns) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(85);
  expect_cuda_runs_bit_identical(a_case({2, 1000, 3, 64, 32, 32, 32}), at::kBFloat16);
}

// The model's sparse branch with sparse = "a" on the GPU in bfloat16 (the fast path) against the
// same branch on the CPU in float64 (the patterns' lists), output and input gradients.
TEST(AShapedAttentionCuda, ModelBranchMatchesCpuLists) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(86);
  hax::ModelConfig mc;
  mc.d_model = 32, mc.d_state = 32, mc.sparse = "a", mc.sparse_keys = 40, mc.attn_heads = 2, mc.qk_dim = 32;
  hax::SparseAttentionBranch branch(mc, 32, 64, 0);
  const int64_t B = 2, L = 333, H = 2, D = 32;
  at::Tensor x0 = at::randn({B, L, 32});
  auto fn = [&](const Tensors& in) {
    hax::ForwardContext ctx;
    return Tensors{branch.attend(x0.to(in[0].device()), in[0], in[1], in[2], {}, &ctx, nullptr)};
  };
  Tensors in = {at::randn({B, L, H, D}).requires_grad_(), (at::randn({B, L, H, D}) / std::sqrt(32.0)).requires_grad_(),
                at::randn({B, L, H, D}).requires_grad_()};
  Tensors gpu_in = to_device(in, at::Device(at::kCUDA, 0), at::kBFloat16);
  ASSERT_TRUE(a_shaped_attention_native(gpu_in[0], gpu_in[2], 20, 20));
  Tensors w = random_cotangents(fn(clone_leaves(in)));
  const auto gpu = run_on_device(fn, gpu_in, w);
  const auto cpu = run_on_device(fn, to_device(gpu_in, at::Device(at::kCPU), at::kDouble), w);
  expect_runs_close(gpu, cpu, 1e-2);
}

// A small instance of every sink kernel (both head-dim buckets the models use, sinks of one, two
// and four 16-key groups) for compute-sanitizer (scripts/gpu_sanitize.sh).
TEST(AShapedAttentionCuda, SmallInstance) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(87);
  for (const ASize& s : {ASize{1, 150, 2, 64, 64, 32, 32}, ASize{1, 150, 1, 128, 128, 16, 64}, ASize{1, 70, 1, 32, 32, 8, 9}})
    expect_cuda_bf16_close(a_case(s), kTensorCoreFloor);
}
