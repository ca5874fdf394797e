// Training pieces: AdamW against its formula, the schedule, checkpoint files.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "cli_runner.h"
#include "op_harness.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "train/adamw.h"
#include "train/checkpoint.h"
#include "train/schedule.h"

using namespace hax;

TEST(AdamW, MatchesTheUpdateRuleInFloat64) {
  torch::manual_seed(1);
  at::Tensor p = at::randn({7, 3}, at::kDouble);
  at::Tensor ref = p.clone(), m = at::zeros_like(p), v = at::zeros_like(p);
  AdamW opt({{"p", p}}, {0.8, 0.95, 1e-6, 0.1});
  const double lrs[] = {0.1, 0.05, 0.2, 0.01};
  for (int t = 1; t <= 4; ++t) {
    at::Tensor g = at::randn_like(p);
    p.mutable_grad() = g.clone();
    opt.step(lrs[t - 1]);
    // Decoupled weight decay, bias-corrected moments (PyTorch's AdamW).
    const double lr = lrs[t - 1];
    ref = ref * (1 - lr * 0.1);
    m = 0.8 * m + 0.2 * g;
    v = 0.95 * v + 0.05 * g * g;
    at::Tensor mhat = m / (1 - std::pow(0.8, t)), vhat_sqrt = v.sqrt() / std::sqrt(1 - std::pow(0.95, t));
    ref = ref - lr * mhat / (vhat_sqrt + 1e-6);
    EXPECT_TRUE(at::allclose(p, ref, 1e-12, 1e-12)) << "step " << t;
  }
  EXPECT_EQ(opt.steps_taken(), 4);
}

TEST(AdamW, ClipGradNormScalesToTheBound) {
  at::Tensor a = at::zeros({3}, at::kDouble), b = at::zeros({4}, at::kDouble);
  a.mutable_grad() = at::full({3}, 2.0, at::kDouble);
  b.mutable_grad() = at::full({4}, 1.0, at::kDouble);
  const double norm = clip_grad_norm({{"a", a}, {"b", b}}, 1.0);
  EXPECT_NEAR(norm, std::sqrt(12.0 + 4.0), 1e-12);
  const double after = std::sqrt(a.grad().pow(2).sum().item<double>() + b.grad().pow(2).sum().item<double>());
  EXPECT_NEAR(after, 1.0, 1e-5);
  EXPECT_NEAR(clip_grad_norm({{"a", a}, {"b", b}}, 0.0), after, 1e-12);  // 0 disables
}

TEST(AdamW, AsyncClipAndSkipMatchTheReferenceOnTheCpu) {
  torch::manual_seed(3);
  at::Tensor a = at::randn({5, 4}), b = at::randn({7}), a2 = a.clone(), b2 = b.clone();
  const at::Tensor ga = at::randn({5, 4}) * 3, gb = at::randn({7}) * 3;
  a.mutable_grad() = ga.clone(), b.mutable_grad() = gb.clone();
  a2.mutable_grad() = ga.clone(), b2.mutable_grad() = gb.clone();
  // The tensor version is the reference bit for bit on the CPU (norm and clipped gradients).
  const double n1 = clip_grad_norm({{"a", a}, {"b", b}}, 1.0);
  const at::Tensor n2 = clip_grad_norm_async({{"a", a2}, {"b", b2}}, 1.0);
  EXPECT_EQ(n2.scalar_type(), at::kDouble);
  EXPECT_EQ(n2.item<double>(), n1);
  EXPECT_TRUE(at::equal(a.grad(), a2.grad()) && at::equal(b.grad(), b2.grad()));
  // A non-zero skip leaves parameters and moments untouched; zero applies the update.
  AdamW opt({{"a", a}, {"b", b}}, {});
  const at::Tensor before = a.clone();
  opt.step(0.1, at::ones({}, at::kBool));
  EXPECT_TRUE(at::equal(a, before));
  EXPECT_EQ(opt.steps_taken(), 0);
  opt.step(0.1, at::zeros({}, at::kBool));
  EXPECT_FALSE(at::equal(a, before));
  EXPECT_EQ(opt.steps_taken(), 1);
  EXPECT_FALSE(opt.fused());  // the fused kernel is for CUDA parameters only
}

TEST(Schedule, WarmupThenConstantOrCosine) {
  EXPECT_DOUBLE_EQ(learning_rate(0, 100, 1.0, 0.1, 10, "constant"), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(9, 100, 1.0, 0.1, 10, "constant"), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(99, 100, 1.0, 0.1, 10, "constant"), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(10, 110, 1.0, 0.1, 10, "cosine"), 1.0);
  EXPECT_NEAR(learning_rate(60, 110, 1.0, 0.1, 10, "cosine"), 0.55, 1e-12);
  EXPECT_NEAR(learning_rate(110, 110, 1.0, 0.1, 10, "cosine"), 0.1, 1e-12);
  EXPECT_DOUBLE_EQ(learning_rate(0, 10, 0.5, 0.0, 0, "constant"), 0.5);
}

namespace {
ModelConfig tiny_model() {
  ModelConfig c;
  c.d_model = 16, c.n_layers = 1, c.headdim = 8, c.d_state = 4, c.chunk_size = 8;
  return c;
}
}  // namespace

TEST(Checkpoint, RoundTripKeepsWeightsOptimizerAndConfigs) {
  const std::string dir = hax::testing::temp_dir("ckpt");
  torch::manual_seed(2);
  LanguageModel a(tiny_model());
  AdamW opt(a.state_tensors(), {});
  for (auto& [n, p] : a.state_tensors()) p.mutable_grad() = at::randn_like(p);
  opt.step(0.01);
  CheckpointMeta meta;
  meta.step = 7, meta.best_valid_acc = 0.25, meta.best_step = 5, meta.model = tiny_model();
  meta.task.nc_min = 3, meta.config_text = "x = 1\n";
  save_checkpoint(dir + "/c.safetensors", a, &opt, meta);
  Checkpoint ck = read_checkpoint(dir + "/c.safetensors");
  EXPECT_EQ(ck.meta.step, 7);
  EXPECT_EQ(ck.meta.best_valid_acc, 0.25);
  EXPECT_EQ(ck.meta.best_step, 5);
  EXPECT_EQ(ck.meta.model.to_json(), tiny_model().to_json());
  EXPECT_EQ(ck.meta.task.nc_min, 3);
  EXPECT_EQ(ck.meta.config_text, "x = 1\n");
  ASSERT_TRUE(ck.has_optimizer);
  torch::manual_seed(3);
  LanguageModel b(tiny_model());
  load_weights(b, ck, "c");
  for (auto& [n, p] : a.state_tensors()) EXPECT_TRUE(at::equal(p, b.state_tensors()[n])) << n;
  AdamW opt2(b.state_tensors(), {});
  opt2.load_state(ck.file.tensors, ck.meta.step, "c");
  for (auto& [n, t] : opt.state_tensors()) EXPECT_TRUE(at::equal(t, opt2.state_tensors()[n])) << n;
  hax::testing::remove_tree(dir);
}

TEST(Checkpoint, BadFilesAreClearErrors) {
  const std::string dir = hax::testing::temp_dir("ckpt-bad");
  auto expect_error = [](const std::function<void()>& fn, const std::string& needle) {
    hax::testing::expect_usage_error(fn, needle);
  };
  expect_error([&] { read_checkpoint(dir + "/missing.safetensors"); }, "cannot open");
  write_file_atomic(dir + "/junk.safetensors", "this is not a checkpoint at all");
  expect_error([&] { read_checkpoint(dir + "/junk.safetensors"); }, "is corrupt");
  // A valid checkpoint truncated in its data section.
  torch::manual_seed(4);
  LanguageModel m(tiny_model());
  CheckpointMeta meta;
  meta.model = tiny_model();
  save_checkpoint(dir + "/ok.safetensors", m, nullptr, meta);
  std::string bytes = read_file(dir + "/ok.safetensors", "x");
  write_file_atomic(dir + "/cut.safetensors", bytes.substr(0, bytes.size() - 10));
  expect_error([&] { read_checkpoint(dir + "/cut.safetensors"); }, "is corrupt");
  // A safetensors file that is not a hax checkpoint.
  save_safetensors(dir + "/plain.safetensors", {{"w", at::ones({2})}});
  expect_error([&] { read_checkpoint(dir + "/plain.safetensors"); }, "not a hax checkpoint");
  // Shapes that do not match the configured model.
  Checkpoint ck = read_checkpoint(dir + "/ok.safetensors");
  ModelConfig wider = tiny_model();
  wider.d_model = 32;
  LanguageModel w(wider);
  expect_error([&] { load_weights(w, ck, "ok"); }, "backbone.embedding.weight has shape [100, 16] but the configured model needs [100, 32]");
  hax::testing::remove_tree(dir);
}

TEST(Safetensors, HeaderFollowsTheFormat) {
  // 8-byte little-endian length, JSON header with dtype/shape/data_offsets, 8-byte aligned data.
  std::string bytes = safetensors_serialize({{"a", at::arange(3, at::kFloat)}, {"b", at::ones({2, 2}, at::kDouble)}},
                                            {{"k", "v"}});
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= (uint64_t)(uint8_t)bytes[i] << (8 * i);
  EXPECT_EQ((8 + n) % 8, 0u);
  auto h = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(h["a"]["dtype"], "F32");
  EXPECT_EQ(h["a"]["data_offsets"], nlohmann::json({0, 12}));
  EXPECT_EQ(h["b"]["dtype"], "F64");
  EXPECT_EQ(h["b"]["shape"], nlohmann::json({2, 2}));
  EXPECT_EQ(h["b"]["data_offsets"], nlohmann::json({12, 44}));
  EXPECT_EQ(h["__metadata__"]["k"], "v");
  EXPECT_EQ(bytes.size(), 8 + n + 44);
  float f[3];
  std::memcpy(f, bytes.data() + 8 + n, 12);
  EXPECT_EQ(f[2], 2.0f);
  auto back = safetensors_parse(bytes, "x");
  EXPECT_TRUE(at::equal(back.tensors["b"], at::ones({2, 2}, at::kDouble)));
}
