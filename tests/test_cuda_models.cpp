// Whole models on the GPU: every variant's loss and parameter gradients equal the CPU's (float32),
// a Mamba-2+HAX training run follows the CPU's loss curve, a GPU-trained checkpoint evaluates the
// same on the CPU, and bf16 autocast training learns. Skipped without a CUDA device.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cli_runner.h"
#include "cuda_harness.h"
#include "eval/evaluator.h"
#include "model_variants.h"
#include "models/lm.h"
#include "tasks/batch.h"
#include "tasks/registry.h"
#include "tasks/splits.h"
#include "train/adamw.h"
#include "train/checkpoint.h"
#include "train/loss.h"
#include "train/precision.h"
#include "train/trainer.h"

using namespace hax;
using hax::testing::all_variants;
using hax::testing::hybrid_config;
using hax::testing::name_of;
using hax::testing::rel_err;

namespace {

const at::Device kGpu(at::kCUDA, 0);

// Two copies of one randomly perturbed float32 model: on the CPU and on the GPU.
std::pair<std::shared_ptr<LanguageModel>, std::shared_ptr<LanguageModel>> twin_models(const ModelConfig& c, uint64_t seed) {
  torch::manual_seed(seed);
  auto cpu = std::make_shared<LanguageModel>(c);
  {
    torch::NoGradGuard ng;
    for (auto& p : cpu->parameters()) p.add_(at::randn_like(p) * 0.05);
  }
  torch::manual_seed(seed);
  auto gpu = std::make_shared<LanguageModel>(c);
  {
    torch::NoGradGuard ng;
    auto src = cpu->state_tensors();
    for (auto& [name, p] : gpu->state_tensors()) p.copy_(src.at(name));
  }
  gpu->to(kGpu);
  return {cpu, gpu};
}

// Σ over the batch of the LM loss plus α · ranking losses, as training computes it.
at::Tensor training_loss(LanguageModel& m, const at::Tensor& ids, const at::Tensor& seq, uint64_t seed) {
  ForwardContext ctx;
  ctx.training = true;
  ctx.seed = seed;
  const at::Device d = m.device();
  at::Tensor loss = m.forward(ids.to(d), seq.defined() ? seq.to(d) : seq, &ctx).logsumexp(-1).mean();
  for (auto& r : ctx.ranking_losses) loss = loss + 0.1 * r;
  return loss;
}

// A run of `steps` AdamW steps of a fresh GPU model (seeded) on fixed random packed batches, in
// float32 or under bf16 autocast: each step's loss, then the parameters and their last gradients.
struct StepsRun {
  std::vector<at::Tensor> losses;
  std::map<std::string, at::Tensor> params, grads;
};
StepsRun run_steps(const ModelConfig& c, const std::string& precision, int steps) {
  torch::manual_seed(41);
  auto m = std::make_shared<LanguageModel>(c);
  m->to(kGpu);
  AdamW opt(m->state_tensors(), {});
  StepsRun r;
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(42 + step);
    at::Tensor ids = at::randint(0, 29, {4, 150}, at::kLong);
    at::Tensor seq = hax::testing::random_packing(4, 150, 0.02);
    opt.zero_grad();
    at::Tensor loss;
    {
      AutocastScope autocast(precision, kGpu);
      loss = training_loss(*m, ids, seq, 7 + step);
    }
    loss.backward();
    opt.step(3e-3);
    r.losses.push_back(loss.detach().cpu());
  }
  for (auto& [name, p] : m->state_tensors()) {
    r.params[name] = p.detach().cpu();
    if (p.grad().defined()) r.grads[name] = p.grad().cpu();
  }
  return r;
}

}  // namespace

TEST(CudaTrain, DeterministicModeGivesBitIdenticalRunsForEveryVariant) {
  // --deterministic promises bit-identical reruns: every variant, in float32 and bf16 autocast,
  // run twice from the same seed and batches, gives the same losses, gradients and weights to the
  // bit (hax's kernels sum in a fixed order, and LibTorch's own ops take their deterministic forms).
  HAX_REQUIRE_CUDA();
  hax::ops::DeterministicScope on(true);
  for (const auto& v : all_variants()) {
    for (const char* precision : {"fp32", "bf16"}) {
      SCOPED_TRACE(name_of(v) + " " + precision);
      try {
        const ModelConfig c = hybrid_config(v.first, v.second);
        StepsRun a = run_steps(c, precision, 3), b = run_steps(c, precision, 3);
        for (size_t k = 0; k < a.losses.size(); ++k) EXPECT_TRUE(at::equal(a.losses[k], b.losses[k])) << "loss " << k;
        for (auto& [name, p] : a.grads) EXPECT_TRUE(at::equal(p, b.grads.at(name))) << name << " gradient";
        for (auto& [name, p] : a.params) EXPECT_TRUE(at::equal(p, b.params.at(name))) << name;
      } catch (const std::exception& e) {
        ADD_FAILURE() << std::string(e.what()).substr(0, 400);
      }
    }
  }
}

TEST(CudaTrain, DeterministicTrainRunsWriteIdenticalCheckpoints) {
  // hax train --device cuda --deterministic, twice: the same metrics and, to the bit, the same
  // last checkpoint (weights and optimizer state), for the sparse patterns built on the GPU.
  HAX_REQUIRE_CUDA();
  for (const char* sparse : {"hax", "hsa"}) {
    SCOPED_TRACE(sparse);
    auto run_once = [&](const std::string& dir) {
      hax::testing::remove_tree(dir);
      RunConfig run;
      run.model.mixer = "mamba2", run.model.d_model = 32, run.model.n_layers = 2, run.model.sparse = sparse;
      run.model.sparse_keys = 16, run.model.chunk_size = 32, run.model.hsa_chunk = 16, run.model.hsa_topk = 2;
      run.task.nc_min = 2, run.task.nc_max = 3, run.task.nk_min = 2, run.task.nk_max = 3;
      run.train.run_dir = dir, run.train.device = "cuda", run.train.precision = "bf16", run.train.deterministic = true;
      run.train.steps = 20, run.train.batch_size = 16, run.train.lr = 3e-3, run.train.warmup_steps = 5;
      run.train.eval_every = 10, run.train.save_every = 10, run.train.n_valid = 32, run.train.n_test = 32;
      run.train.progress = false, run.train.log_every = 5;
      run.config_text = "# test\n";
      return train(run);
    };
    const std::string d1 = ::testing::TempDir() + "hax_det_a", d2 = ::testing::TempDir() + "hax_det_b";
    hax::ops::DeterministicScope restore(false);  // train() turns the mode on: as before again at the end
    TrainSummary s1 = run_once(d1), s2 = run_once(d2);
    ASSERT_EQ(s1.steps_done, 20);
    EXPECT_EQ(s1.test_loss, s2.test_loss);
    EXPECT_EQ(s1.test_acc, s2.test_acc);
    Checkpoint c1 = read_checkpoint(last_checkpoint_path(d1)), c2 = read_checkpoint(last_checkpoint_path(d2));
    ASSERT_EQ(c1.file.tensors.size(), c2.file.tensors.size());
    EXPECT_TRUE(c1.has_optimizer);
    for (const auto& [name, a] : c1.file.tensors) EXPECT_TRUE(at::equal(a, c2.file.tensors.at(name))) << name;
    hax::testing::remove_tree(d1), hax::testing::remove_tree(d2);
  }
}

TEST(CudaModels, EveryVariantMatchesCpuLossAndGradients) {
  HAX_REQUIRE_CUDA();
  for (const auto& v : all_variants()) {
    SCOPED_TRACE(name_of(v));
    auto [cpu, gpu] = twin_models(hybrid_config(v.first, v.second), 31);
    torch::manual_seed(32);
    at::Tensor ids = at::randint(0, 29, {2, 97}, at::kLong);
    at::Tensor seq = hax::testing::random_packing(2, 97, 0.03);
    at::Tensor lc = training_loss(*cpu, ids, seq, 5), lg = training_loss(*gpu, ids, seq, 5);
    lc.backward();
    lg.backward();
    EXPECT_NEAR(lg.item<double>(), lc.item<double>(), 1e-4 * (1 + std::abs(lc.item<double>())));
    auto gc = cpu->state_tensors();
    for (auto& [name, p] : gpu->state_tensors()) {
      const at::Tensor& ref = gc.at(name).grad();
      // The scorer's last bias gets no gradient by construction (the ranking loss sees only
      // score differences): both devices give rounding noise there.
      if (!ref.defined() || name.find("scorer.l3.bias") != std::string::npos) continue;
      ASSERT_TRUE(p.grad().defined()) << name;
      const double scale = std::max(1e-6, ref.abs().max().item<double>());
      EXPECT_LE(rel_err(p.grad().cpu(), ref, 1e-3 * scale, 1e-3), 1.0) << name << " gradient differs";
    }
  }
}

TEST(CudaModels, DecodingOnGpuEqualsForward) {
  HAX_REQUIRE_CUDA();
  for (const auto& v : all_variants()) {
    SCOPED_TRACE(name_of(v));
    auto gpu = twin_models(hybrid_config(v.first, v.second), 33).second;
    torch::NoGradGuard ng;
    at::Tensor ids = at::randint(0, 29, {2, 40}, at::TensorOptions().dtype(at::kLong).device(kGpu));
    try {
      at::Tensor full = gpu->forward(ids).cpu();
      auto states = gpu->zero_states(2);
      for (int64_t t = 0; t < 40; ++t) {
        at::Tensor step = gpu->step(ids.select(1, t), states).cpu();
        ASSERT_LE(rel_err(step, full.select(1, t), 1e-4, 1e-3), 1.0) << "token " << t;
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << name_of(v) << ": " << std::string(e.what()).substr(0, 300);
    }
  }
}

TEST(CudaTrain, Mamba2HaxLossCurveMatchesCpuInFloat32) {
  HAX_REQUIRE_CUDA();
  ModelConfig c = hybrid_config("mamba2", "hax");
  auto [cpu, gpu] = twin_models(c, 35);
  AdamW oc(cpu->state_tensors(), {}), og(gpu->state_tensors(), {});
  torch::manual_seed(36);
  for (int step = 0; step < 8; ++step) {
    at::Tensor ids = at::randint(0, 29, {4, 64}, at::kLong);
    at::Tensor lc = training_loss(*cpu, ids, {}, 100 + step), lg = training_loss(*gpu, ids, {}, 100 + step);
    EXPECT_NEAR(lg.item<double>(), lc.item<double>(), 2e-4 * (1 + std::abs(lc.item<double>()))) << "step " << step;
    oc.zero_grad(), og.zero_grad();
    lc.backward(), lg.backward();
    oc.step(3e-3), og.step(3e-3);
  }
}

TEST(CudaTrain, GpuCheckpointEvaluatesTheSameOnCpuAndBf16Learns) {
  HAX_REQUIRE_CUDA();
  const std::string dir = ::testing::TempDir() + "hax_cuda_train";
  hax::testing::remove_tree(dir);
  RunConfig run;
  run.model.mixer = "mamba2", run.model.d_model = 32, run.model.n_layers = 2, run.model.sparse = "hax";
  run.model.sparse_keys = 16, run.model.chunk_size = 32;
  run.task.nc_min = 2, run.task.nc_max = 3, run.task.nk_min = 2, run.task.nk_max = 3;
  run.train.run_dir = dir, run.train.device = "cuda", run.train.precision = "bf16";
  run.train.steps = 60, run.train.batch_size = 16, run.train.lr = 3e-3, run.train.warmup_steps = 10;
  run.train.eval_every = 30, run.train.save_every = 30, run.train.n_valid = 64, run.train.n_test = 64;
  run.train.progress = false, run.train.log_every = 10;
  if (fused_optimizer_built()) run.train.cuda_graphs = "on";  // the steps replay from CUDA graphs
  run.config_text = "# test\n";
  TrainSummary s = train(run);
  ASSERT_EQ(s.steps_done, 60);
  EXPECT_TRUE(std::isfinite(s.test_loss));
  // --cuda-graphs on: after two eager steps, the steps replay from CUDA graphs.
  if (fused_optimizer_built()) {
    EXPECT_EQ(s.graphs_off, "");
    EXPECT_GE(s.graph_captures, 1);
    EXPECT_GE(s.graph_replays, 50);
  }
  // The best checkpoint, loaded on the CPU, scores the run's test set as the GPU did (float32 eval).
  Checkpoint ck = read_checkpoint(best_checkpoint_path(dir));
  LanguageModel cpu_model(ck.meta.model);
  load_weights(cpu_model, ck, best_checkpoint_path(dir));
  auto task = make_task(run.task);
  auto test = eval_fingerprints(*task, run.train.seed, run.train.n_valid, run.train.n_test, 0, run.train.n_test).test;
  const int64_t pack_len = task->max_length() - 1;
  EvalResult r = evaluate(cpu_model, test, run.train.eval_batch_size, run.train.pack, pack_len, eval_seed(run.train.seed));
  EXPECT_NEAR(r.accuracy, s.test_acc, 0.02);
  EXPECT_NEAR(r.loss, s.test_loss, 1e-3 * (1 + s.test_loss));
  // The loss went down from its first logged value.
  std::ifstream metrics(dir + "/metrics.jsonl");
  std::string line;
  std::vector<double> losses;
  while (std::getline(metrics, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "train") losses.push_back(j.at("loss").get<double>());
  }
  ASSERT_GE(losses.size(), 2u);
  EXPECT_LT(losses.back(), losses.front()) << "bf16 training on the GPU did not lower the loss";
  hax::testing::remove_tree(dir);
}
