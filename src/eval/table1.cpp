#include "eval/table1.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"
#include "eval/run_reuse.h"
#include "models/model_config.h"
#include "train/run_config_text.h"
#include "train/trainer.h"

namespace hax {
namespace {

const char* kSparse[] = {"base", "d", "sw", "sw+d", "a", "lsh", "ks", "hax", "dim"};

// The paper's Table 1 (test accuracy %, 2 layers, d_model 64, k = 64, 400K steps of batch 64).
double paper_accuracy(const std::string& base, const std::string& v) {
  static const std::map<std::string, std::pair<double, double>> t = {
      {"base", {16.3, 36.6}}, {"d", {7.8, 19.6}},  {"sw", {18.7, 70.6}},  {"sw+d", {16.6, 48.6}},
      {"a", {16.4, 49.3}},    {"lsh", {11.6, 13.5}}, {"ks", {36.6, 60.1}}, {"hax", {38.0, 74.3}},
      {"dim", {34.5, 59.2}},  {"samba", {6.3, NAN}}};
  auto it = t.find(v);
  if (it == t.end()) return NAN;
  return base == "mamba" ? it->second.first : it->second.second;
}

// "mamba2+hax" -> ("mamba2", "hax"); "samba" -> ("mamba", "samba").
std::pair<std::string, std::string> split_variant(const std::string& name) {
  if (name == "samba") return {"mamba", "samba"};
  auto plus = name.find('+');
  HAX_CHECK(plus != std::string::npos, "--variants: `{}` is not a Table 1 variant (e.g. mamba2+hax, mamba+dim, samba)",
            name);
  std::string base = name.substr(0, plus), v = name.substr(plus + 1);
  HAX_CHECK(base == "mamba" || base == "mamba2", "--variants: `{}` has base `{}`; choose mamba or mamba2", name, base);
  HAX_CHECK(std::find(std::begin(kSparse), std::end(kSparse), v) != std::end(kSparse),
            "--variants: `{}` has unknown variant `{}`; choose base, d, sw, sw+d, a, lsh, ks, hax or dim", name, v);
  return {base, v};
}

// The paper's model for a variant (appendix D.1 and the reference configs).
ModelConfig variant_model(const std::string& base, const std::string& v, const Table1Config& cfg) {
  ModelConfig m;
  m.vocab_size = 100;
  m.d_model = 64;
  m.n_layers = 2;
  m.chunk_size = cfg.chunk_size;
  if (base == "mamba") {
    m.mixer = "mamba";
    m.d_state = 16;
    m.dt_rank = 8;
  } else {
    m.mixer = "mamba2";
    m.d_state = 32;
    m.headdim = 16;
  }
  if (v == "dim") {
    m.d_model = 128;
    if (base == "mamba2") m.headdim = 32;
  } else if (v == "samba") {
    m.mixer = "samba";
    m.n_layers = 4;  // Mamba, attention, Mamba, attention
    m.swa_window = 64;
    m.swa_heads = 4;
  } else if (v != "base") {
    m.sparse = v;
    m.sparse_keys = cfg.sparse_keys;
  }
  return m;
}

}  // namespace

ModelConfig table1_model(const std::string& variant, const Table1Config& cfg) {
  auto [base, v] = split_variant(variant);
  return variant_model(base, v, cfg);
}

std::vector<std::string> table1_variants() {
  std::vector<std::string> out;
  for (const char* base : {"mamba", "mamba2"})
    for (const char* v : kSparse) out.push_back(std::string(base) + "+" + v);
  out.push_back("samba");
  return out;
}

void run_table1(const Table1Config& cfg) {
  HAX_CHECK(!cfg.seeds.empty(), "--seeds must list at least one seed");
  const std::vector<std::string> variants = cfg.variants.empty() ? table1_variants() : cfg.variants;
  for (const auto& name : variants) split_variant(name);  // a bad name fails before any run is trained
  nlohmann::json runs = nlohmann::json::array();
  std::map<std::string, std::vector<double>> acc;
  for (const auto& name : variants) {
    auto [base, v] = split_variant(name);
    for (uint64_t seed : cfg.seeds) {
      RunConfig run;
      run.model = variant_model(base, v, cfg);
      run.task = cfg.task;
      run.train.run_dir = fmt::format("{}/{}-s{}", cfg.runs_dir, name, seed);
      run.train.seed = seed;
      // run.train.threads stays 0: the thread count (set by the command) does not change results, so a
      // run trained with any count is reused.
      run.train.steps = cfg.steps;
      run.train.batch_size = cfg.batch_size;
      run.train.lr = cfg.lr;
      run.train.warmup_steps = cfg.warmup_steps;
      run.train.eval_every = cfg.eval_every;
      run.train.save_every = cfg.eval_every;
      run.train.log_every = std::max<int64_t>(1, cfg.eval_every / 10);
      run.train.n_valid = cfg.n_valid;
      run.train.n_test = cfg.n_test;
      run.train.progress = false;
      run.config_text = run_config_text(run.model, run.task, run.train);
      const ExperimentRun r = train_or_reuse(run, "table1", fmt::format("{} (seed {})", name, seed));
      const double test = r.test_acc, seconds = r.seconds;
      const bool reused = r.reused;
      fmt::print("table1: {} seed {}: test accuracy {:.2f}%{}\n", name, seed, 100 * test, reused ? " (reused)" : "");
      acc[name].push_back(test);
      runs.push_back({{"variant", name}, {"seed", seed}, {"test_acc", test}, {"train_seconds", seconds},
                      {"run_dir", run.train.run_dir}});
    }
  }
  // The markdown table: one row per variant, hax's mean test accuracy beside the paper's.
  auto cell = [&](const std::string& name) -> std::string {
    auto it = acc.find(name);
    if (it == acc.end()) return "–";
    const auto& xs = it->second;
    double mean = 0;
    for (double x : xs) mean += x;
    mean /= xs.size();
    if (xs.size() == 1) return fmt::format("{:.1f}", 100 * mean);
    auto [lo, hi] = std::minmax_element(xs.begin(), xs.end());
    return fmt::format("{:.1f} ({:.1f}–{:.1f})", 100 * mean, 100 * *lo, 100 * *hi);
  };
  auto paper = [](const std::string& base, const std::string& v) {
    double p = paper_accuracy(base, v);
    return std::isnan(p) ? std::string("–") : fmt::format("{:.1f}", p);
  };
  const std::map<std::string, std::string> label = {
      {"base", "Base"}, {"d", "+D"},     {"sw", "+SW"},          {"sw+d", "+SW+D"}, {"a", "+A"},
      {"lsh", "+LSH"},  {"ks", "+KS"},   {"hax", "+HAX"},        {"dim", "Base (dim)"}, {"samba", "Samba"}};
  std::string md = "# Table 1: multi-query joint recall, test accuracy (%)\n\n";
  md += fmt::format("Command: `{}`\n\n", cfg.command);
  md += fmt::format(
      "Budget per run: {} steps of batch {} ({} samples), lr {} after {} warmup steps, constant; seeds {}; validation "
      "on {} samples every {} steps, test on {} samples with the best-validation model. Task: joint recall with n_c "
      "in {}..{} and n_k in {}..{}. Models as the paper's (2 layers, d_model 64, k = {}); the paper trained 400K "
      "steps of batch 64 with n_c, n_k in 5..16.\n\n",
      cfg.steps, cfg.batch_size, cfg.steps * cfg.batch_size, cfg.lr, cfg.warmup_steps,
      nlohmann::json(cfg.seeds).dump(), cfg.n_valid, cfg.eval_every, cfg.n_test, cfg.task.nc_min, cfg.task.nc_max,
      cfg.task.nk_min, cfg.task.nk_max, cfg.sparse_keys);
  md += "| variant | Mamba (hax) | Mamba (paper) | Mamba2 (hax) | Mamba2 (paper) |\n|---|---|---|---|---|\n";
  for (const char* v : {"base", "d", "sw", "sw+d", "a", "lsh", "ks", "hax", "dim", "samba"}) {
    const std::string vs = v;
    const std::string m1 = vs == "samba" ? "samba" : "mamba+" + vs, m2 = "mamba2+" + vs;
    md += fmt::format("| {} | {} | {} | {} | {} |\n", label.at(vs), cell(m1), paper("mamba", vs),
                      vs == "samba" ? "–" : cell(m2), paper("mamba2", vs));
  }
  md += "\nEach hax cell is the mean over seeds (range in parentheses when there are several).\n";
  write_file_atomic(cfg.out_md, md);
  write_file_atomic(cfg.out_json, nlohmann::json({{"command", cfg.command}, {"runs", runs}}).dump(2) + "\n");
  fmt::print("\n{}\nwrote {} and {}\n", md, cfg.out_md, cfg.out_json);
}

}  // namespace hax
