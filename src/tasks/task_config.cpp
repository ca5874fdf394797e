#include "tasks/task_config.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "tasks/niah.h"

namespace hax {

namespace {

// Longest sequence any task may produce (token positions are int32 in batches).
constexpr double kMaxTokens = 1u << 30;

// Flag that sets the minimum (or maximum) size of `level` (0-based) of a w-level config.
std::string level_flag(const TaskConfig& c, size_t level, bool is_max) {
  const bool explicit_ranges = is_max ? !c.level_max.empty() : !c.level_min.empty();
  if (explicit_ranges) return fmt::format("--level-{} (level {})", is_max ? "max" : "min", level + 1);
  const bool keys = level + 1 == (size_t)c.levels;
  return fmt::format("--n{}-{}", keys ? "k" : "c", is_max ? "max" : "min");
}

void validate_joint_recall(const TaskConfig& c) {
  HAX_CHECK(c.levels >= 1, "--levels {} must be >= 1", c.levels);
  HAX_CHECK(c.levels <= 16, "--levels {} must be <= 16", c.levels);
  HAX_CHECK(c.name != "joint_recall" || c.levels == 2,
            "--levels {} is not valid for --task joint_recall (2 levels: contexts and keys); use "
            "--task multilevel",
            c.levels);
  HAX_CHECK(c.level_min.empty() || (int64_t)c.level_min.size() == c.levels,
            "--level-min has {} entries, must have one per level (--levels {})", c.level_min.size(),
            c.levels);
  HAX_CHECK(c.level_max.empty() || (int64_t)c.level_max.size() == c.levels,
            "--level-max has {} entries, must have one per level (--levels {})", c.level_max.size(),
            c.levels);
  HAX_CHECK(c.level_vocab.empty() || c.level_vocab.size() == 1 ||
                (int64_t)c.level_vocab.size() == c.levels,
            "--level-vocab has {} entries, must have 1 or one per level (--levels {})",
            c.level_vocab.size(), c.levels);
  HAX_CHECK(c.num_values >= 1, "--num-values {} must be >= 1", c.num_values);
  HAX_CHECK(c.num_values <= (1 << 20), "--num-values {} must be <= {}", c.num_values, 1 << 20);
  const auto lo = c.level_min_sizes(), hi = c.level_max_sizes(), vocab = c.level_vocab_sizes();
  double info = 0;  // longest information section, built from the last level up
  for (size_t l = lo.size(); l-- > 0;) {
    HAX_CHECK(lo[l] >= 1, "{} {} must be >= 1", level_flag(c, l, false), lo[l]);
    HAX_CHECK(lo[l] <= hi[l], "{} {} must be <= {} {}", level_flag(c, l, false), lo[l],
              level_flag(c, l, true), hi[l]);
    HAX_CHECK(vocab[l] >= hi[l],
              "--level-vocab {} (level {}) must be >= that level's maximum size {} {}", vocab[l],
              l + 1, level_flag(c, l, true), hi[l]);
    HAX_CHECK(vocab[l] <= (1 << 20), "--level-vocab {} (level {}) must be <= {}", vocab[l], l + 1,
              1 << 20);
    info = l + 1 == lo.size() ? 2.0 * hi[l] : hi[l] * (1 + info);
  }
  HAX_CHECK(2 + 2 * info <= kMaxTokens,
            "--levels {} with maximum sizes {} gives samples of {:.0f} tokens, more than {:.0f}",
            c.levels, nlohmann::json(hi).dump(), 2 + 2 * info, kMaxTokens);
}

void validate_mqar(const TaskConfig& c) {
  HAX_CHECK(c.kv_min >= 1, "--kv-min {} must be >= 1", c.kv_min);
  HAX_CHECK(c.kv_min <= c.kv_max, "--kv-min {} must be <= --kv-max {}", c.kv_min, c.kv_max);
  HAX_CHECK(c.seq_len >= 1, "--seq-len {} must be >= 1", c.seq_len);
  HAX_CHECK(c.seq_len <= kMaxTokens - 1, "--seq-len {} must be <= {:.0f}", c.seq_len,
            kMaxTokens - 1);
  HAX_CHECK(c.seq_len >= 4 * c.kv_max,
            "--seq-len {} is too short for --kv-max {}: the {} context tokens and {} query slots of "
            "2 tokens need seq_len >= 4 * kv = {}",
            c.seq_len, c.kv_max, 2 * c.kv_max, c.kv_max, 4 * c.kv_max);
  HAX_CHECK(c.vocab_size <= INT32_MAX, "--mqar-vocab {} must be <= {}", c.vocab_size, INT32_MAX);
  HAX_CHECK(c.vocab_size / 2 - 1 >= c.kv_max,
            "--mqar-vocab {} is too small for --kv-max {}: distinct keys come from [1, V/2) and "
            "distinct values from [V/2, V), which needs V >= 2 * kv + 2 = {}",
            c.vocab_size, c.kv_max, 2 * c.kv_max + 2);
  HAX_CHECK(std::isfinite(c.power_a) && c.power_a > 0, "--power-a {} must be > 0 and finite",
            c.power_a);
}

void validate_niah(const TaskConfig& c) {
  const auto& v = c.niah_variant;
  HAX_CHECK(v == "single" || v == "multikey" || v == "multivalue" || v == "multiquery",
            "--niah-variant '{}' is unknown (choose single, multikey, multivalue or multiquery)", v);
  HAX_CHECK(c.niah_key_len >= 1 && c.niah_key_len <= 64, "--niah-key-len {} must be in [1, 64]",
            c.niah_key_len);
  HAX_CHECK(c.niah_value_len >= 1 && c.niah_value_len <= 64, "--niah-value-len {} must be in [1, 64]",
            c.niah_value_len);
  HAX_CHECK(c.niah_key_vocab >= 1 && c.niah_key_vocab <= (1 << 20), "--niah-key-vocab {} must be in [1, {}]",
            c.niah_key_vocab, 1 << 20);
  HAX_CHECK(c.niah_vocab >= 1 && c.niah_vocab <= (1 << 20), "--niah-vocab {} must be in [1, {}]", c.niah_vocab,
            1 << 20);
  const bool many_keys = v == "multikey" || v == "multiquery";
  if (many_keys) {
    HAX_CHECK(c.niah_needles >= 1 && c.niah_needles <= (1 << 16),
              "--niah-needles {} must be in [1, {}] for --niah-variant {}", c.niah_needles, 1 << 16, v);
    const double keys = std::pow((double)c.niah_key_vocab, (double)c.niah_key_len);
    HAX_CHECK(keys >= (double)c.niah_needles,
              "--niah-needles {} needs that many distinct keys, but --niah-key-vocab {} with --niah-key-len {} "
              "gives only {:.0f}",
              c.niah_needles, c.niah_key_vocab, c.niah_key_len, keys);
  }
  if (v == "multivalue")
    HAX_CHECK(c.niah_values >= 1 && c.niah_values <= (1 << 16),
              "--niah-values {} must be in [1, {}] for --niah-variant multivalue", c.niah_values, 1 << 16);
  HAX_CHECK(std::isfinite(c.niah_depth) && c.niah_depth <= 1,
            "--niah-depth {} must be <= 1: a fixed depth in [0, 1] (0 = start, 1 = end), or negative for a "
            "random depth per sample",
            c.niah_depth);
  HAX_CHECK(c.seq_len <= kMaxTokens - 1, "--seq-len {} must be <= {:.0f}", c.seq_len, kMaxTokens - 1);
  const NiahShape s = niah_shape(c);
  const std::string sizes =
      v == "multikey" || v == "multiquery" ? fmt::format(" --niah-needles {}", c.niah_needles)
      : v == "multivalue"                  ? fmt::format(" --niah-values {}", c.niah_values)
                                           : std::string();
  HAX_CHECK(c.seq_len >= s.min_seq_len(),
            "--seq-len {} is too short for --niah-variant {}{}: {} needles of {} tokens, a query section of {} "
            "tokens{} need seq_len >= {}",
            c.seq_len, v, sizes, s.needles, s.needle_len, s.query_len,
            s.min_filler ? fmt::format(" and {} filler tokens (so the distractors fit around the queried "
                                       "needle at any depth)",
                                       s.min_filler)
                         : std::string(),
            s.min_seq_len());
}

}  // namespace

void TaskConfig::validate() const {
  if (name == "joint_recall" || name == "multilevel") {
    validate_joint_recall(*this);
  } else if (name == "mqar") {
    validate_mqar(*this);
  } else if (name == "niah") {
    validate_niah(*this);
  } else {
    fail("--task '{}' is not a task (choose joint_recall, multilevel, mqar or niah)", name);
  }
}

std::vector<int64_t> TaskConfig::level_min_sizes() const {
  if (!level_min.empty()) return level_min;
  std::vector<int64_t> v(std::max<int64_t>(levels, 0), nc_min);
  if (!v.empty()) v.back() = nk_min;
  return v;
}

std::vector<int64_t> TaskConfig::level_max_sizes() const {
  if (!level_max.empty()) return level_max;
  std::vector<int64_t> v(std::max<int64_t>(levels, 0), nc_max);
  if (!v.empty()) v.back() = nk_max;
  return v;
}

std::vector<int64_t> TaskConfig::level_vocab_sizes() const {
  const size_t w = std::max<int64_t>(levels, 0);
  if (level_vocab.size() == 1) return std::vector<int64_t>(w, level_vocab[0]);
  if (!level_vocab.empty()) return level_vocab;
  auto v = level_max_sizes();
  for (auto& x : v) x = std::max<int64_t>(16, x);
  return v;
}

nlohmann::json TaskConfig::describe() const {
  nlohmann::json j = {{"name", name}};
  if (name == "mqar") {
    j.update({{"vocab_size", vocab_size},
              {"seq_len", seq_len},
              {"kv_min", kv_min},
              {"kv_max", kv_max},
              {"power_a", power_a}});
  } else if (name == "niah") {
    j.update({{"variant", niah_variant}, {"seq_len", seq_len}});
    if (niah_variant == "multikey" || niah_variant == "multiquery") j["needles"] = niah_needles;
    if (niah_variant == "multivalue") j["values"] = niah_values;
    j.update({{"key_len", niah_key_len},
              {"value_len", niah_value_len},
              {"key_vocab", niah_key_vocab},
              {"filler_vocab", niah_vocab},
              {"depth", niah_depth}});
  } else {
    j.update({{"levels", levels},
              {"level_min", level_min_sizes()},
              {"level_max", level_max_sizes()},
              {"level_vocab", level_vocab_sizes()},
              {"num_values", num_values}});
  }
  return j;
}

// The fields, once, for both directions of the JSON round trip.
template <class Config, class F>
void for_each_field(Config& c, F&& f) {
  f("name", c.name);
  f("levels", c.levels);
  f("nc_min", c.nc_min);
  f("nc_max", c.nc_max);
  f("nk_min", c.nk_min);
  f("nk_max", c.nk_max);
  f("level_min", c.level_min);
  f("level_max", c.level_max);
  f("level_vocab", c.level_vocab);
  f("num_values", c.num_values);
  f("vocab_size", c.vocab_size);
  f("seq_len", c.seq_len);
  f("kv_min", c.kv_min);
  f("kv_max", c.kv_max);
  f("power_a", c.power_a);
  f("niah_variant", c.niah_variant);
  f("niah_needles", c.niah_needles);
  f("niah_values", c.niah_values);
  f("niah_key_len", c.niah_key_len);
  f("niah_value_len", c.niah_value_len);
  f("niah_key_vocab", c.niah_key_vocab);
  f("niah_vocab", c.niah_vocab);
  f("niah_depth", c.niah_depth);
}

nlohmann::json task_config_to_json(const TaskConfig& config) {
  nlohmann::json j = nlohmann::json::object();
  for_each_field(config, [&](const char* key, const auto& value) { j[key] = value; });
  return j;
}

TaskConfig task_config_from_json(const nlohmann::json& j) {
  HAX_CHECK(j.is_object(), "task config JSON must be an object, got {}", j.dump());
  TaskConfig c;
  size_t known = 0;
  for_each_field(c, [&](const char* key, auto& value) {
    auto it = j.find(key);
    if (it == j.end()) return;
    ++known;
    try {
      it->get_to(value);
    } catch (const nlohmann::json::exception&) {
      fail("task config key '{}' has a value of the wrong type: {}", key, it->dump());
    }
  });
  if (known != j.size()) {
    const auto fields = task_config_to_json(TaskConfig{});
    for (auto it = j.begin(); it != j.end(); ++it)
      HAX_CHECK(fields.contains(it.key()), "task config has an unknown key '{}'", it.key());
  }
  return c;
}

}  // namespace hax
