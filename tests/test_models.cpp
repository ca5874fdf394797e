// Whole models: recurrent decoding equals the full forward pass, causality, packing, states.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/lm.h"
#include "op_harness.h"

using hax::LanguageModel;
using hax::ModelConfig;
using hax::testing::rel_err;

namespace {

ModelConfig small_config(const std::string& mixer) {
  ModelConfig c;
  c.mixer = mixer;
  c.vocab_size = 37;
  c.d_model = 24;
  c.n_layers = 2;
  c.d_state = mixer == "mamba" ? 5 : 6;
  c.headdim = 8;  // 6 heads of 8 for d_inner 48
  c.ngroups = 2;
  c.chunk_size = 16;
  return c;
}

// A float64 model with random (not just initial) parameters so every path matters.
std::shared_ptr<LanguageModel> random_model(const ModelConfig& c, uint64_t seed) {
  torch::manual_seed(seed);
  auto m = std::make_shared<LanguageModel>(c);
  m->to(at::kDouble);
  torch::NoGradGuard ng;
  for (auto& p : m->parameters()) p.add_(at::randn_like(p) * 0.05);
  return m;
}

class ModelTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelTest, RecurrentDecodingEqualsFullForward) {
  auto m = random_model(small_config(GetParam()), 1);
  for (int64_t L : {1, 63, 97}) {
    at::Tensor ids = at::randint(0, 37, {3, L}, at::kLong);
    torch::NoGradGuard ng;
    at::Tensor full = m->forward(ids);  // (B, L, V)
    auto states = m->zero_states(3);
    for (auto& s : states) s.conv = s.conv.to(at::kDouble), s.ssm = s.ssm.to(at::kDouble);
    for (int64_t t = 0; t < L; ++t) {
      at::Tensor step = m->step(ids.select(1, t), states);
      ASSERT_LE(rel_err(step, full.select(1, t), 1e-10, 1e-8), 1.0) << GetParam() << " L=" << L << " t=" << t;
    }
  }
}

TEST_P(ModelTest, ForwardInPiecesWithStatesEqualsOnePass) {
  auto m = random_model(small_config(GetParam()), 2);
  at::Tensor ids = at::randint(0, 37, {2, 97}, at::kLong);
  torch::NoGradGuard ng;
  at::Tensor full = m->hidden(ids, {});
  auto states = m->zero_states(2);
  for (auto& s : states) s.conv = s.conv.to(at::kDouble), s.ssm = s.ssm.to(at::kDouble);
  std::vector<at::Tensor> parts;
  int64_t off = 0;
  for (int64_t len : {1, 2, 30, 64}) {
    parts.push_back(m->hidden(ids.narrow(1, off, len), {}, &states));
    off += len;
  }
  EXPECT_LE(rel_err(at::cat(parts, 1), full, 1e-10, 1e-8), 1.0);
}

TEST_P(ModelTest, FutureTokensNeverChangePastOutputs) {
  auto m = random_model(small_config(GetParam()), 3);
  torch::NoGradGuard ng;
  for (int64_t L : {63, 97}) {
    at::Tensor ids = at::randint(0, 37, {2, L}, at::kLong);
    at::Tensor base = m->forward(ids);
    for (int64_t t : {0L, 15L, 16L, L / 2, L - 2}) {
      at::Tensor other = ids.clone();
      other.narrow(1, t + 1, L - t - 1).random_(0, 37);
      at::Tensor out = m->forward(other);
      EXPECT_TRUE(at::equal(out.narrow(1, 0, t + 1), base.narrow(1, 0, t + 1)))
          << GetParam() << ": changing tokens after " << t << " changed outputs at or before it";
      EXPECT_FALSE(at::equal(out.narrow(1, t + 1, L - t - 1), base.narrow(1, t + 1, L - t - 1)));
    }
  }
}

TEST_P(ModelTest, PackedSequencesEqualSeparateRuns) {
  auto m = random_model(small_config(GetParam()), 4);
  torch::NoGradGuard ng;
  const std::vector<int64_t> lens = {5, 1, 40, 17, 33};
  int64_t L = 0;
  for (auto l : lens) L += l;
  at::Tensor ids = at::randint(0, 37, {1, L}, at::kLong);
  at::Tensor seq = at::zeros({1, L}, at::kInt);
  int64_t off = 0, id = 0;
  for (auto l : lens) seq.narrow(1, off, l).fill_(id++), off += l;
  at::Tensor packed = m->hidden(ids, seq);
  off = 0;
  for (auto l : lens) {
    at::Tensor alone = m->hidden(ids.narrow(1, off, l), {});
    EXPECT_LE(rel_err(packed.narrow(1, off, l), alone, 1e-10, 1e-8), 1.0) << "segment at " << off;
    off += l;
  }
}

TEST_P(ModelTest, GradientsReachEveryParameter) {
  ModelConfig c = small_config(GetParam());
  torch::manual_seed(5);
  LanguageModel m(c);
  at::Tensor ids = at::randint(0, 37, {2, 40}, at::kLong);
  m.forward(ids).logsumexp(-1).sum().backward();
  for (auto& [name, p] : m.state_tensors()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_GT(p.grad().abs().sum().item<double>(), 0) << name << " gets no gradient";
  }
}

INSTANTIATE_TEST_SUITE_P(Mixers, ModelTest, ::testing::Values("mamba", "mamba2"));

TEST(Model, ParameterNamesAndCountsFollowMambaSsm) {
  // The paper's Mamba-2 joint-recall model: d_model 64, expand 2, 8 heads of 16, d_state 32.
  ModelConfig c;
  LanguageModel m(c);
  auto t = m.state_tensors();
  const int64_t d = 64, di = 128, H = 8, N = 32, W = 4, V = 100, conv = di + 2 * N;
  const int64_t per_layer = d * (2 * di + 2 * N + H) + conv * W + conv + 3 * H + di + di * d + d;
  int64_t total = 0;
  for (auto& [name, p] : t) total += p.numel();
  EXPECT_EQ(total, V * d + 2 * per_layer + d);
  EXPECT_TRUE(t.count("backbone.embedding.weight"));
  EXPECT_TRUE(t.count("backbone.layers.1.mixer.in_proj.weight"));
  EXPECT_TRUE(t.count("backbone.layers.0.mixer.conv1d.weight"));
  EXPECT_EQ(t["backbone.layers.0.mixer.conv1d.weight"].sizes(), at::IntArrayRef({conv, 1, W}));
  EXPECT_TRUE(t.count("backbone.layers.0.mixer.norm.weight"));
  EXPECT_TRUE(t.count("backbone.layers.0.norm.weight"));
  EXPECT_TRUE(t.count("backbone.norm_f.weight"));
  EXPECT_FALSE(t.count("lm_head.weight"));  // tied
  // Mamba with d_inner 128, d_state 16, dt_rank 4.
  c.mixer = "mamba", c.d_state = 16;
  LanguageModel mm(c);
  const int64_t R = 4, Nm = 16;
  const int64_t per_layer_m = d * 2 * di + di * W + di + di * (R + 2 * Nm) + R * di + di + di * Nm + di + di * d + d;
  total = 0;
  for (auto& [name, p] : mm.state_tensors()) total += p.numel();
  EXPECT_EQ(total, V * d + 2 * per_layer_m + d);
}

TEST(Model, InvalidConfigsNameTheOption) {
  auto expect_error = [](ModelConfig c, const std::string& needle) {
    hax::testing::expect_usage_error([&] { c.validate(); }, needle);
  };
  ModelConfig c;
  c.headdim = 24;
  expect_error(c, "--headdim 24 must divide the inner width d_inner = expand * d_model = 128");
  c = {};
  c.d_model = 0;
  expect_error(c, "--d-model 0 must be positive");
  c = {};
  c.ngroups = 3;
  expect_error(c, "--ngroups 3 must divide the head count");
  c = {};
  c.mixer = "rnn";
  expect_error(c, "--mixer rnn is unknown");
  c = {};
  c.n_layers = -1;
  expect_error(c, "--n-layers -1 must be positive");
}

}  // namespace
