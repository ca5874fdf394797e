// Causal depthwise conv1d: kernel vs. the LibTorch definition in float64, gradients, conv
// states, packing, errors.
#include "cuda_harness.h"
#include "op_harness.h"
#include "ops/conv1d/conv1d.h"

using namespace hax::testing;
using hax::ops::causal_conv1d;
using hax::ops::causal_conv1d_forward;
using hax::ops::causal_conv1d_reference;

namespace {

struct ConvSize {
  int64_t B, L, C, W;
  bool bias, init, packed, silu;
};

// with_final: also compare the final conv state (it carries no gradient, so the finite-difference
// check, which differentiates every output, leaves it out).
OpCase conv_case(ConvSize s, bool with_final = true) {
  OpCase c;
  c.name = "conv1d";
  c.make_inputs = [s](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    Tensors in;
    in.push_back(at::randn({s.B, s.L, s.C}, o).requires_grad_());                                     // x
    in.push_back((at::randn({s.C, s.W}, o) * 0.5).detach().requires_grad_());                         // weight
    in.push_back(s.bias ? at::randn({s.C}, o).requires_grad_() : at::Tensor());                       // bias
    in.push_back(s.init ? at::randn({s.B, s.W - 1, s.C}, o).requires_grad_() : at::Tensor());         // init
    in.push_back(s.packed ? random_packing(s.B, s.L, 0.15) : at::Tensor());                           // seq_idx
    return in;
  };
  const bool silu = s.silu;
  c.op = [silu, with_final](const Tensors& in) {
    auto [out, f] = causal_conv1d(in[0], in[1], in[2], in[3], in[4], silu);
    return with_final ? Tensors{out, f} : Tensors{out};
  };
  c.reference = [silu, with_final](const Tensors& in) {
    auto [out, f] = causal_conv1d_reference(in[0], in[1], in[2], in[3], in[4], silu);
    return with_final ? Tensors{out, f} : Tensors{out};
  };
  return c;
}

}  // namespace

TEST(Conv1d, MatchesDefinitionFloat64) {
  // C = 70: one full block of 64 channels and a partial one.
  torch::manual_seed(11);
  for (int64_t L : {1, 63, 97, 1025})
    for (int64_t W : {2, 4})
      for (bool init : {false, true})
        for (bool packed : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "L=" << L << " W=" << W << " init=" << init << " packed=" << packed);
          expect_matches_reference(conv_case({2, L, 70, W, true, init, packed, true}), at::kDouble, 1e-12, 1e-10);
        }
}

TEST(Conv1d, WithoutBiasOrActivationAndOtherWidths) {
  torch::manual_seed(12);
  for (int64_t W : {1, 2, 3, 4, 7})
    for (bool silu : {false, true})
      for (bool bias : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "W=" << W << " silu=" << silu << " bias=" << bias);
        expect_matches_reference(conv_case({3, 20, 13, W, bias, true, true, silu}), at::kDouble, 1e-12, 1e-10);
      }
  // Rows shorter than the window: the final state is padded from the initial state.
  for (int64_t L : {1, 2, 5})
    expect_matches_reference(conv_case({2, L, 5, 6, true, true, false, true}), at::kDouble, 1e-12, 1e-10);
}

TEST(Conv1d, Float32CloseToFloat64Reference) {
  torch::manual_seed(13);
  expect_float32_close_to_reference(conv_case({2, 300, 150, 4, true, true, true, true}), 1e-5, 1e-4);
}

TEST(Conv1d, FiniteDifferenceGradients) {
  torch::manual_seed(14);
  expect_gradients_match_finite_differences(conv_case({2, 29, 11, 4, true, true, true, true}, false));
  expect_gradients_match_finite_differences(conv_case({2, 17, 70, 2, true, true, false, false}, false));
  expect_gradients_match_finite_differences(conv_case({1, 1, 5, 4, true, true, false, true}, false));
}

TEST(Conv1d, FinalStateContinuesTheConvolution) {
  // Running [0, t) then [t, L) with the first part's final state as initial state equals one run,
  // also when t < W-1 (the final state then still holds initial-state entries).
  torch::manual_seed(15);
  const int64_t L = 97, W = 4;
  OpCase c = conv_case({2, L, 19, W, true, true, false, true});
  Tensors in = c.make_inputs(at::kDouble);
  auto [y, f] = causal_conv1d(in[0], in[1], in[2], in[3], at::Tensor(), true);
  for (int64_t t : {1, 2, 50, 96}) {
    auto [y1, f1] = causal_conv1d(in[0].narrow(1, 0, t), in[1], in[2], in[3], at::Tensor(), true);
    auto [y2, f2] = causal_conv1d(in[0].narrow(1, t, L - t), in[1], in[2], f1, at::Tensor(), true);
    EXPECT_LE(rel_err(at::cat({y1, y2}, 1), y, 1e-12, 1e-10), 1.0) << "split at " << t;
    EXPECT_LE(rel_err(f2, f, 1e-12, 1e-10), 1.0) << "split at " << t;
  }
  // Packed: split inside the last sequence; the first part's final state holds only that sequence.
  at::Tensor seq = at::zeros({2, L}, at::kInt);
  seq.narrow(1, 30, L - 30).fill_(1);
  seq.narrow(1, 60, L - 60).fill_(2);
  auto [yp, fp] = causal_conv1d(in[0], in[1], in[2], in[3], seq, true);
  for (int64_t t : {61, 62, 80}) {
    auto [y1, f1] = causal_conv1d(in[0].narrow(1, 0, t), in[1], in[2], in[3], seq.narrow(1, 0, t), true);
    auto [y2, f2] = causal_conv1d(in[0].narrow(1, t, L - t), in[1], in[2], f1, seq.narrow(1, t, L - t), true);
    EXPECT_LE(rel_err(at::cat({y1, y2}, 1), yp, 1e-12, 1e-10), 1.0) << "packed split at " << t;
    EXPECT_LE(rel_err(f2, fp, 1e-12, 1e-10), 1.0) << "packed split at " << t;
  }
}

TEST(Conv1d, PackingEqualsSeparateSequences) {
  torch::manual_seed(16);
  const int64_t C = 9, W = 4, lens[] = {13, 1, 2, 40, 30};
  int64_t L = 0;
  for (auto l : lens) L += l;
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({1, L, C}, o), w = at::randn({C, W}, o), bias = at::randn({C}, o);
  at::Tensor h0 = at::randn({1, W - 1, C}, o);
  at::Tensor seq = at::zeros({1, L}, at::kInt);
  int64_t off = 0, id = 7;
  for (auto l : lens) seq.narrow(1, off, l).fill_(id++), off += l;
  auto [y, f] = causal_conv1d(x, w, bias, h0, seq, true);
  off = 0;
  for (auto l : lens) {
    // The initial state feeds only the row's first sequence.
    auto [ys, fs] = causal_conv1d(x.narrow(1, off, l), w, bias, off == 0 ? h0 : at::Tensor(), at::Tensor(), true);
    EXPECT_LE(rel_err(y.narrow(1, off, l), ys, 1e-12, 1e-10), 1.0) << "segment at " << off;
    if (off + l == L) {
      EXPECT_LE(rel_err(f, fs, 1e-12, 1e-10), 1.0);
    }
    off += l;
  }
}

TEST(Conv1d, FinalStateCarriesNoGradient) {
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({1, 6, 3}, o).requires_grad_(), w = at::randn({3, 4}, o).requires_grad_();
  auto [y, f] = causal_conv1d(x, w, at::Tensor(), at::Tensor(), at::Tensor(), false);
  EXPECT_TRUE(y.requires_grad());
  EXPECT_FALSE(f.requires_grad());
  EXPECT_TRUE(at::equal(f, x.detach().narrow(1, 3, 3)));
}

TEST(Conv1d, DeterministicAcrossThreadCounts) {
  torch::manual_seed(17);
  expect_deterministic_across_threads(conv_case({4, 200, 150, 4, true, true, true, true}));
}

TEST(Conv1d, BadInputsNameTheTensor) {
  auto o = at::TensorOptions().dtype(at::kFloat);
  at::Tensor x = at::randn({2, 5, 16}, o), w = at::randn({16, 3}, o), b = at::randn({16}, o);
  at::Tensor h0 = at::randn({2, 2, 16}, o);
  expect_usage_error([&] { causal_conv1d(x.view({10, 16}), w, b, {}, {}, true); }, "conv1d: x has shape [10, 16]");
  expect_usage_error([&] { causal_conv1d(x.to(at::kLong), w, b, {}, {}, true); }, "conv1d: x has dtype Long");
  expect_usage_error([&] { causal_conv1d(x, at::randn({8, 3}, o), b, {}, {}, true); },
                     "conv1d: weight has shape [8, 3] but must be (C, W) = [16, 3]");
  expect_usage_error([&] { causal_conv1d(x, w.view({48}), b, {}, {}, true); }, "weight has shape [48]");
  expect_usage_error([&] { causal_conv1d(x, at::randn({16, 0}, o), b, {}, {}, true); },
                     "kernel width W = 0 (weight's dim 1) must be at least 1");
  expect_usage_error([&] { causal_conv1d(x, w.to(at::kDouble), b, {}, {}, true); }, "weight has dtype Double");
  expect_usage_error([&] { causal_conv1d(x, w, at::randn({15}, o), {}, {}, true); },
                     "bias has shape [15] but must be (C) = [16]");
  expect_usage_error([&] { causal_conv1d(x, w, b.to(at::kDouble), {}, {}, true); }, "bias has dtype Double");
  expect_usage_error([&] { causal_conv1d(x, w, b, at::randn({2, 3, 16}, o), {}, true); },
                     "init_state has shape [2, 3, 16] but must be (B, W-1, C) = [2, 2, 16]");
  expect_usage_error([&] { causal_conv1d(x, w, b, h0.to(at::kDouble), {}, true); }, "init_state has dtype Double");
  expect_usage_error([&] { causal_conv1d(x, w, b, h0, at::zeros({2, 6}, at::kInt), true); },
                     "seq_idx has shape [2, 6]");
  at::Tensor bad_seq = at::tensor({0, 0, 1, 1, 0, 0, 0, 0, 0, 0}, at::kInt).view({2, 5});
  expect_usage_error([&] { causal_conv1d(x, w, b, h0, bad_seq, true); }, "non-decreasing");
  expect_usage_error([&] { causal_conv1d_forward(x, at::randn({16, 0}, o), b, {}, {}, true); }, "W = 0");
}

// ---- CUDA (skipped without a GPU) ----

TEST(Conv1dCuda, MatchesCpuFloat32AndBf16) {
  // Channel counts that leave a partial 32-channel tile; lengths around the 128-position blocks.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(21);
  for (int64_t L : {1, 2, 3, 63, 97, 1025})
    for (int64_t W : {2, 3, 4})
      for (int64_t C : {33, 100})
        for (int flags = 0; flags < 8; ++flags) {
          if (C == 100 && flags % 3 != 0) continue;  // every combination at C = 33, a few at 100
          const bool bias = flags & 1, init = flags & 2, packed = flags & 4, silu = (flags + W) % 2 == 0;
          SCOPED_TRACE(::testing::Message() << "L=" << L << " W=" << W << " C=" << C << " bias=" << bias
                                            << " init=" << init << " packed=" << packed << " silu=" << silu);
          OpCase c = conv_case({2, L, C, W, bias, init, packed, silu});
          expect_cuda_matches_cpu(c, 2e-5, 1e-4);
          expect_cuda_bf16_close(c);
        }
}

TEST(Conv1dCuda, OtherWidthsAndShortRows) {
  // Widths of every compiled bound (4, 8, 16) and rows shorter than the window.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(22);
  for (int64_t W : {1, 5, 8, 9, 16})
    for (int64_t L : {1, 5, 200}) {
      SCOPED_TRACE(::testing::Message() << "W=" << W << " L=" << L);
      OpCase c = conv_case({3, L, 40, W, true, true, true, true});
      expect_cuda_matches_cpu(c, 2e-5, 1e-4);
      expect_cuda_bf16_close(c);
    }
}

TEST(Conv1dCuda, LongRow) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(23);
  OpCase c = conv_case({1, 65537, 5, 4, true, true, true, true});
  expect_cuda_matches_cpu(c, 1e-4, 1e-4);
  expect_cuda_bf16_close(c);
}

TEST(Conv1dCuda, EmptyRowKeepsTheState) {
  HAX_REQUIRE_CUDA();
  auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  at::Tensor h0 = at::randn({2, 3, 7}, o);
  auto [y, f] = causal_conv1d_forward(at::zeros({2, 0, 7}, o), at::randn({7, 4}, o), at::randn({7}, o), h0, {}, true);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 0, 7}));
  EXPECT_TRUE(at::equal(f, h0));
}

TEST(Conv1dCuda, GradientsAreBitIdenticalAcrossRuns) {
  // dweight and dbias are reduced in a fixed order (no atomics), deterministic mode or not.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(24);
  OpCase c = conv_case({4, 3000, 70, 4, true, true, true, true});
  Tensors in = to_device(c.make_inputs(at::kFloat), at::Device(at::kCUDA, 0), at::kFloat);
  Tensors w = random_cotangents(c.op(clone_leaves(in)));
  auto [o1, g1] = run_on_device(c.op, in, w);
  auto [o2, g2] = run_on_device(c.op, in, w);
  for (size_t i = 0; i < g1.size(); ++i) {
    if (g1[i].defined()) {
      EXPECT_TRUE(at::equal(g1[i], g2[i])) << "gradient " << i;
    }
  }
}

TEST(Conv1dCuda, BadInputsNameTheTensor) {
  HAX_REQUIRE_CUDA();
  auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  at::Tensor x = at::randn({2, 5, 16}, o);
  expect_usage_error([&] { causal_conv1d(x, at::randn({16, 17}, o), {}, {}, {}, true); },
                     "kernel width W = 17 (weight's dim 1) exceeds the CUDA kernels' maximum 16");
  expect_usage_error([&] { causal_conv1d(x.to(at::kDouble), at::randn({16, 4}, o).to(at::kDouble), {}, {}, {}, true); },
                     "x has dtype Double on cuda:0, but the CUDA kernels take float32 or bfloat16");
  expect_usage_error([&] { causal_conv1d(x, at::randn({16, 4}), {}, {}, {}, true); }, "weight is on cpu");
}
