// Length-extrapolation evaluation: the grid (lengths x needle depths) in process on a tiny random
// model, the heat map picture, and end to end through the command line (hax train on niah and mqar,
// hax eval --lengths, hax data --task niah).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "core/error.h"
#include "eval/heatmap_svg.h"
#include "eval/length_eval.h"
#include "models/lm.h"

using hax::testing::CliResult;
using hax::testing::expect_cli_error;
using hax::testing::run_hax;
using hax::testing::slurp;
using hax::testing::temp_dir;

namespace {

size_t count(const std::string& s, const std::string& needle) {
  size_t n = 0;
  for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + needle.size())) ++n;
  return n;
}

// Checks the picture is well-formed enough for a browser: one root, balanced elements, `cells` cells.
void expect_svg(const std::string& svg, size_t cells) {
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u) << svg.substr(0, 80);
  EXPECT_EQ(count(svg, "<svg "), 1u);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
  EXPECT_EQ(count(svg, "<rect class=\"cell\""), cells);
  EXPECT_EQ(count(svg, "<text"), count(svg, "</text>"));
  EXPECT_EQ(count(svg, "<title>"), count(svg, "</title>"));
  EXPECT_EQ(count(svg, "<"), count(svg, ">")) << "unescaped < or > in text";
  // Every '&' starts an entity.
  for (size_t p = svg.find('&'); p != std::string::npos; p = svg.find('&', p + 1)) {
    const std::string rest = svg.substr(p, 6);
    EXPECT_TRUE(rest.rfind("&amp;", 0) == 0 || rest.rfind("&lt;", 0) == 0 || rest.rfind("&gt;", 0) == 0 ||
                rest.rfind("&quot;", 0) == 0 || rest.rfind("&apos;", 0) == 0)
        << rest;
  }
}

hax::ModelConfig tiny_model() {
  hax::ModelConfig c;
  c.vocab_size = 100;
  c.d_model = 16;
  c.n_layers = 1;
  c.headdim = 8;
  c.d_state = 4;
  c.chunk_size = 8;
  return c;
}

hax::TaskConfig niah_task(int64_t seq_len) {
  hax::TaskConfig t;
  t.name = "niah";
  t.seq_len = seq_len;
  return t;
}

template <class F>
void expect_usage(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected " << parts[0];
  } catch (const hax::UsageError& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

// ---- the library ---------------------------------------------------------------------------------

TEST(LengthEval, Labels) {
  EXPECT_EQ(hax::length_label(1024), "1K");
  EXPECT_EQ(hax::length_label(65536), "64K");
  EXPECT_EQ(hax::length_label(1 << 20), "1M");
  EXPECT_EQ(hax::length_label(1000), "1000");
  EXPECT_EQ(hax::length_label(1536), "1536");
  EXPECT_EQ(hax::length_label(64), "64");
}

TEST(LengthEval, IndicesSpreadOverTheGrid) {
  EXPECT_EQ(hax::length_eval_indices(5, 1), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(hax::length_eval_indices(4, 4), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(hax::length_eval_indices(4, 8), (std::vector<int64_t>{0, 2, 4, 6}));
  const auto idx = hax::length_eval_indices(20, 512);  // MQAR 1..512 pairs: spread, not 1..20
  ASSERT_EQ(idx.size(), 20u);
  EXPECT_EQ(idx.front(), 0);
  EXPECT_GE(idx.back(), 480);
  EXPECT_TRUE(std::is_sorted(idx.begin(), idx.end()));
  EXPECT_EQ(std::set<int64_t>(idx.begin(), idx.end()).size(), 20u);
}

TEST(LengthEval, CellConfigsAndErrors) {
  const hax::TaskConfig t = hax::length_eval_task(niah_task(256), 4096, 0.25);
  EXPECT_EQ(t.seq_len, 4096);
  EXPECT_EQ(t.niah_depth, 0.25);
  EXPECT_EQ(hax::length_eval_task(niah_task(256), 512, std::nan("")).niah_depth, -1);  // the task's own
  expect_usage([] { hax::length_eval_task(niah_task(256), 8, 0.5); },
               {"--lengths", "length 8", "niah", "--seq-len 8 is too short"});
  expect_usage([] { hax::length_eval_task(hax::TaskConfig{}, 1024, std::nan("")); },
               {"--lengths", "joint_recall", "mqar or niah"});
  hax::TaskConfig mqar;
  mqar.name = "mqar";
  expect_usage([&] { hax::length_eval_task(mqar, 100, std::nan("")); }, {"--lengths", "length 100", "--kv-max 64"});
  expect_usage([&] { hax::length_eval_task(mqar, 1024, 0.5); }, {"--depths", "mqar"});
  expect_usage([] { hax::length_eval_task(niah_task(256), 1024, 1.5); }, {"--depths", "1.5", "[0, 1]"});
}

TEST(LengthEval, GridOnATinyRandomModel) {
  torch::manual_seed(3);
  hax::LanguageModel model(tiny_model());
  hax::LengthEvalConfig cfg;
  cfg.lengths = {64, 96};
  cfg.depths = {0, 0.5, 1};
  cfg.n = 5;
  cfg.batch_size = 4;
  cfg.max_batch_tokens = 200;
  cfg.seed = 11;
  std::vector<std::pair<int64_t, double>> seen;
  const hax::LengthEvalGrid g = hax::length_eval(model, niah_task(256), cfg, [&](const hax::LengthEvalCell& c) {
    seen.push_back({c.length, c.depth});
  });
  ASSERT_EQ(g.cells.size(), 6u);
  EXPECT_EQ(seen.size(), 6u);
  EXPECT_EQ(g.lengths, cfg.lengths);
  EXPECT_EQ(g.depths, cfg.depths);
  for (size_t r = 0; r < 2; ++r) {
    for (size_t c = 0; c < 3; ++c) {
      const auto& cell = g.at(r, c);
      EXPECT_EQ(cell.length, cfg.lengths[r]);
      EXPECT_EQ(cell.depth, cfg.depths[c]);
      EXPECT_EQ(cell.result.samples, 5);
      EXPECT_EQ(cell.result.positions, 5 * 4);  // 4 passkey digits each
      EXPECT_TRUE(cell.result.accuracy >= 0 && cell.result.accuracy <= 1);
      EXPECT_TRUE(std::isfinite(cell.result.loss));
      EXPECT_EQ(cell.batch_size, r == 0 ? 3 : 2);  // 200 tokens per batch at most
    }
  }
  // Reproducible, and the model is left as it was (training mode).
  EXPECT_TRUE(model.is_training());
  const hax::LengthEvalGrid again = hax::length_eval(model, niah_task(256), cfg);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(again.cells[i].result.loss, g.cells[i].result.loss);

  const nlohmann::json j = hax::length_eval_json(g);
  EXPECT_EQ(j["lengths"], nlohmann::json({64, 96}));
  EXPECT_EQ(j["depths"], nlohmann::json({0.0, 0.5, 1.0}));
  ASSERT_EQ(j["accuracy"].size(), 2u);
  EXPECT_EQ(j["accuracy"][1].size(), 3u);
  ASSERT_EQ(j["cells"].size(), 6u);
  EXPECT_EQ(j["cells"][5]["length"], 96);
  EXPECT_EQ(j["cells"][5]["depth"], 1.0);
  for (const char* key : {"accuracy", "loss", "samples", "positions", "batch_size", "seconds", "peak_memory_bytes"})
    EXPECT_TRUE(j["cells"][0].contains(key)) << key;
  EXPECT_EQ(j["task"]["name"], "niah");

  const std::string table = hax::length_eval_table(g);
  EXPECT_NE(table.find("d=0.5"), std::string::npos) << table;
  EXPECT_NE(table.find("mean"), std::string::npos) << table;
  EXPECT_EQ(count(table, "\n"), 3u) << table;
  expect_svg(hax::heatmap_svg(hax::length_eval_heatmap(g, "a <tiny> & random model")), 6);
}

TEST(LengthEval, MqarHasOneColumn) {
  torch::manual_seed(4);
  hax::ModelConfig mc = tiny_model();
  mc.vocab_size = 64;
  hax::LanguageModel model(mc);
  hax::TaskConfig t;
  t.name = "mqar", t.vocab_size = 64, t.kv_min = 2, t.kv_max = 8, t.seq_len = 32;
  hax::LengthEvalConfig cfg;
  cfg.lengths = {32, 128};
  cfg.depths = {0, 1};  // not a NIAH task: ignored
  cfg.n = 7;
  const auto g = hax::length_eval(model, t, cfg);
  ASSERT_EQ(g.depths.size(), 1u);
  EXPECT_TRUE(std::isnan(g.depths[0]));
  ASSERT_EQ(g.cells.size(), 2u);
  EXPECT_EQ(g.cells[1].result.samples, 7);
  EXPECT_EQ(g.cells[1].result.positions, 2 + 3 + 4 + 5 + 6 + 7 + 8);  // every pair count once
  EXPECT_TRUE(hax::length_eval_json(g)["depths"][0].is_null());
  expect_svg(hax::heatmap_svg(hax::length_eval_heatmap(g, "mqar")), 2);
  // A model whose vocabulary is too small for the task.
  t.vocab_size = 200;
  expect_usage([&] { hax::length_eval(model, t, cfg); }, {"vocabulary", "64", "200"});
}

TEST(Heatmap, ColoursEscapingAndShape) {
  EXPECT_EQ(hax::heatmap_colour(0), "#d73027");
  EXPECT_EQ(hax::heatmap_colour(0.5), "#fee08b");
  EXPECT_EQ(hax::heatmap_colour(1), "#1a9850");
  EXPECT_EQ(hax::heatmap_colour(2), "#1a9850");
  EXPECT_EQ(hax::heatmap_colour(std::nan("")), "#c8c8c8");
  EXPECT_EQ(hax::xml_escape("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&apos;");
  hax::Heatmap h;
  h.title = "run <1> & \"2\"";
  h.rows = {"1K", "4K", "16K"};
  h.cols = {"0", "0.5"};
  h.values = {1, 0.5, 0, std::nan(""), 0.25, 0.75};
  const std::string svg = hax::heatmap_svg(h);
  expect_svg(svg, 6);
  EXPECT_NE(svg.find("run &lt;1&gt; &amp; &quot;2&quot;"), std::string::npos);
  EXPECT_NE(svg.find(">100.0<"), std::string::npos);
  EXPECT_NE(svg.find(">n/a<"), std::string::npos);
  EXPECT_NE(svg.find(">16K<"), std::string::npos);
  h.values.pop_back();
  EXPECT_THROW(hax::heatmap_svg(h), hax::UsageError);
}

// ---- the command line ----------------------------------------------------------------------------

// A tiny model trained for 5 steps into `run_dir` on `task_args`.
CliResult train_tiny(const std::string& run_dir, const std::vector<std::string>& task_args) {
  std::vector<std::string> a = {"train", "--run-dir", run_dir, "--steps", "5", "--d-model", "16", "--n-layers", "1",
                                "--headdim", "8", "--d-state", "4", "--chunk-size", "8", "--batch-size", "4",
                                "--n-valid", "8", "--n-test", "8", "--warmup-steps", "2", "--log-every", "5",
                                "--eval-every", "5", "--save-every", "5", "--no-progress", "--threads", "2"};
  a.insert(a.end(), task_args.begin(), task_args.end());
  return run_hax(a);
}


TEST(CliLengths, NiahTrainThenEvalGrid) {
  const std::string dir = temp_dir("lengths");
  CliResult t = train_tiny(dir + "/run", {"--task", "niah", "--seq-len", "64", "--niah-depth", "-1"});
  ASSERT_EQ(t.status, 0) << t.err;
  const std::string ck = dir + "/run/checkpoints/last.safetensors";
  // The run's config (with the NIAH fields) reads back.
  EXPECT_NE(slurp(dir + "/run/config.toml").find("niah_variant = \"single\""), std::string::npos);
  CliResult info = run_hax({"info", "--config", dir + "/run/config.toml"});
  EXPECT_EQ(info.status, 0) << info.err;

  CliResult e = run_hax({"eval", "--checkpoint", ck, "--lengths", "64,128", "--depths", "0,1", "--n", "3", "--json",
                         dir + "/grid.json", "--svg", dir + "/grid.svg", "--threads", "2"});
  ASSERT_EQ(e.status, 0) << e.err;
  EXPECT_NE(e.out.find("d=0"), std::string::npos) << e.out;
  EXPECT_NE(e.out.find("128"), std::string::npos) << e.out;
  const auto j = nlohmann::json::parse(slurp(dir + "/grid.json"));
  EXPECT_EQ(j["lengths"], nlohmann::json({64, 128}));
  EXPECT_EQ(j["depths"], nlohmann::json({0.0, 1.0}));
  ASSERT_EQ(j["accuracy"].size(), 2u);
  for (const auto& row : j["accuracy"]) EXPECT_EQ(row.size(), 2u);
  ASSERT_EQ(j["cells"].size(), 4u);
  for (const auto& c : j["cells"]) {
    EXPECT_EQ(c["samples"], 3);
    EXPECT_TRUE(c["accuracy"].get<double>() >= 0 && c["accuracy"].get<double>() <= 1);
  }
  EXPECT_EQ(j["checkpoint"], ck);
  EXPECT_EQ(j["step"], 5);
  EXPECT_EQ(j["task"]["variant"], "single");
  const std::string svg = slurp(dir + "/grid.svg");
  expect_svg(svg, 4);
  EXPECT_NE(svg.find("last.safetensors"), std::string::npos);
  EXPECT_NE(svg.find("niah single"), std::string::npos);
  // Reproducible: the same grid again.
  CliResult e2 = run_hax({"eval", "--checkpoint", ck, "--lengths", "64,128", "--depths", "0,1", "--n", "3", "--json",
                          dir + "/grid2.json", "--threads", "2"});
  ASSERT_EQ(e2.status, 0) << e2.err;
  EXPECT_EQ(nlohmann::json::parse(slurp(dir + "/grid2.json"))["accuracy"], j["accuracy"]);
  // Without --depths a NIAH grid has five depth columns.
  CliResult e3 = run_hax({"eval", "--checkpoint", ck, "--lengths", "64", "--n", "2", "--json", dir + "/g3.json"});
  ASSERT_EQ(e3.status, 0) << e3.err;
  EXPECT_EQ(nlohmann::json::parse(slurp(dir + "/g3.json"))["depths"], nlohmann::json({0.0, 0.25, 0.5, 0.75, 1.0}));
  // Without --lengths, hax eval is the split evaluation it always was.
  CliResult plain = run_hax({"eval", "--checkpoint", ck});
  ASSERT_EQ(plain.status, 0) << plain.err;
  EXPECT_NE(plain.out.find("test accuracy"), std::string::npos) << plain.out;

  expect_cli_error({"eval", "--checkpoint", ck, "--lengths", "64,abc"}, "--lengths 64,abc: `abc` is not a positive size");
  expect_cli_error({"eval", "--checkpoint", ck, "--lengths", "0"}, "--lengths 0");
  expect_cli_error({"eval", "--checkpoint", ck, "--lengths", "64,,128"}, "empty entry");
  expect_cli_error({"eval", "--checkpoint", ck, "--lengths", "1k,8"}, "--lengths: length 8 is not valid for task niah");
  expect_cli_error({"eval", "--checkpoint", ck, "--lengths", "64", "--depths", "0,2"}, "--depths 0,2: `2` is not in [0, 1]");
  expect_cli_error({"eval", "--checkpoint", ck, "--depths", "0.5"}, "--depths 0.5 needs --lengths");
  expect_cli_error({"eval", "--checkpoint", ck, "--svg", dir + "/x.svg"}, "needs --lengths");
  expect_cli_error({"eval", "--checkpoint", ck, "--lengths", "64", "--max-batch-tokens", "0"},
                     "--max-batch-tokens 0 must be positive");
  hax::testing::remove_tree(dir);
}

TEST(CliLengths, MqarAndJointRecallCheckpoints) {
  const std::string dir = temp_dir("lengths-mqar");
  CliResult t = train_tiny(dir + "/mqar", {"--task", "mqar", "--mqar-vocab", "64", "--vocab-size", "64", "--kv-min",
                                           "2", "--kv-max", "4", "--seq-len", "32"});
  ASSERT_EQ(t.status, 0) << t.err;
  const std::string ck = dir + "/mqar/checkpoints/last.safetensors";
  CliResult e = run_hax({"eval", "--checkpoint", ck, "--lengths", "32,64", "--n", "4", "--json", dir + "/m.json",
                         "--svg", dir + "/m.svg"});
  ASSERT_EQ(e.status, 0) << e.err;
  const auto j = nlohmann::json::parse(slurp(dir + "/m.json"));
  ASSERT_EQ(j["depths"].size(), 1u);
  EXPECT_TRUE(j["depths"][0].is_null());
  EXPECT_EQ(j["cells"].size(), 2u);
  expect_svg(slurp(dir + "/m.svg"), 2);
  expect_cli_error({"eval", "--checkpoint", ck, "--lengths", "32", "--depths", "0.5"}, "has no needle depth");
  expect_cli_error({"eval", "--checkpoint", ck, "--lengths", "15"}, "--seq-len 15 is too short for --kv-max 4");

  CliResult jr = train_tiny(dir + "/jr", {"--nc-min", "2", "--nc-max", "3", "--nk-min", "2", "--nk-max", "3"});
  ASSERT_EQ(jr.status, 0) << jr.err;
  expect_cli_error({"eval", "--checkpoint", dir + "/jr/checkpoints/last.safetensors", "--lengths", "1k"},
                     "task joint_recall has no --seq-len to vary");
  hax::testing::remove_tree(dir);
}

TEST(CliNiah, DataWritesNiahSamples) {
  CliResult r = run_hax({"data", "--task", "niah", "--niah-variant", "multiquery", "--niah-needles", "3", "--seq-len",
                         "97", "--niah-depth", "0.5", "--n", "4", "--n-valid", "4", "--n-test", "4"});
  ASSERT_EQ(r.status, 0) << r.err;
  std::istringstream in(r.out);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["task"], "niah");
    EXPECT_EQ(j["tokens"].size(), 98u);
    EXPECT_EQ(j["mask"].size(), 98u);
    int supervised = 0;
    for (const auto& m : j["mask"]) supervised += m.get<int>();
    EXPECT_EQ(supervised, 3 * 4);
    EXPECT_EQ(j["params"]["variant"], "multiquery");
    EXPECT_EQ(j["params"]["needle_positions"].size(), 3u);
    EXPECT_EQ(j["params"]["depth"], 0.5);
    ++n;
  }
  EXPECT_EQ(n, 4);
  expect_cli_error({"data", "--task", "niah", "--niah-depth", "2"}, "--niah-depth 2 must be <= 1");
  expect_cli_error({"data", "--task", "niah", "--niah-variant", "many"}, "--niah-variant 'many' is unknown");
  expect_cli_error({"data", "--task", "niah", "--seq-len", "12"}, "--seq-len 12 is too short for --niah-variant single");
}

}  // namespace
