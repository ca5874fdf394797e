// The command line end to end: bad input, Ctrl-C and resume, NaN guard, data, info, eval.
#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "core/atomic_file.h"
#include "core/safetensors.h"
#include "ops/backend.h"

using hax::testing::CliResult;
using hax::testing::expect_cli_error;
using hax::testing::run_hax;
using hax::testing::slurp;
using hax::testing::temp_dir;

namespace {

// A tiny model and task so that a run takes seconds.
std::vector<std::string> tiny(const std::string& run_dir, int64_t steps) {
  return {"train", "--run-dir", run_dir, "--steps", std::to_string(steps), "--d-model", "16", "--n-layers", "1",
          "--headdim", "8", "--d-state", "4", "--chunk-size", "8", "--nc-min", "2", "--nc-max", "3", "--nk-min", "2",
          "--nk-max", "3", "--batch-size", "8", "--n-valid", "16", "--n-test", "16", "--warmup-steps", "5",
          "--log-every", "5", "--eval-every", "20", "--save-every", "20", "--no-progress", "--threads", "2"};
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& more) {
  a.insert(a.end(), more.begin(), more.end());
  return a;
}


std::vector<nlohmann::json> read_metrics(const std::string& run_dir, const std::string& event) {
  std::vector<nlohmann::json> out;
  std::istringstream in(slurp(run_dir + "/metrics.jsonl"));
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == event) {
      j.erase("tokens_per_s");
      out.push_back(j);
    }
  }
  return out;
}

}  // namespace

TEST(Cli, BadInputExitsWithStatus2AndOneClearLine) {
  const std::string dir = temp_dir("bad");
  expect_cli_error({"train", "--bogus"}, "--bogus");
  expect_cli_error({"train", "--d-model", "0"}, "--d-model 0 must be positive");
  expect_cli_error({"train", "--d-model", "abc"}, "--d-model");
  expect_cli_error({"train", "--headdim", "24"}, "--headdim 24 must divide the inner width d_inner");
  expect_cli_error({"train", "--vocab-size", "50"}, "--vocab-size 50 is too small for task joint_recall");
  expect_cli_error({"train", "--steps", "-5"}, "--steps -5 must be positive");
  expect_cli_error({"train", "--lr", "0"}, "--lr 0 must be positive");
  expect_cli_error({"train", "--mixer", "rnn"}, "--mixer rnn is unknown");
  expect_cli_error({"train", "--config", dir + "/missing.toml"}, "missing.toml");
  hax::write_file_atomic(dir + "/bad.toml", "[model]\nd_model = 32\nbogus_key = 3\n");
  expect_cli_error({"train", "--config", dir + "/bad.toml"}, "unknown key `bogus-key`");
  expect_cli_error({"eval", "--checkpoint", dir + "/missing.safetensors"}, "cannot open");
  hax::write_file_atomic(dir + "/corrupt.safetensors", std::string("\x10\0\0\0\0\0\0\0{not json", 17));
  expect_cli_error({"eval", "--checkpoint", dir + "/corrupt.safetensors"}, "is corrupt");
  expect_cli_error({"data", "--task", "nope"}, "--task 'nope' is not a task");
  expect_cli_error({"data", "--nc-min", "0"}, "--nc-min");
  expect_cli_error({"bench", "ssm", "--alone-ms", "-1"}, "--alone-ms: Value -1 not in range");
  expect_cli_error({"train", "--resume", "--run-dir", dir + "/none"}, "no config.toml");
  hax::testing::remove_tree(dir);
}

TEST(Cli, CtrlCWritesACheckpointAndResumeReproducesTheRun) {
  const std::string dir = temp_dir("resume");
  const std::string full = dir + "/full", cut = dir + "/cut";
  CliResult a = run_hax(tiny(full, 60));
  ASSERT_EQ(a.status, 0) << a.err;

  // Interrupt a second, identical run once it has logged a few steps.
  bool sent = false;
  CliResult b = run_hax(tiny(cut, 60), {}, [&](pid_t pid) {
    if (!sent && read_metrics(cut, "train").size() >= 2 && hax::path_exists(cut + "/metrics.jsonl")) {
      kill(pid, SIGINT);
      sent = true;
    }
    return true;
  });
  ASSERT_TRUE(sent) << "the run ended before it could be interrupted";
  EXPECT_EQ(b.status, 130) << b.err;
  EXPECT_NE(b.out.find("--resume"), std::string::npos) << b.out;
  ASSERT_TRUE(hax::path_exists(cut + "/checkpoints/last.safetensors"));
  EXPECT_LT(read_metrics(cut, "train").size(), read_metrics(full, "train").size());

  // Without --resume the run directory is protected.
  expect_cli_error(tiny(cut, 60), "already holds a run");
  // Resuming with a different model width is a clear shape error.
  expect_cli_error(with(tiny(cut, 60), {"--resume", "--d-model", "32"}), "does not match the checkpoint");

  CliResult c = run_hax({"train", "--run-dir", cut, "--resume"});
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_EQ(read_metrics(cut, "train"), read_metrics(full, "train"));
  EXPECT_EQ(read_metrics(cut, "valid"), read_metrics(full, "valid"));
  EXPECT_EQ(read_metrics(cut, "test"), read_metrics(full, "test"));
  // The same best model, bit for bit.
  auto best_cut = hax::load_safetensors(cut + "/checkpoints/best.safetensors");
  auto best_full = hax::load_safetensors(full + "/checkpoints/best.safetensors");
  ASSERT_EQ(best_cut.tensors.size(), best_full.tensors.size());
  for (auto& [name, t] : best_full.tensors) EXPECT_TRUE(at::equal(t, best_cut.tensors.at(name))) << name;
  hax::testing::remove_tree(dir);
}

TEST(Cli, NonFiniteLossStopsAndKeepsTheLastGoodCheckpoint) {
  const std::string dir = temp_dir("nan");
  CliResult r = run_hax(tiny(dir + "/run", 60), {"HAX_INJECT_NAN_AT_STEP=45"});
  EXPECT_EQ(r.status, 3) << r.err;
  EXPECT_NE(r.err.find("step 46: the loss is nan"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(step 40) is kept"), std::string::npos) << r.err;
  CliResult e = run_hax({"eval", "--checkpoint", dir + "/run/checkpoints/last.safetensors"});
  EXPECT_EQ(e.status, 0) << e.err;
  EXPECT_NE(e.out.find("(step 40)"), std::string::npos) << e.out;
  hax::testing::remove_tree(dir);
}

TEST(Cli, TrainThenEvalAgreeOnTestAccuracy) {
  const std::string dir = temp_dir("eval");
  CliResult r = run_hax(tiny(dir + "/run", 40));
  ASSERT_EQ(r.status, 0) << r.err;
  auto summary = nlohmann::json::parse(slurp(dir + "/run/summary.json"));
  CliResult e = run_hax({"eval", "--checkpoint", dir + "/run/checkpoints/best.safetensors", "--json", dir + "/e.json"});
  ASSERT_EQ(e.status, 0) << e.err;
  auto ej = nlohmann::json::parse(slurp(dir + "/e.json"));
  EXPECT_DOUBLE_EQ(ej["accuracy"].get<double>(), summary["test_acc"].get<double>());
  EXPECT_EQ(ej["samples"], 16);
  // --device auto: the GPU where there is one (the same accuracy up to a sample whose argmax a
  // rounding difference flips), else the CPU; an unknown device is a clear error.
  CliResult ea = run_hax({"eval", "--checkpoint", dir + "/run/checkpoints/best.safetensors", "--device", "auto",
                          "--json", dir + "/ea.json"});
  ASSERT_EQ(ea.status, 0) << ea.err;
  auto eaj = nlohmann::json::parse(slurp(dir + "/ea.json"));
  EXPECT_NEAR(eaj["accuracy"].get<double>(), summary["test_acc"].get<double>(), 1.0 / 16 + 1e-12);
  expect_cli_error({"eval", "--checkpoint", dir + "/run/checkpoints/best.safetensors", "--device", "tpu"},
                   "--device tpu is unknown");
  // The resolved config reproduces the run's settings when read back.
  CliResult i = run_hax({"info", "--config", dir + "/run/config.toml"});
  ASSERT_EQ(i.status, 0) << i.err;
  EXPECT_NE(i.out.find("d_model = 16"), std::string::npos) << i.out;
  hax::testing::remove_tree(dir);
}

TEST(Cli, DataWritesInspectableJsonLines) {
  CliResult r = run_hax({"data", "--task", "joint_recall", "--n", "5", "--seed", "3", "--split", "test", "--n-test", "5"});
  ASSERT_EQ(r.status, 0) << r.err;
  std::istringstream in(r.out);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    const auto& tokens = j["tokens"];
    const auto& mask = j["mask"];
    ASSERT_EQ(tokens.size(), mask.size());
    const int nc = j["params"]["n_c"], nk = j["params"]["n_k"];
    EXPECT_EQ((int)tokens.size(), 2 + 2 * nc * (2 * nk + 1));
    int supervised = 0;
    for (auto& m : mask) supervised += m.get<int>();
    EXPECT_EQ(supervised, nc * nk);
    EXPECT_EQ(tokens[0], 1);
    ++n;
  }
  EXPECT_EQ(n, 5);
  // The same seed gives the same samples.
  EXPECT_EQ(run_hax({"data", "--n", "5", "--seed", "3", "--split", "test", "--n-test", "5"}).out, r.out);
}

TEST(Cli, InfoCountsParameters) {
  CliResult r = run_hax({"info", "--d-model", "64", "--mixer", "mamba2", "--headdim", "16", "--d-state", "32"});
  ASSERT_EQ(r.status, 0) << r.err;
  // 100*64 + 2 * (64*(2*128+2*32+8) + 192*4 + 192 + 3*8 + 128 + 128*64 + 64) + 64
  EXPECT_NE(r.out.find(std::to_string(100 * 64 + 2 * (64 * 328 + 192 * 5 + 24 + 128 + 128 * 64 + 64) + 64)),
            std::string::npos)
      << r.out;
}

TEST(Cli, BenchTrainTimesEachSeedAndReportsTheirMedian) {
  // A sparse variant's step cost depends on its training trajectory, so `--seeds N` times N model
  // initializations: a row each (seeds 1..N), and the median, min and max in "summary".
  const std::string dir = temp_dir("bench_train");
  const std::string out = dir + "/bench.json";
  CliResult r = run_hax({"bench", "train", "--device", "cpu", "--variants", "mamba2+base", "--batch", "2", "--steps",
                         "1", "--warmup", "0", "--seeds", "3", "--graphs", "off", "--threads", "2", "--json", out});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(slurp(out));
  ASSERT_EQ(j["results"].size(), 3u);
  std::vector<double> rates;
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(j["results"][k]["seed"].get<int64_t>(), k + 1);
    EXPECT_EQ(j["results"][k]["variant"].get<std::string>(), "mamba2+base");
    rates.push_back(j["results"][k]["steps_per_s"].get<double>());
  }
  std::sort(rates.begin(), rates.end());
  ASSERT_EQ(j["summary"].size(), 1u);
  const auto& s = j["summary"][0];
  EXPECT_EQ(s["seeds"].get<int64_t>(), 3);
  EXPECT_DOUBLE_EQ(s["steps_per_s_median"].get<double>(), rates[1]);
  EXPECT_DOUBLE_EQ(s["steps_per_s_min"].get<double>(), rates[0]);
  EXPECT_DOUBLE_EQ(s["steps_per_s_max"].get<double>(), rates[2]);
  EXPECT_NE(r.out.find("median"), std::string::npos) << r.out;
  expect_cli_error({"bench", "train", "--seeds", "0"}, "--seeds 0 must be in 1..100");
  hax::testing::remove_tree(dir);
}

TEST(Cli, BenchTrainDeterministicTimesEagerStepsAndRestoresTheMode) {
  // --deterministic times the steps as hax train --deterministic runs them (eager only), says so in
  // the JSON, and leaves the process's deterministic mode as it found it.
  const std::string dir = temp_dir("bench_train_det");
  const std::string out = dir + "/bench.json";
  ASSERT_FALSE(hax::ops::deterministic());
  CliResult r = run_hax({"bench", "train", "--device", "cpu", "--variants", "mamba2+hax", "--batch", "2", "--steps",
                         "1", "--warmup", "0", "--deterministic", "--threads", "2", "--json", out});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_FALSE(hax::ops::deterministic());
  const auto j = nlohmann::json::parse(slurp(out));
  EXPECT_TRUE(j["config"]["deterministic"].get<bool>());
  ASSERT_EQ(j["results"].size(), 1u);
  EXPECT_FALSE(j["results"][0]["cuda_graphs"].get<bool>());
  expect_cli_error({"bench", "train", "--graphs", "on", "--deterministic"}, "no --deterministic (its steps run eagerly)");
  hax::testing::remove_tree(dir);
}
