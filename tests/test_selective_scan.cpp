// Selective scan (S6): kernel vs. the naive float64 recurrence, gradients, checkpointed backward,
// states, packing, errors.

#include "cuda_harness.h"
#include "op_harness.h"
#include "ops/selective_scan/selective_scan.h"

using namespace hax::testing;
using hax::ops::selective_scan;
using hax::ops::selective_scan_forward;
using hax::ops::selective_scan_reference;

namespace {

struct ScanSize {
  int64_t B, L, D, G, N, checkpoint;
  bool init, packed;
};

// y_only: the op returns only y, so no gradient reaches the final state (dfinal absent).
OpCase scan_case(ScanSize s, bool y_only = false) {
  OpCase c;
  c.name = "selective_scan";
  c.make_inputs = [s](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    Tensors in;
    in.push_back(at::randn({s.B, s.L, s.D}, o).requires_grad_());                                   // x
    in.push_back((at::softplus(at::randn({s.B, s.L, s.D}, o) - 1.0)).detach().requires_grad_());   // delta > 0
    in.push_back((-at::exp(at::randn({s.D, s.N}, o) * 0.5)).detach().requires_grad_());            // A < 0
    in.push_back((at::randn({s.B, s.L, s.G, s.N}, o) * 0.5).detach().requires_grad_());            // B
    in.push_back((at::randn({s.B, s.L, s.G, s.N}, o) * 0.5).detach().requires_grad_());            // C
    in.push_back(s.init ? at::randn({s.B, s.D, s.N}, o).requires_grad_() : at::Tensor());          // init
    in.push_back(s.packed ? random_packing(s.B, s.L) : at::Tensor());                              // seq_idx
    return in;
  };
  const int64_t ck = s.checkpoint;
  c.op = [ck, y_only](const Tensors& in) {
    auto [y, f] = selective_scan(in[0], in[1], in[2], in[3], in[4], in[5], in[6], ck);
    return y_only ? Tensors{y} : Tensors{y, f};
  };
  c.reference = [y_only](const Tensors& in) {
    auto [y, f] = selective_scan_reference(in[0], in[1], in[2], in[3], in[4], in[5], in[6]);
    return y_only ? Tensors{y} : Tensors{y, f};
  };
  return c;
}

}  // namespace

TEST(SelectiveScan, MatchesNaiveRecurrenceFloat64) {
  // D = 70 in G = 2 groups: 35 channels a group, three channel blocks (16, 16, 3) each.
  // L = 1025 runs the checkpointed backward over 17 segments (the last one a single step).
  torch::manual_seed(1);
  for (int64_t L : {1, 63, 97, 1025})
    for (bool init : {false, true})
      for (bool packed : {false, true}) {
        if (L == 1025 && init != packed) continue;  // the slow reference: two of the four there
        SCOPED_TRACE(::testing::Message() << "L=" << L << " init=" << init << " packed=" << packed);
        expect_matches_reference(scan_case({2, L, 70, 2, 5, 64, init, packed}), at::kDouble, 1e-10, 1e-8);
      }
}

TEST(SelectiveScan, CheckpointIntervalsAndGroupsFloat64) {
  // Segment lengths from one step to longer than the sequence; groups of 13 channels (one
  // padded block) and G = D (one channel a group).
  torch::manual_seed(2);
  for (int64_t ck : {1, 7, 64, 200})
    for (auto [D, G] : {std::pair<int64_t, int64_t>{39, 3}, {6, 6}, {21, 1}}) {
      SCOPED_TRACE(::testing::Message() << "checkpoint=" << ck << " D=" << D << " G=" << G);
      expect_matches_reference(scan_case({3, 97, D, G, 4, ck, true, true}), at::kDouble, 1e-10, 1e-8);
    }
}

TEST(SelectiveScan, CheckpointsAreOnePerSegment) {
  auto o = at::TensorOptions().dtype(at::kFloat);
  at::Tensor x = at::randn({2, 1025, 8}, o), dl = at::rand({2, 1025, 8}, o), A = -at::rand({8, 4}, o);
  at::Tensor Bm = at::randn({2, 1025, 1, 4}, o), Cm = at::randn({2, 1025, 1, 4}, o);
  auto [y, f, ck] = selective_scan_forward(x, dl, A, Bm, Cm, {}, {});
  EXPECT_EQ(ck.sizes(), (std::vector<int64_t>{2, 17, 8, 4}));  // ceil(1025 / 64) segments
  auto [y2, f2, ck2] = selective_scan_forward(x, dl, A, Bm, Cm, {}, {}, 64, /*save_checkpoints=*/false);
  EXPECT_FALSE(ck2.defined());
  EXPECT_TRUE(at::equal(y, y2));
  EXPECT_TRUE(at::equal(f, f2));
}

TEST(SelectiveScan, Float32CloseToFloat64Reference) {
  torch::manual_seed(3);
  expect_float32_close_to_reference(scan_case({2, 300, 40, 2, 16, 64, true, true}), 1e-4, 1e-3);
  expect_float32_close_to_reference(scan_case({1, 1025, 17, 1, 8, 64, false, false}), 1e-4, 1e-3);
}

TEST(SelectiveScan, FiniteDifferenceGradients) {
  torch::manual_seed(4);
  expect_gradients_match_finite_differences(scan_case({2, 37, 19, 1, 4, 8, true, false}));
  expect_gradients_match_finite_differences(scan_case({2, 41, 18, 3, 3, 5, true, true}));
  expect_gradients_match_finite_differences(scan_case({2, 1, 20, 2, 3, 64, true, false}));
}

TEST(SelectiveScan, FinalStateContinuesTheScan) {
  // Running [0, t) then [t, L) with the first half's final state as initial state equals one run.
  torch::manual_seed(5);
  const int64_t L = 97;
  OpCase c = scan_case({2, L, 20, 2, 6, 16, true, false});
  Tensors in = c.make_inputs(at::kDouble);
  auto [y, f] = selective_scan(in[0], in[1], in[2], in[3], in[4], in[5], at::Tensor(), 16);
  for (int64_t t : {1, 50, 96}) {
    auto part = [&](int i, int64_t a, int64_t n) { return in[i].narrow(1, a, n); };
    auto [y1, f1] = selective_scan(part(0, 0, t), part(1, 0, t), in[2], part(3, 0, t), part(4, 0, t), in[5],
                                   at::Tensor(), 16);
    auto [y2, f2] = selective_scan(part(0, t, L - t), part(1, t, L - t), in[2], part(3, t, L - t),
                                   part(4, t, L - t), f1, at::Tensor(), 16);
    EXPECT_LE(rel_err(at::cat({y1, y2}, 1), y, 1e-12, 1e-10), 1.0) << "split at " << t;
    EXPECT_LE(rel_err(f2, f, 1e-12, 1e-10), 1.0) << "split at " << t;
  }
}

TEST(SelectiveScan, PackingEqualsSeparateSequences) {
  torch::manual_seed(6);
  const int64_t D = 24, G = 2, N = 6, lens[] = {13, 1, 70, 30};
  int64_t L = 0;
  for (auto l : lens) L += l;
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({1, L, D}, o), dl = at::softplus(at::randn({1, L, D}, o)), A = -at::exp(at::randn({D, N}, o));
  at::Tensor Bm = at::randn({1, L, G, N}, o), Cm = at::randn({1, L, G, N}, o), h0 = at::randn({1, D, N}, o);
  at::Tensor seq = at::zeros({1, L}, at::kInt);
  int64_t off = 0, id = 3;
  for (auto l : lens) seq.narrow(1, off, l).fill_(id++), off += l;
  auto [y, f] = selective_scan(x, dl, A, Bm, Cm, h0, seq, 16);
  off = 0;
  for (auto l : lens) {
    // The initial state feeds only the row's first sequence.
    auto [ys, fs] = selective_scan(x.narrow(1, off, l), dl.narrow(1, off, l), A, Bm.narrow(1, off, l),
                                   Cm.narrow(1, off, l), off == 0 ? h0 : at::Tensor(), at::Tensor(), 16);
    EXPECT_LE(rel_err(y.narrow(1, off, l), ys, 1e-12, 1e-10), 1.0) << "segment at " << off;
    if (off + l == L) {
      EXPECT_LE(rel_err(f, fs, 1e-12, 1e-10), 1.0);
    }
    off += l;
  }
}

TEST(SelectiveScan, DeterministicAcrossThreadCounts) {
  torch::manual_seed(7);
  expect_deterministic_across_threads(scan_case({3, 150, 70, 2, 8, 32, true, true}));
}

TEST(SelectiveScan, EmptySequenceKeepsTheState) {
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor h0 = at::randn({2, 4, 3}, o);
  auto [y, f] = selective_scan(at::zeros({2, 0, 4}, o), at::zeros({2, 0, 4}, o), -at::ones({4, 3}, o),
                               at::zeros({2, 0, 1, 3}, o), at::zeros({2, 0, 1, 3}, o), h0, at::Tensor());
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 0, 4}));
  EXPECT_TRUE(at::equal(f, h0));
}

TEST(SelectiveScan, BadInputsNameTheTensor) {
  auto o = at::TensorOptions().dtype(at::kFloat);
  at::Tensor x = at::randn({1, 5, 6}, o), dl = at::rand({1, 5, 6}, o), A = -at::rand({6, 3}, o);
  at::Tensor Bm = at::randn({1, 5, 2, 3}, o), Cm = at::randn({1, 5, 2, 3}, o);
  expect_usage_error([&] { selective_scan(x.view({5, 6}), dl, A, Bm, Cm, {}, {}); }, "selective_scan: x has shape [5, 6]");
  expect_usage_error([&] { selective_scan(x.to(at::kInt), dl, A, Bm, Cm, {}, {}); }, "x has dtype Int");
  expect_usage_error([&] { selective_scan(x, dl.narrow(1, 0, 4), A, Bm, Cm, {}, {}); },
                     "delta has shape [1, 4, 6] but must be (B, L, D) = [1, 5, 6]");
  expect_usage_error([&] { selective_scan(x, dl, A.narrow(1, 0, 2), Bm, Cm, {}, {}); },
                     "A has shape [6, 2] but must be (D, N) = [6, 3]");
  expect_usage_error([&] { selective_scan(x, dl, A, at::randn({1, 5, 4, 3}, o), Cm, {}, {}); },
                     "G = 4 (B's dim 2) must divide the channel count D = 6");
  expect_usage_error([&] { selective_scan(x, dl, A, Bm, Cm.narrow(3, 0, 2), {}, {}); }, "C has shape [1, 5, 2, 2]");
  expect_usage_error([&] { selective_scan(x, dl, A, Bm, Cm.view({1, 5, 6}), {}, {}); }, "C has shape [1, 5, 6]");
  expect_usage_error([&] { selective_scan(x, dl, A.to(at::kDouble), Bm, Cm, {}, {}); }, "A has dtype Double");
  expect_usage_error([&] { selective_scan(x, dl, A, Bm, Cm, at::zeros({1, 6, 4}, o), {}); },
                     "init_state has shape [1, 6, 4] but must be (B, D, N) = [1, 6, 3]");
  expect_usage_error([&] { selective_scan(x, dl, A, Bm, Cm, at::zeros({1, 6, 3}, at::kDouble), {}); },
                     "init_state has dtype Double");
  expect_usage_error([&] { selective_scan(x, dl, A, Bm, Cm, {}, at::zeros({1, 4}, at::kInt)); },
                     "seq_idx has shape [1, 4]");
  expect_usage_error([&] { selective_scan(x, dl, A, Bm, Cm, {}, at::zeros({1, 5}, o)); }, "seq_idx has dtype Float");
  at::Tensor bad_seq = at::tensor({0, 1, 0, 1, 1}, at::kInt).view({1, 5});
  expect_usage_error([&] { selective_scan(x, dl, A, Bm, Cm, {}, bad_seq); }, "non-decreasing");
  expect_usage_error([&] { selective_scan(x, dl, A, Bm, Cm, {}, {}, 0); }, "checkpoint interval 0");
}

// ---- CUDA (skipped without a GPU) ----

TEST(SelectiveScanCuda, MatchesCpuFloat32AndBf16) {
  // Channel counts that leave partial warps and channel tiles (33 in one group, 100 in two groups
  // of 50); L = 1025 spans 17 forward segments and 65 backward sub-segments.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(31);
  for (int64_t L : {1, 2, 3, 63, 97, 1025})
    for (auto [D, G] : {std::pair<int64_t, int64_t>{33, 1}, {100, 2}})
      for (bool init : {false, true})
        for (bool packed : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "L=" << L << " D=" << D << " G=" << G << " init=" << init
                                            << " packed=" << packed);
          OpCase c = scan_case({2, L, D, G, 16, 64, init, packed});
          expect_cuda_matches_cpu(c, 1e-4, 1e-3);
          if (L < 1025 || (init && packed)) expect_cuda_bf16_close(c);  // the naive float64 oracle is slow
        }
}

TEST(SelectiveScanCuda, StateSizesCheckpointsAndGroups) {
  // N up to 16 in one lane, larger N over 2, 4, 8 or 16 lanes; checkpoint intervals that do and do
  // not align with the kernels' segments; one channel per group; no gradient on the final state.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(32);
  for (int64_t N : {1, 5, 8, 16, 17, 32, 64, 100, 256}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N);
    OpCase c = scan_case({2, 97, 40, 2, N, 64, true, true});
    expect_cuda_matches_cpu(c, 1e-4, 1e-3);
    expect_cuda_bf16_close(c);
  }
  for (int64_t ck : {1, 7, 16, 200})
    for (auto [D, G] : {std::pair<int64_t, int64_t>{39, 3}, {6, 6}}) {
      SCOPED_TRACE(::testing::Message() << "checkpoint=" << ck << " D=" << D << " G=" << G);
      OpCase c = scan_case({3, 97, D, G, 4, ck, true, true});
      expect_cuda_matches_cpu(c, 1e-4, 1e-3);
      expect_cuda_bf16_close(c);
    }
  expect_cuda_matches_cpu(scan_case({2, 150, 24, 1, 16, 64, true, true}, /*y_only=*/true), 1e-4, 1e-3);
}

TEST(SelectiveScanCuda, LongSequence) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(33);
  expect_cuda_matches_cpu(scan_case({1, 65537, 4, 1, 16, 64, true, true}), 1e-4, 1e-3);
}

TEST(SelectiveScanCuda, CheckpointsAreTheCpuCheckpoints) {
  // The CUDA forward's (float32) checkpoints hold the same states as the CPU's.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(34);
  OpCase c = scan_case({2, 300, 20, 2, 8, 7, true, true});
  Tensors in = c.make_inputs(at::kFloat);
  auto [y, f, ck] = selective_scan_forward(in[0], in[1], in[2], in[3], in[4], in[5], in[6], 7);
  Tensors g = to_device(in, at::Device(at::kCUDA, 0), at::kFloat);
  auto [yg, fg, ckg] = selective_scan_forward(g[0], g[1], g[2], g[3], g[4], g[5], g[6], 7);
  EXPECT_EQ(ckg.scalar_type(), at::kFloat);
  EXPECT_LE(rel_err(ckg.cpu(), ck, 1e-4 * std::max(1.0, ck.abs().max().item<double>()), 1e-3), 1.0);
  auto [y2, f2, ck2] = selective_scan_forward(g[0], g[1], g[2], g[3], g[4], g[5], g[6], 7, /*save_checkpoints=*/false);
  EXPECT_FALSE(ck2.defined());
  EXPECT_TRUE(at::equal(y2, yg));
  EXPECT_TRUE(at::equal(f2, fg));
}

TEST(SelectiveScanCuda, EmptySequenceKeepsTheState) {
  HAX_REQUIRE_CUDA();
  auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  at::Tensor h0 = at::randn({2, 4, 3}, o);
  auto [y, f] = selective_scan(at::zeros({2, 0, 4}, o), at::zeros({2, 0, 4}, o), -at::ones({4, 3}, o),
                               at::zeros({2, 0, 1, 3}, o), at::zeros({2, 0, 1, 3}, o), h0, at::Tensor());
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 0, 4}));
  EXPECT_TRUE(at::equal(f, h0));
}

TEST(SelectiveScanCuda, GradientsAreBitIdenticalAcrossRuns) {
  // dA, dB and dC are reduced in a fixed order (no atomics), deterministic mode or not.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(35);
  OpCase c = scan_case({3, 1500, 70, 2, 16, 64, true, true});
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

TEST(SelectiveScanCuda, BadInputsNameTheTensor) {
  HAX_REQUIRE_CUDA();
  auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  at::Tensor x = at::randn({1, 5, 6}, o), dl = at::rand({1, 5, 6}, o);
  expect_usage_error(
      [&] {
        selective_scan(x, dl, -at::rand({6, 300}, o), at::randn({1, 5, 1, 300}, o), at::randn({1, 5, 1, 300}, o), {},
                       {});
      },
      "the state size N = 300 (B's dim 3) exceeds the CUDA kernels' maximum 256");
  expect_usage_error([&] { selective_scan(x, dl.cpu(), -at::rand({6, 3}, o), at::randn({1, 5, 1, 3}, o),
                                          at::randn({1, 5, 1, 3}, o), {}, {}); },
                     "delta is on cpu");
}
