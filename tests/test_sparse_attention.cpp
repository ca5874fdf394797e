// Sparse attention over index lists: both kernel paths (dense tiles over a block's key union, and
// per-query gathers) against the dense masked-softmax reference, gradients, properties, errors.
#include <cmath>
#include <cstdio>
#include <random>

#include "op_harness.h"
#include "ops/attention/attention.h"

using namespace hax::testing;
using hax::ops::AttentionPath;
using hax::ops::sparse_attention;
using hax::ops::sparse_attention_reference;

namespace {

enum class Lists {
  kRandom,  // any keys of [0, Lk)
  kCausal,  // random keys j <= i
  kWindow,  // segment s: the K keys before the (s K) most recent ones, i.e. i-(s+1)K+1 .. i-sK
  kSink,    // keys 0 and 1 (when <= i) in every list, then random keys j <= i: popular keys
};

struct AttnSize {
  int64_t B, L, Lk, H, D, Dv, S, K;
  Lists lists;
  bool bias, seg_w, q_order;
  bool four_d = false;      // idx given as (B, H, L, K) (S must be 1)
  double empty_frac = 0.1;  // fraction of queries without any key
};

std::string describe(const AttnSize& s) {
  return ::testing::PrintToString(std::vector<int64_t>{s.B, s.L, s.Lk, s.H, s.D, s.Dv, s.S, s.K}) +
         " lists=" + std::to_string(int(s.lists)) + " bias=" + std::to_string(s.bias) +
         " seg_w=" + std::to_string(s.seg_w) + " q_order=" + std::to_string(s.q_order);
}

// Index lists (B, H, L, S, K) int32 of the given kind: distinct keys per segment, a random number of
// them (some segments empty, some queries without any key), -1 padding, in random slots.
at::Tensor make_lists(const AttnSize& s, std::mt19937& rng) {
  at::Tensor idx = at::full({s.B, s.H, s.L, s.S, s.K}, -1, at::kInt);
  int32_t* p = idx.data_ptr<int32_t>();
  std::uniform_real_distribution<double> u01(0, 1);
  std::vector<int32_t> pool, chosen;
  for (int64_t bh = 0; bh < s.B * s.H; ++bh)
    for (int64_t i = 0; i < s.L; ++i) {
      const bool empty = u01(rng) < s.empty_frac;
      for (int64_t sg = 0; sg < s.S; ++sg) {
        int32_t* li = p + ((bh * s.L + i) * s.S + sg) * s.K;
        if (empty) continue;
        chosen.clear();
        if (s.lists == Lists::kWindow) {
          for (int64_t j = std::max<int64_t>(0, i - (sg + 1) * s.K + 1); j <= i - sg * s.K; ++j) chosen.push_back(j);
        } else if (s.lists == Lists::kSink) {
          for (int64_t j = 0; j <= std::min<int64_t>(i, 1) && (int64_t)chosen.size() < s.K; ++j) chosen.push_back(j);
          for (int64_t j = 2 + std::uniform_int_distribution<int64_t>(0, 3)(rng); j <= i && (int64_t)chosen.size() < s.K;
               j += 1 + std::uniform_int_distribution<int64_t>(0, i)(rng))
            chosen.push_back(j);
        } else {
          const int64_t avail = s.lists == Lists::kCausal ? std::min(i + 1, s.Lk) : s.Lk;
          int64_t n = std::min<int64_t>(s.K, avail);
          if (u01(rng) < 0.4) n = std::uniform_int_distribution<int64_t>(0, n)(rng);
          pool.resize(avail);
          for (int64_t j = 0; j < avail; ++j) pool[j] = int32_t(j);
          for (int64_t t = 0; t < n; ++t) {  // partial Fisher-Yates
            std::swap(pool[t], pool[std::uniform_int_distribution<int64_t>(t, avail - 1)(rng)]);
            chosen.push_back(pool[t]);
          }
          std::sort(chosen.begin(), chosen.end());
        }
        for (size_t t = 0; t < chosen.size(); ++t) li[t] = chosen[t];
        if (u01(rng) < 0.3) std::shuffle(li, li + s.K, rng);  // padding anywhere, keys in any order
      }
    }
  return s.four_d ? idx.view({s.B, s.H, s.L, s.K}) : idx;
}

at::Tensor random_order(int64_t B, int64_t H, int64_t L) {
  std::vector<at::Tensor> rows;
  for (int64_t bh = 0; bh < B * H; ++bh) rows.push_back(at::randperm(L, at::kLong));
  return at::stack(rows).view({B, H, L}).to(at::kInt);
}

// lse is -inf for empty segments; the comparisons (and finite differences) see it as 0 there.
at::Tensor finite(const at::Tensor& lse) { return lse.masked_fill(at::isinf(lse), 0.0); }

OpCase attention_case(AttnSize s) {
  OpCase c;
  c.name = "sparse_attention " + describe(s);
  c.make_inputs = [s](at::ScalarType dt) {
    auto o = at::TensorOptions().dtype(dt);
    std::mt19937 rng(uint32_t(at::randint(1 << 30, {1}, at::kLong).item<int64_t>()));
    Tensors in;
    in.push_back(at::randn({s.B, s.L, s.H, s.D}, o).requires_grad_());    // q
    in.push_back(at::randn({s.B, s.Lk, s.H, s.D}, o).requires_grad_());   // k
    in.push_back(at::randn({s.B, s.Lk, s.H, s.Dv}, o).requires_grad_());  // v
    in.push_back(make_lists(s, rng));                                     // idx
    in.push_back(s.bias ? at::randn({s.B, s.H, s.Lk}, o).requires_grad_() : at::Tensor());
    in.push_back(s.seg_w ? at::randn({s.B, s.H, s.L, s.S}, o).requires_grad_() : at::Tensor());
    in.push_back(s.q_order ? random_order(s.B, s.H, s.L) : at::Tensor());
    return in;
  };
  const double scale = 1.0 / std::sqrt(double(s.D));
  c.op = [scale](const Tensors& in) {
    auto [out, lse] = sparse_attention(in[0], in[1], in[2], in[3], in[4], in[5], in[6], scale);
    return Tensors{out, finite(lse)};
  };
  c.reference = [scale](const Tensors& in) {
    auto [out, lse] = sparse_attention_reference(in[0], in[1], in[2], in[3], in[4], in[5], scale);
    return Tensors{out, finite(lse)};
  };
  return c;
}

// Sets the kernels' path for a scope.
struct PathGuard {
  AttentionPath before = hax::ops::sparse_attention_path();
  explicit PathGuard(AttentionPath p) { hax::ops::set_sparse_attention_path(p); }
  ~PathGuard() { hax::ops::set_sparse_attention_path(before); }
};

const AttentionPath kAllPaths[] = {AttentionPath::kAuto, AttentionPath::kTiles, AttentionPath::kPerQuery};
const char* path_name(AttentionPath p) {
  return p == AttentionPath::kAuto ? "auto" : p == AttentionPath::kTiles ? "tiles" : "per-query";
}

}  // namespace

TEST(SparseAttention, MatchesReferenceFloat64) {
  torch::manual_seed(1);
  int n = 0;
  for (int64_t L : {1, 63, 97})
    for (int64_t K : {1, 7, 64})
      for (Lists lists : {Lists::kRandom, Lists::kCausal, Lists::kWindow})
        for (int64_t S : {1, 3}) {
          ++n;  // vary the rest along the loop
          AttnSize s{2, L, lists == Lists::kRandom ? L + 13 : L, 1 + n % 2, 8, 5 + n % 3, S, K, lists,
                     n % 3 != 0,  n % 4 != 1, n % 2 == 0};
          for (AttentionPath path : kAllPaths) {
            PathGuard g(path);
            SCOPED_TRACE(describe(s) + " path=" + path_name(path));
            expect_matches_reference(attention_case(s), at::kDouble, 1e-11, 1e-9);
          }
        }
}

TEST(SparseAttention, LongSequenceMatchesReferenceFloat64) {
  torch::manual_seed(2);
  for (Lists lists : {Lists::kWindow, Lists::kCausal})
    for (bool q_order : {false, true}) {
      AttnSize s{1, 1025, 1025, 1, 16, 12, 1, 64, lists, true, false, q_order};
      SCOPED_TRACE(describe(s));
      expect_matches_reference(attention_case(s), at::kDouble, 1e-11, 1e-9);
    }
  AttnSize s{1, 1025, 1025, 1, 16, 16, 3, 7, Lists::kRandom, true, true, false};
  SCOPED_TRACE(describe(s));
  expect_matches_reference(attention_case(s), at::kDouble, 1e-11, 1e-9);
}

// Keys in more lists than the backward sums in one piece (2048 entries): their sums are split in
// chunks. Reference, both paths, and bit-identical results on 1 and 2 threads.
TEST(SparseAttention, PopularKeysMatchReferenceAndAreDeterministic) {
  torch::manual_seed(12);
  for (AttentionPath path : kAllPaths) {
    PathGuard g(path);
    AttnSize s{1, 2600, 2600, 1, 8, 6, 1, 6, Lists::kSink, true, false, path == AttentionPath::kAuto};
    s.empty_frac = 0.02;
    SCOPED_TRACE(describe(s) + " path=" + path_name(path));
    expect_matches_reference(attention_case(s), at::kDouble, 1e-11, 1e-9);
    expect_deterministic_across_threads(attention_case(s));
  }
}

TEST(SparseAttention, FourDimensionalIndexIsOneSegment) {
  torch::manual_seed(3);
  for (Lists lists : {Lists::kWindow, Lists::kRandom}) {
    AttnSize s{2, 70, 70, 2, 8, 8, 1, 7, lists, true, true, true};
    s.four_d = true;
    expect_matches_reference(attention_case(s), at::kDouble, 1e-11, 1e-9);
  }
  // (B, H, L, K) and (B, H, L, 1, K) give the same outputs; lse is (B, H, L, 1) for both.
  OpCase c = attention_case({1, 40, 40, 2, 8, 8, 1, 5, Lists::kCausal, true, false, false});
  Tensors in = c.make_inputs(at::kDouble);
  auto [o5, l5] = sparse_attention(in[0], in[1], in[2], in[3], in[4], {}, {}, 0.3);
  auto [o4, l4] = sparse_attention(in[0], in[1], in[2], in[3].view({1, 2, 40, 5}), in[4], {}, {}, 0.3);
  EXPECT_TRUE(at::equal(o4, o5));
  EXPECT_EQ(l4.sizes(), (std::vector<int64_t>{1, 2, 40, 1}));
  EXPECT_TRUE(at::equal(finite(l4), finite(l5)));
}

TEST(SparseAttention, QueryOrderAndPathDoNotChangeTheResult) {
  torch::manual_seed(4);
  for (Lists lists : {Lists::kWindow, Lists::kCausal, Lists::kRandom}) {
    OpCase c = attention_case({2, 150, 150, 2, 16, 8, 2, 16, lists, true, true, false});
    Tensors in = c.make_inputs(at::kDouble);
    Tensors w = random_cotangents(c.op(clone_leaves(in)));
    auto [o0, g0] = run_with_grads(c.op, in, w);
    Tensors with_order = in;
    with_order[6] = random_order(2, 2, 150);
    for (AttentionPath path : kAllPaths) {
      PathGuard g(path);
      for (const Tensors* inputs : {&in, &with_order}) {
        auto [o, gr] = run_with_grads(c.op, *inputs, w);
        for (size_t k = 0; k < o.size(); ++k) EXPECT_LE(rel_err(o[k], o0[k], 1e-12, 1e-10), 1.0) << path_name(path);
        for (size_t i = 0; i < gr.size(); ++i) {
          if (gr[i].defined()) {
            EXPECT_LE(rel_err(gr[i], g0[i], 1e-12, 1e-10), 1.0) << path_name(path) << " grad " << i;
          }
        }
      }
    }
  }
}

TEST(SparseAttention, KeysSharedBetweenSegments) {
  // The same key listed in several segments of a query (HSA chunks may coincide) counts in each.
  torch::manual_seed(5);
  OpCase c = attention_case({1, 50, 50, 2, 8, 8, 3, 6, Lists::kCausal, true, true, true});
  auto make = c.make_inputs;
  c.make_inputs = [make](at::ScalarType dt) {
    Tensors in = make(dt);
    in[3].select(3, 2).copy_(in[3].select(3, 0));  // segment 2 = segment 0
    in[3].select(3, 1).fill_(-1);                  // segment 1 = half of segment 0
    in[3].select(3, 1).narrow(3, 0, 3).copy_(in[3].select(3, 0).narrow(3, 0, 3));
    return in;
  };
  for (AttentionPath path : kAllPaths) {
    PathGuard g(path);
    expect_matches_reference(c, at::kDouble, 1e-11, 1e-9);
  }
}

TEST(SparseAttention, FiniteDifferenceGradients) {
  torch::manual_seed(6);
  for (AttentionPath path : {AttentionPath::kTiles, AttentionPath::kPerQuery}) {
    PathGuard g(path);
    expect_gradients_match_finite_differences(attention_case({2, 37, 41, 2, 5, 3, 3, 6, Lists::kRandom, true, true, true}));
    expect_gradients_match_finite_differences(attention_case({1, 45, 45, 2, 4, 6, 1, 9, Lists::kWindow, true, false, false}));
  }
}

TEST(SparseAttention, Float32CloseToFloat64Reference) {
  torch::manual_seed(7);
  for (AttentionPath path : kAllPaths) {
    PathGuard g(path);
    expect_float32_close_to_reference(attention_case({2, 200, 200, 2, 32, 16, 2, 32, Lists::kWindow, true, true, true}),
                                      1e-4, 1e-3);
    expect_float32_close_to_reference(attention_case({1, 130, 160, 2, 16, 32, 1, 64, Lists::kRandom, true, false, false}),
                                      1e-4, 1e-3);
  }
}

TEST(SparseAttention, DeterministicAcrossThreadCounts) {
  torch::manual_seed(8);
  for (AttentionPath path : kAllPaths) {
    PathGuard g(path);
    expect_deterministic_across_threads(attention_case({2, 300, 300, 2, 32, 16, 2, 16, Lists::kWindow, true, true, true}));
    expect_deterministic_across_threads(attention_case({1, 257, 300, 3, 16, 16, 1, 64, Lists::kRandom, true, true, false}));
    // One (b, h) on two threads: the backward's grouping by key then splits it into chunks.
    expect_deterministic_across_threads(attention_case({1, 500, 500, 1, 16, 16, 1, 24, Lists::kWindow, true, true, true}));
    expect_deterministic_across_threads(attention_case({1, 300, 200, 1, 8, 8, 3, 16, Lists::kRandom, true, true, false}));
  }
}

TEST(SparseAttention, TwoThreadsMatchReferenceFloat64) {
  torch::manual_seed(10);
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  for (AttentionPath path : kAllPaths) {
    PathGuard g(path);
    expect_matches_reference(attention_case({1, 500, 500, 1, 16, 12, 1, 24, Lists::kWindow, true, true, true}),
                             at::kDouble, 1e-11, 1e-9);
    expect_matches_reference(attention_case({1, 300, 200, 1, 8, 8, 3, 16, Lists::kRandom, true, true, false}),
                             at::kDouble, 1e-11, 1e-9);
    expect_matches_reference(attention_case({2, 200, 200, 3, 8, 8, 2, 16, Lists::kCausal, true, true, true}),
                             at::kDouble, 1e-11, 1e-9);
  }
  at::set_num_threads(before);
}

TEST(SparseAttention, EmptyListGivesZeroOutputAndZeroGradients) {
  torch::manual_seed(9);
  for (AttentionPath path : kAllPaths) {
    PathGuard g(path);
    AttnSize s{1, 64, 64, 2, 8, 8, 2, 8, Lists::kCausal, true, true, true};
    s.empty_frac = 0;
    OpCase c = attention_case(s);
    Tensors in = c.make_inputs(at::kDouble);
    in[3].select(2, 10).fill_(-1);  // query 10 of every head: no keys
    in[3].select(2, 0).fill_(-1);   // query 0 too
    in[3][0][1][20][1].fill_(-1);   // query 20 of head 1: segment 1 empty, segment 0 not
    Tensors w = random_cotangents(c.op(clone_leaves(in)));
    auto [outs, grads] = run_with_grads(c.op, in, w);
    auto [out, lse] = sparse_attention(in[0], in[1], in[2], in[3], in[4], in[5], in[6], 0.3);
    for (int64_t i : {0, 10}) {
      EXPECT_TRUE(at::equal(out.select(1, i), at::zeros({1, 2, 8}, out.options()))) << "query " << i;
      EXPECT_TRUE(at::isinf(lse.select(2, i)).all().item<bool>()) << "query " << i;
      EXPECT_TRUE((lse.select(2, i) < 0).all().item<bool>());
      EXPECT_TRUE(at::equal(grads[0].select(1, i), at::zeros({1, 2, 8}, out.options()))) << "dq of query " << i;
      EXPECT_TRUE(at::equal(grads[5].select(2, i), at::zeros({1, 2, 2}, out.options()))) << "dseg_w of query " << i;
    }
    EXPECT_TRUE(std::isinf(lse[0][1][20][1].item<double>()));
    EXPECT_FALSE(std::isinf(lse[0][1][20][0].item<double>()));
    EXPECT_EQ(grads[5][0][1][20][1].item<double>(), 0.0);
    // A key that no list references gets exactly zero dk, dv and dbias.
    in[3].masked_fill_(in[3] == 5, -1);
    auto [o2, g2] = run_with_grads(c.op, in, w);
    EXPECT_TRUE(at::equal(g2[1].select(1, 5), at::zeros({1, 2, 8}, out.options())));
    EXPECT_TRUE(at::equal(g2[2].select(1, 5), at::zeros({1, 2, 8}, out.options())));
    EXPECT_TRUE(at::equal(g2[4].select(2, 5), at::zeros({1, 2}, out.options())));
    // All lists empty: zero output, zero gradients everywhere.
    in[3].fill_(-1);
    auto [o3, g3] = run_with_grads(c.op, in, w);
    EXPECT_EQ(o3[0].abs().max().item<double>(), 0.0);
    for (int i : {0, 1, 2, 4, 5}) EXPECT_EQ(g3[i].abs().max().item<double>(), 0.0) << "input " << i;
  }
}

TEST(SparseAttention, EmptyShapes) {
  auto o = at::TensorOptions().dtype(at::kFloat);
  // No queries; no keys at all (every entry -1); K = 0.
  auto [out, lse] = sparse_attention(at::randn({1, 0, 2, 4}, o), at::randn({1, 5, 2, 4}, o), at::randn({1, 5, 2, 3}, o),
                                     at::zeros({1, 2, 0, 4}, at::kInt), {}, {}, {}, 0.5);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{1, 0, 2, 3}));
  at::Tensor q = at::randn({1, 3, 2, 4}, o).requires_grad_();
  auto [out2, lse2] = sparse_attention(q, at::randn({1, 0, 2, 4}, o), at::randn({1, 0, 2, 3}, o),
                                       at::full({1, 2, 3, 4}, -1, at::kInt), {}, {}, {}, 0.5);
  EXPECT_EQ(out2.abs().sum().item<double>(), 0.0);
  out2.sum().backward();
  EXPECT_EQ(q.grad().abs().sum().item<double>(), 0.0);
  auto [out3, lse3] = sparse_attention(at::randn({1, 3, 2, 4}, o), at::randn({1, 3, 2, 4}, o),
                                       at::randn({1, 3, 2, 3}, o), at::zeros({1, 2, 3, 0}, at::kInt), {}, {}, {}, 0.5);
  EXPECT_EQ(out3.abs().sum().item<double>(), 0.0);
}

TEST(SparseAttention, BadInputsNameTheTensor) {
  auto o = at::TensorOptions().dtype(at::kFloat);
  const int64_t B = 1, L = 6, Lk = 7, H = 2, D = 4, Dv = 3, S = 2, K = 3;
  at::Tensor q = at::randn({B, L, H, D}, o), k = at::randn({B, Lk, H, D}, o), v = at::randn({B, Lk, H, Dv}, o);
  at::Tensor idx = at::randint(-1, Lk, {B, H, L, S, K}, at::kInt), bias = at::randn({B, H, Lk}, o);
  at::Tensor w = at::randn({B, H, L, S}, o), order = random_order(B, H, L);
  auto call = [&](at::Tensor q_, at::Tensor k_, at::Tensor v_, at::Tensor idx_, at::Tensor bias_, at::Tensor w_,
                  at::Tensor order_, double scale) { sparse_attention(q_, k_, v_, idx_, bias_, w_, order_, scale); };
  call(q, k, v, idx, bias, w, order, 0.5);  // valid
  expect_usage_error([&] { call(q[0], k, v, idx, bias, w, order, 0.5); }, "q has shape [6, 2, 4]");
  expect_usage_error([&] { call(q.to(at::kInt), k, v, idx, bias, w, order, 0.5); }, "q has dtype Int");
  expect_usage_error([&] { call(q, k.narrow(3, 0, 3), v, idx, bias, w, order, 0.5); }, "k has shape [1, 7, 2, 3]");
  expect_usage_error([&] { call(q, k, v.narrow(1, 0, 6), idx, bias, w, order, 0.5); }, "v has shape [1, 6, 2, 3]");
  expect_usage_error([&] { call(q, k.to(at::kDouble), v, idx, bias, w, order, 0.5); }, "k has dtype Double");
  expect_usage_error([&] { call(q, k, v.to(at::kDouble), idx, bias, w, order, 0.5); }, "v has dtype Double");
  expect_usage_error([&] { call(q, k, v, idx.to(at::kLong), bias, w, order, 0.5); }, "idx has dtype Long");
  expect_usage_error([&] { call(q, k, v, idx.narrow(2, 0, 5), bias, w, order, 0.5); }, "idx has shape [1, 2, 5, 2, 3]");
  expect_usage_error([&] { call(q, k, v, idx[0], bias, w, order, 0.5); }, "idx has shape [2, 6, 2, 3]");
  at::Tensor far = idx.clone();
  far[0][1][4][1][2] = 7;
  expect_usage_error([&] { call(q, k, v, far, bias, w, order, 0.5); }, "idx[b=0, h=1, i=4, s=1, k=2] = 7");
  at::Tensor neg = idx.clone();
  neg[0][0][2][0][0] = -2;
  expect_usage_error([&] { call(q, k, v, neg, bias, w, order, 0.5); }, "= -2 is not a key position");
  expect_usage_error([&] { call(q, k, v, idx, bias.narrow(2, 0, 6), w, order, 0.5); }, "bias has shape [1, 2, 6]");
  expect_usage_error([&] { call(q, k, v, idx, bias.to(at::kDouble), w, order, 0.5); }, "bias has dtype Double");
  expect_usage_error([&] { call(q, k, v, idx, bias, w.narrow(3, 0, 1), order, 0.5); }, "seg_w has shape [1, 2, 6, 1]");
  expect_usage_error([&] { call(q, k, v, idx, bias, w, order.to(at::kLong), 0.5); }, "q_order has dtype Long");
  expect_usage_error([&] { call(q, k, v, idx, bias, w, order.narrow(2, 0, 5), 0.5); }, "q_order has shape");
  at::Tensor rep = order.clone();
  rep[0][1].copy_(at::tensor({0, 1, 2, 3, 4, 4}, at::kInt));
  expect_usage_error([&] { call(q, k, v, idx, bias, w, rep, 0.5); }, "q_order[b=0, h=1, 5] = 4");
  at::Tensor out_of_range = order.clone();
  out_of_range[0][0][0] = 6;
  expect_usage_error([&] { call(q, k, v, idx, bias, w, out_of_range, 0.5); }, "must be a permutation");
  expect_usage_error([&] { call(q, k, v, idx, bias, w, order, 0.0); }, "scale 0 must be positive");
  expect_usage_error([&] { call(q, k, v, idx, bias, w, order, -1.0); }, "scale -1 must be positive");
  expect_usage_error([&] { call(q, k, v, at::Tensor(), bias, w, order, 0.5); }, "idx is missing");
}
