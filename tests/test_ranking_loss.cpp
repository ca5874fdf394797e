// The fused Key Selection ranking loss: the op (CPU: the LibTorch reference) against a brute-force
// float64 loop of the definition, loss and gradient, with and without a row mask; the row mask's
// padding property; the CUDA kernels against the CPU op in float32 and against float64 in bfloat16,
// with and without a row mask; argument errors.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda_harness.h"
#include "ops/check.h"
#include "ops/ranking_loss/ranking_loss.h"
#include "core/rng.h"
#include "layers/key_scorer.h"

using namespace hax::testing;
using hax::ops::ranking_loss_fused;
using hax::ops::ranking_loss_reference;

namespace {

struct Sizes {
  int64_t B, L, H, N, C;
  bool seq, valid;  // with packed sequences / invalid positions, or those arguments undefined
};

// Random inputs in `dt` on the CPU: scores (B, L, H) requiring grad, q, k (B, L, H, N), seq_idx
// (B, L) int32 with a new sequence starting at ~4% of positions, valid (B, L) with ~10% false
// (but position 0), cand (B, C) distinct positions drawn among all of a row's; rows (B) bool is
// left undefined (every row counts) for the tests to set.
struct Inputs {
  at::Tensor scores, q, k, seq, valid, cand, rows;
};

Inputs make_inputs(const Sizes& s, at::ScalarType dt) {
  auto o = at::TensorOptions().dtype(dt);
  Inputs in;
  in.scores = (at::randn({s.B, s.L, s.H}, o) * 2).requires_grad_();
  in.q = at::randn({s.B, s.L, s.H, s.N}, o);
  in.k = at::randn({s.B, s.L, s.H, s.N}, o) / std::sqrt((double)s.N);
  if (s.seq) {
    at::Tensor start = at::rand({s.B, s.L}) < 0.04;
    start.select(1, 0).fill_(false);
    in.seq = start.to(at::kInt).cumsum(1).to(at::kInt);
  }
  if (s.valid) {
    in.valid = at::rand({s.B, s.L}) > 0.1;
    in.valid.select(1, 0).fill_(true);
  }
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < s.B; ++b) rows.push_back(at::randperm(s.L, at::kLong).narrow(0, 0, s.C));
  in.cand = at::stack(rows);
  return in;
}

at::Tensor loss_of(const Inputs& in) {
  return ranking_loss_fused(in.scores, in.q, in.k, in.seq, in.valid, in.cand, in.rows);
}

// A (B) bool row mask on the CPU.
at::Tensor row_mask(const std::vector<bool>& rows) {
  at::Tensor t = at::empty({(int64_t)rows.size()}, at::kBool);
  for (size_t b = 0; b < rows.size(); ++b) t[(int64_t)b] = (bool)rows[b];
  return t;
}

// `in` with scores a fresh leaf (same values, no gradient yet) and rows = `rows`.
Inputs with_rows(const Inputs& in, const at::Tensor& rows) {
  Inputs out = in;
  out.scores = in.scores.detach().clone().requires_grad_();
  out.rows = rows;
  return out;
}

// The definition as loops in float64: the loss and d loss / d scores (B, L, H), each pair's
// derivative added to both of its candidates (no symmetry argument). Rows with rows[b] false are
// skipped and the sum is divided by R C C H, R = the number of true rows (B without rows); R = 0
// gives 0.
std::pair<double, at::Tensor> brute_force(const Inputs& in) {
  const at::Tensor s = in.scores.detach().to(at::kDouble).contiguous(), q = in.q.to(at::kDouble).contiguous(),
                   k = in.k.to(at::kDouble).contiguous(), cand = in.cand.contiguous();
  const int64_t B = s.size(0), L = s.size(1), H = s.size(2), N = q.size(3), C = cand.size(1);
  const at::Tensor seq = in.seq.defined() ? in.seq.to(at::kInt).contiguous() : at::zeros({B, L}, at::kInt);
  const at::Tensor valid = in.valid.defined() ? in.valid.contiguous() : at::ones({B, L}, at::kBool);
  const at::Tensor rows = in.rows.defined() ? in.rows.contiguous() : at::ones({B}, at::kBool);
  auto rp = rows.accessor<bool, 1>();
  int64_t R = 0;
  for (int64_t b = 0; b < B; ++b) R += rp[b] ? 1 : 0;
  auto sp = s.accessor<double, 3>();
  auto qp = q.accessor<double, 4>(), kp = k.accessor<double, 4>();
  auto seqp = seq.accessor<int32_t, 2>();
  auto vp = valid.accessor<bool, 2>();
  auto cp = cand.accessor<int64_t, 2>();
  at::Tensor grad = at::zeros({B, L, H}, at::kDouble);
  auto gp = grad.accessor<double, 3>();
  const double count = (double)(R * C * C * H);
  double loss = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (!rp[b]) continue;  // a padding row: no terms, zero gradient
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> x(C), y(C, 0.0);
      for (int64_t a = 0; a < C; ++a) {
        const int64_t j = cp[b][a];
        x[a] = sp[b][j][h];
        for (int64_t l = j; l < L; ++l) {
          if (seqp[b][l] != seqp[b][j] || !vp[b][l]) continue;
          double dot = 0;
          for (int64_t n = 0; n < N; ++n) dot += qp[b][l][h][n] * kp[b][j][h][n];
          y[a] += 1.0 / (1.0 + std::exp(-dot));
        }
      }
      for (int64_t a = 0; a < C; ++a)
        for (int64_t c = 0; c < C; ++c) {
          const double t = ((y[a] > y[c]) + (y[a] >= y[c])) / 2.0, z = x[a] - x[c];
          loss += std::max(z, 0.0) - z * t + std::log1p(std::exp(-std::abs(z)));
          const double d = (1.0 / (1.0 + std::exp(-z)) - t) / count;  // d / dz
          gp[b][cp[b][a]][h] += d;
          gp[b][cp[b][c]][h] -= d;
        }
    }
  }
  return {R == 0 ? 0.0 : loss / count, grad};
}

// Awkward sizes: L in {1, 63, 97, 1025} (C = min(L, 37), and every position at L = 63), B in
// {1, 3}, H in {1, 2}, N in {3, 16}, with and without seq_idx / valid.
std::vector<Sizes> awkward_sizes() {
  std::vector<Sizes> out;
  for (int64_t L : {1, 63, 97, 1025})
    for (int64_t B : {1, 3})
      for (int64_t H : {1, 2})
        for (int64_t N : {3, 16}) {
          const bool masks = (B + H + N) % 2 == 0;  // half the shapes with seq_idx and valid
          out.push_back({B, L, H, N, std::min<int64_t>(L, 37), masks, masks});
          if (L == 63 && N == 3) out.push_back({B, L, H, N, L, !masks, masks});
        }
  return out;
}

std::string name_of(const Sizes& s) {
  return ::testing::PrintToString(std::vector<int64_t>{s.B, s.L, s.H, s.N, s.C}) + (s.seq ? " seq" : "") +
         (s.valid ? " valid" : "");
}

}  // namespace

TEST(RankingLoss, MatchesBruteForceFloat64) {
  torch::manual_seed(41);
  for (const Sizes& s : awkward_sizes()) {
    SCOPED_TRACE("B, L, H, N, C = " + name_of(s));
    Inputs in = make_inputs(s, at::kDouble);
    const auto [expect, expect_grad] = brute_force(in);
    at::Tensor loss = loss_of(in);
    EXPECT_EQ(loss.dim(), 0);
    EXPECT_EQ(loss.scalar_type(), at::kDouble);
    EXPECT_NEAR(loss.item<double>(), expect, 1e-12 * std::max(1.0, std::abs(expect)));
    (loss * 0.7).backward();
    EXPECT_LE(rel_err(in.scores.grad(), expect_grad * 0.7, 1e-14, 1e-9), 1.0);
    if (s.C == 1) {
      EXPECT_NEAR(loss.item<double>(), std::log(2.0), 1e-15);  // the pair (a, a) alone
    }
  }
}

// hax::ranking_loss samples each row's candidates with a partial Fisher-Yates over its valid
// positions (compacted into one reused buffer). The sampled candidates must be those of the plain
// algorithm over a listed pool, for a packed row (valid prefix), a full row and rows with holes.
TEST(RankingLoss, SampledCandidatesAreAPartialFisherYatesOverTheValidPositions) {
  torch::manual_seed(17);
  const int64_t B = 4, L = 50, H = 2, N = 3, candidates = 12;
  const uint64_t seed = 99;
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor q = at::randn({B, L, H, N}, o), k = at::randn({B, L, H, N}, o), scores = at::randn({B, L, H}, o);
  at::Tensor valid = at::zeros({B, L}, at::kBool);
  valid[0].fill_(true);                           // every position
  valid[1].narrow(0, 0, 30).fill_(true);          // a packed row: padding at its end
  valid[2] = at::rand({L}) < 0.6;                 // holes
  valid[2][0] = false;
  valid[3].narrow(0, 5, 40).fill_(true);          // valid, but not from 0
  // The plain algorithm.
  int64_t C = candidates;
  std::vector<std::vector<int64_t>> pools(B);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < L; ++t)
      if (valid[b][t].item<bool>()) pools[b].push_back(t);
    C = std::min<int64_t>(C, (int64_t)pools[b].size());
  }
  ASSERT_GE(C, 2);
  at::Tensor cand = at::empty({B, C}, at::kLong);
  for (int64_t b = 0; b < B; ++b) {
    hax::Rng rng(hax::derive_seed(seed, 0x4B53, (uint64_t)b));
    for (int64_t c = 0; c < C; ++c) {
      const int64_t r = c + (int64_t)rng.below(pools[b].size() - c);
      std::swap(pools[b][c], pools[b][r]);
      cand[b][c] = pools[b][c];
    }
  }
  const at::Tensor got = hax::ranking_loss(scores, q, k, {}, valid, candidates, seed);
  const at::Tensor want = hax::ranking_loss_at(scores, q, k, {}, valid, cand);
  EXPECT_EQ(got.item<double>(), want.item<double>());
  // Another seed samples other candidates and gives another loss (the comparison has power).
  EXPECT_NE(hax::ranking_loss(scores, q, k, {}, valid, candidates, seed + 1).item<double>(), want.item<double>());
}

TEST(RankingLoss, Float32CloseToFloat64) {
  torch::manual_seed(42);
  Inputs in = make_inputs({3, 97, 2, 16, 37, true, true}, at::kFloat);
  const auto [expect, expect_grad] = brute_force(in);
  at::Tensor loss = loss_of(in);
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_NEAR(loss.item<double>(), expect, 1e-5 * expect);
  loss.backward();
  EXPECT_LE(rel_err(in.scores.grad(), expect_grad, 1e-6 * expect_grad.abs().max().item<double>(), 1e-5), 1.0);
}

// A row mask: the masked loss against the brute-force loop (which skips the false rows and divides
// by R C C H), value and gradient, on awkward sizes (L = 97; B = 1 and 3; C = 1, 2, 63; a false row
// first, in the middle, or alone); the false rows' gradients exactly zero.
TEST(RankingLoss, RowMaskMatchesBruteForceFloat64) {
  torch::manual_seed(48);
  const std::vector<std::vector<bool>> masks = {
      {true}, {true, false, true}, {false, true, false}, {false, false, true}};
  for (int64_t C : {1, 2, 63})
    for (int64_t H : {1, 2})
      for (const std::vector<bool>& mask : masks) {
        const int64_t B = (int64_t)mask.size(), N = C == 63 ? 16 : 3;
        const Sizes s{B, 97, H, N, C, H == 2, H == 2};
        SCOPED_TRACE("B, L, H, N, C = " + name_of(s) + " rows " + ::testing::PrintToString(mask));
        Inputs in = make_inputs(s, at::kDouble);
        in.rows = row_mask(mask);
        const auto [expect, expect_grad] = brute_force(in);
        at::Tensor loss = loss_of(in);
        EXPECT_EQ(loss.dim(), 0);
        EXPECT_EQ(loss.scalar_type(), at::kDouble);
        EXPECT_NEAR(loss.item<double>(), expect, 1e-12 * std::max(1.0, std::abs(expect)));
        if (C == 1) {
          EXPECT_NEAR(loss.item<double>(), std::log(2.0), 1e-15);  // the pair (a, a) alone, every true row
        }
        (loss * 0.7).backward();
        const at::Tensor grad = in.scores.grad();
        ASSERT_TRUE(grad.defined());
        EXPECT_LE(rel_err(grad, expect_grad * 0.7, 1e-14, 1e-9), 1.0);
        for (int64_t b = 0; b < B; ++b)
          if (!mask[b]) {
            EXPECT_TRUE(at::equal(grad[b], at::zeros_like(grad[b]))) << "row " << b << " is masked out";
          }
      }
}

// rows all true is no rows, bit for bit (loss and gradient, float32 and float64); rows all false
// gives a loss of exactly 0 and a zero gradient (not NaN), also after a nonzero upstream gradient.
TEST(RankingLoss, RowMaskAllTrueIsNoMaskAllFalseIsZero) {
  torch::manual_seed(49);
  for (const Sizes& s : {Sizes{3, 97, 2, 16, 37, true, true}, Sizes{1, 63, 1, 3, 63, false, false},
                         Sizes{3, 63, 2, 3, 2, false, true}})
    for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
      SCOPED_TRACE("B, L, H, N, C = " + name_of(s) + " " + c10::toString(dt));
      const Inputs in = make_inputs(s, dt);
      const Inputs plain = with_rows(in, {});
      at::Tensor loss = loss_of(plain);
      (loss * 0.7).backward();
      const Inputs all = with_rows(in, at::ones({s.B}, at::kBool));
      at::Tensor loss_all = loss_of(all);
      (loss_all * 0.7).backward();
      EXPECT_TRUE(at::equal(loss_all, loss)) << loss_all.item<double>() << " vs " << loss.item<double>();
      EXPECT_TRUE(at::equal(all.scores.grad(), plain.scores.grad()));
      const Inputs none = with_rows(in, at::zeros({s.B}, at::kBool));
      at::Tensor loss_none = loss_of(none);
      EXPECT_EQ(loss_none.scalar_type(), dt);
      EXPECT_EQ(loss_none.item<double>(), 0.0);
      (loss_none * 0.7).backward();
      ASSERT_TRUE(none.scores.grad().defined());
      EXPECT_EQ(none.scores.grad().abs().max().item<double>(), 0.0);  // NaN fails too
    }
}

// The padding property: a batch with padding rows appended (all padding: valid all false, random
// scores, q, k) and masked out has the loss of the batch without them, in float64 to rounding, and
// the real rows' gradients; the padding rows' gradients are exactly zero.
TEST(RankingLoss, MaskedPaddingRowsChangeNothing) {
  torch::manual_seed(50);
  for (const Sizes& s : {Sizes{3, 97, 2, 16, 37, true, true}, Sizes{1, 63, 1, 3, 63, false, false}}) {
    SCOPED_TRACE("B, L, H, N, C = " + name_of(s));
    const int64_t P = 2;  // padding rows
    Inputs real = make_inputs(s, at::kDouble);
    Inputs pad = make_inputs({P, s.L, s.H, s.N, s.C, s.seq, true}, at::kDouble);
    pad.valid.fill_(false);
    Inputs padded;
    padded.scores = at::cat({real.scores.detach(), pad.scores.detach()}).requires_grad_();
    padded.q = at::cat({real.q, pad.q}), padded.k = at::cat({real.k, pad.k});
    if (s.seq) padded.seq = at::cat({real.seq, pad.seq});
    padded.valid = at::cat({real.valid.defined() ? real.valid : at::ones({s.B, s.L}, at::kBool), pad.valid});
    padded.cand = at::cat({real.cand, pad.cand});
    std::vector<bool> mask(s.B + P, true);
    mask[s.B] = mask[s.B + 1] = false;
    padded.rows = row_mask(mask);
    at::Tensor want = loss_of(real), got = loss_of(padded);
    EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-14 * std::abs(want.item<double>()));
    want.backward();
    got.backward();
    const at::Tensor g = padded.scores.grad();
    EXPECT_LE(rel_err(g.narrow(0, 0, s.B), real.scores.grad(), 1e-14 * real.scores.grad().abs().max().item<double>(),
                      1e-12),
              1.0);
    EXPECT_TRUE(at::equal(g.narrow(0, s.B, P), at::zeros({P, s.L, s.H}, at::kDouble)));
    // Without the mask the padding rows count: another loss (the comparison has power).
    padded.rows = at::Tensor();
    EXPECT_GT(std::abs(loss_of(padded).item<double>() - want.item<double>()), 1e-6);
  }
}

TEST(RankingLoss, BadInputsNameTheTensor) {
  torch::manual_seed(43);
  Inputs in = make_inputs({3, 20, 2, 4, 5, true, true}, at::kFloat);
  auto with = [&](auto change) {  // a changed copy of `in` (cand's entries too)
    Inputs c = in;
    c.cand = c.cand.clone();
    change(c);
    return [c] { loss_of(c); };
  };
  expect_usage_error(with([](Inputs& c) { c.cand = c.cand.narrow(0, 0, 2); }),
                     "ranking_loss: cand has shape [2, 5] but must be (B, C) = [3, 5]");
  expect_usage_error(with([](Inputs& c) { c.cand = c.cand[0]; }), "cand has shape [5] but must have 2 dimensions");
  expect_usage_error(with([](Inputs& c) { c.cand = c.cand.to(at::kInt); }), "cand has dtype Int but must be int64");
  expect_usage_error(with([](Inputs& c) { c.cand[1][2] = 20; }),
                     "cand[1, 2] = 20 is not a position: entries must be in [0, L = 20)");
  expect_usage_error(with([](Inputs& c) { c.cand[2][0] = -1; }), "cand[2, 0] = -1 is not a position");
  expect_usage_error(with([](Inputs& c) { c.cand[0][1] = c.cand[0][3].item<int64_t>(); }),
                     "cand row 0 holds position");
  expect_usage_error(with([](Inputs& c) { c.cand = at::zeros({3, 21}, at::kLong); }),
                     "cand has C = 21 candidates per row but a row has only L = 20 positions");
  expect_usage_error(with([](Inputs& c) { c.cand = at::zeros({3, 0}, at::kLong); }), "C = 0");
  expect_usage_error(with([](Inputs& c) { c.q = c.q.narrow(1, 0, 19); }),
                     "q has shape [3, 19, 2, 4] but must be (B, L, H, N) = [3, 20, 2, 4]");
  expect_usage_error(with([](Inputs& c) { c.k = c.k.narrow(3, 0, 3); }), "k has shape [3, 20, 2, 3]");
  expect_usage_error(with([](Inputs& c) { c.k = c.k.to(at::kDouble); }), "k has dtype Double");
  expect_usage_error(with([](Inputs& c) { c.scores = c.scores.detach().to(at::kLong); }), "scores has dtype Long");
  expect_usage_error(with([](Inputs& c) { c.scores = c.scores.detach()[0]; }),
                     "scores has shape [20, 2] but must have 3 dimensions (B, L, H)");
  expect_usage_error(with([](Inputs& c) { c.valid = c.valid.to(at::kInt); }), "valid has dtype Int but must be bool");
  expect_usage_error(with([](Inputs& c) { c.valid = c.valid.narrow(1, 0, 4); }), "valid has shape [3, 4]");
  expect_usage_error(with([](Inputs& c) { c.seq = c.seq.flip({1}).contiguous(); }),
                     "seq_idx must be non-decreasing");
  expect_usage_error(with([](Inputs& c) { c.rows = at::ones({2}, at::kBool); }),
                     "ranking_loss: rows has shape [2] but must be (B) = [3]");
  expect_usage_error(with([](Inputs& c) { c.rows = at::ones({3, 1}, at::kBool); }),
                     "rows has shape [3, 1] but must have 1 dimensions (B)");
  expect_usage_error(with([](Inputs& c) { c.rows = at::ones({3}, at::kInt); }),
                     "rows has dtype Int but must be bool");
}

// ---- CUDA ----------------------------------------------------------------------------------------

namespace {

const at::Device kGpu(at::kCUDA, 0);

// Copies `in` to the GPU with float tensors in score_dt (scores) and qk_dt (q, k); q and k as
// strided views (last dim contiguous) of one (B, L, H, 2N) tensor when `strided`.
Inputs to_gpu(const Inputs& in, at::ScalarType score_dt, at::ScalarType qk_dt, bool strided = false) {
  Inputs g;
  g.scores = in.scores.detach().to(kGpu, score_dt).requires_grad_();
  if (strided) {
    at::Tensor kq = at::cat({in.k, in.q}, -1).to(kGpu, qk_dt);
    const int64_t N = in.q.size(3);
    g.k = kq.narrow(3, 0, N), g.q = kq.narrow(3, N, N);
  } else {
    g.q = in.q.to(kGpu, qk_dt), g.k = in.k.to(kGpu, qk_dt);
  }
  g.seq = in.seq.defined() ? in.seq.to(kGpu) : in.seq;
  g.valid = in.valid.defined() ? in.valid.to(kGpu) : in.valid;
  g.cand = in.cand.to(kGpu);
  g.rows = in.rows.defined() ? in.rows.to(kGpu) : in.rows;
  return g;
}

// Loss and d(w * loss) / d scores on the GPU (outputs poisoned first), both on the CPU in float64.
std::pair<double, at::Tensor> run_gpu(const Inputs& g, double w) {
  hax::ops::set_poison_outputs(true);
  at::Tensor loss = loss_of(g);
  (loss * w).backward();
  hax::ops::set_poison_outputs(false);
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_EQ(loss.scalar_type(), g.scores.scalar_type());
  return {loss.item<double>(), g.scores.grad().to(at::kCPU, at::kDouble)};
}

// The CPU op on `in` (float32) against the GPU op on its copy (strided q, k if asked), loss and
// gradient to float32 precision, with cotangent 0.7; returns the GPU's loss and gradient.
std::pair<double, at::Tensor> expect_gpu_matches_cpu(Inputs& in, bool strided) {
  at::Tensor ref = loss_of(in);
  (ref * 0.7).backward();
  const at::Tensor ref_grad = in.scores.grad().to(at::kDouble);
  const auto [loss, grad] = run_gpu(to_gpu(in, at::kFloat, at::kFloat, strided), 0.7);
  EXPECT_LE(std::abs(loss - ref.item<double>()), 1e-5 * std::abs(ref.item<double>()));
  const double atol = 1e-5 * std::max(1e-30, ref_grad.abs().max().item<double>());
  EXPECT_LE(rel_err(grad, ref_grad, atol, 1e-5), 1.0);  // NaN (an unwritten entry) fails too
  return {loss, grad};
}

// The GPU op in bfloat16 storage (scores in score_dt) against the float64 reference on the same
// rounded inputs (`in` in float64, rounded here; its row mask if any), loss and gradient; returns
// the GPU's gradient. The kernels compute in float32 and round once at the end: the loss and each
// gradient entry carry one bfloat16 rounding (relative 2^-9), checked with a 2x margin (2^-8)
// plus float32-level error.
at::Tensor expect_gpu_bf16_close(Inputs& in, at::ScalarType score_dt) {
  in.scores = in.scores.detach().to(score_dt).to(at::kDouble).requires_grad_();
  in.q = in.q.to(at::kBFloat16).to(at::kDouble), in.k = in.k.to(at::kBFloat16).to(at::kDouble);
  at::Tensor ref = ranking_loss_reference(in.scores, in.q, in.k, in.seq, in.valid, in.cand, in.rows);
  (ref * 3).backward();  // 3 is exact in bfloat16
  const at::Tensor ref_grad = in.scores.grad();
  const auto [loss, grad] = run_gpu(to_gpu(in, score_dt, at::kBFloat16), 3);
  const double rtol = score_dt == at::kBFloat16 ? std::ldexp(1.0, -8) : 1e-5;
  EXPECT_LE(std::abs(loss - ref.item<double>()), (rtol + 1e-5) * std::abs(ref.item<double>()));
  EXPECT_LE(rel_err(grad, ref_grad, 1e-5 * ref_grad.abs().max().item<double>(), rtol), 1.0);
  return grad;
}

}  // namespace

TEST(RankingLossCuda, MatchesCpuFloat32) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(44);
  std::vector<Sizes> sizes = awkward_sizes();
  sizes.push_back({3, 1025, 2, 16, 300, true, true});  // C over one pair-kernel tile (256)
  for (const Sizes& s : sizes)
    for (bool strided : {false, true}) {
      SCOPED_TRACE("B, L, H, N, C = " + name_of(s) + (strided ? " strided q, k" : ""));
      Inputs in = make_inputs(s, at::kFloat);
      expect_gpu_matches_cpu(in, strided);
    }
}

// bfloat16 storage against the float64 reference on the same (bfloat16-rounded) inputs
// (expect_gpu_bf16_close has the tolerances). The targets are exact comparisons of float32 sums: a
// flipped order needs two candidates' sums within ~1e-6, which the fixed seed avoids. With float32
// scores and bfloat16 q, k the result is float32.
TEST(RankingLossCuda, Bfloat16CloseToFloat64) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(45);
  for (const Sizes& s : {Sizes{3, 97, 2, 16, 37, true, true}, Sizes{1, 1025, 2, 3, 37, false, true},
                         Sizes{3, 63, 1, 16, 63, true, false}})
    for (at::ScalarType score_dt : {at::kBFloat16, at::kFloat}) {
      SCOPED_TRACE("B, L, H, N, C = " + name_of(s) + " scores " + c10::toString(score_dt));
      Inputs in = make_inputs(s, at::kDouble);
      expect_gpu_bf16_close(in, score_dt);
    }
}

// A row mask cycling through true/false patterns (all false included: loss 0, zero gradient) on
// the inputs of MatchesCpuFloat32 (same seed and draws: no near-tied targets), float32 against the
// CPU op with the same mask, loss and gradient; an all-true mask is no mask, bit for bit.
TEST(RankingLossCuda, RowMaskMatchesCpuFloat32) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(44);
  std::vector<Sizes> sizes = awkward_sizes();
  sizes.push_back({3, 1025, 2, 16, 300, true, true});  // C over one pair-kernel tile (256)
  const std::vector<std::vector<bool>> masks3 = {
      {true, false, true}, {false, false, true}, {true, true, true}, {false, false, false}, {false, true, true}};
  const std::vector<std::vector<bool>> masks1 = {{true}, {false}};
  int i = 0;
  for (const Sizes& s : sizes)
    for (bool strided : {false, true}) {
      const auto& masks = s.B == 3 ? masks3 : masks1;
      const std::vector<bool>& mask = masks[i++ % masks.size()];
      SCOPED_TRACE("B, L, H, N, C = " + name_of(s) + (strided ? " strided q, k" : "") + " rows " +
                   ::testing::PrintToString(mask));
      ASSERT_EQ((int64_t)mask.size(), s.B);
      Inputs in = make_inputs(s, at::kFloat);
      in.rows = row_mask(mask);
      const auto [loss, grad] = expect_gpu_matches_cpu(in, strided);
      for (int64_t b = 0; b < s.B; ++b)
        if (!mask[b]) {
          EXPECT_EQ(grad[b].abs().max().item<double>(), 0.0) << "row " << b << " is masked out";
        }
      if (std::find(mask.begin(), mask.end(), false) == mask.end()) {  // all true: no mask, bit for bit
        const auto [loss0, grad0] = run_gpu(to_gpu(with_rows(in, {}), at::kFloat, at::kFloat, strided), 0.7);
        EXPECT_EQ(loss, loss0);
        EXPECT_TRUE(at::equal(grad, grad0));
      }
    }
}

// A row mask in bfloat16 storage against the float64 reference with the same mask, on the inputs of
// Bfloat16CloseToFloat64 (same seed and draws), with its tolerances.
TEST(RankingLossCuda, RowMaskBfloat16CloseToFloat64) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(45);
  const std::vector<std::pair<Sizes, std::vector<bool>>> cases = {
      {Sizes{3, 97, 2, 16, 37, true, true}, {true, false, true}},
      {Sizes{1, 1025, 2, 3, 37, false, true}, {true}},
      {Sizes{3, 63, 1, 16, 63, true, false}, {false, true, true}}};
  for (const auto& [s, mask] : cases)
    for (at::ScalarType score_dt : {at::kBFloat16, at::kFloat}) {
      SCOPED_TRACE("B, L, H, N, C = " + name_of(s) + " scores " + c10::toString(score_dt) + " rows " +
                   ::testing::PrintToString(mask));
      Inputs in = make_inputs(s, at::kDouble);
      in.rows = row_mask(mask);
      const at::Tensor grad = expect_gpu_bf16_close(in, score_dt);
      for (int64_t b = 0; b < s.B; ++b)
        if (!mask[b]) {
          EXPECT_EQ(grad[b].abs().max().item<double>(), 0.0) << "row " << b << " is masked out";
        }
    }
}

TEST(RankingLossCuda, Deterministic) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(46);
  Inputs in = make_inputs({3, 1025, 2, 16, 300, true, true}, at::kFloat);
  const auto [l1, g1] = run_gpu(to_gpu(in, at::kFloat, at::kFloat), 1.0);
  const auto [l2, g2] = run_gpu(to_gpu(in, at::kFloat, at::kFloat), 1.0);
  EXPECT_EQ(l1, l2);
  EXPECT_TRUE(at::equal(g1, g2));
}

TEST(RankingLossCuda, BadInputs) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(47);
  Inputs in = make_inputs({2, 20, 2, 4, 5, true, true}, at::kFloat);
  Inputs g = to_gpu(in, at::kFloat, at::kFloat);
  auto with = [&](auto change) {  // a changed copy of g
    Inputs c = g;
    change(c);
    return [c] { loss_of(c); };
  };
  expect_usage_error(with([&](Inputs& c) { c.cand = in.cand; }),
                     "ranking_loss: cand is on cpu but scores is on cuda:0");
  expect_usage_error(with([&](Inputs& c) { c.valid = in.valid; }), "valid is on cpu");
  expect_usage_error(with([&](Inputs& c) { c.rows = at::ones({2}, at::kBool); }), "rows is on cpu");
  expect_usage_error(with([&](Inputs& c) { c.q = c.q.to(at::kDouble); }), "q has dtype Double on cuda:0");
  expect_usage_error(with([&](Inputs& c) { c.cand = c.cand.narrow(1, 0, 4).t(); }), "cand has shape [4, 2]");
  // A value check of a CUDA tensor reads it back (a host synchronization): only while asked.
  Inputs bad = g;
  bad.cand = g.cand.clone();
  bad.cand[1][3] = 20;
  hax::ops::set_check_device_values(true);
  expect_usage_error([&] { loss_of(bad); }, "cand[1, 3] = 20 is not a position");
  hax::ops::set_check_device_values(false);
  // Unchecked, the kernels read an out-of-range candidate as absent (no out-of-bounds access).
  EXPECT_TRUE(std::isfinite(loss_of(bad).item<double>()));
}
