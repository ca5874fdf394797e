// SSD scan: chunked kernel vs. the naive float64 recurrence, gradients, states, packing.
#include "op_harness.h"
#include "ops/ssd/ssd.h"

using namespace hax::testing;
using hax::ops::ssd;
using hax::ops::ssd_reference;

namespace {

struct SsdSize {
  int64_t B, L, H, P, G, N, chunk;
  bool init, packed;
};

// Random packed sequence numbers: each row is split into random-length segments.
at::Tensor random_seq_idx(int64_t B, int64_t L) {
  at::Tensor s = at::zeros({B, L}, at::kInt);
  auto a = s.accessor<int32_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    int32_t id = 0;
    for (int64_t t = 1; t < L; ++t) {
      if (at::rand({1}).item<double>() < 0.08) ++id;
      a[b][t] = id;
    }
  }
  return s;
}

OpCase ssd_case(SsdSize s) {
  OpCase c;
  c.name = "ssd";
  c.make_inputs = [s](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    Tensors in;
    in.push_back(at::randn({s.B, s.L, s.H, s.P}, o).requires_grad_());                              // x
    in.push_back((at::softplus(at::randn({s.B, s.L, s.H}, o) - 1.0)).detach().requires_grad_());   // dt > 0
    in.push_back((-at::exp(at::randn({s.H}, o) * 0.5)).detach().requires_grad_());                  // A < 0
    in.push_back((at::randn({s.B, s.L, s.G, s.N}, o) * 0.5).detach().requires_grad_());            // B
    in.push_back((at::randn({s.B, s.L, s.G, s.N}, o) * 0.5).detach().requires_grad_());            // C
    in.push_back(s.init ? at::randn({s.B, s.H, s.P, s.N}, o).requires_grad_() : at::Tensor());     // init
    in.push_back(s.packed ? random_seq_idx(s.B, s.L) : at::Tensor());                              // seq_idx
    return in;
  };
  const int64_t chunk = s.chunk;
  c.op = [chunk](const Tensors& in) {
    auto [y, f] = ssd(in[0], in[1], in[2], in[3], in[4], in[5], in[6], chunk);
    return Tensors{y, f};
  };
  c.reference = [](const Tensors& in) {
    auto [y, f] = ssd_reference(in[0], in[1], in[2], in[3], in[4], in[5], in[6]);
    return Tensors{y, f};
  };
  return c;
}

}  // namespace

TEST(Ssd, ChunkedEqualsNaiveRecurrenceFloat64) {
  torch::manual_seed(1);
  for (int64_t L : {1, 63, 97, 1025})
    for (int64_t chunk : {1, 16, 64, 256}) {
      SCOPED_TRACE(::testing::Message() << "L=" << L << " chunk=" << chunk);
      expect_matches_reference(ssd_case({2, L, 4, 8, 2, 5, chunk, true, false}), at::kDouble, 1e-10, 1e-8);
    }
}

TEST(Ssd, PackedSequencesAndInitialStateFloat64) {
  torch::manual_seed(2);
  for (int64_t L : {1, 63, 97})
    for (int64_t chunk : {8, 32})
      for (bool init : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "L=" << L << " chunk=" << chunk << " init=" << init);
        expect_matches_reference(ssd_case({3, L, 2, 3, 1, 4, chunk, init, true}), at::kDouble, 1e-10, 1e-8);
      }
}

TEST(Ssd, Float32CloseToFloat64Reference) {
  torch::manual_seed(3);
  OpCase c = ssd_case({2, 200, 4, 16, 1, 32, 64, true, true});
  Tensors in64 = c.make_inputs(at::kDouble);
  Tensors in32;
  for (auto& t : in64) in32.push_back(t.defined() && at::isFloatingType(t.scalar_type()) ? t.detach().to(at::kFloat) : t);
  Tensors ref = c.reference(in64), out = c.op(in32);
  for (size_t k = 0; k < ref.size(); ++k) EXPECT_LE(rel_err(out[k], ref[k], 1e-4, 1e-3), 1.0) << "output " << k;
}

TEST(Ssd, FiniteDifferenceGradients) {
  torch::manual_seed(4);
  expect_gradients_match_finite_differences(ssd_case({2, 37, 2, 3, 1, 4, 8, true, false}));
  expect_gradients_match_finite_differences(ssd_case({2, 41, 4, 3, 2, 3, 16, true, true}));
}

TEST(Ssd, FinalStateContinuesTheScan) {
  // Running [0, t) then [t, L) with the first half's final state as initial state equals one run.
  torch::manual_seed(5);
  OpCase c = ssd_case({2, 97, 4, 8, 1, 6, 16, true, false});
  Tensors in = c.make_inputs(at::kDouble);
  auto [y, f] = ssd(in[0], in[1], in[2], in[3], in[4], in[5], at::Tensor(), 16);
  const int64_t t = 50;
  auto part = [&](int i, int64_t a, int64_t n) { return in[i].narrow(1, a, n); };
  auto [y1, f1] = ssd(part(0, 0, t), part(1, 0, t), in[2], part(3, 0, t), part(4, 0, t), in[5], at::Tensor(), 16);
  auto [y2, f2] = ssd(part(0, t, 97 - t), part(1, t, 97 - t), in[2], part(3, t, 97 - t), part(4, t, 97 - t), f1,
                      at::Tensor(), 16);
  EXPECT_LE(rel_err(at::cat({y1, y2}, 1), y, 1e-12, 1e-10), 1.0);
  EXPECT_LE(rel_err(f2, f, 1e-12, 1e-10), 1.0);
}

TEST(Ssd, PackingEqualsSeparateSequences) {
  torch::manual_seed(6);
  const int64_t H = 4, P = 8, N = 6, lens[] = {13, 1, 40, 30};
  int64_t L = 0;
  for (auto l : lens) L += l;
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({1, L, H, P}, o), dt = at::softplus(at::randn({1, L, H}, o)), A = -at::exp(at::randn({H}, o));
  at::Tensor Bm = at::randn({1, L, 1, N}, o), Cm = at::randn({1, L, 1, N}, o);
  at::Tensor seq = at::zeros({1, L}, at::kInt);
  int64_t off = 0, id = 0;
  for (auto l : lens) seq.narrow(1, off, l).fill_(id++), off += l;
  auto [y, f] = ssd(x, dt, A, Bm, Cm, at::Tensor(), seq, 16);
  off = 0;
  for (auto l : lens) {
    auto [ys, fs] = ssd(x.narrow(1, off, l), dt.narrow(1, off, l), A, Bm.narrow(1, off, l), Cm.narrow(1, off, l),
                        at::Tensor(), at::Tensor(), 16);
    EXPECT_LE(rel_err(y.narrow(1, off, l), ys, 1e-12, 1e-10), 1.0) << "segment at " << off;
    if (off + l == L) {
      EXPECT_LE(rel_err(f, fs, 1e-12, 1e-10), 1.0);
    }
    off += l;
  }
}

TEST(Ssd, DeterministicAcrossThreadCounts) {
  torch::manual_seed(7);
  expect_deterministic_across_threads(ssd_case({3, 150, 4, 16, 2, 8, 32, true, true}));
}

TEST(Ssd, BadInputsNameTheTensor) {
  auto o = at::TensorOptions().dtype(at::kFloat);
  at::Tensor x = at::randn({1, 5, 4, 8}, o), dt = at::rand({1, 5, 4}, o), A = -at::rand({4}, o);
  at::Tensor Bm = at::randn({1, 5, 1, 3}, o), Cm = at::randn({1, 5, 1, 3}, o);
  expect_usage_error([&] { ssd(x, dt.narrow(1, 0, 4), A, Bm, Cm, {}, {}, 4); }, "dt has shape [1, 4, 4]");
  expect_usage_error([&] { ssd(x, dt, A, at::randn({1, 5, 3, 3}, o), Cm, {}, {}, 4); }, "must divide the head count");
  expect_usage_error([&] { ssd(x, dt, A, Bm, Cm, {}, {}, 0); }, "chunk size 0");
  expect_usage_error([&] { ssd(x, dt, A.to(at::kDouble), Bm, Cm, {}, {}, 4); }, "A has dtype Double");
  at::Tensor bad_seq = at::tensor({0, 1, 0, 1, 1}, at::kInt).view({1, 5});
  expect_usage_error([&] { ssd(x, dt, A, Bm, Cm, {}, bad_seq, 4); }, "non-decreasing");
}
