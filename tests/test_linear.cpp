// The linear op against at::linear in float64, finite differences, determinism.
#include "op_harness.h"
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
