// Fused decoding steps (conv1d_step, ssd_step, selective_scan_step): the CPU ops against the
// LibTorch expressions they replace (float64), token-by-token decoding against the sequence ops,
// in-place state updates, errors; CUDA against the CPU (float32) and bfloat16 against float64.
#include "cuda_harness.h"
#include "op_harness.h"
#include "ops/conv1d/conv1d.h"
#include "ops/selective_scan/selective_scan.h"
#include "ops/ssd/ssd.h"
#include "ops/ssm_step/ssm_step.h"

using namespace hax::testing;
namespace ops = hax::ops;

namespace {

// The same values as t (B, ...), as a slice of a wider projection: each row contiguous, rows
// further apart (how the layers pass x, dt, B and C).
at::Tensor as_slice(const at::Tensor& t) {
  const int64_t B = t.size(0), row = B ? t.numel() / B : 0;
  at::Tensor wide = at::zeros({B, row + 9}, t.options());
  wide.narrow(1, 4, row).copy_(t.reshape({B, row}));
  std::vector<int64_t> shape = t.sizes().vec();
  return wide.narrow(1, 4, row).view(shape);
}

at::Tensor maybe_slice(const at::Tensor& t, bool slice) { return slice ? as_slice(t) : t; }

struct ConvStep {
  int64_t B, C, W;
  bool bias, silu, sliced;
};

// Outputs: (out (B, C), the updated state).
OpCase conv_step_case(ConvStep s) {
  OpCase c;
  c.name = "conv1d_step";
  c.make_inputs = [s](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    return Tensors{at::randn({s.B, s.C}, o), at::randn({s.B, s.W - 1, s.C}, o), at::randn({s.C, s.W}, o) * 0.5,
                   s.bias ? at::randn({s.C}, o) : at::Tensor()};
  };
  c.op = [s](const Tensors& in) {
    at::Tensor st = in[1].clone();
    at::Tensor out = ops::conv1d_step(maybe_slice(in[0], s.sliced), st, in[2], in[3], s.silu);
    return Tensors{out, st};
  };
  c.reference = [s](const Tensors& in) {
    at::Tensor st = in[1].clone();
    at::Tensor out = ops::conv1d_step_reference(in[0], st, in[2], in[3], s.silu);
    return Tensors{out, st};
  };
  return c;
}

struct SsdStep {
  int64_t B, H, P, G, N;
  bool skip, bias, softplus, sliced, float_state;
};

// Outputs: (y (B, H, P), the updated state). float_state: the op gets a float32 copy of the state.
OpCase ssd_step_case(SsdStep s) {
  OpCase c;
  c.name = "ssd_step";
  c.make_inputs = [s](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    at::Tensor dtv = s.softplus ? at::randn({s.B, s.H}, o) - 1.0 : at::rand({s.B, s.H}, o) * 0.5;
    return Tensors{at::randn({s.B, s.H, s.P}, o),                                   // x
                   dtv,                                                             // dt (raw)
                   -at::exp(at::randn({s.H}, o)),                                   // A
                   at::randn({s.B, s.G, s.N}, o),                                   // B
                   at::randn({s.B, s.G, s.N}, o),                                   // C
                   s.skip ? at::randn({s.H}, o) : at::Tensor(),                     // D
                   s.bias ? at::randn({s.H}, o) * 0.5 : at::Tensor(),               // dt_bias
                   at::randn({s.B, s.H, s.P, s.N}, o)};                             // state
  };
  c.op = [s](const Tensors& in) {
    at::Tensor st = s.float_state ? in[7].to(at::kFloat).clone() : in[7].clone();
    at::Tensor y = ops::ssd_step(maybe_slice(in[0], s.sliced), maybe_slice(in[1], s.sliced), in[2],
                                 maybe_slice(in[3], s.sliced), maybe_slice(in[4], s.sliced), in[5], in[6], s.softplus,
                                 st);
    return Tensors{y, st};
  };
  c.reference = [s](const Tensors& in) {
    at::Tensor st = in[7].clone();
    at::Tensor y = ops::ssd_step_reference(in[0], in[1], in[2], in[3], in[4], in[5], in[6], s.softplus, st);
    return Tensors{y, st};
  };
  return c;
}

struct ScanStep {
  int64_t B, D, G, N;
  bool skip, bias, softplus, sliced, float_state;
};

// Outputs: (y (B, D), the updated state).
OpCase scan_step_case(ScanStep s) {
  OpCase c;
  c.name = "selective_scan_step";
  c.make_inputs = [s](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    at::Tensor dl = s.softplus ? at::randn({s.B, s.D}, o) - 1.0 : at::rand({s.B, s.D}, o) * 0.5;
    return Tensors{at::randn({s.B, s.D}, o),                                        // x
                   dl,                                                              // delta (raw)
                   -at::exp(at::randn({s.D, s.N}, o) * 0.5),                        // A
                   at::randn({s.B, s.G, s.N}, o),                                   // B
                   at::randn({s.B, s.G, s.N}, o),                                   // C
                   s.skip ? at::randn({s.D}, o) : at::Tensor(),                     // D
                   s.bias ? at::randn({s.D}, o) * 0.5 : at::Tensor(),               // delta_bias
                   at::randn({s.B, s.D, s.N}, o)};                                  // state
  };
  c.op = [s](const Tensors& in) {
    at::Tensor st = s.float_state ? in[7].to(at::kFloat).clone() : in[7].clone();
    at::Tensor y = ops::selective_scan_step(maybe_slice(in[0], s.sliced), maybe_slice(in[1], s.sliced), in[2],
                                            maybe_slice(in[3], s.sliced), maybe_slice(in[4], s.sliced), in[5], in[6],
                                            s.softplus, st);
    return Tensors{y, st};
  };
  c.reference = [s](const Tensors& in) {
    at::Tensor st = in[7].clone();
    at::Tensor y = ops::selective_scan_step_reference(in[0], in[1], in[2], in[3], in[4], in[5], in[6], s.softplus, st);
    return Tensors{y, st};
  };
  return c;
}

}  // namespace

TEST(SsmStep, Conv1dStepMatchesTheLibTorchExpressionFloat64) {
  torch::manual_seed(41);
  for (int64_t B : {1, 63})
    for (int64_t W : {1, 2, 4, 7})
      for (bool bias : {false, true})
        for (bool silu : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "B=" << B << " W=" << W << " bias=" << bias << " silu=" << silu);
          expect_matches_reference(conv_step_case({B, 37, W, bias, silu, B > 1}), at::kDouble, 1e-13, 1e-12);
        }
}

TEST(SsmStep, SsdStepMatchesTheLibTorchExpressionFloat64) {
  torch::manual_seed(42);
  for (int64_t B : {1, 63})
    for (auto [H, P, G, N] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{8, 16, 1, 32}, {4, 64, 2, 16}, {3, 5, 3, 7}})
      for (int flags = 0; flags < 8; ++flags) {
        const bool skip = flags & 1, bias = flags & 2, softplus = flags & 4;
        SCOPED_TRACE(::testing::Message() << "B=" << B << " H=" << H << " P=" << P << " G=" << G << " N=" << N
                                          << " flags=" << flags);
        expect_matches_reference(ssd_step_case({B, H, P, G, N, skip, bias, softplus, flags % 3 == 0, false}),
                                 at::kDouble, 1e-13, 1e-12);
      }
}

TEST(SsmStep, SelectiveScanStepMatchesTheLibTorchExpressionFloat64) {
  torch::manual_seed(43);
  for (int64_t B : {1, 63})
    for (auto [D, G, N] : {std::tuple<int64_t, int64_t, int64_t>{33, 1, 16}, {100, 2, 16}, {24, 4, 5}})
      for (int flags = 0; flags < 8; ++flags) {
        const bool skip = flags & 1, bias = flags & 2, softplus = flags & 4;
        SCOPED_TRACE(::testing::Message() << "B=" << B << " D=" << D << " G=" << G << " N=" << N << " flags=" << flags);
        expect_matches_reference(scan_step_case({B, D, G, N, skip, bias, softplus, flags % 3 == 0, false}),
                                 at::kDouble, 1e-13, 1e-12);
      }
}

TEST(SsmStep, Float32StateWithFloat64Inputs) {
  // The state may be float32 whatever the inputs: rounded on each store, nothing else changes.
  torch::manual_seed(44);
  for (OpCase c : {ssd_step_case({3, 4, 8, 2, 16, true, true, true, false, true}),
                   scan_step_case({3, 20, 1, 16, true, false, true, false, true})}) {
    SCOPED_TRACE(c.name);
    Tensors in = c.make_inputs(at::kDouble);
    Tensors out = c.op(in), ref = c.reference(in);
    EXPECT_EQ(out[1].scalar_type(), at::kFloat);
    EXPECT_LE(rel_err(out[0], ref[0], 1e-6, 1e-5), 1.0);
    EXPECT_LE(rel_err(out[1], ref[1], 1e-6, 1e-5), 1.0);
  }
}

TEST(SsmStep, StatesAreUpdatedInPlace) {
  torch::manual_seed(45);
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor conv = at::randn({2, 3, 6}, o), x = at::randn({2, 6}, o);
  const void* before = conv.data_ptr();
  at::Tensor old = conv.clone();
  ops::conv1d_step(x, conv, at::randn({6, 4}, o), at::Tensor(), true);
  EXPECT_EQ(conv.data_ptr(), before);
  EXPECT_TRUE(at::equal(conv.narrow(1, 0, 2), old.narrow(1, 1, 2)));  // the window rolled
  EXPECT_TRUE(at::equal(conv.select(1, 2), x));                       // the new input last
  at::Tensor ssm = at::zeros({2, 4, 3, 5}, o);
  at::Tensor y = ops::ssd_step(at::randn({2, 4, 3}, o), at::rand({2, 4}, o), -at::ones({4}, o), at::randn({2, 1, 5}, o),
                               at::randn({2, 1, 5}, o), at::Tensor(), at::Tensor(), false, ssm);
  EXPECT_GT(ssm.abs().sum().item<double>(), 0);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 4, 3}));
}

TEST(SsmStep, DecodingTokenByTokenEqualsTheSequenceOps) {
  torch::manual_seed(46);
  auto o = at::TensorOptions().dtype(at::kDouble);
  const int64_t B = 2, L = 23;
  {  // causal conv1d with an initial state
    const int64_t C = 10, W = 4;
    at::Tensor x = at::randn({B, L, C}, o), w = at::randn({C, W}, o), bias = at::randn({C}, o);
    at::Tensor h0 = at::randn({B, W - 1, C}, o);
    auto [full, fin] = ops::causal_conv1d(x, w, bias, h0, at::Tensor(), true);
    at::Tensor st = h0.clone();
    for (int64_t t = 0; t < L; ++t) {
      at::Tensor out = ops::conv1d_step(x.select(1, t), st, w, bias, true);
      ASSERT_LE(rel_err(out, full.select(1, t), 1e-12, 1e-10), 1.0) << "conv t=" << t;
    }
    EXPECT_LE(rel_err(st, fin, 1e-12, 1e-10), 1.0);
  }
  {  // SSD (Mamba-2) with dt bias + softplus and the D skip
    const int64_t H = 4, P = 3, G = 2, N = 5;
    at::Tensor x = at::randn({B, L, H, P}, o), dt = at::randn({B, L, H}, o), dt_bias = at::randn({H}, o);
    at::Tensor A = -at::exp(at::randn({H}, o)), D = at::randn({H}, o);
    at::Tensor Bm = at::randn({B, L, G, N}, o), Cm = at::randn({B, L, G, N}, o), h0 = at::randn({B, H, P, N}, o);
    auto [y, fin] = ops::ssd_reference(x, at::softplus(dt + dt_bias), A, Bm, Cm, h0, at::Tensor());
    at::Tensor full = y + x * D.view({1, 1, H, 1});
    at::Tensor st = h0.clone();
    for (int64_t t = 0; t < L; ++t) {
      at::Tensor yt = ops::ssd_step(x.select(1, t), dt.select(1, t), A, Bm.select(1, t), Cm.select(1, t), D, dt_bias,
                                    true, st);
      ASSERT_LE(rel_err(yt, full.select(1, t), 1e-12, 1e-10), 1.0) << "ssd t=" << t;
    }
    EXPECT_LE(rel_err(st, fin, 1e-12, 1e-10), 1.0);
  }
  {  // selective scan (Mamba) with softplus and the D skip
    const int64_t D = 12, G = 3, N = 6;
    at::Tensor x = at::randn({B, L, D}, o), dl = at::randn({B, L, D}, o), A = -at::exp(at::randn({D, N}, o));
    at::Tensor Dv = at::randn({D}, o), Bm = at::randn({B, L, G, N}, o), Cm = at::randn({B, L, G, N}, o);
    at::Tensor h0 = at::randn({B, D, N}, o);
    auto [y, fin] = ops::selective_scan(x, at::softplus(dl), A, Bm, Cm, h0, at::Tensor());
    at::Tensor full = y + x * Dv;
    at::Tensor st = h0.clone();
    for (int64_t t = 0; t < L; ++t) {
      at::Tensor yt = ops::selective_scan_step(x.select(1, t), dl.select(1, t), A, Bm.select(1, t), Cm.select(1, t), Dv,
                                               at::Tensor(), true, st);
      ASSERT_LE(rel_err(yt, full.select(1, t), 1e-12, 1e-10), 1.0) << "scan t=" << t;
    }
    EXPECT_LE(rel_err(st, fin, 1e-12, 1e-10), 1.0);
  }
}

TEST(SsmStep, BadInputsNameTheTensor) {
  auto o = at::TensorOptions().dtype(at::kFloat);
  at::Tensor x = at::randn({2, 8}, o), conv = at::zeros({2, 3, 8}, o), w = at::randn({8, 4}, o);
  expect_usage_error([&] { ops::conv1d_step(x, at::zeros({2, 2, 8}, o), w, {}, true); },
                     "conv1d_step: conv_state has shape [2, 2, 8] but must be (B, W-1, C) = [2, 3, 8]");
  expect_usage_error([&] { ops::conv1d_step(x, at::zeros({2, 8, 3}, o).transpose(1, 2), w, {}, true); },
                     "conv1d_step: conv_state (shape [2, 3, 8]) must be contiguous");
  expect_usage_error([&] { ops::conv1d_step(x, conv.to(at::kDouble), w, {}, true); },
                     "conv1d_step: conv_state has dtype Double");
  expect_usage_error([&] { ops::conv1d_step(x, conv, w, at::randn({7}, o), true); }, "bias has shape [7]");
  expect_usage_error([&] { ops::conv1d_step(x, conv, at::randn({8, 0}, o), {}, true); }, "kernel width W = 0");

  at::Tensor xs = at::randn({2, 4, 3}, o), dt = at::rand({2, 4}, o), A = -at::ones({4}, o);
  at::Tensor Bm = at::randn({2, 2, 5}, o), st = at::zeros({2, 4, 3, 5}, o);
  expect_usage_error([&] { ops::ssd_step(xs, dt, A, at::randn({2, 3, 5}, o), at::randn({2, 3, 5}, o), {}, {}, true, st); },
                     "ssd_step: the group count G = 3 (B's dim 1) must divide the head count 4");
  expect_usage_error([&] { ops::ssd_step(xs, dt, A, Bm, at::randn({2, 2, 4}, o), {}, {}, true, st); },
                     "ssd_step: C has shape [2, 2, 4] but must be (B, G, N) = [2, 2, 5]");
  expect_usage_error([&] { ops::ssd_step(xs, dt, A, Bm, Bm, {}, {}, true, st.to(at::kDouble)); },
                     "ssd_step: state has dtype Double but must have x's dtype Float or be float32");
  expect_usage_error([&] { ops::ssd_step(xs, dt, A, Bm, Bm, {}, {}, true, at::zeros({2, 4, 5, 3}, o).transpose(2, 3)); },
                     "ssd_step: state (shape [2, 4, 3, 5]) must be contiguous");
  expect_usage_error([&] { ops::ssd_step(xs, dt, A, Bm, Bm, at::randn({3}, o), {}, true, st); },
                     "ssd_step: D has shape [3] but must be (H) = [4]");
  expect_usage_error([&] { ops::ssd_step(xs, dt, A, Bm, Bm, {}, at::randn({4}, at::kDouble), true, st); },
                     "ssd_step: dt_bias has dtype Double");

  at::Tensor xm = at::randn({2, 6}, o), dl = at::rand({2, 6}, o), Am = -at::ones({6, 5}, o);
  at::Tensor sm = at::zeros({2, 6, 5}, o);
  expect_usage_error([&] { ops::selective_scan_step(xm, dl, Am, at::randn({2, 4, 5}, o), at::randn({2, 4, 5}, o), {}, {},
                                                    true, sm); },
                     "selective_scan_step: the group count G = 4 (B's dim 1) must divide the channel count 6");
  expect_usage_error([&] { ops::selective_scan_step(xm, dl, -at::ones({6, 4}, o), Bm, Bm, {}, {}, true, sm); },
                     "selective_scan_step: A has shape [6, 4] but must be (D, N) = [6, 5]");
  expect_usage_error([&] { ops::selective_scan_step(xm, dl, Am, Bm, Bm, {}, {}, true, at::zeros({2, 6, 4}, o)); },
                     "selective_scan_step: state has shape [2, 6, 4] but must be (B, D, N) = [2, 6, 5]");
}

// ---- CUDA (skipped without a GPU) ----

TEST(SsmStepCuda, Conv1dStepMatchesCpuFloat32AndBf16) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(51);
  for (int64_t B : {1, 63})
    for (int64_t C : {33, 100, 256})
      for (int64_t W : {1, 2, 4})
        for (int flags = 0; flags < 4; ++flags) {
          SCOPED_TRACE(::testing::Message() << "B=" << B << " C=" << C << " W=" << W << " flags=" << flags);
          OpCase c = conv_step_case({B, C, W, bool(flags & 1), bool(flags & 2), flags == 3});
          expect_cuda_matches_cpu(c, 1e-5, 1e-5);
          expect_cuda_bf16_close(c);
        }
}

TEST(SsmStepCuda, SsdStepMatchesCpuFloat32AndBf16) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(52);
  for (int64_t B : {1, 63})
    for (auto [H, P, G, N] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{8, 16, 1, 32}, {4, 64, 2, 16},
                              {3, 5, 3, 7}, {2, 128, 1, 128}, {16, 32, 4, 64}})
      for (int flags = 0; flags < 4; ++flags) {
        const bool skip = flags != 1, bias = flags != 2, sliced = flags == 3;
        SCOPED_TRACE(::testing::Message() << "B=" << B << " H=" << H << " P=" << P << " G=" << G << " N=" << N
                                          << " flags=" << flags);
        expect_cuda_matches_cpu(ssd_step_case({B, H, P, G, N, skip, bias, true, sliced, false}), 1e-5, 1e-4);
        expect_cuda_bf16_close(ssd_step_case({B, H, P, G, N, skip, bias, true, sliced, false}));
        expect_cuda_bf16_close(ssd_step_case({B, H, P, G, N, skip, bias, true, sliced, true}));  // float32 state
      }
}

TEST(SsmStepCuda, SelectiveScanStepMatchesCpuFloat32AndBf16) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(53);
  for (int64_t B : {1, 63})
    for (auto [D, G, N] : {std::tuple<int64_t, int64_t, int64_t>{33, 1, 16}, {100, 2, 16}, {256, 4, 8}, {64, 1, 64}})
      for (int flags = 0; flags < 4; ++flags) {
        const bool skip = flags != 1, softplus = flags != 2, sliced = flags == 3;
        SCOPED_TRACE(::testing::Message() << "B=" << B << " D=" << D << " G=" << G << " N=" << N << " flags=" << flags);
        expect_cuda_matches_cpu(scan_step_case({B, D, G, N, skip, flags == 0, softplus, sliced, false}), 1e-5, 1e-4);
        expect_cuda_bf16_close(scan_step_case({B, D, G, N, skip, flags == 0, softplus, sliced, false}));
        expect_cuda_bf16_close(scan_step_case({B, D, G, N, skip, flags == 0, softplus, sliced, true}));
      }
}
