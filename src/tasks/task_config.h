// The configuration of a synthetic task: which task and its size ranges.
//
// One plain struct for every task; each task reads only its own fields, and validate() checks only
// the fields of the chosen task. Errors name the command-line flag (given in each comment).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace hax {

struct TaskConfig {
  // --task: which task. "joint_recall" (multi-query joint recall, 2 levels: contexts and keys),
  // "multilevel" (multi-level joint recall with --levels levels; 1 level = associative recall),
  // "mqar" (Zoology's multi-query associative recall) or "niah" (needle in a haystack, RULER-style
  // variants). Default "joint_recall".
  std::string name = "joint_recall";

  // ---- joint recall / multilevel ----------------------------------------------------------------
  // --levels: number of levels w, the last level being the keys. Example 3; default 2. Must be 2
  // for "joint_recall".
  int64_t levels = 2;
  // --nc-min / --nc-max: range of the number of contexts n_c per sample (inclusive). For w > 2 every
  // context level (1..w-1) uses this range unless --level-min/--level-max are given. Default 5..16.
  int64_t nc_min = 5;
  int64_t nc_max = 16;
  // --nk-min / --nk-max: range of the number of keys n_k per context (the last level). Default 5..16.
  int64_t nk_min = 5;
  int64_t nk_max = 16;
  // --level-min / --level-max: per-level size ranges, level 1 (outermost context) first; when given
  // they override --nc-*/--nk-* and must have exactly --levels entries. Example "2,3,4" / "4,4,6";
  // default empty.
  std::vector<int64_t> level_min;
  std::vector<int64_t> level_max;
  // --level-vocab: number of distinct ids of each level (a sample of size n uses the first n).
  // Empty: 16 per level, or the level's maximum size when larger; one entry: the same for every
  // level; else exactly --levels entries. Must be >= each level's maximum size. Example "16,16".
  std::vector<int64_t> level_vocab;
  // --num-values: number of distinct value tokens (ids 10..10+num_values-1). Default 16.
  int64_t num_values = 16;

  // ---- mqar ---------------------------------------------------------------------------------------
  // --mqar-vocab: vocabulary size V; keys come from [1, V/2), values from [V/2, V), filler from
  // [0, V). Default 8192 (Zoology).
  int64_t vocab_size = 8192;
  // --seq-len: model input length of mqar and niah; a sample has seq_len + 1 tokens. Example 16384;
  // default 256.
  int64_t seq_len = 256;
  // --kv-min / --kv-max: range of the number of key-value pairs; sample i has
  // kv_min + i mod (kv_max - kv_min + 1) pairs. Needs seq_len >= 4 * kv_max. Default 4..64.
  int64_t kv_min = 4;
  int64_t kv_max = 64;
  // --power-a: exponent a of the query-gap law p(g) ∝ a * g^(a-1), g = 1..space; small a puts most
  // queries right after the context. Must be > 0. Default 0.01 (Zoology).
  double power_a = 0.01;

  // ---- niah (tasks/niah.h; --seq-len sets its length) -----------------------------------------------
  // --niah-variant: "single" (one needle, queried), "multikey" (--niah-needles needles with distinct
  // keys, one queried), "multivalue" (one key in --niah-values needles, every passkey queried in
  // haystack order) or "multiquery" (--niah-needles needles, all queried). Default "single".
  std::string niah_variant = "single";
  // --niah-needles: needles of multikey and multiquery (distinct keys). Example 8; default 4.
  int64_t niah_needles = 4;
  // --niah-values: passkeys of multivalue's one key, one needle each. Example 3; default 4.
  int64_t niah_values = 4;
  // --niah-key-len: key tokens per needle. Default 2.
  int64_t niah_key_len = 2;
  // --niah-value-len: passkey digits per needle (the supervised tokens of one answer). Default 4.
  int64_t niah_value_len = 4;
  // --niah-key-vocab: distinct key tokens (ids from 20). Default 16 (256 distinct 2-token keys).
  int64_t niah_key_vocab = 16;
  // --niah-vocab: distinct filler tokens (ids after the key tokens). Default 64 (vocabulary 100).
  int64_t niah_vocab = 64;
  // --niah-depth: where the queried needles sit: a fixed depth in [0, 1] (0 = right after bos,
  // 1 = right before the query section), or negative for a uniformly random place per needle and
  // sample (the training default). Example 0.5; default -1.
  double niah_depth = -1;

  // Throws hax::UsageError naming the flag, the value and the constraint for an invalid setting.
  void validate() const;

  // Resolved per-level ranges and id vocabularies of joint recall / multilevel (levels entries,
  // level 1 first), from --level-min/--level-max or else --nc-*/--nk-*.
  std::vector<int64_t> level_min_sizes() const;
  std::vector<int64_t> level_max_sizes() const;
  std::vector<int64_t> level_vocab_sizes() const;

  // The chosen task's resolved settings (what Task::describe() reports); not for round trips.
  nlohmann::json describe() const;
};

// Every field, for checkpoints and run directories; task_config_from_json(task_config_to_json(c))
// == c. Keys are the field names.
nlohmann::json task_config_to_json(const TaskConfig& config);
// Missing keys keep their defaults; an unknown key or a value of the wrong type throws
// hax::UsageError naming it. Does not validate.
TaskConfig task_config_from_json(const nlohmann::json& j);

}  // namespace hax
