// (Gated) RMSNorm: kernel vs. the LibTorch definition in float64, gradients, errors.
#include "cuda_harness.h"
#include "ops/rmsnorm/rmsnorm.h"

using namespace hax::testing;
using hax::ops::rmsnorm;
using hax::ops::rmsnorm_forward;
using hax::ops::rmsnorm_reference;

namespace {

OpCase norm_case(std::vector<int64_t> shape, bool gated, int64_t group_size, double eps = 1e-5) {
  OpCase c;
  c.name = "rmsnorm";
  c.make_inputs = [shape, gated](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    const int64_t D = shape.back();
    Tensors in;
    in.push_back(at::randn(shape, o).requires_grad_());                               // x
    in.push_back(gated ? (at::randn(shape, o) * 2).detach().requires_grad_() : at::Tensor());  // z
    in.push_back((at::randn({D}, o) * 0.3 + 1).detach().requires_grad_());            // weight
    return in;
  };
  c.op = [=](const Tensors& in) { return Tensors{rmsnorm(in[0], in[1], in[2], eps, group_size)}; };
  c.reference = [=](const Tensors& in) { return Tensors{rmsnorm_reference(in[0], in[1], in[2], eps, group_size)}; };
  return c;
}

}  // namespace

TEST(RmsNorm, MatchesDefinitionFloat64) {
  torch::manual_seed(21);
  const std::vector<std::vector<int64_t>> shapes = {{30}, {7, 30}, {2, 3, 30}, {3000, 30}, {2, 1, 5, 30}};
  for (const auto& shape : shapes)
    for (bool gated : {false, true})
      for (int64_t gs : {0, 5, 6, 15, 30}) {
        SCOPED_TRACE(::testing::Message() << "shape " << at::IntArrayRef(shape) << " gated=" << gated << " gs=" << gs);
        expect_matches_reference(norm_case(shape, gated, gs), at::kDouble, 1e-12, 1e-10);
      }
}

TEST(RmsNorm, EpsilonMatters) {
  // Small inputs make eps a large part of the mean square.
  torch::manual_seed(22);
  OpCase c = norm_case({4, 12}, true, 4, 0.5);
  auto make = c.make_inputs;
  c.make_inputs = [make](at::ScalarType dt) {
    Tensors in = make(dt);
    in[0] = (in[0] * 0.1).detach().requires_grad_();
    return in;
  };
  expect_matches_reference(c, at::kDouble, 1e-12, 1e-10);
  expect_gradients_match_finite_differences(c);
}

TEST(RmsNorm, Float32CloseToFloat64Reference) {
  torch::manual_seed(23);
  expect_float32_close_to_reference(norm_case({64, 10, 48}, true, 16), 1e-5, 1e-4);
  expect_float32_close_to_reference(norm_case({64, 10, 48}, false, 0), 1e-5, 1e-4);
}

TEST(RmsNorm, FiniteDifferenceGradients) {
  torch::manual_seed(24);
  expect_gradients_match_finite_differences(norm_case({3, 5, 12}, true, 4));
  expect_gradients_match_finite_differences(norm_case({3, 5, 12}, false, 0));
  expect_gradients_match_finite_differences(norm_case({600, 6}, true, 3));
}

TEST(RmsNorm, NonContiguousInputs) {
  torch::manual_seed(25);
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor xz = at::randn({4, 9, 32}, o);
  at::Tensor x = xz.narrow(-1, 0, 16), z = xz.narrow(-1, 16, 16), w = at::randn({32}, o).slice(0, 0, 32, 2);
  ASSERT_FALSE(x.is_contiguous());
  ASSERT_FALSE(w.is_contiguous());
  EXPECT_LE(rel_err(rmsnorm(x, z, w, 1e-5, 8), rmsnorm_reference(x, z, w, 1e-5, 8), 1e-12, 1e-10), 1.0);
  EXPECT_LE(rel_err(rmsnorm(x.transpose(0, 1), {}, w), rmsnorm_reference(x.transpose(0, 1), {}, w), 1e-12, 1e-10), 1.0);
}

TEST(RmsNorm, DeterministicAcrossThreadCounts) {
  torch::manual_seed(26);
  expect_deterministic_across_threads(norm_case({4000, 64}, true, 16));
}

TEST(RmsNorm, EmptyRows) {
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({0, 8}, o).requires_grad_(), w = at::randn({8}, o).requires_grad_();
  at::Tensor y = rmsnorm(x, at::Tensor(), w);
  EXPECT_EQ(y.sizes(), x.sizes());
  y.sum().backward();
  EXPECT_TRUE(at::equal(w.grad(), at::zeros({8}, o)));
}

TEST(RmsNorm, BadInputsNameTheTensor) {
  auto o = at::TensorOptions().dtype(at::kFloat);
  at::Tensor x = at::randn({2, 3, 16}, o), z = at::randn({2, 3, 16}, o), w = at::randn({16}, o);
  expect_usage_error([&] { rmsnorm(x, z, w, 1e-5, 5); }, "rmsnorm: group_size 5 must divide the last dim 16");
  expect_usage_error([&] { rmsnorm(x, z, w, 1e-5, 32); }, "group_size 32 must divide the last dim 16");
  expect_usage_error([&] { rmsnorm(x, z, w, 1e-5, -4); }, "group_size -4 must be positive");
  expect_usage_error([&] { rmsnorm(x, z, at::randn({8}, o)); }, "rmsnorm: weight has shape [8] but must be (D) = [16]");
  expect_usage_error([&] { rmsnorm(x, z, at::randn({1, 16}, o)); }, "weight has shape [1, 16]");
  expect_usage_error([&] { rmsnorm(x, z.narrow(1, 0, 2), w); }, "z has shape [2, 2, 16] but must have x's shape [2, 3, 16]");
  expect_usage_error([&] { rmsnorm(x, z.to(at::kDouble), w); }, "z has dtype Double");
  expect_usage_error([&] { rmsnorm(x, z, w.to(at::kDouble)); }, "weight has dtype Double");
  expect_usage_error([&] { rmsnorm(x.to(at::kInt), {}, w); }, "x has dtype Int");
  expect_usage_error([&] { rmsnorm(at::randn({}, o), {}, w); }, "x has shape []");
  expect_usage_error([&] { rmsnorm(x, z, w, -1.0); }, "eps -1 must be finite and non-negative");
  expect_usage_error([&] { rmsnorm_forward(x, z, w, 1e-5, 7); }, "group_size 7 must divide the last dim 16");
}

TEST(RmsNormCuda, MatchesCpuFloat32AndBf16) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(24);
  for (int64_t rows : {1, 63, 97, 1025})
    for (int64_t D : {16, 30, 64, 128})
      for (bool gated : {false, true})
        for (int64_t gs : {int64_t(0), D / 2}) {
          SCOPED_TRACE(::testing::Message() << "rows " << rows << " D " << D << " gated=" << gated << " gs=" << gs);
          expect_cuda_matches_cpu(norm_case({rows, D}, gated, gs), 1e-5, 1e-5);
          expect_cuda_bf16_close(norm_case({rows, D}, gated, gs));
        }
}
