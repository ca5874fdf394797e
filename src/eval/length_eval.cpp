#include "eval/length_eval.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/peak_memory.h"
#include "core/rng.h"
#include "tasks/registry.h"

namespace hax {

namespace {

// derive_seed stream of the length grid's samples (distinct from the tasks' and the splits' streams).
constexpr uint64_t kLengthEvalStream = 0x4C45'0001;

std::string depth_label(double d) { return std::isnan(d) ? std::string("all") : fmt::format("{:g}", d); }

// The task's variant in words, for titles: "niah single", "mqar".
std::string task_words(const nlohmann::json& desc) {
  std::string s = desc.value("name", std::string("?"));
  if (desc.contains("variant")) s += " " + desc["variant"].get<std::string>();
  return s;
}

}  // namespace

bool task_has_length(const TaskConfig& task) { return task.name == "mqar" || task.name == "niah"; }
bool task_has_depth(const TaskConfig& task) { return task.name == "niah"; }

TaskConfig length_eval_task(const TaskConfig& task, int64_t length, double depth) {
  HAX_CHECK(task_has_length(task),
            "--lengths: task {} has no --seq-len to vary (its length follows its sizes); length grids need mqar or "
            "niah",
            task.name);
  TaskConfig c = task;
  c.seq_len = length;
  if (!std::isnan(depth)) {
    HAX_CHECK(task_has_depth(task), "--depths: task {} has no needle depth", task.name);
    HAX_CHECK(depth >= 0 && depth <= 1, "--depths: depth {} must be in [0, 1]", depth);
    c.niah_depth = depth;
  }
  try {
    c.validate();
  } catch (const UsageError& e) {
    fail("--lengths: length {} is not valid for task {}: {}", length, task.name, e.what());
  }
  return c;
}

std::vector<int64_t> length_eval_indices(int64_t n, int64_t grid_size) {
  std::vector<int64_t> out(std::max<int64_t>(n, 0));
  for (int64_t j = 0; j < n; ++j) out[j] = n >= grid_size ? j : j * grid_size / n;
  return out;
}

LengthEvalGrid length_eval(LanguageModel& model, const TaskConfig& task, const LengthEvalConfig& cfg,
                           const std::function<void(const LengthEvalCell&)>& on_cell) {
  HAX_CHECK(!cfg.lengths.empty(), "--lengths must list at least one length");
  HAX_CHECK(cfg.n >= 1, "--n {} must be >= 1 (samples per cell)", cfg.n);
  HAX_CHECK(cfg.batch_size >= 1, "--batch-size {} must be >= 1", cfg.batch_size);
  HAX_CHECK(cfg.max_batch_tokens >= 1, "--max-batch-tokens {} must be >= 1", cfg.max_batch_tokens);
  for (int64_t L : cfg.lengths) HAX_CHECK(L >= 1, "--lengths: length {} must be positive", L);
  for (double d : cfg.depths)
    HAX_CHECK(std::isfinite(d) && d >= 0 && d <= 1, "--depths: depth {} must be in [0, 1]", d);

  LengthEvalGrid grid;
  grid.task = task.name;
  grid.task_config = make_task(task)->describe();
  grid.lengths = cfg.lengths;
  grid.depths = task_has_depth(task) && !cfg.depths.empty() ? cfg.depths : std::vector<double>{std::nan("")};
  grid.n = cfg.n;
  grid.seed = cfg.seed;

  // Validate every cell (and the vocabulary) before running any.
  std::vector<TaskConfig> configs;
  for (int64_t L : grid.lengths) {
    for (double d : grid.depths) {
      configs.push_back(length_eval_task(task, L, d));
      const auto t = make_task(configs.back());
      HAX_CHECK(model.config().vocab_size >= t->min_vocab(),
                "the model's vocabulary ({}) is smaller than task {}'s ({})", model.config().vocab_size, t->name(),
                t->min_vocab());
    }
  }

  size_t k = 0;
  for (int64_t L : grid.lengths) {
    for (double d : grid.depths) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto task_at = make_task(configs[k++]);
      const uint64_t sample_seed = derive_seed(cfg.seed, kLengthEvalStream, (uint64_t)L);
      std::vector<Sample> samples;
      samples.reserve(cfg.n);
      for (int64_t index : length_eval_indices(cfg.n, task_at->grid_size()))
        samples.push_back(task_at->sample(sample_seed, index));
      LengthEvalCell cell;
      cell.length = L;
      cell.depth = d;
      cell.batch_size = std::clamp<int64_t>(cfg.max_batch_tokens / L, 1, cfg.batch_size);
      cell.peak_memory_bytes = peak_memory_added(
          [&] { cell.result = evaluate(model, samples, cell.batch_size, false, L, cfg.seed); });
      cell.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      grid.cells.push_back(cell);
      if (on_cell) on_cell(grid.cells.back());
    }
  }
  return grid;
}

std::string length_label(int64_t length) {
  if (length >= (1 << 20) && length % (1 << 20) == 0) return fmt::format("{}M", length >> 20);
  if (length >= 1024 && length % 1024 == 0) return fmt::format("{}K", length >> 10);
  return std::to_string(length);
}

nlohmann::json length_eval_json(const LengthEvalGrid& g) {
  nlohmann::json depths = nlohmann::json::array(), acc = nlohmann::json::array(), cells = nlohmann::json::array();
  for (double d : g.depths) depths.push_back(std::isnan(d) ? nlohmann::json(nullptr) : nlohmann::json(d));
  for (size_t r = 0; r < g.lengths.size(); ++r) {
    nlohmann::json row = nlohmann::json::array();
    for (size_t c = 0; c < g.depths.size(); ++c) {
      const LengthEvalCell& cell = g.at(r, c);
      row.push_back(cell.result.accuracy);
      cells.push_back({{"length", cell.length},
                       {"depth", depths[c]},
                       {"accuracy", cell.result.accuracy},
                       {"loss", cell.result.loss},
                       {"samples", cell.result.samples},
                       {"positions", cell.result.positions},
                       {"batch_size", cell.batch_size},
                       {"seconds", cell.seconds},
                       {"peak_memory_bytes", cell.peak_memory_bytes}});
    }
    acc.push_back(row);
  }
  return {{"task", g.task_config}, {"n", g.n},         {"seed", g.seed},         {"lengths", g.lengths},
          {"depths", depths},      {"accuracy", acc}, {"cells", cells}};
}

std::string length_eval_table(const LengthEvalGrid& g) {
  const bool depths = !(g.depths.size() == 1 && std::isnan(g.depths[0]));
  const bool mean = g.depths.size() > 1;
  std::string s = fmt::format("{:>8}", "length");
  for (double d : g.depths) s += fmt::format(" {:>8}", depths ? "d=" + depth_label(d) : std::string("acc %"));
  if (mean) s += fmt::format(" {:>8}", "mean");
  s += "\n";
  for (size_t r = 0; r < g.lengths.size(); ++r) {
    s += fmt::format("{:>8}", length_label(g.lengths[r]));
    double sum = 0;
    for (size_t c = 0; c < g.depths.size(); ++c) {
      const double a = g.at(r, c).result.accuracy;
      sum += a;
      s += fmt::format(" {:>8.1f}", 100 * a);
    }
    if (mean) s += fmt::format(" {:>8.1f}", 100 * sum / g.depths.size());
    s += "\n";
  }
  return s;
}

Heatmap length_eval_heatmap(const LengthEvalGrid& g, const std::string& title) {
  Heatmap h;
  h.title = title;
  h.subtitle = fmt::format("task {}: accuracy (%), {} samples per cell", task_words(g.task_config), g.n);
  h.row_title = "length (tokens)";
  const bool depths = !(g.depths.size() == 1 && std::isnan(g.depths[0]));
  h.col_title = depths ? "needle depth (0 = start, 1 = end)" : "";
  for (int64_t L : g.lengths) h.rows.push_back(length_label(L));
  for (double d : g.depths) h.cols.push_back(depth_label(d));
  for (const auto& cell : g.cells) {
    h.values.push_back(cell.result.samples > 0 ? cell.result.accuracy : std::nan(""));
    h.notes.push_back(fmt::format("length {}{}: {:.1f}% of {} samples, loss {:.4f}", cell.length,
                                  std::isnan(cell.depth) ? std::string() : fmt::format(", depth {:g}", cell.depth),
                                  100 * cell.result.accuracy, cell.result.samples, cell.result.loss));
  }
  return h;
}

}  // namespace hax
