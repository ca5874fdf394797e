// Hybrid models (SSM + sparse attention branch) and Samba: causality for every variant, decoding,
// packing, the Key Selection ranking loss, Q/K initialization from C/B.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "layers/key_scorer.h"
#include "layers/mamba.h"
#include "layers/mamba2.h"
#include "layers/sparse_branch.h"
#include "ops/attention/attention.h"
#include "models/lm.h"
#include "model_variants.h"
#include "op_harness.h"

using hax::ForwardContext;
using hax::LanguageModel;
using hax::ModelConfig;
using hax::testing::clone_leaves;
using hax::testing::random_cotangents;
using hax::testing::rel_err;
using hax::testing::run_with_grads;
using hax::testing::Tensors;
using hax::testing::all_variants;
using hax::testing::hybrid_config;
using hax::testing::name_of;

namespace {

std::shared_ptr<LanguageModel> random_model(const ModelConfig& c, uint64_t seed) {
  torch::manual_seed(seed);
  auto m = std::make_shared<LanguageModel>(c);
  m->to(at::kDouble);
  torch::NoGradGuard ng;
  for (auto& p : m->parameters()) p.add_(at::randn_like(p) * 0.05);
  return m;
}


}  // namespace

TEST(Hybrid, FutureTokensNeverChangePastOutputsForEveryVariant) {
  for (const auto& v : all_variants()) {
    auto m = random_model(hybrid_config(v.first, v.second), 11);
    ForwardContext ctx;
    ctx.seed = 5;
    torch::NoGradGuard ng;
    const int64_t L = 70;
    at::Tensor ids = at::randint(0, 29, {2, L}, at::kLong);
    at::Tensor base = m->forward(ids, {}, &ctx);
    for (int64_t t : {0L, 9L, 33L, L - 2}) {
      at::Tensor other = ids.clone();
      other.narrow(1, t + 1, L - t - 1).random_(0, 29);
      at::Tensor out = m->forward(other, {}, &ctx);
      // Equal up to float64 summation order: the attention op groups queries into tiles by
      // q_order (LSH sorts queries by bucket, future ones included), which can change the order
      // in which a past query's terms are added, never which terms.
      EXPECT_LE(rel_err(out.narrow(1, 0, t + 1), base.narrow(1, 0, t + 1), 1e-13, 1e-12), 1.0)
          << name_of(v) << ": changing tokens after " << t << " changed outputs at or before it";
    }
  }
}

TEST(Hybrid, DecodingTokenByTokenEqualsForwardForEveryVariant) {
  for (const auto& v : all_variants()) {
    auto m = random_model(hybrid_config(v.first, v.second), 12);
    ForwardContext ctx;
    ctx.seed = 6;
    torch::NoGradGuard ng;
    const int64_t L = 41;
    at::Tensor ids = at::randint(0, 29, {2, L}, at::kLong);
    at::Tensor full = m->forward(ids, {}, &ctx);
    auto states = m->zero_states(2);
    for (auto& s : states) {
      if (s.conv.defined()) s.conv = s.conv.to(at::kDouble);
      if (s.ssm.defined()) s.ssm = s.ssm.to(at::kDouble);
    }
    for (int64_t t = 0; t < L; ++t) {
      at::Tensor step = m->step(ids.select(1, t), states, &ctx);
      ASSERT_LE(rel_err(step, full.select(1, t), 1e-9, 1e-7), 1.0) << name_of(v) << " t=" << t;
    }
  }
}

TEST(Hybrid, PackedSequencesEqualSeparateRunsForEveryVariant) {
  const std::vector<int64_t> lens = {5, 1, 30, 17};
  int64_t L = 0;
  for (auto l : lens) L += l;
  for (const auto& v : all_variants()) {
    auto m = random_model(hybrid_config(v.first, v.second), 13);
    ForwardContext ctx;
    ctx.seed = 7;
    torch::NoGradGuard ng;
    at::Tensor ids = at::randint(0, 29, {1, L}, at::kLong);
    at::Tensor seq = at::zeros({1, L}, at::kInt);
    int64_t off = 0, id = 0;
    for (auto l : lens) seq.narrow(1, off, l).fill_(id++), off += l;
    at::Tensor packed = m->hidden(ids, seq, nullptr, &ctx);
    off = 0;
    for (auto l : lens) {
      at::Tensor alone = m->hidden(ids.narrow(1, off, l), {}, nullptr, &ctx);
      EXPECT_LE(rel_err(packed.narrow(1, off, l), alone, 1e-10, 1e-8), 1.0) << name_of(v) << " segment at " << off;
      off += l;
    }
  }
}

TEST(Hybrid, TrainingGradientsReachEveryParameter) {
  for (const auto& v : all_variants()) {
    torch::manual_seed(14);
    LanguageModel m(hybrid_config(v.first, v.second));
    ForwardContext ctx;
    ctx.training = true;
    ctx.seed = 8;
    at::Tensor ids = at::randint(0, 29, {2, 50}, at::kLong);
    at::Tensor loss = m.forward(ids, {}, &ctx).logsumexp(-1).mean();
    for (auto& r : ctx.ranking_losses) loss = loss + 0.1 * r;
    loss.backward();
    for (auto& [name, p] : m.state_tensors()) {
      // The scorer's last bias shifts every score alike, and the ranking loss only sees score
      // differences: it gets no gradient by construction (as in the reference).
      if (name.find("scorer.l3.bias") != std::string::npos) continue;
      ASSERT_TRUE(p.grad().defined()) << name_of(v) << ": " << name;
      EXPECT_GT(p.grad().abs().sum().item<double>(), 0) << name_of(v) << ": " << name << " gets no gradient";
    }
  }
}

TEST(KeySelection, RankingLossEqualsItsFormula) {
  torch::manual_seed(15);
  const int64_t B = 2, L = 23, H = 2, N = 3, C = 5;
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor q = at::randn({B, L, H, N}, o), k = at::randn({B, L, H, N}, o), scores = at::randn({B, L, H}, o);
  at::Tensor seq = at::zeros({B, L}, at::kInt);
  seq.narrow(1, 9, L - 9).fill_(1);
  at::Tensor valid = at::ones({B, L}, at::kBool);
  valid[1][L - 1] = false;
  at::Tensor cand = at::stack({at::randperm(L, at::kLong).narrow(0, 0, C), at::randperm(L - 1, at::kLong).narrow(0, 0, C)});
  double expect = 0;
  int64_t terms = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> x(C), y(C, 0.0);
      for (int64_t a = 0; a < C; ++a) {
        const int64_t j = cand[b][a].item<int64_t>();
        x[a] = scores[b][j][h].item<double>();
        for (int64_t i = j; i < L; ++i) {
          if (seq[b][i].item<int>() != seq[b][j].item<int>() || !valid[b][i].item<bool>()) continue;
          y[a] += 1.0 / (1.0 + std::exp(-(q[b][i][h] * k[b][j][h]).sum().item<double>()));
        }
      }
      for (int64_t a = 0; a < C; ++a)
        for (int64_t c = 0; c < C; ++c) {
          const double t = ((y[a] > y[c]) + (y[a] >= y[c])) / 2.0, z = x[a] - x[c];
          expect += std::max(z, 0.0) - z * t + std::log1p(std::exp(-std::abs(z)));
          ++terms;
        }
    }
  expect /= terms;
  at::Tensor got = hax::ranking_loss_at(scores, q, k, seq, valid, cand);
  EXPECT_NEAR(got.item<double>(), expect, 1e-12);
  // The sampled form reads the host copy of valid when one is given (a GPU step does not wait):
  // the same candidates, so the same loss.
  EXPECT_TRUE(at::equal(hax::ranking_loss(scores, q, k, seq, valid, C, 7),
                        hax::ranking_loss(scores, q, k, seq, valid, C, 7, valid.clone())));
}

TEST(KeySelection, RankingLossGradientReachesOnlyTheScorer) {
  ModelConfig c = hybrid_config("mamba2", "hax");
  torch::manual_seed(16);
  LanguageModel m(c);
  ForwardContext ctx;
  ctx.training = true;
  ctx.seed = 9;
  at::Tensor ids = at::randint(0, 29, {2, 60}, at::kLong);
  m.forward(ids, {}, &ctx);
  ASSERT_EQ(ctx.ranking_losses.size(), 2u);
  at::Tensor r = ctx.ranking_losses[0] + ctx.ranking_losses[1];
  r.backward();
  int scorer_params = 0;
  for (auto& [name, p] : m.state_tensors()) {
    const bool in_scorer = name.find(".scorer.") != std::string::npos;
    const double g = p.grad().defined() ? p.grad().abs().sum().item<double>() : 0.0;
    if (name.find("scorer.l3.bias") != std::string::npos) {
      EXPECT_LT(g, 1e-6) << name;  // shifts all scores alike: invisible to a loss on differences
    } else {
      EXPECT_EQ(g > 0, in_scorer) << name;
    }
    scorer_params += in_scorer;
  }
  EXPECT_EQ(scorer_params, 2 * 6);  // two layers x three linear layers x (weight, bias)
}

TEST(Hybrid, QkInitFromSsmCandB) {
  // Mamba: the branch's [K; Q] rows start as x_proj's B and C rows.
  ModelConfig c = hybrid_config("mamba", "sw");
  c.qk_init = "bc";
  torch::manual_seed(17);
  hax::MambaMixer mm(c, 0);
  const int64_t R = c.dt_rank_resolved(), N = c.d_state;
  EXPECT_TRUE(at::equal(mm.sparse->qk_proj->weight.narrow(0, 0, N), mm.x_proj->weight.narrow(0, R, N)));
  EXPECT_TRUE(at::equal(mm.sparse->qk_proj->weight.narrow(0, N, N), mm.x_proj->weight.narrow(0, R + N, N)));
  // Mamba-2: the branch reads the whole post-conv xBC and starts by selecting B (keys) and C (queries).
  ModelConfig c2 = hybrid_config("mamba2", "sw");
  c2.qk_init = "bc";
  c2.ngroups = 1;
  hax::Mamba2Mixer m2(c2, 0);
  at::Tensor xbc = at::randn({1, 3, m2.conv_dim()});
  auto [q, k] = m2.sparse->queries_keys(xbc);
  const int64_t di = c2.d_inner();
  EXPECT_TRUE(at::allclose(k.reshape({1, 3, N}), xbc.narrow(-1, di, N) / std::sqrt((double)N)));
  EXPECT_TRUE(at::allclose(q.reshape({1, 3, N}), xbc.narrow(-1, di + N, N)));
}

TEST(Hybrid, LshHashIsFixedBySeedAndResampledAcrossSeeds) {
  auto m = random_model(hybrid_config("mamba2", "lsh"), 18);
  torch::NoGradGuard ng;
  at::Tensor ids = at::randint(0, 29, {1, 80}, at::kLong);
  ForwardContext a, b, c;
  a.seed = b.seed = 1;
  c.seed = 2;
  EXPECT_TRUE(at::equal(m->forward(ids, {}, &a), m->forward(ids, {}, &b)));
  EXPECT_FALSE(at::equal(m->forward(ids, {}, &a), m->forward(ids, {}, &c)));
}

TEST(Hybrid, HaxAsTwoAttentionsEqualsOneOverTheMergedLists) {
  // On the CPU, HAX attends with LSH's lists (in bucket order) and Key Selection's lists without
  // LSH's keys (in position order), joined by their log-sum-exps; that must equal one attention
  // over the merged lists, forward and backward, packed or not, at awkward lengths.
  ModelConfig c = hybrid_config("mamba2", "hax");
  c.sparse_keys = 16;
  torch::manual_seed(21);
  hax::SparseAttentionBranch branch(c, 12, 16, 0);
  branch.to(at::kDouble);
  for (int64_t L : {1, 63, 97}) {
    for (bool packed : {false, true}) {
      SCOPED_TRACE("L = " + std::to_string(L) + (packed ? " packed" : ""));
      at::Tensor seq = at::zeros({2, L}, at::kInt);
      if (packed) seq.narrow(1, L / 2, L - L / 2).fill_(1);
      const at::Tensor s = packed ? seq : at::Tensor();
      at::Tensor x = at::randn({2, L, 12}, at::kDouble);
      auto [q0, k0] = branch.queries_keys(x);
      Tensors in = {q0.detach(), k0.detach(), at::randn({2, L, 1, 16}, at::kDouble)};
      ForwardContext ctx;
      ctx.seed = 3;
      auto two = [&](const Tensors& t) { return Tensors{branch.attend(x, t[0], t[1], t[2], s, &ctx, nullptr)}; };
      auto merged = [&](const Tensors& t) {
        hax::patterns::KeyLists lists = branch.key_lists(t[0], t[1], s, &ctx, nullptr);
        return Tensors{std::get<0>(hax::ops::sparse_attention(t[0], t[1], t[2], lists.idx, {}, {}, lists.q_order, 1.0))};
      };
      Tensors w = random_cotangents(merged(clone_leaves(in)));
      auto [o_two, g_two] = run_with_grads(two, in, w);
      auto [o_one, g_one] = run_with_grads(merged, in, w);
      EXPECT_LE(rel_err(o_two[0], o_one[0], 1e-12, 1e-10), 1.0);
      for (int k = 0; k < 3; ++k) EXPECT_LE(rel_err(g_two[k], g_one[k], 1e-12, 1e-10), 1.0) << "gradient of input " << k;
    }
  }
}

TEST(Hybrid, SlidingWindowCoveringTheSequenceEqualsFullAttention) {
  // With k >= L a sliding window sees every earlier key: the sw and full variants must agree
  // (outputs and gradients), packed or not, through two different attention ops.
  for (const char* mixer : {"mamba", "mamba2"}) {
    ModelConfig cs = hybrid_config(mixer, "sw"), cf = hybrid_config(mixer, "full");
    cs.sparse_keys = 64;
    auto ms = random_model(cs, 19), mf = random_model(cf, 20);
    {
      torch::NoGradGuard ng;
      auto src = ms->state_tensors();
      for (auto& [name, p] : mf->state_tensors()) p.copy_(src.at(name));
    }
    const int64_t L = 50;
    at::Tensor ids = at::randint(0, 29, {2, L}, at::kLong);
    at::Tensor seq = at::zeros({2, L}, at::kInt);
    seq.narrow(1, 20, 30).fill_(1);
    for (bool packed : {false, true}) {
      at::Tensor hs = ms->hidden(ids, packed ? seq : at::Tensor()), hf = mf->hidden(ids, packed ? seq : at::Tensor());
      EXPECT_LE(rel_err(hs, hf, 1e-10, 1e-8), 1.0) << mixer << " packed=" << packed;
      at::Tensor w = at::randn_like(hs);
      (hs * w).sum().backward();
      (hf * w).sum().backward();
      auto ps = ms->state_tensors(), pf = mf->state_tensors();
      for (auto& [name, p] : ps)
        EXPECT_LE(rel_err(p.grad(), pf.at(name).grad(), 1e-10, 1e-8), 1.0) << mixer << " packed=" << packed << " " << name;
      ms->zero_grad();
      mf->zero_grad();
    }
  }
}

// The scorer's query input normalize(Σ_{p=start..j} q_p), written as a direct loop, on packed rows.
TEST(KeySelection, PrefixQueryDirectionEqualsItsFormula) {
  torch::manual_seed(16);
  for (int64_t L : {1, 63, 97, 1025})
    for (at::ScalarType dt : {at::kDouble, at::kFloat}) {
      const int64_t B = 2, H = 3, N = 5;
      at::Tensor q = at::randn({B, L, H, N}, at::TensorOptions().dtype(dt));
      at::Tensor seq = hax::testing::random_packing(B, L, 0.05);
      at::Tensor got = hax::prefix_query_direction(q, seq).to(at::kDouble);
      at::Tensor qd = q.to(at::kDouble), expect = at::empty_like(qd);
      for (int64_t b = 0; b < B; ++b) {
        at::Tensor sum = at::zeros({H, N}, at::kDouble);
        for (int64_t i = 0; i < L; ++i) {
          if (i > 0 && seq[b][i].item<int>() != seq[b][i - 1].item<int>()) sum.zero_();
          sum += qd[b][i];
          expect[b][i] = sum / sum.norm(2, -1, true).clamp_min(1e-12);
        }
      }
      const double tol = dt == at::kDouble ? 1e-12 : 1e-6;
      EXPECT_LE(rel_err(got, expect, tol, tol), 1.0) << "L " << L;
      at::Tensor generic = hax::segment_cumsum(qd, seq);  // the tensor formula used off the CPU
      EXPECT_LE(rel_err(generic / generic.norm(2, -1, true).clamp_min(1e-12), expect, 1e-12, 1e-12), 1.0);
    }
}
