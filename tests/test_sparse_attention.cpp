// Sparse attention over index lists: both kernel paths (dense tiles over a block's key union, and
// per-query gathers) against the dense masked-softmax reference, gradients, properties, errors; and
// the CUDA kernels against the CPU op (float32) and the reference (bfloat16), with atomics and in
// deterministic mode.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>

#include "cuda_harness.h"
#include "ops/attention/attention.h"
#include "ops/check.h"

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
  kScattered,  // random keys j <= i drawn independently (duplicates dropped): cheap for long sequences
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
        } else if (s.lists == Lists::kScattered) {
          const int64_t avail = std::min(i + 1, s.Lk);
          int64_t n = std::min<int64_t>(s.K, avail);
          if (u01(rng) < 0.4) n = std::uniform_int_distribution<int64_t>(0, n)(rng);
          for (int64_t t = 0; t < n; ++t) chosen.push_back(int32_t(std::uniform_int_distribution<int64_t>(0, avail - 1)(rng)));
          std::sort(chosen.begin(), chosen.end());
          chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
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

// join_by_lse: the attention over the union of two disjoint key sets, from the attention over
// each, equals the attention over the union (outputs and every gradient, float64), including
// queries whose first, second or both sets are empty.
TEST(SparseAttention, JoinByLseOfDisjointSetsEqualsAttentionOverTheUnion) {
  torch::manual_seed(31);
  std::mt19937 rng(17);
  for (int64_t L : {1, 63, 97, 1025}) {
    SCOPED_TRACE("L = " + std::to_string(L));
    const int64_t B = 2, H = 2, D = 8, K = 12;
    at::Tensor all = at::full({B, H, L, K}, -1, at::kInt), a = all.clone(), b = all.clone();
    auto ap = all.accessor<int32_t, 4>(), aa = a.accessor<int32_t, 4>(), ab = b.accessor<int32_t, 4>();
    for (int64_t bb = 0; bb < B; ++bb)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < L; ++i) {
          std::set<int32_t> keys;
          const int64_t n = std::uniform_int_distribution<int64_t>(0, std::min<int64_t>(K, i + 1))(rng);
          while ((int64_t)keys.size() < n) keys.insert(std::uniform_int_distribution<int32_t>(0, int32_t(i))(rng));
          int64_t t = 0, ta = 0, tb = 0;
          const int mode = int(i % 5);  // 0: all in a, 1: all in b, else split at random
          for (int32_t j : keys) {
            ap[bb][h][i][t++] = j;
            const bool to_a = mode == 0 || (mode > 1 && rng() % 2);
            if (to_a) aa[bb][h][i][ta++] = j;
            else ab[bb][h][i][tb++] = j;
          }
        }
    Tensors in = {at::randn({B, L, H, D}, at::kDouble), at::randn({B, L, H, D}, at::kDouble),
                  at::randn({B, L, H, D}, at::kDouble)};
    for (auto& t : in) t.requires_grad_();
    auto joined = [&](const Tensors& x) {
      auto [o1, l1] = sparse_attention(x[0], x[1], x[2], a, {}, {}, {}, 0.4);
      auto [o2, l2] = sparse_attention(x[0], x[1], x[2], b, {}, {}, {}, 0.4);
      return Tensors{hax::ops::join_by_lse(o1, l1, o2, l2)};
    };
    auto direct = [&](const Tensors& x) { return Tensors{std::get<0>(sparse_attention(x[0], x[1], x[2], all, {}, {}, {}, 0.4))}; };
    Tensors w = random_cotangents(direct(clone_leaves(in)));
    auto [o_join, g_join] = run_with_grads(joined, in, w);
    auto [o_all, g_all] = run_with_grads(direct, in, w);
    EXPECT_LE(rel_err(o_join[0], o_all[0], 1e-12, 1e-10), 1.0);
    for (int k = 0; k < 3; ++k) EXPECT_LE(rel_err(g_join[k], g_all[k], 1e-12, 1e-10), 1.0) << "gradient of input " << k;
    // The LibTorch formula the fused CPU op replaces (used on other devices) agrees with it.
    auto [o1, l1] = sparse_attention(in[0], in[1], in[2], a, {}, {}, {}, 0.4);
    auto [o2, l2] = sparse_attention(in[0], in[1], in[2], b, {}, {}, {}, 0.4);
    at::Tensor wt = at::sigmoid((l1 - l2).permute({0, 2, 1, 3}).nan_to_num(0.0));
    EXPECT_LE(rel_err(hax::ops::join_by_lse(o1, l1, o2, l2), o2 + wt * (o1 - o2), 1e-14, 1e-12), 1.0);
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

// ---------------------------------------------------------------------------------------------
// CUDA kernels. Every test skips without a CUDA device.

namespace {

// The GPU sweep's case `variant` (0..3) at L queries and head dim D: the rest varies by variant.
// 0: plain (B = H = 1, one segment, sliding windows, no bias, weights or order);
// 1: everything (B = 2, H = 3, Lk != L, odd Dv (scalar loads), S = 3 of K = 7 random keys, bias,
//    weights, q_order);
// 2: Dv != D (another lane group), K = 33 (not a multiple of the group), causal lists given as
//    (B, H, L, K), bias, q_order;
// 3: popular keys (sinks), S = 3, weights.
AttnSize gpu_size(int64_t L, int64_t D, int variant) {
  switch (variant) {
    case 0: return {1, L, L, 1, D, D, 1, 64, Lists::kWindow, false, false, false};
    case 1: return {2, L, L + 13, 3, D, D / 2 + 3, 3, 7, Lists::kRandom, true, true, true};
    case 2: {
      AttnSize s{1, L, L, 3, D, D == 128 ? 96 : 2 * D, 1, 33, Lists::kCausal, true, false, true};
      s.four_d = true;
      return s;
    }
    default: return {2, L, L, 1, D, D, 3, 16, Lists::kSink, false, true, false};
  }
}

// Two runs of the op on the GPU (float32 inputs, the same cotangents) give bit-identical outputs
// and gradients.
void expect_gpu_runs_identical(const OpCase& c, at::ScalarType dtype) {
  Tensors in = to_device(c.make_inputs(at::kFloat), at::Device(at::kCUDA, 0), dtype);
  Tensors w = random_cotangents(c.op(clone_leaves(in)));
  auto [o1, g1] = run_on_device(c.op, in, w);
  auto [o2, g2] = run_on_device(c.op, in, w);
  for (size_t k = 0; k < o1.size(); ++k) EXPECT_TRUE(at::equal(o1[k], o2[k])) << c.name << ": output " << k;
  for (size_t i = 0; i < g1.size(); ++i) {
    if (g1[i].defined()) {
      EXPECT_TRUE(at::equal(g1[i], g2[i])) << c.name << ": gradient " << i;
    }
  }
}

// The bf16 error floor (relative to the largest entry): one-segment lists run on the tile path,
// whose tensor-core products take P and dS rounded to bfloat16 (as the causal attention kernel's,
// which uses the same floor); the per-query kernels keep them in float32.
double bf16_floor(const AttnSize& s) { return s.S == 1 ? 5e-3 : 2e-3; }

}  // namespace

TEST(SparseAttentionCuda, MatchesCpuFloat32AndBf16) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(31);
  for (int64_t L : {1, 63, 97, 1025})
    for (int64_t D : {16, 32, 64, 128})
      for (int variant = 0; variant < 4; ++variant) {
        const AttnSize s = gpu_size(L, D, variant);
        SCOPED_TRACE(describe(s) + " variant " + std::to_string(variant));
        expect_cuda_matches_cpu(attention_case(s), 2e-5, 1e-4);
        expect_cuda_bf16_close(attention_case(s), bf16_floor(s));
      }
}

// Head dims off the 16/32/64/128 buckets, and very unequal D and Dv.
TEST(SparseAttentionCuda, AnyHeadDimUpTo128) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(32);
  const std::vector<std::pair<int64_t, int64_t>> dims = {{1, 1}, {5, 7}, {17, 16}, {100, 100}, {16, 128}, {128, 3}, {127, 128}};
  for (const auto& [D, Dv] : dims) {
    AttnSize s{2, 97, 120, 2, D, Dv, 2, 12, Lists::kRandom, true, true, true};
    SCOPED_TRACE(describe(s));
    expect_cuda_matches_cpu(attention_case(s), 2e-5, 1e-4);
    expect_cuda_bf16_close(attention_case(s), bf16_floor(s));
  }
}

// Long lists: a segment's entries then live in the global workspace rather than in shared memory
// (K·8 bytes per group over 48 KiB per CTA).
TEST(SparseAttentionCuda, LongListsUseTheWorkspace) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(33);
  for (const AttnSize& s : {AttnSize{1, 300, 400, 2, 16, 16, 2, 128, Lists::kRandom, true, true, true},
                            AttnSize{1, 700, 700, 1, 64, 64, 1, 512, Lists::kCausal, true, false, false}}) {
    SCOPED_TRACE(describe(s));
    expect_cuda_matches_cpu(attention_case(s), 2e-5, 1e-4);
    expect_cuda_bf16_close(attention_case(s));
  }
}

TEST(SparseAttentionCuda, LongSequenceMatchesCpu) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(34);
  for (Lists lists : {Lists::kScattered, Lists::kWindow}) {
    AttnSize s{1, 65537, 65537, 1, 16, 16, 1, 8, lists, true, false, lists == Lists::kScattered};
    SCOPED_TRACE(describe(s));
    expect_cuda_matches_cpu(attention_case(s), 2e-5, 1e-4);
  }
}

// The same bf16 inputs through both CUDA paths (the tile path where it applies, then the per-query
// kernels alone): outputs and gradients agree to bf16 rounding.
namespace {
void expect_tile_path_matches_per_query(const AttnSize& s) {
  const OpCase c = attention_case(s);
  Tensors in = to_device(c.make_inputs(at::kFloat), at::Device(at::kCUDA, 0), at::kBFloat16);
  Tensors w = random_cotangents(c.op(clone_leaves(in)));
  const auto tile = run_on_device(c.op, in, w);
  PathGuard per_query(AttentionPath::kPerQuery);
  expect_runs_close(tile, run_on_device(c.op, in, w), 1e-2);
}
}  // namespace

// The bf16 tile path (one segment): query blocks whose key union fits in kAttentionTileMaxKeys run on
// tensor cores, the others on the per-query kernels, in one call. Sliding windows of 64 and 128
// keys (unions of 127 and 191), sinks (popular keys), random causal keys of K = 12 (at L = 1025
// the early blocks' unions fit in 512 keys, the later ones overflow), random orders of the queries, with and without bias, at awkward
// lengths and every head-dim bucket: against the float64 definition, and against the per-query
// kernels on the same bf16 inputs.
TEST(SparseAttentionCuda, TilePathMatchesReferenceAndPerQueryKernels) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(37);
  std::vector<AttnSize> sizes;
  for (int64_t L : {1, 63, 97, 1025})
    for (int64_t D : {16, 64, 128}) {
      sizes.push_back({1, L, L, 2, D, D, 1, 64, Lists::kWindow, false, false, false});
      sizes.push_back({2, L, L, 1, D, D == 128 ? 96 : D, 1, 128, Lists::kWindow, true, false, false});
      sizes.push_back({1, L, L, 2, D, D, 1, 16, Lists::kSink, true, false, true});
      sizes.push_back({1, L, L + 7, 1, D, D, 1, 12, Lists::kCausal, L < 200, false, true});
    }
  // The plan stages the lists in shared memory 16 bytes at a time (K % 4 == 0, above), one entry at
  // a time (K = 13), or not at all (K = 400 > kMaxStagedKeys; a 400-key window's union still fits).
  // K = 176: 44 KB of staged lists, under 48 KB alone but not with the kernel's static shared
  // memory (the launch failed until the plan raised its limit for the two together).
  sizes.push_back({1, 1025, 1025, 1, 64, 64, 1, 13, Lists::kCausal, true, false, true});
  sizes.push_back({1, 1025, 1025, 1, 32, 32, 1, 400, Lists::kWindow, false, false, false});
  sizes.push_back({1, 1025, 1025, 1, 64, 64, 1, 176, Lists::kWindow, false, false, false});
  for (const AttnSize& s : sizes) {
    SCOPED_TRACE(describe(s));
    auto checks = [&] {
      expect_cuda_bf16_close(attention_case(s), 5e-3);
      expect_tile_path_matches_per_query(s);
    };
    if (s.D != 64) {
      checks();
      continue;
    }
    // Head dim 64 has two forms of the tile products: wgmma (the default, on Hopper) and, on the
    // same random inputs, mma.sync.
    with_same_draws(checks, [&] {
      ScopedSwitch w(hax::ops::sparse_attention_wgmma_products, hax::ops::set_sparse_attention_wgmma_products, false);
      SCOPED_TRACE("tile products on mma.sync");
      checks();
    });
  }
}

// The tile path at the length the issue asks of every GPU op (16K query blocks of sliding windows
// and of random causal keys), against the per-query kernels on the same bf16 inputs.
TEST(SparseAttentionCuda, TilePathAt65537) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(39);
  for (const AttnSize& s : {AttnSize{1, 65537, 65537, 2, 64, 64, 1, 64, Lists::kWindow, true, false, false},
                            AttnSize{1, 65537, 65537, 1, 32, 32, 1, 12, Lists::kCausal, false, false, true}}) {
    SCOPED_TRACE(describe(s));
    expect_tile_path_matches_per_query(s);
  }
}

// A small instance of the tile path (plan, forward, both backward kernels; one block overflowing
// to the per-query kernels), quick enough for compute-sanitizer's memcheck and racecheck.
TEST(SparseAttentionCuda, TilePathSmallInstance) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(38);
  for (const AttnSize& s : {AttnSize{1, 130, 130, 1, 64, 64, 1, 64, Lists::kWindow, true, false, false},
                            AttnSize{1, 700, 700, 1, 32, 32, 1, 12, Lists::kRandom, false, false, true}}) {
    SCOPED_TRACE(describe(s));
    expect_cuda_bf16_close(attention_case(s), 5e-3);
  }
}

// Deterministic mode: the key pass over the entries sorted by key replaces the atomics. It matches
// the CPU, and two runs give bit-identical gradients (popular keys included).
TEST(SparseAttentionCuda, DeterministicModeMatchesCpuAndRepeatsBitForBit) {
  HAX_REQUIRE_CUDA();
  hax::ops::DeterministicScope det(true);
  torch::manual_seed(35);
  for (int64_t L : {1, 97, 1025})
    for (int64_t D : {16, 64, 128})
      for (int variant : {1, 2, 3}) {
        const AttnSize s = gpu_size(L, D, variant);
        SCOPED_TRACE(describe(s) + " variant " + std::to_string(variant));
        expect_cuda_matches_cpu(attention_case(s), 2e-5, 1e-4);
        expect_cuda_bf16_close(attention_case(s));
        expect_gpu_runs_identical(attention_case(s), at::kFloat);
      }
  AttnSize sinks{1, 3000, 3000, 2, 32, 32, 1, 16, Lists::kSink, true, false, true};
  sinks.empty_frac = 0.02;
  expect_cuda_matches_cpu(attention_case(sinks), 2e-5, 1e-4);
  expect_gpu_runs_identical(attention_case(sinks), at::kFloat);
  expect_gpu_runs_identical(attention_case(sinks), at::kBFloat16);
  expect_gpu_runs_identical(attention_case(gpu_size(97, 64, 1)), at::kBFloat16);
}

// Empty queries, segments and lists, K = 0 and Lk = 0 on the GPU: zeros, never the poison.
TEST(SparseAttentionCuda, EmptyListsAndShapes) {
  HAX_REQUIRE_CUDA();
  torch::manual_seed(36);
  const at::Device cuda(at::kCUDA, 0);
  for (bool det : {false, true}) {
    hax::ops::DeterministicScope guard(det);
    hax::ops::set_poison_outputs(true);
    auto o = at::TensorOptions().dtype(at::kFloat).device(cuda);
    at::Tensor q = at::randn({1, 5, 2, 8}, o).requires_grad_(), k = at::randn({1, 6, 2, 8}, o).requires_grad_();
    at::Tensor v = at::randn({1, 6, 2, 4}, o).requires_grad_(), bias = at::randn({1, 2, 6}, o).requires_grad_();
    at::Tensor w = at::randn({1, 2, 5, 2}, o).requires_grad_();
    at::Tensor idx = at::full({1, 2, 5, 2, 3}, -1, o.dtype(at::kInt));
    idx[0][1][3][1][2] = 4;  // one key in the whole tensor
    auto [out, lse] = sparse_attention(q, k, v, idx, bias, w, {}, 0.5);
    (out.sum() + finite(lse).sum()).backward();
    at::Tensor out_c = out.cpu(), lse_c = lse.cpu();
    EXPECT_EQ(out_c.select(2, 0).abs().max().item<double>(), 0.0);
    EXPECT_EQ(out_c.select(1, 0).abs().max().item<double>(), 0.0);
    EXPECT_NE(out_c[0][3][1].abs().max().item<double>(), 0.0);
    EXPECT_EQ(at::isinf(lse_c).sum().item<int64_t>(), 2 * 5 * 2 - 1);
    EXPECT_FALSE(at::isnan(q.grad()).any().item<bool>());
    EXPECT_EQ(q.grad().cpu().select(2, 0).abs().max().item<double>(), 0.0);
    EXPECT_EQ(k.grad().cpu().select(2, 0).abs().max().item<double>(), 0.0);
    EXPECT_EQ(k.grad().cpu().narrow(1, 0, 4).abs().max().item<double>(), 0.0);
    EXPECT_EQ(v.grad().cpu().narrow(1, 5, 1).abs().max().item<double>(), 0.0);
    EXPECT_FALSE(at::isnan(bias.grad()).any().item<bool>());
    EXPECT_FALSE(at::isnan(w.grad()).any().item<bool>());
    EXPECT_EQ(w.grad().cpu().select(1, 0).abs().max().item<double>(), 0.0);
    // K = 0; no keys at all (Lk = 0); no queries.
    auto [o1, l1] = sparse_attention(q, k, v, at::zeros({1, 2, 5, 0}, o.dtype(at::kInt)), {}, {}, {}, 0.5);
    EXPECT_EQ(o1.abs().max().item<double>(), 0.0);
    at::Tensor q2 = at::randn({1, 3, 2, 8}, o).requires_grad_();
    auto [o2, l2] = sparse_attention(q2, at::randn({1, 0, 2, 8}, o), at::randn({1, 0, 2, 4}, o),
                                     at::full({1, 2, 3, 4}, -1, o.dtype(at::kInt)), {}, {}, {}, 0.5);
    o2.sum().backward();
    EXPECT_EQ(o2.abs().max().item<double>(), 0.0);
    EXPECT_EQ(q2.grad().abs().max().item<double>(), 0.0);
    auto [o3, l3] = sparse_attention(at::randn({1, 0, 2, 8}, o), k, v, at::zeros({1, 2, 0, 3}, o.dtype(at::kInt)), {},
                                      {}, {}, 0.5);
    EXPECT_EQ(o3.sizes(), (std::vector<int64_t>{1, 0, 2, 4}));
    hax::ops::set_poison_outputs(false);
  }
}

TEST(SparseAttentionCuda, BadInputsNameTheTensor) {
  HAX_REQUIRE_CUDA();
  const at::Device cuda(at::kCUDA, 0);
  auto o = at::TensorOptions().dtype(at::kFloat).device(cuda);
  const int64_t B = 1, L = 6, Lk = 7, H = 2, D = 4, Dv = 3, S = 2, K = 3;
  at::Tensor q = at::randn({B, L, H, D}, o), k = at::randn({B, Lk, H, D}, o), v = at::randn({B, Lk, H, Dv}, o);
  at::Tensor idx = at::randint(-1, Lk, {B, H, L, S, K}, at::kInt), bias = at::randn({B, H, Lk}, o);
  at::Tensor w = at::randn({B, H, L, S}, o), order = random_order(B, H, L);
  auto call = [&](at::Tensor q_, at::Tensor k_, at::Tensor v_, at::Tensor idx_, at::Tensor bias_, at::Tensor w_,
                  at::Tensor order_) { sparse_attention(q_, k_, v_, idx_, bias_, w_, order_, 0.5); };
  call(q, k, v, idx.to(cuda), bias, w, order.to(cuda));  // valid
  at::Tensor far = idx.clone();
  far[0][1][4][1][2] = 7;
  {
    // Without the device-value checks (the default: they synchronize with the host) a key out of
    // range is read as no key, never outside k and v.
    hax::ops::set_check_device_values(false);
    at::Tensor none = far.clone();
    none[0][1][4][1][2] = -1;
    auto [o_far, l_far] = sparse_attention(q, k, v, far.to(cuda), bias, w, order.to(cuda), 0.5);
    auto [o_none, l_none] = sparse_attention(q, k, v, none.to(cuda), bias, w, order.to(cuda), 0.5);
    EXPECT_TRUE(at::equal(o_far, o_none));
  }
  hax::ops::set_check_device_values(true);  // the checks below read the values
  expect_usage_error([&] { call(q, k, v, far.to(cuda), bias, w, order.to(cuda)); }, "idx[b=0, h=1, i=4, s=1, k=2] = 7");
  at::Tensor neg = idx.clone();
  neg[0][0][2][0][0] = -2;
  expect_usage_error([&] { call(q, k, v, neg.to(cuda), bias, w, order.to(cuda)); }, "= -2 is not a key position");
  at::Tensor rep = order.clone();
  rep[0][1].copy_(at::tensor({0, 1, 2, 3, 4, 4}, at::kInt));
  expect_usage_error([&] { call(q, k, v, idx.to(cuda), bias, w, rep.to(cuda)); }, "q_order[b=0, h=1, 5] = 4");
  at::Tensor out_of_range = order.clone();
  out_of_range[0][0][0] = 6;
  expect_usage_error([&] { call(q, k, v, idx.to(cuda), bias, w, out_of_range.to(cuda)); }, "must be a permutation");
  expect_usage_error([&] { call(q, k, v, idx, bias, w, order.to(cuda)); }, "idx is on cpu");
  expect_usage_error([&] { call(q, k, v, idx.to(cuda), bias, w, order); }, "q_order is on cpu");
  expect_usage_error([&] { call(q, k, v, idx.to(cuda), bias.cpu(), w, order.to(cuda)); }, "bias is on cpu");
  expect_usage_error([&] { call(q.to(at::kDouble), k, v, idx.to(cuda), bias, w, order.to(cuda)); }, "q has dtype Double");
  at::Tensor q129 = at::randn({B, L, H, 129}, o), k129 = at::randn({B, Lk, H, 129}, o);
  expect_usage_error([&] { call(q129, k129, v, idx.to(cuda), bias, w, order.to(cuda)); }, "must be at most 128");
  hax::ops::set_check_device_values(false);
}
