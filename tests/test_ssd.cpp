// SSD scan: chunked kernel vs. the naive float64 recurrence, gradients, states, packing; the CUDA
// kernels against the CPU op (float32) and the float64 recurrence (bfloat16).
#include <algorithm>
#include <cstdlib>

#include "cuda_harness.h"
#include "op_harness.h"
#include "ops/ssd/ssd.h"

using namespace hax::testing;
using hax::ops::ssd;
using hax::ops::ssd_forward;
using hax::ops::ssd_reference;

namespace {

struct SsdSize {
  int64_t B, L, H, P, G, N, chunk;
  bool init, packed;
  bool harness_packing = false;  // seq_idx from op_harness's random_packing (else random_seq_idx)
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
    in.push_back(!s.packed ? at::Tensor() : s.harness_packing ? random_packing(s.B, s.L) : random_seq_idx(s.B, s.L));
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

TEST(Ssd, CudaGridSizeCountsEveryKernelsBlocks) {
  // ssd_cuda_max_grid (the bound the CUDA binding checks against 2^31) against a brute-force count
  // of the grids: one block a (row, head, sub-chunk of 64 steps) and, for dB/dC, two a (row, group,
  // sub-chunk, 64 columns of the state), over awkward sizes; then sizes on both sides of 2^31.
  for (int64_t B : {1, 3})
    for (int64_t L : {1, 63, 97, 1025, 65537})
      for (int64_t chunk : {16, 64, 256})
        for (int64_t H : {1, 4, 16})
          for (int64_t N : {1, 64, 130, 512}) {
            hax::ops::SsdParams p;
            p.batch = B, p.seqlen = L, p.nheads = H, p.ngroups = H >= 4 ? 2 : 1, p.dstate = N, p.chunk = chunk;
            int64_t subs = 0;  // sub-chunks of one row: each chunk cut into pieces of at most 64 steps
            for (int64_t t0 = 0; t0 < L; t0 += chunk) subs += (std::min(chunk, L - t0) + 63) / 64;
            const int64_t tiles_n = (N + 63) / 64;
            const int64_t want = std::max(B * subs * H, B * subs * p.ngroups * tiles_n * 2);
            EXPECT_EQ(hax::ops::ssd_cuda_max_grid(p), want) << "B=" << B << " L=" << L << " chunk=" << chunk << " H=" << H << " N=" << N;
          }
  hax::ops::SsdParams p;
  p.batch = 1, p.nheads = 16, p.ngroups = 1, p.dstate = 128, p.chunk = 64;
  p.seqlen = (int64_t{1} << 27) * 64 - 64;  // 2^27 - 1 sub-chunks, 2^31 - 16 blocks
  EXPECT_LT(hax::ops::ssd_cuda_max_grid(p), int64_t{1} << 31);
  p.seqlen += 64;  // 2^31
  EXPECT_EQ(hax::ops::ssd_cuda_max_grid(p), int64_t{1} << 31);
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

// ---------------------------------------------------------------------------------------------
// CUDA kernels. Each (L, P, N) runs with one of these layouts of heads, groups, chunk, initial
// state and packing, in turn: chunks of 16 to 256 steps (the kernels split chunks longer than 64
// into 64-step pieces, 100 into 64 + 36), few that divide L.

namespace {

struct GpuVariant {
  int64_t H, G, chunk;
  bool init, packed;
};
constexpr GpuVariant kGpuVariants[] = {
    {2, 1, 64, true, false}, {4, 2, 16, false, true}, {3, 3, 256, true, true},
    {4, 1, 100, false, false}, {2, 2, 32, true, true}, {6, 2, 48, true, false},
};

OpCase gpu_case(int64_t L, int64_t P, int64_t N, int variant) {
  const GpuVariant& v = kGpuVariants[variant % 6];
  return ssd_case({2, L, v.H, P, v.G, N, v.chunk, v.init, v.packed, true});
}

std::string gpu_trace(int64_t L, int64_t P, int64_t N, int variant) {
  const GpuVariant& v = kGpuVariants[variant % 6];
  return fmt::format("L={} P={} N={} H={} G={} chunk={} init={} packed={}", L, P, N, v.H, v.G, v.chunk, v.init,
                     v.packed);
}

// The case without dA: A stops requiring a gradient. dA sums over every step of every row, so
// rounding the cotangents to bfloat16 (as a bfloat16 run receives them) moves the float64 dA by
// up to ~1% where the sum cancels, whatever computes it; the bfloat16 dA has its own test.
OpCase without_dA(OpCase c) {
  auto make = c.make_inputs;
  c.make_inputs = [make](at::ScalarType dtype) {
    Tensors in = make(dtype);
    in[2] = in[2].detach();
    return in;
  };
  return c;
}

constexpr int64_t kGpuLengths[] = {1, 63, 64, 65, 97, 1025};
constexpr int64_t kGpuHeadDims[] = {16, 32, 64, 128};
constexpr int64_t kGpuStates[] = {16, 64, 128};

}  // namespace

TEST(SsdCuda, MatchesCpuFloat32) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(30);
  int k = 0;
  for (int64_t L : kGpuLengths)
    for (int64_t P : kGpuHeadDims)
      for (int64_t N : kGpuStates) {
        SCOPED_TRACE(gpu_trace(L, P, N, k));
        expect_cuda_matches_cpu(gpu_case(L, P, N, k++), 1e-4, 1e-4);
      }
}

TEST(SsdCuda, Bfloat16CloseToFloat64Reference) {
  // Both forms of the kernels (wgmma where the sizes allow it: the forward's chunk_scan, the
  // local states of both directions and the backward's dB/dC with u, dx then without its Y
  // product; and mma.sync) on the same draws: P 64 and 128 with N 64 or 128 take the wgmma forms
  // on an sm_90a build.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(31);
  int k = 0;
  for (int64_t L : kGpuLengths)
    for (int64_t P : kGpuHeadDims) {
      const int64_t N = kGpuStates[k % 3];
      SCOPED_TRACE(gpu_trace(L, P, N, k));
      const OpCase c = without_dA(gpu_case(L, P, N, k++));
      with_same_draws([&] { expect_cuda_bf16_close(c); },
                      [&] {
                        SCOPED_TRACE("mma.sync kernels");
                        ScopedSwitch mma(hax::ops::ssd_wgmma, hax::ops::set_ssd_wgmma, false);
                        expect_cuda_bf16_close(c);
                      });
    }
}

TEST(SsdCuda, WgmmaFormsAgree) {
  // The wgmma kernels (the forward's chunk_scan, the local states of both directions, dB/dC with u
  // and dx without Y) against the mma.sync ones on the same bfloat16 inputs and cotangents, at every size the wgmma forms take
  // (P, N multiples of 64, N <= 128), with groups, packing, initial states, chunks of one and of
  // several 64-step pieces, and lengths that end inside a piece: y, the final state and the
  // gradients of x, dt, B, C and the initial state within a few bfloat16 roundings of each other
  // (the products sum in another order); each form is also checked against the float64
  // recurrence by Bfloat16CloseToFloat64Reference.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(41);
  for (int64_t L : {1, 63, 64, 97, 1025})
    for (int64_t P : {64, 128})
      for (int64_t N : {64, 128})
        for (int64_t chunk : {64, 256}) {
          const OpCase c = without_dA(ssd_case({2, L, 4, P, 2, N, chunk, true, true, true}));
          SCOPED_TRACE(::testing::Message() << "L=" << L << " P=" << P << " N=" << N << " chunk=" << chunk);
          const Tensors in = to_device(c.make_inputs(at::kFloat), at::Device(at::kCUDA, 0), at::kBFloat16);
          const Tensors w = random_cotangents(c.op(clone_leaves(in)));
          const auto wg = run_on_device(c.op, in, w);
          ScopedSwitch mma(hax::ops::ssd_wgmma, hax::ops::set_ssd_wgmma, false);
          expect_runs_close(wg, run_on_device(c.op, in, w), 2e-2);
        }
}

namespace {

// A process switch's two forms (on, off) on the same bfloat16 inputs and cotangents of c: y, the
// final state and every gradient within a few bfloat16 roundings; with against_f64, the form
// switched on is also checked against the float64 recurrence.
void expect_switch_forms_agree(bool (*get)(), void (*set)(bool), const OpCase& c, bool against_f64) {
  const Tensors in = to_device(c.make_inputs(at::kFloat), at::Device(at::kCUDA, 0), at::kBFloat16);
  const Tensors w = random_cotangents(c.op(clone_leaves(in)));
  std::pair<Tensors, Tensors> on_run;
  {
    ScopedSwitch on(get, set, true);
    on_run = run_on_device(c.op, in, w);
    if (against_f64) {
      SCOPED_TRACE("the form switched on against float64");
      expect_cuda_bf16_close(c);
    }
  }
  ScopedSwitch off(get, set, false);
  expect_runs_close(on_run, run_on_device(c.op, in, w), 2e-2);
}

}  // namespace

TEST(SsdCuda, SweepAgreesWithTwoKernelForm) {
  // The states by one sweep (segment_scan_wgmma.cuh: local states and pass together, rows cut
  // into segments whose runs are folded) against the local-state kernel plus the state pass, on
  // the same bfloat16 inputs and cotangents: one segment (many rows and heads: B H >= 256) and
  // many (up to one sub-chunk each), sequence resets (packed), slow decays, initial states, chunks of one
  // 64-step piece (both directions swept) and of several (the backward only), lengths that end
  // inside a piece. y, the final state and every gradient within a few bfloat16 roundings.
  HAX_REQUIRE_CUDA();
  if (std::getenv("HAX_SSD_SEGSCAN")) GTEST_SKIP() << "HAX_SSD_SEGSCAN is set: both runs would take one form";
  torch::manual_seed(43);
  struct Size {
    int64_t B, L, H, P, G, N, chunk;
  };
  for (const Size& z : {Size{2, 1025, 4, 64, 2, 128, 64}, Size{1, 97, 2, 128, 1, 64, 64}, Size{1, 4097, 1, 64, 1, 64, 64},
                        Size{2, 1025, 4, 64, 2, 128, 256}, Size{4, 130, 64, 64, 4, 64, 64}, Size{1, 63, 2, 64, 1, 128, 64}})
    for (int form = 0; form < 3; ++form) {  // 0 plain, 1 packed, 2 slow decays (dt / 100: runs reach far back)
      const bool packed = form == 1;
      OpCase c = without_dA(ssd_case({z.B, z.L, z.H, z.P, z.G, z.N, z.chunk, true, packed, true}));
      if (form == 2) {
        auto make = c.make_inputs;
        c.make_inputs = [make](at::ScalarType dtype) {
          Tensors in = make(dtype);
          in[1] = (in[1] * 0.01).detach().requires_grad_();
          return in;
        };
      }
      SCOPED_TRACE(::testing::Message() << "B=" << z.B << " L=" << z.L << " H=" << z.H << " P=" << z.P << " N=" << z.N
                                        << " chunk=" << z.chunk << " form=" << form);
      expect_switch_forms_agree(hax::ops::ssd_sweep, hax::ops::set_ssd_sweep, c, form > 0 && z.L == 1025 && z.chunk == 64);
    }
}

TEST(SsdCuda, JointDbdcAgreesWithSplitForm) {
  // dB, dC and <dS, S> in one block (dbdc_joint_wgmma.cuh; dx then reads no states) against dB and
  // dC blocks apart with <dS, S> in dx, on the same bfloat16 inputs and cotangents: groups of one
  // and several heads, N 64 (one block a sub-chunk) and 128 (two: g in two parts), P 64 and 128,
  // sequence resets (packed), initial states, chunks of one and several 64-step pieces, lengths
  // that end inside a piece. Every gradient within a few bfloat16 roundings; the joint form is
  // also checked against the float64 recurrence.
  HAX_REQUIRE_CUDA();
  if (std::getenv("HAX_SSD_DBDC_JOINT")) GTEST_SKIP() << "HAX_SSD_DBDC_JOINT is set: both runs would take one form";
  torch::manual_seed(47);
  struct Size {
    int64_t B, L, H, P, G, N, chunk;
  };
  for (const Size& z : {Size{2, 1025, 4, 64, 2, 128, 64}, Size{1, 97, 2, 128, 1, 64, 64}, Size{1, 4097, 4, 64, 1, 128, 64},
                        Size{2, 1025, 4, 128, 2, 128, 256}, Size{1, 63, 2, 64, 1, 128, 64}, Size{1, 1, 1, 64, 1, 64, 64}})
    for (int form = 0; form < 2; ++form) {  // 0 plain, 1 packed
      const bool packed = form == 1;
      const OpCase c = without_dA(ssd_case({z.B, z.L, z.H, z.P, z.G, z.N, z.chunk, true, packed, true}));
      SCOPED_TRACE(::testing::Message() << "B=" << z.B << " L=" << z.L << " H=" << z.H << " P=" << z.P << " G=" << z.G
                                        << " N=" << z.N << " chunk=" << z.chunk << " form=" << form);
      expect_switch_forms_agree(hax::ops::ssd_joint_dbdc, hax::ops::set_ssd_joint_dbdc, c, z.L == 1025);
    }
}

TEST(SsdCuda, Bfloat16DaMatchesReferenceOnTheSameCotangents) {
  // dA in bfloat16 against the float64 reference given the bfloat16-rounded cotangents.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(37);
  int k = 0;
  for (int64_t L : {1, 65, 97, 1025})
    for (int64_t P : {16, 64}) {
      SCOPED_TRACE(gpu_trace(L, P, 64, k));
      OpCase c = gpu_case(L, P, 64, k++);
      Tensors in16 = to_device(c.make_inputs(at::kDouble), at::kCPU, at::kBFloat16);
      Tensors ref_in = to_device(in16, at::kCPU, at::kDouble);
      Tensors w = random_cotangents(c.reference(clone_leaves(ref_in)));
      for (auto& t : w) t = t.to(at::kBFloat16).to(at::kDouble);
      auto [ref_out, ref_grads] = run_on_device(c.reference, ref_in, w);
      auto [out, grads] = run_on_device(c.op, to_device(in16, at::Device(at::kCUDA, 0), at::kBFloat16), w);
      const at::Tensor& ref = ref_grads[2];
      const double e = scaled_err(grads[2], ref), en = scaled_err(ref.to(at::kBFloat16).to(at::kDouble), ref);
      EXPECT_LE(e, 2 * en + 2e-3) << "bf16 dA error " << e << " vs naive " << en;
    }
}

TEST(SsdCuda, EmptySequenceAndOddSizes) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(32);
  // L = 0 passes the initial state through; head dims and state sizes off the 16-grid.
  expect_cuda_matches_cpu(ssd_case({2, 0, 2, 16, 1, 16, 64, true, false, true}), 1e-4, 1e-4);
  expect_cuda_matches_cpu(ssd_case({3, 70, 4, 3, 2, 5, 16, true, true, true}), 1e-4, 1e-4);
  expect_cuda_matches_cpu(ssd_case({1, 130, 2, 72, 1, 136, 64, false, true, true}), 1e-4, 1e-4);
  expect_cuda_bf16_close(without_dA(ssd_case({3, 70, 4, 3, 2, 5, 16, true, true, true})));
}

TEST(SsdCuda, ManyHeadsPerGroupBfloat16) {
  // Many heads a group, bfloat16 against float64: 10 heads in each of two groups at N = 128, and 16
  // heads of one group at P = 128 (the benchmark's head count), with the wgmma forms.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(42);
  expect_cuda_bf16_close(without_dA(ssd_case({1, 300, 20, 64, 2, 128, 64, true, true, true})));
  expect_cuda_bf16_close(without_dA(ssd_case({1, 200, 16, 128, 1, 64, 64, true, false, true})));
}

TEST(SsdCuda, LongSequenceMatchesCpu) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(33);
  expect_cuda_matches_cpu(ssd_case({1, 65537, 2, 16, 1, 16, 64, true, false, true}), 1e-4, 1e-4);
}

TEST(SsdCuda, ChunkStatesMatchCpuLayout) {
  // ssd_forward's chunk_states (x's dtype on both) hold the CPU's values in the CPU's layout.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(34);
  for (int64_t chunk : {16, 64, 100, 256}) {
    SCOPED_TRACE(::testing::Message() << "chunk=" << chunk);
    Tensors in = ssd_case({2, 300, 4, 32, 2, 16, chunk, true, true, true}).make_inputs(at::kFloat);
    auto [y, f, cst] = ssd_forward(in[0], in[1], in[2], in[3], in[4], in[5], in[6], chunk);
    Tensors g = to_device(in, at::Device(at::kCUDA, 0), at::kFloat);
    auto [gy, gf, gcst] = ssd_forward(g[0], g[1], g[2], g[3], g[4], g[5], g[6], chunk);
    ASSERT_EQ(gcst.sizes(), cst.sizes());
    EXPECT_EQ(gcst.scalar_type(), at::kFloat);
    EXPECT_LE(rel_err(gcst.to(at::kCPU), cst, 1e-4 * std::max(1.0, cst.abs().max().item<double>()), 1e-4), 1.0);
    EXPECT_LE(rel_err(gy.to(at::kCPU), y, 1e-4 * std::max(1.0, y.abs().max().item<double>()), 1e-4), 1.0);
    // bfloat16 inputs: the states are stored in bfloat16, each the float32 state rounded once.
    Tensors g16 = to_device(in, at::Device(at::kCUDA, 0), at::kBFloat16);
    at::Tensor c16 = std::get<2>(ssd_forward(g16[0], g16[1], g16[2], g16[3], g16[4], g16[5], g16[6], chunk));
    ASSERT_EQ(c16.scalar_type(), at::kBFloat16);
    EXPECT_LE(rel_err(c16.to(at::kCPU).to(at::kFloat), cst, 0.05 * std::max(1.0, cst.abs().max().item<double>()), 0.05),
              1.0);
  }
}

TEST(SsdCuda, FinalStateContinuesTheScan) {
  // On the GPU, running [0, t) then [t, L) with the first half's final state as the initial state
  // equals one run, for chunks of one and of several 64-step pieces.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(35);
  const int64_t L = 1000, t = 437;
  for (int64_t chunk : {64, 256}) {
    SCOPED_TRACE(::testing::Message() << "chunk=" << chunk);
    Tensors in = to_device(ssd_case({2, L, 4, 32, 2, 64, chunk, true, false, true}).make_inputs(at::kFloat),
                           at::Device(at::kCUDA, 0), at::kFloat);
    torch::NoGradGuard no_grad;
    auto [y, f] = ssd(in[0], in[1], in[2], in[3], in[4], in[5], at::Tensor(), chunk);
    auto part = [&](int i, int64_t a, int64_t n) { return in[i].narrow(1, a, n); };
    auto [y1, f1] = ssd(part(0, 0, t), part(1, 0, t), in[2], part(3, 0, t), part(4, 0, t), in[5], at::Tensor(), chunk);
    auto [y2, f2] = ssd(part(0, t, L - t), part(1, t, L - t), in[2], part(3, t, L - t), part(4, t, L - t), f1,
                        at::Tensor(), chunk);
    const at::Tensor yc = at::cat({y1, y2}, 1).to(at::kCPU), yr = y.to(at::kCPU);
    EXPECT_LE(rel_err(yc, yr, 1e-5 * std::max(1.0, yr.abs().max().item<double>()), 1e-4), 1.0);
    const at::Tensor f2c = f2.to(at::kCPU), fr = f.to(at::kCPU);
    EXPECT_LE(rel_err(f2c, fr, 1e-5 * std::max(1.0, fr.abs().max().item<double>()), 1e-4), 1.0);
  }
}

TEST(SsdCuda, BackwardIsDeterministic) {
  // No atomics: two runs give bit-identical outputs and gradients.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(36);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    OpCase c = ssd_case({2, 300, 4, 64, 2, 64, 128, true, true, true});
    Tensors in = to_device(c.make_inputs(at::kFloat), at::Device(at::kCUDA, 0), dtype);
    Tensors w = random_cotangents(c.op(clone_leaves(in)));
    auto [o1, g1] = run_on_device(c.op, in, w);
    auto [o2, g2] = run_on_device(c.op, in, w);
    for (size_t k = 0; k < o1.size(); ++k) EXPECT_TRUE(at::equal(o1[k], o2[k])) << "output " << k;
    for (size_t i = 0; i < g1.size(); ++i) {
      if (g1[i].defined()) {
        EXPECT_TRUE(at::equal(g1[i], g2[i])) << "gradient " << i;
      }
    }
  }
}

TEST(SsdCuda, SideStreamGivesBitIdenticalResults) {
  // C B^T (forward) and dcb (backward) run on a side stream beside the state kernels
  // (HAX_SIDE_STREAM=0: everything on one stream): each entry is computed by the same kernel code
  // either way, so both give the same bits, with chunks of several pieces, packing and an initial state.
  HAX_REQUIRE_CUDA();
  torch::manual_seed(39);
  struct Env {  // restores the default on every exit
    ~Env() { unsetenv("HAX_SIDE_STREAM"); }
  } restore;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << "dtype=" << dtype);
    OpCase c = ssd_case({2, 300, 6, 64, 2, 64, 100, true, true, true});
    Tensors in = to_device(c.make_inputs(at::kFloat), at::Device(at::kCUDA, 0), dtype);
    Tensors w = random_cotangents(c.op(clone_leaves(in)));
    setenv("HAX_SIDE_STREAM", "0", 1);
    auto [o1, g1] = run_on_device(c.op, in, w);
    setenv("HAX_SIDE_STREAM", "1", 1);
    auto [o2, g2] = run_on_device(c.op, in, w);
    for (size_t k = 0; k < o1.size(); ++k) EXPECT_TRUE(at::equal(o1[k], o2[k])) << "output " << k;
    for (size_t i = 0; i < g1.size(); ++i) {
      if (g1[i].defined()) {
        EXPECT_TRUE(at::equal(g1[i], g2[i])) << "gradient " << i;
      }
    }
  }
}

TEST(SsdCuda, SeqIdxMustBeOnTheInputsDevice) {
  HAX_REQUIRE_CUDA();
  Tensors in = ssd_case({1, 10, 2, 16, 1, 16, 4, false, true, true}).make_inputs(at::kFloat);
  at::Tensor seq_cpu = in[6];
  Tensors g = to_device(in, at::Device(at::kCUDA, 0), at::kFloat);
  expect_usage_error([&] { ssd(g[0], g[1], g[2], g[3], g[4], {}, seq_cpu, 4); }, "seq_idx is on");
}
