// Causal (sliding-window, packed) attention: the blocked online-softmax kernels against the dense
// masked-softmax reference, gradients, long sequences, errors.
#include <cmath>

#include "cuda_harness.h"
#include "ops/attention/attention.h"
#include "ops/causal_attention/causal_attention.h"

using namespace hax::testing;
using hax::ops::causal_attention;
using hax::ops::causal_attention_reference;

namespace {

struct CausalSize {
  int64_t B, L, H, D, Dv, window;
  bool packed;
};

std::string describe(const CausalSize& s) {
  return ::testing::PrintToString(std::vector<int64_t>{s.B, s.L, s.H, s.D, s.Dv}) +
         " window=" + std::to_string(s.window) + " packed=" + std::to_string(s.packed);
}

OpCase causal_case(CausalSize s) {
  OpCase c;
  c.name = "causal_attention " + describe(s);
  c.make_inputs = [s](at::ScalarType dt) {
    Tensors in = random_qkv(s.B, s.L, s.H, s.D, s.Dv, dt);
    in.push_back(s.packed ? random_packing(s.B, s.L, 0.05) : at::Tensor());
    return in;
  };
  const double scale = 1.0 / std::sqrt(double(s.D));
  const int64_t window = s.window;
  c.op = [=](const Tensors& in) {
    auto [out, lse] = causal_attention(in[0], in[1], in[2], in[3], window, scale);
    return Tensors{out, lse};
  };
  c.reference = [=](const Tensors& in) {
    auto [out, lse] = causal_attention_reference(in[0], in[1], in[2], in[3], window, scale);
    return Tensors{out, lse};
  };
  return c;
}

}  // namespace

TEST(CausalAttention, MatchesReferenceFloat64) {
  torch::manual_seed(1);
  const int64_t dims[] = {16, 32, 64};
  int n = 0;
  for (int64_t L : {1, 63, 97, 130})
    for (int64_t window : {0, 1, 5, 64})
      for (bool packed : {false, true}) {
        const int64_t D = dims[n % 3], Dv = n % 2 ? D : dims[(n + 1) % 3];
        ++n;
        CausalSize s{2, L, 2, D, Dv, window, packed};
        SCOPED_TRACE(describe(s));
        expect_matches_reference(causal_case(s), at::kDouble, 1e-11, 1e-9);
      }
}

TEST(CausalAttention, LongSequenceMatchesReferenceFloat64) {
  torch::manual_seed(2);
  for (int64_t window : {0, 64, 300})
    for (bool packed : {false, true}) {
      CausalSize s{1, 1025, 1, 32, 16, window, packed};
      SCOPED_TRACE(describe(s));
      expect_matches_reference(causal_case(s), at::kDouble, 1e-11, 1e-9);
    }
}

TEST(CausalAttention, VeryLongSequenceForwardRowsFloat64) {
  // L = 3000: a few rows recomputed directly in float64 from their visible keys.
  torch::manual_seed(3);
  const int64_t B = 2, L = 3000, H = 2, D = 64, Dv = 32;
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor q = at::randn({B, L, H, D}, o), k = at::randn({B, L, H, D}, o), v = at::randn({B, L, H, Dv}, o);
  at::Tensor q32 = q.to(at::kFloat), k32 = k.to(at::kFloat), v32 = v.to(at::kFloat);
  const double scale = 0.125;
  for (int64_t window : {0, 1, 5, 64})
    for (bool packed : {false, true}) {
      at::Tensor seq = packed ? random_packing(B, L, 0.002) : at::Tensor();
      auto [out, lse] = causal_attention(q, k, v, seq, window, scale);
      auto [out32, lse32] = causal_attention(q32, k32, v32, seq, window, scale);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i : {int64_t(0), int64_t(1), int64_t(63), int64_t(64), int64_t(1500), int64_t(2047),
                          int64_t(2998), int64_t(2999)}) {
          int64_t lo = window > 0 ? std::max<int64_t>(0, i - window + 1) : 0;
          if (packed)
            while (lo < i && seq[b][lo].item<int>() != seq[b][i].item<int>()) ++lo;
          for (int64_t h = 0; h < H; ++h) {
            at::Tensor kk = k[b].narrow(0, lo, i - lo + 1).select(1, h), vv = v[b].narrow(0, lo, i - lo + 1).select(1, h);
            at::Tensor sc = at::matmul(kk, q[b][i][h]) * scale;  // (n)
            at::Tensor ref_lse = at::logsumexp(sc, 0);
            at::Tensor ref = at::matmul(at::softmax(sc, 0), vv);
            EXPECT_LE(rel_err(out[b][i][h], ref, 1e-12, 1e-10), 1.0) << "row " << i << " window " << window;
            EXPECT_LE(rel_err(lse[b][h][i], ref_lse, 1e-12, 1e-10), 1.0) << "row " << i;
            EXPECT_LE(rel_err(out32[b][i][h], ref, 1e-4, 1e-3), 1.0) << "float32 row " << i;
            EXPECT_LE(rel_err(lse32[b][h][i], ref_lse, 1e-4, 1e-4), 1.0) << "float32 row " << i;
          }
        }
    }
}

TEST(CausalAttention, FiniteDifferenceGradients) {
  torch::manual_seed(4);
  expect_gradients_match_finite_differences(causal_case({2, 70, 2, 5, 3, 0, true}));
  expect_gradients_match_finite_differences(causal_case({1, 150, 2, 4, 6, 20, false}));
}

TEST(CausalAttention, Float32CloseToFloat64Reference) {
  torch::manual_seed(5);
  expect_float32_close_to_reference(causal_case({2, 300, 2, 64, 64, 0, true}), 1e-4, 1e-3);
  expect_float32_close_to_reference(causal_case({1, 257, 2, 32, 16, 50, false}), 1e-4, 1e-3);
}

TEST(CausalAttention, DeterministicAcrossThreadCounts) {
  torch::manual_seed(6);
  expect_deterministic_across_threads(causal_case({2, 400, 2, 32, 16, 0, true}));
  expect_deterministic_across_threads(causal_case({1, 333, 3, 16, 32, 70, false}));
}

TEST(CausalAttention, EqualsSparseAttentionOnSlidingWindowLists) {
  // The same function as sparse_attention over the lists {max(start, i-w+1) .. i}.
  torch::manual_seed(7);
  const int64_t B = 2, L = 200, H = 2, D = 16, Dv = 8, w = 24;
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor q = at::randn({B, L, H, D}, o), k = at::randn({B, L, H, D}, o), v = at::randn({B, L, H, Dv}, o);
  at::Tensor seq = random_packing(B, L, 0.05);
  at::Tensor idx = at::full({B, H, L, w}, -1, at::kInt);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t t = 0; t < w && i - t >= 0; ++t)
        if (seq[b][i - t].item<int>() == seq[b][i].item<int>()) idx.select(2, i).select(0, b).select(1, t).fill_(i - t);
  auto [oc, lc] = causal_attention(q, k, v, seq, w, 0.3);
  auto [os, ls] = hax::ops::sparse_attention(q, k, v, idx, {}, {}, {}, 0.3);
  EXPECT_LE(rel_err(oc, os, 1e-12, 1e-10), 1.0);
  EXPECT_LE(rel_err(lc, ls.squeeze(3), 1e-12, 1e-10), 1.0);
}

TEST(CausalAttention, BadInputsNameTheTensor) {
  auto o = at::TensorOptions().dtype(at::kFloat);
  at::Tensor q = at::randn({1, 6, 2, 4}, o), k = at::randn({1, 6, 2, 4}, o), v = at::randn({1, 6, 2, 3}, o);
  causal_attention(q, k, v, {}, 0, 0.5);  // valid
  expect_usage_error([&] { causal_attention(q[0], k, v, {}, 0, 0.5); }, "q has shape [6, 2, 4]");
  expect_usage_error([&] { causal_attention(q.to(at::kLong), k, v, {}, 0, 0.5); }, "q has dtype Long");
  expect_usage_error([&] { causal_attention(q, k.narrow(1, 0, 5), v, {}, 0, 0.5); }, "k has shape [1, 5, 2, 4]");
  expect_usage_error([&] { causal_attention(q, k, v.narrow(2, 0, 1), {}, 0, 0.5); }, "v has shape [1, 6, 1, 3]");
  expect_usage_error([&] { causal_attention(q, k.to(at::kDouble), v, {}, 0, 0.5); }, "k has dtype Double");
  expect_usage_error([&] { causal_attention(q, k, v.to(at::kDouble), {}, 0, 0.5); }, "v has dtype Double");
  expect_usage_error([&] { causal_attention(q, k, v, at::zeros({1, 5}, at::kInt), 0, 0.5); }, "seq_idx has shape [1, 5]");
  expect_usage_error([&] { causal_attention(q, k, v, at::tensor({0, 0, 1, 1, 0, 1}, at::kInt).view({1, 6}), 0, 0.5); },
                     "non-decreasing");
  expect_usage_error([&] { causal_attention(q, k, v, {}, -1, 0.5); }, "window -1 must be >= 0");
  expect_usage_error([&] { causal_attention(q, k, v, {}, 0, 0.0); }, "scale 0 must be positive");
  expect_usage_error([&] { causal_attention(q, k, at::Tensor(), {}, 0, 0.5); }, "v is missing");
  expect_usage_error([&] { causal_attention(q, k, v, {}, 0, 0.5, {}, 3); }, "key_rows 3 and dkdv_splits 1 need a band");
  expect_usage_error([&] { causal_attention(q, k, v, {}, 0, 0.5, {}, 0, 0); }, "dkdv_splits 0 in [1, 65535]");
}

// ---------------------------------------------------------------------------------------------
// CUDA kernels: float32 against the CPU op, bfloat16 (tensor cores and FMA tiles) against the
// float64 definition. Every case applies random cotangents to both outputs (dlse included).

namespace {

// Runs the bfloat16 CUDA kernels on tensor cores (or not) while alive.
struct TensorCores {
  bool before;
  explicit TensorCores(bool on) : before(hax::ops::causal_attention_tensor_cores()) {
    hax::ops::set_causal_attention_tensor_cores(on);
  }
  ~TensorCores() { hax::ops::set_causal_attention_tensor_cores(before); }
};

// Runs the tensor-core kernels' second products on wgmma (or on mma.sync) while alive; only the
// TMA-fed tiles (bfloat16, head dim 64, Hopper) have both forms.
struct WgmmaProducts : ScopedSwitch {
  explicit WgmmaProducts(bool on)
      : ScopedSwitch(hax::ops::causal_attention_wgmma_products, hax::ops::set_causal_attention_wgmma_products, on) {}
};

// The case with only `out` as an output: the backward gets no dlse (the layers' use).
OpCase out_only(CausalSize s) {
  OpCase c = causal_case(s);
  auto op = c.op, ref = c.reference;
  c.name += " (out only)";
  c.op = [op](const Tensors& in) { return Tensors{op(in)[0]}; };
  c.reference = [ref](const Tensors& in) { return Tensors{ref(in)[0]}; };
  return c;
}

// The bfloat16 error floor of the tensor-core kernels. P and dS enter their second products
// rounded to bfloat16 (as in FlashAttention-2), so a gradient is rounded twice: a row with few
// visible keys gets about twice the naive error by itself, before any sum. Measured on an
// emulation of the kernels (float64 everywhere but those roundings): max(error - 2 naive) 2.9e-3
// (D = Dv = 1), under 1e-3 for D >= 16. The FMA tiles keep P and dS in float32, but both paths
// take Δ = dO·O from the bfloat16-rounded output (as FlashAttention does): on the H100 a window-5
// case's dq/dk reached 2·naive + 2.5e-3 with the FMA tiles, so both use this floor.
constexpr double kTensorCoreFloor = 5e-3;

// float32 vs the CPU, then bfloat16 vs float64 on both tile families (tensor cores with their
// second products on wgmma and on mma.sync).
void expect_cuda_case(const OpCase& c) {
  expect_cuda_matches_cpu(c, 5e-5, 1e-4);
  {
    TensorCores tc(true);
    SCOPED_TRACE("bfloat16, tensor cores");
    expect_cuda_bf16_close(c, kTensorCoreFloor);
  }
  {
    TensorCores tc(true);
    WgmmaProducts w(false);
    SCOPED_TRACE("bfloat16, tensor cores, second products on mma.sync");
    expect_cuda_bf16_close(c, kTensorCoreFloor);
  }
  {
    TensorCores tc(false);
    SCOPED_TRACE("bfloat16, FMA tiles");
    expect_cuda_bf16_close(c, kTensorCoreFloor);
  }
}

}  // namespace

TEST(CausalAttentionCuda, MatchesCpuFloat32AndBf16) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(30);
  const int64_t dims[] = {16, 32, 64, 128};
  const int64_t other_dv[] = {24, 20, 128, 72};  // Dv != D: other buckets; 20 % 8 != 0 (unvectorized loads)
  int m = 0;
  for (int64_t L : {1, 63, 64, 65, 97, 1025})
    for (int di = 0; di < 4; ++di, ++m)
      for (int var = 0; var < 2; ++var) {
        // Per (L, D): one case with B = 1, H = 3 and one with B = 2, H = 1; Dv != D in one of them,
        // packing in one of them (which ones alternates with m).
        const int64_t D = dims[di], Dv = (m + var) % 2 ? other_dv[di] : D;
        CausalSize s{var ? 2 : 1, L, var ? 1 : 3, D, Dv, 0, (m / 2 + var) % 2 == 0};
        SCOPED_TRACE(describe(s));
        expect_cuda_case(causal_case(s));
      }
}

TEST(CausalAttentionCuda, SlidingWindowsAndOddHeadDims) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(31);
  for (int64_t window : {1, 5, 64, 65, 128, 300})
    for (bool packed : {false, true}) {
      CausalSize s{2, window >= 128 ? 1025 : 201, 2, 32, 16, window, packed};
      SCOPED_TRACE(describe(s));
      expect_cuda_case(causal_case(s));
    }
  // Any head dim up to 128: padded to the next bucket.
  const std::vector<std::pair<int64_t, int64_t>> odd = {{1, 1}, {5, 3}, {17, 33}, {100, 100}, {127, 65}, {128, 1}};
  for (auto [D, Dv] : odd) {
    CausalSize s{2, 130, 2, D, Dv, 0, true};
    SCOPED_TRACE(describe(s));
    expect_cuda_case(causal_case(s));
  }
}

TEST(CausalAttentionCuda, WithoutLseCotangent) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(32);
  for (bool packed : {false, true}) {
    CausalSize s{2, 300, 3, 64, 64, 0, packed};
    SCOPED_TRACE(describe(s));
    expect_cuda_case(out_only(s));
  }
}

TEST(CausalAttentionCuda, LongSequence) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(33);
  expect_cuda_matches_cpu(causal_case({1, 4097, 1, 32, 32, 0, false}), 5e-5, 1e-4);
  expect_cuda_matches_cpu(causal_case({1, 4097, 1, 32, 16, 0, true}), 5e-5, 1e-4);
  TensorCores tc(true);
  for (bool wgmma : {true, false}) {
    WgmmaProducts w(wgmma);
    SCOPED_TRACE(wgmma ? "second products on wgmma" : "second products on mma.sync");
    expect_cuda_bf16_close(causal_case({1, 2049, 2, 64, 64, 0, false}), kTensorCoreFloor);
  }
}

// The length the issue asks of every GPU op, at the windows a model uses: float32 against the CPU
// kernel, and the bf16 tensor-core kernels against the CPU kernel in float64 on the same
// bf16-rounded inputs (the dense reference has no room for an L x L matrix here).
TEST(CausalAttentionCuda, SlidingWindowsAt65537) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(36);
  for (int64_t window : {64, 128})
    for (bool packed : {false, true}) {
      const CausalSize s{1, 65537, 2, 64, 64, window, packed};
      SCOPED_TRACE(describe(s));
      const OpCase c = causal_case(s);
      expect_cuda_matches_cpu(c, 5e-5, 1e-4);
      TensorCores tc(true);
      expect_cuda_bf16_close_to_cpu_float64(c, 1e-2);
    }
}

TEST(CausalAttentionCuda, GradientsAreBitIdenticalAcrossRuns) {
  // No atomics: two runs give the same bits (deterministic mode changes nothing here).
  HAX_REQUIRE_CUDA();
  torch::manual_seed(34);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16})
    expect_cuda_runs_bit_identical(causal_case({2, 1000, 3, 64, 32, 0, true}), dt);
  // The TMA-fed tiles (D = Dv = 64) in both forms of their second products, with a window.
  for (bool wgmma : {true, false}) {
    WgmmaProducts w(wgmma);
    SCOPED_TRACE(wgmma ? "second products on wgmma" : "second products on mma.sync");
    expect_cuda_runs_bit_identical(causal_case({2, 1000, 3, 64, 64, 0, true}), at::kBFloat16);
    expect_cuda_runs_bit_identical(causal_case({1, 1000, 2, 64, 64, 128, false}), at::kBFloat16);
  }
}

TEST(CausalAttentionCuda, BadInputsNameTheTensor) {
  HAX_REQUIRE_CUDA();
  auto o = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  at::Tensor q = at::randn({1, 6, 2, 4}, o), k = at::randn({1, 6, 2, 4}, o), v = at::randn({1, 6, 2, 3}, o);
  at::Tensor seq = at::zeros({1, 6}, at::kInt);
  causal_attention(q, k, v, seq.cuda(), 0, 0.5);  // valid
  expect_usage_error([&] { causal_attention(q, k, v, seq, 0, 0.5); }, "seq_idx is on cpu but q is on cuda");
  expect_usage_error([&] { causal_attention(q, k, v.cpu(), {}, 0, 0.5); }, "v is on cpu");
  expect_usage_error([&] { causal_attention(q.to(at::kDouble), k, v, {}, 0, 0.5); }, "q has dtype Double");
  at::Tensor big = at::randn({1, 6, 2, 129}, o);
  expect_usage_error([&] { causal_attention(big, big, v, {}, 0, 0.5); }, "must be at most 128 on CUDA");
}
