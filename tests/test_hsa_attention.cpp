// HSA attention (each query attends inside the chunks it retrieved, one softmax per chunk, the
// chunks summed with their weights): the lists path against the dense float64 reference on
// awkward sizes with empty, repeated and missing chunks, bad inputs, and the CUDA fast path
// (pairs sorted by chunk) forward and backward against float64, a chunk popular enough to need the
// multi-group reduction, long rows, determinism, the model branch and float32.
#include <cmath>
#include <random>

#include "cuda_harness.h"
#include "layers/forward_context.h"
#include "layers/sparse_branch.h"
#include "models/model_config.h"
#include "ops/hsa_attention/hsa_attention.h"

using namespace hax::testing;
using hax::ops::hsa_attention;
using hax::ops::hsa_attention_native;
using hax::ops::hsa_attention_reference;

namespace {

struct HsaSize {
  int64_t B, L, H, D, Dv, C, S;  // C: keys per chunk; S: slots (retrieved chunks) per query
};

std::string describe(const HsaSize& s) {
  return ::testing::PrintToString(std::vector<int64_t>{s.B, s.L, s.H, s.D, s.Dv}) + " C=" + std::to_string(s.C) +
         " S=" + std::to_string(s.S);
}

// A chunk layout and retrieved chunks, int32 on the CPU: chunks (B, L, S), start (B, NC). Chunk c
// starts at c C (NC = L / C), with one chunk of each row of two or more missing (start -1) and
// others missing at random. Query i picks among the chunks complete before its own (c < i / C);
// the first chunk's queries have none (all -1). Some slots are empty (-1), some repeat the previous
// slot's chunk; the first `popular` slots of every query that has a chunk hold chunk 0 (never
// missing then).
std::pair<at::Tensor, at::Tensor> hsa_layout(const HsaSize& s, uint64_t seed, int64_t popular) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  const int64_t NC = s.L / s.C;
  at::Tensor start = at::empty({s.B, NC}, at::kInt), chunks = at::empty({s.B, s.L, s.S}, at::kInt);
  auto st = start.accessor<int32_t, 2>();
  auto ch = chunks.accessor<int32_t, 3>();
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t c = 0; c < NC; ++c) st[b][c] = int32_t(c * s.C);
    if (NC >= 2) st[b][1 + rng() % (NC - 1)] = -1;
    for (int64_t c = popular ? 1 : 0; c < NC; ++c)
      if (u(rng) < 0.1) st[b][c] = -1;
    for (int64_t i = 0; i < s.L; ++i) {
      const int64_t n = i / s.C;  // the chunks complete before query i's own
      for (int64_t j = 0; j < s.S; ++j) {
        int32_t c = -1;
        if (n == 0) c = -1;
        else if (j < popular) c = 0;
        else if (u(rng) < 0.2) c = -1;
        else if (j > 0 && u(rng) < 0.25) c = ch[b][i][j - 1];
        else c = int32_t(rng() % n);
        ch[b][i][j] = c;
      }
    }
  }
  return {chunks, start};
}

// Inputs {q, k, v, w}; w (B, L, S) a softmax over the slots, as the retrieval gives. With one key
// per chunk (C = 1) each softmax is the constant 1 and q, k have exactly zero gradient; a bfloat16
// run leaves rounding-size values there, which no tolerance relative to a zero tensor admits, so
// such cases take q and k as constants (qk_grad false).
OpCase hsa_case(HsaSize s, uint64_t seed = 1, int64_t popular = 0, bool qk_grad = true) {
  const std::pair<at::Tensor, at::Tensor> layout = hsa_layout(s, seed, popular);
  const at::Tensor chunks = layout.first, start = layout.second;
  OpCase c;
  c.name = "hsa_attention " + describe(s) + (popular ? " popular=" + std::to_string(popular) : "");
  c.make_inputs = [s, qk_grad](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    Tensors in;
    in.push_back(at::randn({s.B, s.L, s.H, s.D}, o).requires_grad_(qk_grad));   // q
    in.push_back(at::randn({s.B, s.L, s.H, s.D}, o).requires_grad_(qk_grad));   // k
    in.push_back(at::randn({s.B, s.L, s.H, s.Dv}, o).requires_grad_());         // v
    in.push_back(at::softmax(at::randn({s.B, s.L, s.S}, o), -1).requires_grad_());  // w
    return in;
  };
  const double scale = 1.0 / std::sqrt(double(s.D));
  c.op = [=](const Tensors& in) {
    const at::Device d = in[0].device();
    return Tensors{hsa_attention(in[0], in[1], in[2], chunks.to(d), start.to(d), in[3], s.C, scale)};
  };
  c.reference = [=](const Tensors& in) {
    const at::Device d = in[0].device();
    return Tensors{hsa_attention_reference(in[0], in[1], in[2], chunks.to(d), start.to(d), in[3], s.C, scale)};
  };
  return c;
}

// The error floor of the tensor-core kernels in bfloat16 (P and dS rounded before their second
// products; see test_causal_attention.cpp), plus the rounding of each pair's output before the
// weighted sum over the slots.
constexpr double kTensorCoreFloor = 5e-3;

// Whether bfloat16 CUDA inputs of these sizes take the fast path.
bool fast_path(const HsaSize& s) {
  const at::Tensor probe = at::zeros({1, 1, 1, s.D}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
  const at::Tensor probe_v = at::zeros({1, 1, 1, s.Dv}, probe.options());
  return hsa_attention_native(probe, probe_v, s.C);
}

}  // namespace

TEST(HsaAttention, ListsPathMatchesReferenceFloat64) {
  torch::manual_seed(91);
  int n = 0;
  for (int64_t L : {1, 63, 97, 200})
    for (int64_t C : {1, 7, 16, 64}) {
      if (C > L) continue;
      for (int64_t S : {1, 3}) {
        const int64_t D = n % 2 ? 16 : 32, Dv = n % 2 ? 8 : 32, H = 1 + n % 3;
        const HsaSize s{n % 2 ? 1 : 2, L, H, D, Dv, C, S};
        ++n;
        SCOPED_TRACE(describe(s));
        expect_matches_reference(hsa_case(s, 100 + n), at::kDouble, 1e-11, 1e-9);
      }
    }
  // Rows shorter than a chunk (no chunk at all), and a chunk every query retrieves.
  expect_matches_reference(hsa_case({2, 5, 2, 16, 8, 7, 2}), at::kDouble, 1e-11, 1e-9);
  expect_matches_reference(hsa_case({1, 150, 2, 16, 24, 16, 3}, 7, /*popular=*/2), at::kDouble, 1e-11, 1e-9);
}

TEST(HsaAttention, BadInputsNameTheOption) {
  const int64_t B = 1, L = 12, H = 2, S = 2, C = 4;
  const at::Tensor q = at::randn({B, L, H, 8}), v = at::randn({B, L, H, 8});
  const std::pair<at::Tensor, at::Tensor> layout = hsa_layout({B, L, H, 8, 8, C, S}, 3, 0);
  const at::Tensor chunks = layout.first, start = layout.second, w = at::rand({B, L, S});
  EXPECT_NO_THROW(hsa_attention(q, q, v, chunks, start, w, C, 0.5));
  expect_usage_error([&] { hsa_attention(q, q, v, chunks.view({B, L * S}), start, w, C, 0.5); }, "chunks has shape");
  expect_usage_error([&] { hsa_attention(q, q, v, chunks.narrow(1, 0, L - 1), start, w, C, 0.5); }, "chunks has shape");
  expect_usage_error([&] { hsa_attention(q, q, v, at::cat({chunks, chunks}), start, w, C, 0.5); }, "chunks has shape");
  expect_usage_error([&] { hsa_attention(q, q, v, chunks.to(at::kLong), start, w, C, 0.5); }, "chunks must be int32");
  expect_usage_error([&] { hsa_attention(q, q, v, chunks, start.to(at::kLong), w, C, 0.5); }, "start must be int32");
  expect_usage_error([&] { hsa_attention(q, q, v, chunks, start, w.narrow(2, 0, 1), C, 0.5); }, "w has shape");
  expect_usage_error([&] { hsa_attention(q, q, v, chunks, start, w.narrow(1, 0, L - 1), C, 0.5); }, "w has shape");
  expect_usage_error([&] { hsa_attention(q, q, v, chunks, start, w, 0, 0.5); }, "chunk 0 must be >= 1");
  expect_usage_error([&] { hsa_attention(q, q, v, chunks, start, w, C, 0.0); }, "scale 0 must be positive");
  expect_usage_error([&] { hsa_attention(q, q, v, chunks, start, w, C, -1.0); }, "scale -1 must be positive");
  expect_usage_error([&] { hsa_attention(q, q.narrow(1, 0, L - 1), v, chunks, start, w, C, 0.5); }, "k has shape");
  // Values: chunk numbers past NC, and a chunk whose keys run past the row's end.
  expect_usage_error([&] { hsa_attention(q, q, v, chunks + L, start, w, C, 0.5); }, "chunks holds values");
  const at::Tensor late = start.clone();
  late[0][0] = L - C + 1;
  expect_usage_error([&] { hsa_attention(q, q, v, chunks, late, w, C, 0.5); }, "start must hold -1 or chunk starts");
}

// The fast path: bfloat16 on the GPU against float64 on the same rounded inputs, forward and
// backward, every head-dim bucket, chunks of 64 keys down to 1, rows shorter than a chunk.
TEST(HsaAttentionCuda, FastPathMatchesFloat64) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(92);
  const int64_t dims[] = {8, 16, 32, 64, 128}, slots[] = {1, 2, 4};
  int m = 0;
  for (int64_t L : {1, 63, 64, 65, 97, 1025})
    for (int64_t C : {64, 16, 7, 1}) {
      const int64_t D = dims[m % 5], Dv = m % 3 == 0 ? dims[(m + 2) % 5] : D;
      const HsaSize s{m % 2 ? 2 : 1, L, m % 2 ? 1 : 3, D, Dv, C, slots[(m / 2) % 3]};
      ++m;
      SCOPED_TRACE(describe(s));
      ASSERT_TRUE(fast_path(s)) << "this case must take the fast path";
      expect_cuda_bf16_close(hsa_case(s, 200 + m, 0, /*qk_grad=*/C > 1), kTensorCoreFloor);
    }
}

// Every query that has a chunk retrieves chunk 0 in slot 0: one chunk of ~4100 pairs (> 16 tiles
// of 64), so the backward splits it in groups and reduces their dK, dV.
TEST(HsaAttentionCuda, PopularChunkManyGroups) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(93);
  for (const HsaSize& s : {HsaSize{1, 4200, 2, 64, 64, 64, 1}, HsaSize{1, 4200, 1, 32, 64, 64, 2}}) {
    SCOPED_TRACE(describe(s));
    ASSERT_TRUE(fast_path(s)) << "this case must take the fast path";
    expect_cuda_bf16_close(hsa_case(s, 11, /*popular=*/1), kTensorCoreFloor);
  }
}

// L = 65537 at the model's sizes: the fast path against the CPU op in float64 on the same
// bfloat16-rounded inputs (the dense reference would need L S C gathered keys per head).
TEST(HsaAttentionCuda, At65537) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(94);
  const HsaSize s{1, 65537, 2, 64, 64, 64, 2};
  ASSERT_TRUE(fast_path(s)) << "this case must take the fast path";
  expect_cuda_bf16_close_to_cpu_float64(hsa_case(s, 12), 1e-2);
}

TEST(HsaAttentionCuda, GradientsAreBitIdenticalAcrossRuns) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(95);
  expect_cuda_runs_bit_identical(hsa_case({2, 1000, 3, 64, 32, 64, 2}, 13), at::kBFloat16);
}

// float32 runs the lists path on both devices.
TEST(HsaAttentionCuda, Float32TakesTheListsPath) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(96);
  const HsaSize s{1, 97, 2, 32, 16, 7, 3};
  const at::Tensor probe = at::zeros({1, 1, 1, s.D}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  EXPECT_FALSE(hsa_attention_native(probe, probe, s.C));
  expect_cuda_matches_cpu(hsa_case(s, 14), 5e-5, 1e-4);
}

// The model's sparse branch with sparse = "hsa" on the GPU in bfloat16 against the same branch on
// the CPU in float64, output and input gradients. The retrieval is made free of near ties (which
// bfloat16 could order differently from float64): mean landmarks and retrieval queries that read
// one input feature each, so a chunk's score is ±(its value) / sqrt(d_ret) with values 0.5 apart.
TEST(HsaAttentionCuda, ModelBranchMatchesCpu) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(97);
  hax::ModelConfig mc;
  mc.d_model = 32, mc.d_state = 32, mc.sparse = "hsa", mc.attn_heads = 2, mc.qk_dim = 32;
  mc.hsa_chunk = 16, mc.hsa_topk = 2, mc.hsa_landmark = "mean";
  hax::SparseAttentionBranch branch(mc, 32, 64, 0);
  const int64_t B = 2, L = 333, H = 2, D = 32, C = 16, NC = L / C;
  {
    torch::NoGradGuard ng;
    branch.hsa->ret_q->weight.zero_()[0][1] = 1;             // retrieval query = ± 1 (feature 1)
    branch.hsa->encoder->in_proj->weight.zero_()[0][0] = 1;  // landmark = the chunk's value (feature 0)
  }
  at::Tensor x0 = at::randn({B, L, 32});
  x0.select(2, 1).copy_(at::randint(0, 2, {B, L}) * 2 - 1);
  x0.select(2, 0).zero_();
  for (int64_t b = 0; b < B; ++b) {
    const at::Tensor value = at::randperm(NC, at::kLong).to(at::kFloat) * 0.5;  // distinct per chunk
    x0[b].select(1, 0).narrow(0, 0, NC * C).copy_(value.repeat_interleave(C));
  }
  auto fn = [&](const Tensors& in) {
    // (Module::to keeps each parameter's gradient where it was: drop them, or the next device's
    // backward would add into the last device's.)
    for (auto& par : branch.parameters()) par.mutable_grad() = at::Tensor();
    branch.to(in[0].device(), in[0].scalar_type());
    hax::ForwardContext ctx;
    return Tensors{branch.attend(x0.to(in[0].device(), in[0].scalar_type()), in[0], in[1], in[2], {}, &ctx, nullptr)};
  };
  Tensors in = {at::randn({B, L, H, D}).requires_grad_(), (at::randn({B, L, H, D}) / std::sqrt(32.0)).requires_grad_(),
                at::randn({B, L, H, D}).requires_grad_()};
  Tensors gpu_in = to_device(in, at::Device(at::kCUDA, 0), at::kBFloat16);
  ASSERT_TRUE(hsa_attention_native(gpu_in[0], gpu_in[2], C));
  Tensors w = random_cotangents(fn(clone_leaves(in)));
  const auto gpu = run_on_device(fn, gpu_in, w);
  const auto cpu = run_on_device(fn, to_device(gpu_in, at::Device(at::kCPU), at::kDouble), w);
  expect_runs_close(gpu, cpu, 2e-2);
}

// Small instances of the fast path's kernels (both head-dim buckets the models use, chunks of 64
// and 16 keys, one and two slots, and a chunk of > 1024 pairs, so that the reduction runs) for
// compute-sanitizer (scripts/gpu_sanitize.sh).
TEST(HsaAttentionCuda, SmallInstance) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(98);
  expect_cuda_bf16_close(hsa_case({1, 150, 2, 64, 64, 64, 2}, 15), kTensorCoreFloor);
  expect_cuda_bf16_close(hsa_case({1, 200, 1, 128, 128, 16, 1}, 16), kTensorCoreFloor);
  // 284 queries x 4 slots all on chunk 0: 1136 pairs, 18 tiles, two groups.
  expect_cuda_bf16_close(hsa_case({1, 300, 1, 64, 64, 16, 4}, 17, /*popular=*/4), kTensorCoreFloor);
}
