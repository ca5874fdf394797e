// The linear op against at::linear in float64, finite differences, determinism.
#include "op_harness.h"
#include "core/small_gemm.h"
#include "ops/linear/linear.h"

using namespace hax::testing;

namespace {

OpCase linear_case(std::vector<int64_t> lead, int64_t in, int64_t out, bool bias, bool relu = false) {
  OpCase c;
  c.name = relu ? "linear_relu" : "linear";
  c.make_inputs = [=](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    auto xs = lead;
    xs.push_back(in);
    return Tensors{at::randn(xs, o).requires_grad_(), at::randn({out, in}, o).requires_grad_(),
                   bias ? at::randn({out}, o).requires_grad_() : at::Tensor()};
  };
  if (relu) {
    c.op = [](const Tensors& in) { return Tensors{hax::ops::linear_relu(in[0], in[1], in[2])}; };
    c.reference = [](const Tensors& in) { return Tensors{at::relu(at::linear(in[0], in[1], in[2]))}; };
  } else {
    c.op = [](const Tensors& in) { return Tensors{hax::ops::linear(in[0], in[1], in[2])}; };
    c.reference = [](const Tensors& in) { return Tensors{at::linear(in[0], in[1], in[2])}; };
  }
  return c;
}

}  // namespace

TEST(Linear, MatchesLibTorchInFloat64) {
  torch::manual_seed(1);
  for (auto lead : std::vector<std::vector<int64_t>>{{1}, {63}, {3, 97}, {1025}, {2, 5, 7}})
    for (auto [in, out] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {13, 7}, {64, 128}, {100, 3}})
      for (bool bias : {false, true})
        for (bool relu : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "rows " << lead.back() << " in " << in << " out " << out << " relu " << relu);
          expect_matches_reference(linear_case(lead, in, out, bias, relu), at::kDouble, 1e-11, 1e-10);
        }
}

TEST(Linear, FiniteDifferencesFloat32CloseAndDeterministic) {
  torch::manual_seed(2);
  expect_gradients_match_finite_differences(linear_case({2, 9}, 5, 4, true));
  expect_float32_close_to_reference(linear_case({600}, 48, 40, true), 1e-4, 1e-4);
  expect_deterministic_across_threads(linear_case({5000}, 64, 32, true));
  expect_gradients_match_finite_differences(linear_case({2, 9}, 5, 4, true, true));
  expect_deterministic_across_threads(linear_case({5000}, 64, 32, true, true));
}

TEST(Linear, BadShapesNameTheTensor) {
  expect_usage_error([] { hax::ops::linear(at::randn({3, 4}), at::randn({5, 3}), {}); }, "last dim must be in = 3");
  expect_usage_error([] { hax::ops::linear(at::randn({3, 4}), at::randn({5, 4}), at::randn({4})); },
                     "b has shape [4]");
}

// core/small_gemm.h: C = A B and C = A^T B (A stored transposed) against a float64 loop nest, at
// awkward sizes (vector-width tails and single rows), with and without accumulation into C.
TEST(SmallGemm, PlainAndTransposedAMatchNaiveProducts) {
  torch::manual_seed(3);
  for (int64_t M : {1, 7, 16, 33})
    for (int64_t N : {1, 5, 16, 47})
      for (int64_t K : {1, 9, 64})
        for (bool acc : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "M " << M << " N " << N << " K " << K << " acc " << acc);
          at::Tensor a = at::randn({M, K}), at_ = a.t().contiguous(), b = at::randn({K, N}), c0 = at::randn({M, N});
          at::Tensor want = (acc ? c0.to(at::kDouble) : at::zeros({M, N}, at::kDouble)) +
                            at::matmul(a.to(at::kDouble), b.to(at::kDouble));
          at::Tensor c1 = c0.clone(), c2 = c0.clone();
          hax::small_gemm<float>(M, N, K, a.data_ptr<float>(), K, b.data_ptr<float>(), N, c1.data_ptr<float>(), N, acc);
          hax::small_gemm_tn<float>(M, N, K, at_.data_ptr<float>(), M, b.data_ptr<float>(), N, c2.data_ptr<float>(), N,
                                    acc);
          EXPECT_LE(rel_err(c1, want, 1e-5, 1e-5), 1.0);
          EXPECT_LE(rel_err(c2, want, 1e-5, 1e-5), 1.0);
        }
}

// CUDA: the cuBLAS path (one autograd node) against the CPU op, forward and backward, with and
// without bias and ReLU, 2-d and 3-d inputs; dx is not computed when x needs no gradient; under
// bf16 autocast the output is bfloat16 and the float32 parameters still get float32 gradients.
#include "cuda_harness.h"
#include "train/precision.h"

TEST(LinearCuda, MatchesCpuFloat32AndSkipsUnneededGradients) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(4);
  const at::Device dev(at::kCUDA);
  for (auto lead : std::vector<std::vector<int64_t>>{{1}, {63}, {3, 97}, {1025}})
    for (bool bias : {false, true})
      for (bool relu : {false, true})
        for (bool x_grad : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "rows " << lead.back() << " bias " << bias << " relu " << relu
                                            << " x_grad " << x_grad);
          auto xs = lead;
          xs.push_back(48);
          at::Tensor x = at::randn(xs), w = at::randn({40, 48}), b = bias ? at::randn({40}) : at::Tensor();
          at::Tensor g = at::randn(xs).narrow(-1, 0, 40).contiguous();
          auto run = [&](const at::Device& d) {
            // detach() first: on the CPU, to(kCPU) would return x itself and mark it.
            at::Tensor xd = x.detach().to(d).requires_grad_(x_grad), wd = w.detach().to(d).requires_grad_(),
                       bd = bias ? b.detach().to(d).requires_grad_() : at::Tensor();
            at::Tensor y = relu ? hax::ops::linear_relu(xd, wd, bd) : hax::ops::linear(xd, wd, bd);
            (y * g.to(d)).sum().backward();
            return std::vector<at::Tensor>{y.cpu(), x_grad ? xd.grad().cpu() : at::Tensor(), wd.grad().cpu(),
                                           bias ? bd.grad().cpu() : at::Tensor()};
          };
          auto want = run(at::kCPU), got = run(dev);
          for (size_t i = 0; i < want.size(); ++i) {
            ASSERT_EQ(got[i].defined(), want[i].defined()) << "output " << i;
            if (want[i].defined()) {
              EXPECT_LE(rel_err(got[i], want[i], 1e-4, 1e-4), 1.0) << "output " << i;
            }
          }
        }
}

TEST(LinearCuda, Bf16AutocastGivesBf16OutputAndFloat32Gradients) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(5);
  const at::Device dev(at::kCUDA);
  at::Tensor x = at::randn({97, 32}, at::TensorOptions().device(dev)).requires_grad_();
  at::Tensor w = at::randn({24, 32}, at::TensorOptions().device(dev)).requires_grad_();
  at::Tensor b = at::randn({24}, at::TensorOptions().device(dev)).requires_grad_();
  at::Tensor y;
  {
    hax::AutocastScope ac("bf16", dev);
    y = hax::ops::linear_relu(x, w, b);
  }
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  y.to(at::kFloat).sum().backward();
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
  EXPECT_EQ(x.grad().scalar_type(), at::kFloat);
  // Against float64 on the bf16-rounded inputs: within bf16 rounding of the result.
  at::Tensor xr = x.detach().to(at::kBFloat16).to(at::kDouble), wr = w.detach().to(at::kBFloat16).to(at::kDouble),
             br = b.detach().to(at::kBFloat16).to(at::kDouble);
  at::Tensor want = at::relu(at::linear(xr, wr, br));
  EXPECT_LE(rel_err(y.to(at::kDouble).cpu(), want.cpu(), 1e-2, 1.0 / 128), 1.0);
}
