// Key Selection's query direction normalize(Σ_{p = start..i} q_p) on CUDA (the chunked scan of
// patterns/cuda/prefix_direction.cu) against the CPU path, itself checked against its float64
// definition by KeySelection.PrefixQueryDirectionEqualsItsFormula. Outputs are poisoned (NaN)
// before every GPU run, so a position the kernels never write fails. Without a GPU these skip.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cuda_harness.h"
#include "layers/key_scorer.h"

namespace {

using hax::testing::random_packing;
using hax::testing::rel_err;

struct PoisonOutputs {
  PoisonOutputs() { hax::ops::set_poison_outputs(true); }
  ~PoisonOutputs() { hax::ops::set_poison_outputs(false); }
};

at::Tensor cuda(const at::Tensor& t) { return t.defined() ? t.to(at::Device(at::kCUDA, 0)) : t; }

// Sequences starting at 0 and at each of `starts` below L (chunk edges of 64 and their neighbours).
at::Tensor packing_at(int64_t B, int64_t L, const std::vector<int64_t>& starts) {
  at::Tensor is_start = at::zeros({B, L}, at::kInt);
  for (int64_t s : starts)
    if (s > 0 && s < L) is_start.select(1, s).fill_(1);
  return is_start.cumsum(1).to(at::kInt);
}

// The packings every case runs on: none (one sequence per row), mostly length-1 sequences, ~20
// positions (numbers from 7 in steps of 3: only changes count), a few long ones across many chunks,
// and starts at chunk edges.
std::vector<std::pair<std::string, at::Tensor>> packings(int64_t B, int64_t L) {
  return {{"unpacked", at::Tensor()},
          {"p=0.5", random_packing(B, L, 0.5)},
          {"p=0.05", random_packing(B, L, 0.05) * 3 + 7},
          {"p=0.003", random_packing(B, L, 0.003)},
          {"edges", packing_at(B, L, {1, 2, 63, 64, 65, 127, 129, 191, 192, 640, 1023, 1024, 4097, 65535, 65536})}};
}

std::string trace(int64_t B, int64_t L, int64_t H, int64_t N, const std::string& packing) {
  return "B=" + std::to_string(B) + " L=" + std::to_string(L) + " H=" + std::to_string(H) + " N=" +
         std::to_string(N) + " " + packing;
}

// q_gpu (CUDA float32) gives the CPU path's result on q_cpu within 1e-5 (relative to each value, and
// to the unit vector's norm for values near 0).
void expect_float32_equal_cpu(const at::Tensor& q_gpu, const at::Tensor& q_cpu, const at::Tensor& seq) {
  const at::Tensor want = hax::prefix_query_direction(q_cpu, seq);
  const at::Tensor got = hax::prefix_query_direction(q_gpu, cuda(seq));
  ASSERT_TRUE(got.is_cuda());
  ASSERT_EQ(got.scalar_type(), at::kFloat);
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_LE(rel_err(got.cpu(), want, 1e-5, 1e-5), 1.0);
}

// bfloat16 qb on the GPU gives the float64 result on the same (rounded) inputs within 2^-7 relative
// and 2e-5 absolute (see Bfloat16WithinRoundingOfFloat64).
void expect_bf16_within_rounding(const at::Tensor& qb, const at::Tensor& seq) {
  const at::Tensor want = hax::prefix_query_direction(qb.to(at::kDouble), seq);
  const at::Tensor got = hax::prefix_query_direction(cuda(qb), cuda(seq));
  ASSERT_EQ(got.scalar_type(), at::kBFloat16);
  EXPECT_LE(rel_err(got.cpu().to(at::kDouble), want, 2e-5, std::ldexp(1.0, -7)), 1.0);
}

TEST(PrefixDirectionCuda, Float32EqualsCpu) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(61);
  for (int64_t L : {1, 63, 97, 1025})
    for (int64_t B : {1, 3})
      for (int64_t H : {1, 2})
        for (int64_t N : {16, 32, 64, 128})
          for (const auto& [name, seq] : packings(B, L)) {
            SCOPED_TRACE(trace(B, L, H, N, name));
            const at::Tensor q = at::randn({B, L, H, N});
            expect_float32_equal_cpu(cuda(q), q, seq);
          }
  // A long row: 1025 chunks, carried across many chunks.
  const int64_t B = 1, L = 65537, H = 2, N = 64;
  for (const auto& [name, seq] : packings(B, L)) {
    SCOPED_TRACE(trace(B, L, H, N, name));
    const at::Tensor q = at::randn({B, L, H, N});
    expect_float32_equal_cpu(cuda(q), q, seq);
  }
}

// q as the model has it: a view of a wider projection (strided b, position and head), and, copied
// first, a q whose n is strided; other N than powers of two; seq_idx as int64 on the CPU.
TEST(PrefixDirectionCuda, StridedQAndOddSizes) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(62);
  for (int64_t L : {1, 97, 1025})
    for (int64_t N : {1, 5, 33, 100, 256}) {
      const int64_t B = 3, H = 2;
      const at::Tensor seq = random_packing(B, L, 0.05);
      SCOPED_TRACE(trace(B, L, H, N, "strided"));
      const at::Tensor wide = at::randn({B, L, H, 2 * N});
      expect_float32_equal_cpu(cuda(wide).narrow(3, N, N), wide.narrow(3, N, N), seq);
      const at::Tensor t = at::randn({B, L, N, H});
      expect_float32_equal_cpu(cuda(t).transpose(2, 3), t.transpose(2, 3), seq);
      const at::Tensor q = at::randn({B, L, H, N});
      const at::Tensor want = hax::prefix_query_direction(q, seq);
      EXPECT_LE(rel_err(hax::prefix_query_direction(cuda(q), seq.to(at::kLong)).cpu(), want, 1e-5, 1e-5), 1.0);
    }
}

// More heads than the grouped kernels put in a warp (32 / G of them, G lanes a head: 4 heads of
// N = 64 in bfloat16, 2 in float32), and head counts that leave a warp's group part empty; N from 8
// (G = 1 or 2) to 256 (float32 falls back to lane pairs there). float32 against the CPU path,
// bfloat16 within rounding of float64 (as below). L = 9000 at 16 heads takes chunks of 64 and the
// carry kernel (141 chunks), the others the summed look-back.
TEST(PrefixDirectionCuda, GroupedHeadsEqualCpu) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(64);
  struct Case {
    int64_t B, L, H, N;
  };
  for (const Case& c : {Case{1, 97, 3, 8}, Case{2, 1025, 5, 64}, Case{1, 1025, 16, 64}, Case{1, 9000, 16, 64},
                        Case{2, 97, 33, 16}, Case{1, 1025, 7, 128}, Case{1, 63, 9, 256}})
    for (const auto& [name, seq] : packings(c.B, c.L)) {
      SCOPED_TRACE(trace(c.B, c.L, c.H, c.N, name));
      const at::Tensor q = at::randn({c.B, c.L, c.H, c.N});
      expect_float32_equal_cpu(cuda(q), q, seq);
      expect_bf16_within_rounding(q.to(at::kBFloat16), seq);
    }
}

// bfloat16 q against the float64 result on the same (rounded) inputs: the kernels sum in float32
// (errors ~1e-6 of the unit vector) and round the result once, so each value is within bfloat16's
// unit roundoff (2^-8 relative: 8 significant bits) plus the float32 error; 2^-7 relative and
// 2e-5 absolute leave a margin.
TEST(PrefixDirectionCuda, Bfloat16WithinRoundingOfFloat64) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(63);
  struct Case {
    int64_t B, L, H, N;
  };
  for (const Case& c : {Case{3, 1, 2, 16}, Case{3, 63, 1, 32}, Case{3, 97, 2, 64}, Case{1, 1025, 2, 128},
                        Case{3, 1025, 1, 16}, Case{1, 65537, 2, 64}})
    for (const auto& [name, seq] : packings(c.B, c.L)) {
      SCOPED_TRACE(trace(c.B, c.L, c.H, c.N, name));
      expect_bf16_within_rounding(at::randn({c.B, c.L, c.H, c.N}).to(at::kBFloat16), seq);
    }
}

// A zero running sum gives a zero direction (the norm's floor), not NaN: a zero row, and a zero
// sequence in the middle of a packed row across chunk edges.
TEST(PrefixDirectionCuda, ZeroSumGivesZero) {
  HAX_REQUIRE_CUDA();
  PoisonOutputs poison;
  torch::manual_seed(64);
  const int64_t B = 2, L = 300, H = 2, N = 32;
  const at::Tensor seq = packing_at(B, L, {50, 230});
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    at::Tensor q = at::randn({B, L, H, N}).to(dt);
    q.select(0, 1).zero_();
    q.select(0, 0).narrow(0, 50, 180).zero_();
    for (const at::Tensor& s : {seq, at::Tensor()}) {
      const at::Tensor got = hax::prefix_query_direction(cuda(q), cuda(s)).cpu().to(at::kFloat);
      EXPECT_TRUE(got.isfinite().all().item<bool>());
      EXPECT_EQ(got.select(0, 1).abs().max().item<float>(), 0.f);
      if (s.defined()) {
        EXPECT_EQ(got.select(0, 0).narrow(0, 50, 180).abs().max().item<float>(), 0.f);
      }
      EXPECT_LE(rel_err(got, hax::prefix_query_direction(q.to(at::kDouble), s), 2e-5, std::ldexp(1.0, -7)), 1.0);
    }
  }
  const at::Tensor one = hax::prefix_query_direction(cuda(at::zeros({1, 1, 1, 16})), at::Tensor()).cpu();
  EXPECT_EQ(one.abs().max().item<float>(), 0.f);
}

// float16, and N above the kernels' 256, take the tensor formula: the same values.
TEST(PrefixDirectionCuda, OtherDtypesAndWideRowsUseTheFormula) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(65);
  const int64_t B = 2, L = 200, H = 2;
  const at::Tensor seq = random_packing(B, L, 0.05);
  const at::Tensor wide = at::randn({B, L, H, 300});
  EXPECT_LE(rel_err(hax::prefix_query_direction(cuda(wide), cuda(seq)).cpu(), hax::prefix_query_direction(wide, seq),
                    1e-5, 1e-5),
            1.0);
  const at::Tensor half = at::randn({B, L, H, 64}).to(at::kHalf);
  const at::Tensor got = hax::prefix_query_direction(cuda(half), cuda(seq));
  ASSERT_EQ(got.scalar_type(), at::kHalf);
  EXPECT_LE(rel_err(got.cpu().to(at::kDouble), hax::prefix_query_direction(half.to(at::kDouble), seq), 1e-4, 2e-3),
            1.0);
}

}  // namespace
