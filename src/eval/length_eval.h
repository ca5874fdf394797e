// Length extrapolation: the accuracy of one model on its task at other sequence lengths and, for
// NIAH, at fixed needle depths — the grid of `hax eval --lengths` (rows = lengths, columns = depths),
// meant to be reused by commands that compare checkpoints.
//
// Cell (length L, depth d) evaluates n samples of the task with --seq-len L (and --niah-depth d), the
// task's other settings unchanged. Sample j of every cell of length L is
// task.sample(derive_seed(seed, stream, L), index_j), so the cells of one length share their keys,
// passkeys and filler (for single-needle NIAH only the needle moves); index_j spreads the n samples
// evenly over the task's parameter grid (MQAR's pair counts) when n is smaller than the grid.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "eval/evaluator.h"
#include "eval/heatmap_svg.h"
#include "models/lm.h"
#include "tasks/task_config.h"

namespace hax {

struct LengthEvalConfig {
  // --lengths: model input lengths (seq_len) of the rows, e.g. {1024, 4096, 16384}. Each must be a valid
  // --seq-len for the task; errors name --lengths and the length.
  std::vector<int64_t> lengths;
  // --depths: needle depths of the columns, each in [0, 1], e.g. {0, 0.25, 0.5, 0.75, 1}; NIAH only
  // (ignored by tasks without needles, which get one column). Empty: one column with the task's own
  // --niah-depth (random per sample when negative).
  std::vector<double> depths;
  int64_t n = 20;                     // --n: samples per cell
  int64_t batch_size = 128;           // --batch-size: most samples per batch
  int64_t max_batch_tokens = 65536;   // --max-batch-tokens: most tokens per batch (>= one sample always)
  uint64_t seed = 0;                  // samples' seed, also fixing the model's randomness (LSH hashing)
};

struct LengthEvalCell {
  int64_t length = 0;               // seq_len of the cell
  double depth = std::nan("");      // fixed needle depth; NaN when the column has none
  EvalResult result;                // loss, accuracy, samples, positions
  int64_t batch_size = 0;           // samples per batch used at this length
  double seconds = 0;               // wall time of generating and evaluating the cell
  int64_t peak_memory_bytes = -1;   // resident memory the evaluation added at its peak (CPU); -1: unknown
};

struct LengthEvalGrid {
  std::string task;                   // task name, e.g. "niah"
  nlohmann::json task_config;         // the task's describe() at its own settings
  std::vector<int64_t> lengths;       // (rows)
  std::vector<double> depths;         // (cols); one NaN entry when the task has no depths
  std::vector<LengthEvalCell> cells;  // (rows, cols) row-major
  int64_t n = 0;                      // samples per cell
  uint64_t seed = 0;
  const LengthEvalCell& at(size_t row, size_t col) const { return cells[row * depths.size() + col]; }
};

// Whether the task has a --seq-len to vary (mqar, niah) and needle depths (niah).
bool task_has_length(const TaskConfig& task);
bool task_has_depth(const TaskConfig& task);

// The task config of one cell: `task` with seq_len = length and, unless depth is NaN, niah_depth =
// depth; validated (UsageError naming --lengths or --depths, the value and the task's constraint).
TaskConfig length_eval_task(const TaskConfig& task, int64_t length, double depth);

// The n sample indices of a cell: 0..n-1 when n >= grid_size, else n indices spread evenly over
// 0..grid_size-1.
std::vector<int64_t> length_eval_indices(int64_t n, int64_t grid_size);

// Evaluates `model` (in eval mode, without gradients) on every cell, lengths in the given order.
// Every cell's config is validated before the first one runs. `on_cell` (optional) sees each cell
// as it completes (for progress lines).
LengthEvalGrid length_eval(LanguageModel& model, const TaskConfig& task, const LengthEvalConfig& config,
                           const std::function<void(const LengthEvalCell&)>& on_cell = {});

// "1K" for 1024, "64K", "1M"; a length that is no multiple of 1024 as plain digits ("1000").
std::string length_label(int64_t length);
// The grid as JSON: task, n, seed, lengths, depths (null for none), accuracy as a (rows, cols) matrix
// and one object per cell (length, depth, accuracy, loss, samples, positions, batch_size, seconds,
// peak_memory_bytes).
nlohmann::json length_eval_json(const LengthEvalGrid& grid);
// A plain-text table of accuracy (%) with a row per length and a column per depth (and a mean
// column when there are several depths).
std::string length_eval_table(const LengthEvalGrid& grid);
// The heat map of the grid's accuracies titled `title` (e.g. the checkpoint).
Heatmap length_eval_heatmap(const LengthEvalGrid& grid, const std::string& title);

}  // namespace hax
