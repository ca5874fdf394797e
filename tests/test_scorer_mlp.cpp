// The scorer MLP op (ops/scorer_mlp): on the CPU against a float64 loop over rows written from the
// definition; on CUDA the fused bfloat16 kernel (forward) and its recomputing backward against the
// float64 definition, within twice a naive bfloat16 computation's error, on awkward row counts
// (1, 63, 97, 1025, 65537 positions) and every hidden width the kernel takes. Outputs are poisoned
// (NaN) before the GPU runs, so a row the kernel never writes fails. Without a GPU those skip.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda_harness.h"
#include "ops/scorer_mlp/scorer_mlp.h"
#include "train/precision.h"

namespace {

using hax::testing::OpCase;
using hax::testing::Tensors;

// k (B, L, H, N), u (unit rows), then w1, b1, w2, b2, w3, b3 at nn::Linear's initial scale.
Tensors make_inputs(int64_t B, int64_t L, int64_t H, int64_t N, int64_t hidden, at::ScalarType dt) {
  const auto o = at::TensorOptions().dtype(dt);
  at::Tensor k = at::randn({B, L, H, N}, o) * 0.5;
  at::Tensor u = at::randn({B, L, H, N}, o);
  u = u / u.norm(2, -1, true).clamp_min(1e-12);
  auto uniform = [&](std::vector<int64_t> shape, int64_t fan_in) {
    return ((at::rand(shape, o) * 2 - 1) / std::sqrt((double)fan_in)).requires_grad_();
  };
  return {k, u, uniform({hidden, 2 * N}, 2 * N), uniform({hidden}, 2 * N), uniform({hidden, hidden}, hidden),
          uniform({hidden}, hidden), uniform({1, hidden}, hidden), uniform({1}, hidden)};
}

Tensors run_op(const Tensors& t) { return {hax::ops::scorer_mlp(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7])}; }
Tensors run_reference(const Tensors& t) {
  return {hax::ops::scorer_mlp_reference(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7])};
}

OpCase scorer_case(int64_t B, int64_t L, int64_t H, int64_t N, int64_t hidden) {
  const std::string name = "B=" + std::to_string(B) + " L=" + std::to_string(L) + " H=" + std::to_string(H) +
                           " N=" + std::to_string(N) + " hidden=" + std::to_string(hidden);
  return {name, [=](at::ScalarType dt) { return make_inputs(B, L, H, N, hidden, dt); }, run_op, run_reference};
}

// The definition row by row in float64 with plain loops (independent of LibTorch's products).
at::Tensor loop_reference(const Tensors& t) {
  const at::Tensor k = t[0].to(at::kDouble).contiguous(), u = t[1].to(at::kDouble).contiguous();
  const int64_t N = k.size(-1), R = k.numel() / N, hid = t[2].size(0);
  auto d = [](const at::Tensor& x) { return x.detach().to(at::kDouble).contiguous(); };
  const at::Tensor w1 = d(t[2]), b1 = d(t[3]), w2 = d(t[4]), b2 = d(t[5]), w3 = d(t[6]), b3 = d(t[7]);
  const double *kp = k.data_ptr<double>(), *up = u.data_ptr<double>(), *W1 = w1.data_ptr<double>(),
               *B1 = b1.data_ptr<double>(), *W2 = w2.data_ptr<double>(), *B2 = b2.data_ptr<double>(),
               *W3 = w3.data_ptr<double>();
  at::Tensor out = at::empty({R}, at::kDouble);
  std::vector<double> x(2 * N), h1(hid);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t n = 0; n < N; ++n) x[n] = kp[r * N + n], x[N + n] = up[r * N + n];
    for (int64_t o = 0; o < hid; ++o) {
      double s = B1[o];
      for (int64_t i = 0; i < 2 * N; ++i) s += W1[o * 2 * N + i] * x[i];
      h1[o] = std::max(s, 0.0);
    }
    double score = b3.item<double>();
    for (int64_t o = 0; o < hid; ++o) {
      double s = B2[o];
      for (int64_t i = 0; i < hid; ++i) s += W2[o * hid + i] * h1[i];
      score += W3[o] * std::max(s, 0.0);
    }
    out[r] = score;
  }
  return out.view(k.sizes().slice(0, k.dim() - 1));
}

TEST(ScorerMlp, CpuEqualsRowLoopInFloat64) {
  for (auto [L, N, hid] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 4, 8}, {63, 8, 16}, {97, 24, 48}}) {
    torch::manual_seed(L);
    const Tensors in64 = make_inputs(2, L, 3, N, hid, at::kDouble);
    const at::Tensor want = loop_reference(in64);
    EXPECT_LE((run_op(in64)[0] - want).abs().max().item<double>(), 1e-12) << "L=" << L << " N=" << N;
    const Tensors in32 = make_inputs(2, L, 3, N, hid, at::kFloat);
    const at::Tensor got32 = run_op(in32)[0].to(at::kDouble);
    EXPECT_LE(hax::testing::rel_err(got32, loop_reference(in32), 1e-5, 1e-5), 1.0) << "float32 L=" << L;
  }
}

TEST(ScorerMlp, BadArgumentsNameTheTensorAndConstraint) {
  const Tensors t = make_inputs(1, 5, 2, 8, 16, at::kFloat);
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string m = message([&] { hax::ops::scorer_mlp(t[0], t[1].narrow(1, 0, 4), t[2], t[3], t[4], t[5], t[6], t[7]); });
  EXPECT_NE(m.find("scorer_mlp: u"), std::string::npos) << m;
  m = message([&] { hax::ops::scorer_mlp(t[0], t[1], t[2].narrow(1, 0, 8), t[3], t[4], t[5], t[6], t[7]); });
  EXPECT_NE(m.find("w1"), std::string::npos) << m;
  EXPECT_NE(m.find("(hidden, 2N)"), std::string::npos) << m;
  m = message([&] { hax::ops::scorer_mlp(t[0], t[1], t[2], t[3], t[4], t[5], t[6].view({16, 1}), t[7]); });
  EXPECT_NE(m.find("w3"), std::string::npos) << m;
  m = message([&] { hax::ops::scorer_mlp(t[0], t[1], t[2], t[3].narrow(0, 0, 3), t[4], t[5], t[6], t[7]); });
  EXPECT_NE(m.find("b1"), std::string::npos) << m;
}

// Every hidden width the kernels take, input widths 2N = 16 .. 256, and awkward position counts.
// Hidden 64 or 128 with 2N a multiple of 64 runs the warpgroup kernel on an H100 build
// (scorer_mlp_wgmma.cu), the other sizes scorer_mlp.cu's.
TEST(ScorerMlpCuda, Bfloat16WithinTwiceNaiveError) {
  HAX_REQUIRE_CUDA();
  struct Size {
    int64_t B, L, H, N, hidden;
  };
  const std::vector<Size> sizes = {{1, 1, 1, 8, 16},    {2, 63, 3, 16, 32},  {1, 97, 5, 24, 64},
                                   {1, 1025, 4, 64, 128}, {1, 65537, 1, 64, 128}, {3, 97, 2, 128, 128},
                                   {1, 33, 2, 32, 16},   {1, 97, 3, 32, 64},  {2, 63, 2, 96, 64},
                                   {1, 1025, 2, 32, 128}, {1, 1, 1, 64, 64}};
  for (const auto& s : sizes) {
    torch::manual_seed(s.L * 7 + s.N);
    const OpCase c = scorer_case(s.B, s.L, s.H, s.N, s.hidden);
    const Tensors probe = hax::testing::to_device(c.make_inputs(at::kFloat), at::Device(at::kCUDA, 0), at::kBFloat16);
    ASSERT_TRUE(hax::ops::scorer_mlp_fused_applies(probe[0], probe[1], probe[2], probe[4])) << c.name;
    SCOPED_TRACE(c.name);
    hax::testing::expect_cuda_bf16_close(c);
  }
}

// Shapes of one hidden width whose shared memory shrinks, then grows back: the kernel's
// shared-memory limit is set per kernel, not per shape, so the smaller shape must not lower it
// below what the larger (cached) one launches with. 2N = 128 takes 138 KB at hidden 128, 2N = 64
// takes 90 KB; the second 2N = 128 call failed to launch when the limit followed the last shape.
TEST(ScorerMlpCuda, SharedMemoryOfAnEarlierShapeStaysAllowed) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(41);
  for (int64_t N : {64, 32, 64}) {
    const OpCase c = scorer_case(1, 97, 2, N, 128);
    SCOPED_TRACE(c.name);
    hax::testing::expect_cuda_bf16_close(c);
  }
}

// float32 on CUDA (LibTorch's products: the kernel takes bfloat16 only) equals the CPU.
TEST(ScorerMlpCuda, Float32MatchesCpu) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(3);
  hax::testing::expect_cuda_matches_cpu(scorer_case(2, 97, 3, 16, 32), 1e-5, 1e-5);
}

// Under autocast, float32 weights and bfloat16 inputs take the fused kernel on bfloat16 copies of
// the weights: the same scores as the op on those copies, and float32 gradients for the weights.
TEST(ScorerMlpCuda, AutocastUsesBfloat16Weights) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(5);
  Tensors t = hax::testing::to_device(make_inputs(1, 200, 2, 32, 64, at::kFloat), at::Device(at::kCUDA, 0), at::kFloat);
  t[0] = t[0].to(at::kBFloat16), t[1] = t[1].to(at::kBFloat16);
  Tensors t16 = t;
  for (size_t i = 2; i < t16.size(); ++i) t16[i] = t[i].detach().to(at::kBFloat16);
  const at::Tensor want = run_op(t16)[0];
  at::Tensor got;
  {
    hax::AutocastScope ac("bf16", at::Device(at::kCUDA, 0));
    got = run_op(t)[0];
  }
  ASSERT_EQ(got.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(got, want));
  got.to(at::kFloat).sum().backward();
  for (size_t i = 2; i < t.size(); ++i) {
    ASSERT_TRUE(t[i].grad().defined()) << "weight " << i;
    EXPECT_EQ(t[i].grad().scalar_type(), at::kFloat);
    EXPECT_TRUE(t[i].grad().isfinite().all().item<bool>());
  }
}

}  // namespace
