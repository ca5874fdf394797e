// Tests of the synthetic tasks (joint recall, multilevel, MQAR), their config and the splits (NIAH:
// test_niah.cpp).
// Every layout property is checked by an independent parser written here, not by fixed outputs.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>
#include <set>

#include "core/error.h"
#include "tasks/joint_recall.h"
#include "tasks/mqar.h"
#include "tasks/registry.h"
#include "tasks/splits.h"
#include "task_checks.h"

namespace {

using hax::Sample;
using hax::TaskConfig;

// ---- an independent parser of (multi-level) joint recall -----------------------------------------

struct Layout {
  std::vector<int64_t> sizes;  // n_1..n_w
  std::vector<int64_t> base;   // first token id of each level
  int64_t num_values = 16;
};

// Ids by the documented rule: values from 10, then the last level, then the one above, ...
Layout layout_for(const std::vector<int64_t>& sizes, const std::vector<int64_t>& vocab,
                  int64_t num_values) {
  Layout L{sizes, std::vector<int64_t>(sizes.size()), num_values};
  int64_t next = 10 + num_values;
  for (int l = (int)sizes.size() - 1; l >= 0; --l) {
    L.base[l] = next;
    next += vocab[l];
  }
  return L;
}

struct Section {
  std::map<std::vector<int>, int> table;  // (i_1..i_w) -> value index
  std::vector<size_t> value_positions;
  std::vector<std::vector<int>> block_orders;  // the id order of every block, in order of appearance
};

// Parses the nested blocks of `level` starting at tokens[pos]; checks every block is a permutation
// of the first n_l ids of its level and every value is a value token.
void parse_block(const std::vector<int32_t>& tok, size_t& pos, const Layout& L, size_t level,
                 std::vector<int>& path, Section& out) {
  std::set<int> seen;
  std::vector<int> order;
  for (int64_t j = 0; j < L.sizes[level]; ++j) {
    ASSERT_LT(pos, tok.size());
    const int i = tok[pos++] - (int)L.base[level];
    ASSERT_GE(i, 0) << "level " << level << " id at " << pos - 1;
    ASSERT_LT(i, L.sizes[level]) << "level " << level << " id at " << pos - 1;
    ASSERT_TRUE(seen.insert(i).second) << "id repeated in a block at " << pos - 1;
    order.push_back(i);
    path.push_back(i);
    if (level + 1 == L.sizes.size()) {
      ASSERT_LT(pos, tok.size());
      const int v = tok[pos] - 10;
      ASSERT_GE(v, 0);
      ASSERT_LT(v, L.num_values);
      out.value_positions.push_back(pos);
      out.table[path] = v;
      ++pos;
    } else {
      parse_block(tok, pos, L, level + 1, path, out);
      if (::testing::Test::HasFatalFailure()) return;
    }
    path.pop_back();
  }
  out.block_orders.push_back(order);
}

// Checks the whole sample: bos, info section, sep, query section with the same table, the mask.
void check_joint_recall(const Sample& s, const Layout& L) {
  const auto& tok = s.tokens;
  ASSERT_EQ(tok.size(), s.mask.size());
  int64_t entries = 1, section = 0, prefix = 1;
  for (auto n : L.sizes) {
    prefix *= n;
    section += prefix;  // one id token per node of the level
  }
  entries = prefix;
  section += entries;  // one value token per leaf
  ASSERT_EQ((int64_t)tok.size(), 2 + 2 * section);
  ASSERT_EQ(tok[0], 1);
  ASSERT_EQ(tok[1 + section], 4) << "sep position";
  Section info, query;
  std::vector<int> path;
  size_t pos = 1;
  parse_block(tok, pos, L, 0, path, info);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_EQ(pos, (size_t)(1 + section));
  pos = 2 + section;
  parse_block(tok, pos, L, 0, path, query);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_EQ(pos, tok.size());
  ASSERT_EQ((int64_t)info.table.size(), entries);
  EXPECT_EQ(info.table, query.table) << "values differ between the sections";
  std::set<size_t> supervised(query.value_positions.begin(), query.value_positions.end());
  int64_t count = 0;
  for (size_t t = 0; t < tok.size(); ++t) {
    EXPECT_EQ(s.mask[t] != 0, supervised.count(t) > 0) << "mask at " << t;
    count += s.mask[t];
  }
  EXPECT_EQ(count, entries);
  EXPECT_EQ(s.params["sizes"].get<std::vector<int64_t>>(), L.sizes);
}

std::unique_ptr<hax::Task> make(const TaskConfig& c) { return hax::make_task(c); }

// ---- joint recall -------------------------------------------------------------------------------

TEST(TaskJointRecall, DefaultsMatchThePaper) {
  auto task = make(TaskConfig{});
  EXPECT_EQ(task->name(), "joint_recall");
  EXPECT_EQ(task->min_vocab(), 58);
  EXPECT_EQ(task->max_length(), 2 + 2 * 16 * (2 * 16 + 1));
  EXPECT_EQ(task->max_length(), 1058);
  // Index 143 is the last grid cell, 16 x 16.
  const Sample s = task->sample(7, 143);
  EXPECT_EQ(s.params["n_c"], 16);
  EXPECT_EQ(s.params["n_k"], 16);
  EXPECT_EQ((int64_t)s.tokens.size(), 1058);
  std::set<int32_t> ids(s.tokens.begin(), s.tokens.end());
  for (int32_t t : ids) EXPECT_TRUE(t == 1 || t == 4 || (t >= 10 && t <= 57)) << t;
  for (int32_t t = 26; t <= 57; ++t) EXPECT_TRUE(ids.count(t)) << "id " << t << " unused";
  check_joint_recall(s, layout_for({16, 16}, {16, 16}, 16));
}

TEST(TaskJointRecall, ExactLayoutAtManySizes) {
  auto task = make(TaskConfig{});
  for (int64_t index : {0, 1, 13, 77, 142, 143, 144 * 5 + 31}) {
    const Sample s = task->sample(123, index);
    const int64_t nc = s.params["n_c"], nk = s.params["n_k"];
    EXPECT_EQ((int64_t)s.tokens.size(), 2 + 2 * nc * (2 * nk + 1));
    EXPECT_EQ(s.tokens[1 + nc * (2 * nk + 1)], 4);
    check_joint_recall(s, layout_for({nc, nk}, {16, 16}, 16));
    // Each section: every context once, right after it the keys of its block.
    for (int sec = 0; sec < 2; ++sec) {
      const size_t start = sec == 0 ? 1 : 2 + nc * (2 * nk + 1);
      std::set<int32_t> contexts;
      for (int64_t c = 0; c < nc; ++c) {
        const size_t b = start + c * (2 * nk + 1);
        EXPECT_GE(s.tokens[b], 42);
        EXPECT_LT(s.tokens[b], 42 + nc);
        contexts.insert(s.tokens[b]);
        std::set<int32_t> keys;
        for (int64_t k = 0; k < nk; ++k) {
          const int32_t key = s.tokens[b + 1 + 2 * k], value = s.tokens[b + 2 + 2 * k];
          EXPECT_GE(key, 26);
          EXPECT_LT(key, 26 + nk);
          EXPECT_GE(value, 10);
          EXPECT_LE(value, 25);
          keys.insert(key);
        }
        EXPECT_EQ((int64_t)keys.size(), nk);
      }
      EXPECT_EQ((int64_t)contexts.size(), nc);
    }
  }
}

TEST(TaskJointRecall, AwkwardSizesAndVocab) {
  TaskConfig c;
  c.nc_min = 3, c.nc_max = 7, c.nk_min = 2, c.nk_max = 9, c.num_values = 5;
  c.level_vocab = {11, 13};
  auto task = make(c);
  EXPECT_EQ(task->min_vocab(), 10 + 5 + 13 + 11);
  EXPECT_EQ(task->max_length(), 2 + 2 * 7 * (2 * 9 + 1));
  for (int64_t index = 0; index < 40; ++index) {
    const Sample s = task->sample(5, index);
    check_joint_recall(s, layout_for(s.params["sizes"].get<std::vector<int64_t>>(), {11, 13}, 5));
    if (HasFatalFailure()) return;
  }
}

TEST(TaskJointRecall, GridCyclesWithFirstLevelSlowest) {
  auto task = make(TaskConfig{});
  std::set<std::pair<int, int>> pairs;
  for (int64_t i = 1000; i < 1000 + 144; ++i) {
    const Sample s = task->sample(3, i);
    pairs.insert({s.params["n_c"].get<int>(), s.params["n_k"].get<int>()});
  }
  EXPECT_EQ(pairs.size(), 144u);
  for (auto [nc, nk] : pairs) {
    EXPECT_TRUE(nc >= 5 && nc <= 16 && nk >= 5 && nk <= 16);
  }
  EXPECT_EQ(task->sample(3, 0).params["sizes"], nlohmann::json({5, 5}));
  EXPECT_EQ(task->sample(3, 1).params["sizes"], nlohmann::json({5, 6}));
  EXPECT_EQ(task->sample(3, 12).params["sizes"], nlohmann::json({6, 5}));
  EXPECT_EQ(task->sample(3, 144 + 12).params["sizes"], nlohmann::json({6, 5}));
}

TEST(TaskJointRecall, ValuesRoughlyUniform) {
  auto task = make(TaskConfig{});
  std::vector<int64_t> counts(16, 0);
  int64_t total = 0;
  for (int64_t i = 0; i < 288; ++i) {
    const Sample s = task->sample(11, i);
    for (size_t t = 0; t < s.tokens.size(); ++t) {
      if (!s.mask[t]) continue;
      ++counts[s.tokens[t] - 10];
      ++total;
    }
  }
  const double expected = total / 16.0;  // about 2,400 each: sd ~ 48
  for (int v = 0; v < 16; ++v) EXPECT_NEAR(counts[v], expected, 0.1 * expected) << "value " << v;
}

TEST(TaskJointRecall, FreshPermutationPerBlock) {
  auto task = make(TaskConfig{});
  const Sample s = task->sample(2, 143);  // 16 x 16
  Section info, query;
  std::vector<int> path;
  const Layout L = layout_for({16, 16}, {16, 16}, 16);
  size_t pos = 1;
  parse_block(s.tokens, pos, L, 0, path, info);
  pos += 1;
  parse_block(s.tokens, pos, L, 0, path, query);
  ASSERT_FALSE(HasFatalFailure());
  // block_orders: 16 key blocks, then the context block.
  std::set<std::vector<int>> key_orders(info.block_orders.begin(), info.block_orders.end() - 1);
  EXPECT_GT(key_orders.size(), 12u) << "key blocks share permutations";
  EXPECT_NE(info.block_orders.back(), query.block_orders.back()) << "context order not reshuffled";
  EXPECT_NE(info.block_orders, query.block_orders);
}

TEST(TaskJointRecall, Deterministic) {
  auto task = make(TaskConfig{});
  for (int64_t i : {0, 57, 1000003}) {
    const Sample a = task->sample(42, i), b = task->sample(42, i);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.mask, b.mask);
    EXPECT_EQ(a.params, b.params);
    EXPECT_NE(a.tokens, task->sample(43, i).tokens);
    EXPECT_EQ(a.params, task->sample(43, i).params);
    EXPECT_NE(a.tokens, task->sample(42, i + 144).tokens);  // same cell, different sample
  }
  // A second instance from the same config gives the same data.
  EXPECT_EQ(make(TaskConfig{})->sample(9, 9).tokens, task->sample(9, 9).tokens);
}

// ---- multilevel -----------------------------------------------------------------------------------

TEST(TaskMultilevel, OneLevelIsAssociativeRecall) {
  TaskConfig c;
  c.name = "multilevel", c.levels = 1, c.nk_min = 3, c.nk_max = 11, c.num_values = 7;
  auto task = make(c);
  EXPECT_EQ(task->name(), "multilevel");
  EXPECT_EQ(task->min_vocab(), 10 + 7 + 16);
  EXPECT_EQ(task->max_length(), 2 + 2 * 2 * 11);
  for (int64_t i = 0; i < 9; ++i) {
    const Sample s = task->sample(1, i);
    const int64_t n = 3 + i;
    EXPECT_EQ(s.params["sizes"], nlohmann::json({n}));
    ASSERT_EQ((int64_t)s.tokens.size(), 2 + 4 * n);
    EXPECT_EQ(s.tokens[1 + 2 * n], 4);
    for (int64_t k = 0; k < n; ++k) {  // key, value pairs in both sections
      EXPECT_GE(s.tokens[1 + 2 * k], 17);
      EXPECT_LT(s.tokens[1 + 2 * k], 17 + n);
      EXPECT_GE(s.tokens[2 + 2 * k], 10);
      EXPECT_LT(s.tokens[2 + 2 * k], 17);
    }
    check_joint_recall(s, layout_for({n}, {16}, 7));
  }
}

TEST(TaskMultilevel, ThreeLevelsAwkward) {
  TaskConfig c;
  c.name = "multilevel", c.levels = 3;
  c.level_min = {2, 1, 3};
  c.level_max = {3, 4, 5};
  c.level_vocab = {5, 4, 7};
  c.num_values = 6;
  auto task = make(c);
  // values 10..15, keys (level 3) 16..22, level 2 23..26, level 1 27..31.
  EXPECT_EQ(task->min_vocab(), 32);
  EXPECT_EQ(task->max_length(), 2 + 2 * (3 + 3 * 4 + 2 * 3 * 4 * 5));
  std::set<std::vector<int64_t>> cells;
  for (int64_t i = 0; i < 24; ++i) {
    const Sample s = task->sample(77, 48 + i);
    const auto n = s.params["sizes"].get<std::vector<int64_t>>();
    cells.insert(n);
    EXPECT_EQ((int64_t)s.tokens.size(), 2 + 2 * (n[0] + n[0] * n[1] + 2 * n[0] * n[1] * n[2]));
    check_joint_recall(s, layout_for(n, {5, 4, 7}, 6));
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(cells.size(), 24u);  // 2 * 4 * 3 combinations, each once
  EXPECT_EQ(task->sample(0, 0).params["sizes"], nlohmann::json({2, 1, 3}));
  EXPECT_EQ(task->sample(0, 1).params["sizes"], nlohmann::json({2, 1, 4}));
  EXPECT_EQ(task->sample(0, 3).params["sizes"], nlohmann::json({2, 2, 3}));
  EXPECT_EQ(task->sample(0, 12).params["sizes"], nlohmann::json({3, 1, 3}));
}

TEST(TaskMultilevel, ThreeLevelsFromNcNk) {
  TaskConfig c;
  c.name = "multilevel", c.levels = 3, c.nc_min = 2, c.nc_max = 3, c.nk_min = 4, c.nk_max = 4;
  auto task = make(c);
  EXPECT_EQ(task->min_vocab(), 10 + 16 + 3 * 16);  // keys 26..41, level 2 42..57, level 1 58..73
  const Sample s = task->sample(1, 3);
  EXPECT_EQ(s.params["sizes"], nlohmann::json({3, 3, 4}));
  check_joint_recall(s, layout_for({3, 3, 4}, {16, 16, 16}, 16));
}

// ---- MQAR -----------------------------------------------------------------------------------------

// Checks Zoology's layout with teacher forcing; returns the query gap of each key in context order.
std::vector<int64_t> check_mqar(const Sample& s, int64_t V, int64_t seq_len, int64_t kv) {
  std::vector<int64_t> gaps(kv, -1);
  EXPECT_EQ((int64_t)s.tokens.size(), seq_len + 1);
  EXPECT_EQ(s.mask.size(), s.tokens.size());
  EXPECT_EQ(s.params["num_kv_pairs"], kv);
  EXPECT_EQ(s.params["seq_len"], seq_len);
  std::map<int32_t, int64_t> key_index;
  std::set<int32_t> values;
  for (int64_t i = 0; i < kv; ++i) {
    const int32_t k = s.tokens[2 * i], v = s.tokens[2 * i + 1];
    EXPECT_TRUE(k >= 1 && k < V / 2) << k;
    EXPECT_TRUE(v >= V / 2 && v < V) << v;
    EXPECT_TRUE(key_index.emplace(k, i).second) << "key repeated";
    EXPECT_TRUE(values.insert(v).second) << "value repeated";
    EXPECT_EQ(s.mask[2 * i], 0);
    EXPECT_EQ(s.mask[2 * i + 1], 0);
  }
  const int64_t space = (seq_len - 2 * kv) / 2;
  int64_t supervised = 0;
  for (int64_t t = 2 * kv; t <= seq_len; ++t) {
    EXPECT_TRUE(s.tokens[t] >= 0 && s.tokens[t] < V);
    if (!s.mask[t]) continue;
    ++supervised;
    const int64_t offset = t - 1 - 2 * kv;
    EXPECT_EQ(offset % 2, 0) << "query at odd offset";
    EXPECT_LT(offset / 2, space);
    auto it = key_index.find(s.tokens[t - 1]);
    if (it == key_index.end()) {
      ADD_FAILURE() << "masked position " << t << " does not follow a key";
      continue;
    }
    EXPECT_EQ(s.tokens[t], s.tokens[2 * it->second + 1]) << "wrong value for key";
    EXPECT_EQ(gaps[it->second], -1) << "key queried twice";
    gaps[it->second] = offset / 2;
  }
  EXPECT_EQ(supervised, kv);
  for (auto g : gaps) EXPECT_GE(g, 0) << "key never queried";
  return gaps;
}

TEST(TaskMqar, Layout) {
  TaskConfig c;
  c.name = "mqar", c.vocab_size = 1001, c.seq_len = 203, c.kv_min = 3, c.kv_max = 50;
  auto task = make(c);
  EXPECT_EQ(task->name(), "mqar");
  EXPECT_EQ(task->min_vocab(), 1001);
  EXPECT_EQ(task->max_length(), 204);
  for (int64_t i = 0; i < 96; ++i) check_mqar(task->sample(4, i), 1001, 203, 3 + i % 48);
  // Tight fit: seq_len = 4 * kv and V = 2 * kv + 2 (every key and value id used).
  c.vocab_size = 2 * 50 + 2, c.seq_len = 200, c.kv_min = 50;
  auto tight = make(c);
  for (int64_t i = 0; i < 5; ++i) check_mqar(tight->sample(4, i), 102, 200, 50);
}

TEST(TaskMqar, DeterministicAndSeeded) {
  TaskConfig c;
  c.name = "mqar";
  auto task = make(c);
  const Sample a = task->sample(1, 17);
  EXPECT_EQ(a.tokens, task->sample(1, 17).tokens);
  EXPECT_EQ(a.mask, task->sample(1, 17).mask);
  EXPECT_NE(a.tokens, task->sample(2, 17).tokens);
  EXPECT_EQ(a.params, task->sample(2, 17).params);
  EXPECT_EQ(a.params["num_kv_pairs"], 4 + 17);
}

TEST(TaskMqar, LongSequencesAreFast) {
  TaskConfig c;
  c.name = "mqar", c.seq_len = 16384, c.kv_min = 512, c.kv_max = 512;
  auto task = make(c);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < 20; ++i) check_mqar(task->sample(9, i), 8192, 16384, 512);
  const double s16k = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s16k, 2.0) << "20 samples of 16K tokens (with checks)";
  c.seq_len = 131072;  // space ~ 65K gaps
  auto longer = make(c);
  const auto t1 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < 5; ++i) longer->sample(9, i);
  const double s128k = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  EXPECT_LT(s128k, 2.0) << "5 samples of 128K tokens";
  check_mqar(longer->sample(9, 5), 8192, 131072, 512);
}

TEST(TaskMqar, FiveHundredTwelvePairs) {
  // The DMA setting: 512 pairs at 4K and 16K tokens, and every pair count up to 512 in one grid.
  TaskConfig c;
  c.name = "mqar", c.kv_min = 512, c.kv_max = 512, c.seq_len = 4096;
  auto task = make(c);
  EXPECT_EQ(task->grid_size(), 1);
  for (int64_t i = 0; i < 5; ++i) check_mqar(task->sample(2, i), 8192, 4096, 512);
  // Tightest fit: seq_len = 4 * 512 (every query slot used) and V = 2 * 512 + 2 (every id used).
  c.seq_len = 2048, c.vocab_size = 1026;
  auto tight = make(c);
  for (int64_t i = 0; i < 3; ++i) {
    const auto gaps = check_mqar(tight->sample(2, i), 1026, 2048, 512);
    EXPECT_EQ(std::set<int64_t>(gaps.begin(), gaps.end()).size(), 512u);
  }
  c.vocab_size = 1025;
  EXPECT_THROW(c.validate(), hax::UsageError);
  // A range of pair counts: the grid has 512 cells, index 511 holds 512 pairs.
  c.vocab_size = 8192, c.seq_len = 16384, c.kv_min = 1;
  auto range = make(c);
  EXPECT_EQ(range->grid_size(), 512);
  check_mqar(range->sample(4, 511), 8192, 16384, 512);
  check_mqar(range->sample(4, 512 + 63), 8192, 16384, 64);
  const Sample a = range->sample(4, 1023);
  EXPECT_EQ(a.tokens, range->sample(4, 1023).tokens);
  EXPECT_NE(a.tokens, range->sample(5, 1023).tokens);
  // 64K tokens with 512 pairs: generation is O(seq_len).
  c.kv_min = 512, c.seq_len = 65536;
  auto longest = make(c);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < 10; ++i) longest->sample(9, i);
  const double s64k = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s64k, 2.0) << "10 samples of 64K tokens with 512 pairs";
  check_mqar(longest->sample(9, 10), 8192, 65536, 512);
}

TEST(TaskMqar, PowerLawGaps) {
  // The first key gets the first gap drawn, which must follow p(g) ∝ (g+1)^(a-1) exactly.
  TaskConfig c;
  c.name = "mqar", c.vocab_size = 64, c.seq_len = 72, c.kv_min = 4, c.kv_max = 4, c.power_a = 0.3;
  auto task = make(c);
  const int64_t space = (72 - 8) / 2, n = 20000;
  std::vector<double> p(space);
  double sum = 0;
  for (int64_t g = 0; g < space; ++g) sum += p[g] = std::pow(g + 1.0, c.power_a - 1);
  // Buckets [0,1), [1,3), [3,8), [8,space): expected vs observed frequency of the first key's gap.
  const std::vector<int64_t> edges = {0, 1, 3, 8, space};
  std::vector<int64_t> observed(4, 0);
  int64_t early = 0, late = 0;  // over all keys: first vs last quarter of the query region
  for (int64_t i = 0; i < n; ++i) {
    const auto gaps = check_mqar(task->sample(6, i), 64, 72, 4);
    for (int b = 0; b < 4; ++b) observed[b] += gaps[0] >= edges[b] && gaps[0] < edges[b + 1];
    for (auto g : gaps) early += g < space / 4, late += g >= 3 * space / 4;
    if (HasFailure()) return;
  }
  for (int b = 0; b < 4; ++b) {
    double q = 0;
    for (int64_t g = edges[b]; g < edges[b + 1]; ++g) q += p[g] / sum;
    const double sd = std::sqrt(n * q * (1 - q));
    EXPECT_NEAR(observed[b], n * q, 5 * sd) << "bucket " << b;
  }
  EXPECT_GT(early, 2 * late);
  // With Zoology's a = 0.01 the skew is strong.
  c.power_a = 0.01, c.vocab_size = 8192, c.seq_len = 1024, c.kv_min = c.kv_max = 16;
  auto zoology = make(c);
  early = late = 0;
  for (int64_t i = 0; i < 200; ++i) {
    for (auto g : check_mqar(zoology->sample(6, i), 8192, 1024, 16)) {
      early += g < (1024 - 32) / 2 / 4;
      late += g >= 3 * (1024 - 32) / 2 / 4;
    }
  }
  EXPECT_GT(early, 3 * late);
}

// ---- config, registry ---------------------------------------------------------------------------

using hax::testing::expect_invalid;

TEST(TaskConfig, ValidDefaults) {
  for (const auto& name : hax::task_names()) {
    TaskConfig c;
    c.name = name;
    EXPECT_NO_THROW(c.validate()) << name;
    EXPECT_EQ(hax::make_task(c)->name(), name);
  }
  EXPECT_EQ(hax::task_names(), (std::vector<std::string>{"joint_recall", "multilevel", "mqar", "niah"}));
  // Fields of other tasks are not checked.
  TaskConfig mqar;
  mqar.name = "mqar", mqar.nc_min = 0;
  EXPECT_NO_THROW(mqar.validate());
  TaskConfig jr;
  jr.kv_min = 0;
  EXPECT_NO_THROW(jr.validate());
  // Without --level-vocab, a level larger than 16 gets as many ids as its maximum size.
  TaskConfig big;
  big.nc_max = 20;
  EXPECT_EQ(hax::make_task(big)->min_vocab(), 10 + 16 + 16 + 20);
}

TEST(TaskConfig, JointRecallErrors) {
  TaskConfig c;
  c.name = "recall";
  expect_invalid(c, {"--task", "recall", "joint_recall"});
  c = {}, c.levels = 3;
  expect_invalid(c, {"--levels 3", "--task joint_recall", "multilevel"});
  c = {}, c.name = "multilevel", c.levels = 0;
  expect_invalid(c, {"--levels 0", ">= 1"});
  c = {}, c.name = "multilevel", c.levels = 17;
  expect_invalid(c, {"--levels 17", "<= 16"});
  c = {}, c.nc_min = 0;
  expect_invalid(c, {"--nc-min 0", ">= 1"});
  c = {}, c.nk_min = -3;
  expect_invalid(c, {"--nk-min -3", ">= 1"});
  c = {}, c.nc_min = 9, c.nc_max = 8;
  expect_invalid(c, {"--nc-min 9", "--nc-max 8"});
  c = {}, c.nk_min = 12, c.nk_max = 11;
  expect_invalid(c, {"--nk-min 12", "--nk-max 11"});
  c = {}, c.nc_max = 17, c.level_vocab = {16};
  expect_invalid(c, {"--level-vocab 16", "level 1", "--nc-max 17"});
  c = {}, c.nk_max = 13, c.level_vocab = {16, 12};
  expect_invalid(c, {"--level-vocab 12", "level 2", "--nk-max 13"});
  c = {}, c.level_vocab = {16, 16, 16};
  expect_invalid(c, {"--level-vocab", "3 entries", "--levels 2"});
  c = {}, c.num_values = 0;
  expect_invalid(c, {"--num-values 0", ">= 1"});
  c = {}, c.name = "multilevel", c.levels = 3, c.level_min = {1, 2};
  expect_invalid(c, {"--level-min", "2 entries", "--levels 3"});
  c = {}, c.name = "multilevel", c.levels = 3, c.level_max = {4, 4, 4, 4};
  expect_invalid(c, {"--level-max", "4 entries", "--levels 3"});
  c = {}, c.name = "multilevel", c.levels = 3, c.level_min = {1, 5, 1}, c.level_max = {2, 4, 2};
  expect_invalid(c, {"--level-min (level 2) 5", "--level-max (level 2) 4"});
  c = {}, c.name = "multilevel", c.levels = 3, c.level_min = {1, 0, 1};
  expect_invalid(c, {"--level-min (level 2) 0", ">= 1"});
  c = {}, c.name = "multilevel", c.levels = 8, c.nc_min = c.nk_min = 16;
  expect_invalid(c, {"--levels 8", "tokens"});
}

TEST(TaskConfig, MqarErrors) {
  TaskConfig m;
  m.name = "mqar";
  TaskConfig c = m;
  c.kv_min = 0;
  expect_invalid(c, {"--kv-min 0", ">= 1"});
  c = m, c.kv_min = 65;
  expect_invalid(c, {"--kv-min 65", "--kv-max 64"});
  c = m, c.seq_len = 0;
  expect_invalid(c, {"--seq-len 0", ">= 1"});
  c = m, c.seq_len = 255;
  expect_invalid(c, {"--seq-len 255", "--kv-max 64", "256"});
  c = m, c.vocab_size = 129;
  expect_invalid(c, {"--mqar-vocab 129", "--kv-max 64", "130"});
  c = m, c.vocab_size = 130;
  EXPECT_NO_THROW(c.validate());
  c = m, c.power_a = 0;
  expect_invalid(c, {"--power-a 0", "> 0"});
  c = m, c.power_a = std::nan("");
  expect_invalid(c, {"--power-a nan"});
  c = m, c.kv_max = 512, c.seq_len = 2047;
  expect_invalid(c, {"--seq-len 2047", "--kv-max 512", "2048"});
  c.seq_len = 2048;
  EXPECT_NO_THROW(c.validate());
}

TEST(TaskConfig, JsonRoundTrip) {
  TaskConfig c;
  c.name = "multilevel", c.levels = 3, c.level_min = {1, 2, 3}, c.level_max = {2, 3, 4};
  c.level_vocab = {7}, c.num_values = 9, c.vocab_size = 999, c.seq_len = 77, c.kv_min = 2;
  c.kv_max = 5, c.power_a = 0.123456789;
  const nlohmann::json j = hax::task_config_to_json(c);
  const TaskConfig back = hax::task_config_from_json(nlohmann::json::parse(j.dump()));
  EXPECT_EQ(hax::task_config_to_json(back), j);
  EXPECT_EQ(back.power_a, c.power_a);
  EXPECT_EQ(back.level_min, c.level_min);
  // Missing keys keep defaults; unknown keys and wrong types are errors naming the key.
  EXPECT_EQ(hax::task_config_from_json({{"nc_max", 9}}).nc_max, 9);
  EXPECT_EQ(hax::task_config_from_json({{"nc_max", 9}}).nk_max, 16);
  try {
    hax::task_config_from_json({{"nc_max", 9}, {"n_cmax", 3}});
    ADD_FAILURE() << "unknown key accepted";
  } catch (const hax::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("n_cmax"), std::string::npos) << e.what();
  }
  try {
    hax::task_config_from_json({{"levels", "three"}});
    ADD_FAILURE() << "wrong type accepted";
  } catch (const hax::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("levels"), std::string::npos) << e.what();
  }
  // describe() reports the resolved settings of the chosen task only.
  const auto d = hax::make_task(c)->describe();
  EXPECT_EQ(d["level_vocab"], nlohmann::json({7, 7, 7}));
  EXPECT_FALSE(d.contains("seq_len"));
}

// ---- splits ---------------------------------------------------------------------------------------

TEST(Splits, DistinctBalancedAndTrainAvoidsEval) {
  // Cell (1,1) has only 3 distinct samples (3 values): valid and test take 2, training the 3rd.
  TaskConfig c;
  c.nc_min = 1, c.nc_max = 2, c.nk_min = 1, c.nk_max = 2, c.num_values = 3;
  auto task = make(c);
  const auto eval = hax::make_eval_splits(*task, 5, 4, 4);
  ASSERT_EQ(eval.valid.size(), 4u);
  ASSERT_EQ(eval.test.size(), 4u);
  std::set<std::vector<int32_t>> seen;
  for (const auto* split : {&eval.valid, &eval.test}) {
    for (size_t i = 0; i < split->size(); ++i) {
      const Sample& s = (*split)[i];
      EXPECT_TRUE(seen.insert(s.tokens).second) << "duplicate sample";
      EXPECT_EQ(s.params, task->sample(0, (int64_t)i).params) << "grid cell changed";
      check_joint_recall(s, layout_for(s.params["sizes"].get<std::vector<int64_t>>(), {16, 16}, 3));
    }
  }
  hax::TrainStream train(*task, 5, eval);
  std::set<std::vector<int32_t>> cell11;
  for (int64_t i = 0; i < 400; ++i) {
    const Sample s = train.at(i);
    EXPECT_EQ(seen.count(s.tokens), 0u) << "training sample " << i << " is in valid/test";
    EXPECT_EQ(s.params, task->sample(0, i).params);
    EXPECT_TRUE(train.in_eval(s.tokens) == false);
    if (i % 4 == 0) cell11.insert(s.tokens);
  }
  EXPECT_EQ(cell11.size(), 1u);  // the one (1,1) sample left for training
  EXPECT_TRUE(train.in_eval(eval.test[3].tokens));
  EXPECT_EQ(train.at(17).tokens, train.at(17).tokens);
}

TEST(Splits, LargeConfigSplitsDifferAndRepeat) {
  auto task = make(TaskConfig{});
  const auto a = hax::make_eval_splits(*task, 1, 300, 200);
  const auto b = hax::make_eval_splits(*task, 1, 300, 200);
  ASSERT_EQ(a.valid.size(), 300u);
  ASSERT_EQ(a.test.size(), 200u);
  for (size_t i = 0; i < 300; ++i) EXPECT_EQ(a.valid[i].tokens, b.valid[i].tokens);
  std::set<std::vector<int32_t>> all;
  for (const auto& s : a.valid) all.insert(s.tokens);
  for (const auto& s : a.test) all.insert(s.tokens);
  EXPECT_EQ(all.size(), 500u);
  hax::TrainStream train(*task, 1, a);
  EXPECT_NE(train.at(0).tokens, a.valid[0].tokens);
  EXPECT_NE(train.at(0).tokens, a.test[0].tokens);
  EXPECT_NE(a.valid[0].tokens, a.test[0].tokens);
  EXPECT_NE(hax::make_eval_splits(*task, 2, 1, 0).valid[0].tokens, a.valid[0].tokens);
}

TEST(Splits, TinyConfigFailsClearly) {
  // One cell, one context, one key, two values: exactly 2 distinct samples.
  TaskConfig c;
  c.nc_min = c.nc_max = c.nk_min = c.nk_max = 1, c.num_values = 2;
  auto task = make(c);
  EXPECT_NO_THROW(hax::make_eval_splits(*task, 3, 1, 1));
  EXPECT_NO_THROW(hax::make_eval_splits(*task, 3, 2, 0));
  try {
    hax::make_eval_splits(*task, 3, 2, 1);
    ADD_FAILURE() << "3 distinct samples of a task with 2";
  } catch (const hax::UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("--n-valid 2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--n-test 1"), std::string::npos) << msg;
  }
  const auto full = hax::make_eval_splits(*task, 3, 1, 1);
  hax::TrainStream train(*task, 3, full);
  try {
    train.at(0);
    ADD_FAILURE() << "training sample drawn although valid and test hold every sample";
  } catch (const hax::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--n-valid 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(hax::make_eval_splits(*task, 3, -1, 0), hax::UsageError);
}

TEST(Splits, ThreadCountAndFingerprintsDoNotChangeTheSplits) {
  // Collisions (cell (1,1) has 3 distinct samples) make redraws; blocks are drawn in parallel.
  TaskConfig c;
  c.nc_min = 1, c.nc_max = 2, c.nk_min = 1, c.nk_max = 2, c.num_values = 3;
  auto task = make(c);
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = hax::make_eval_splits(*task, 5, 4, 4);
  at::set_num_threads(2);
  const auto two = hax::make_eval_splits(*task, 5, 4, 4);
  at::set_num_threads(threads);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(one.valid[i].tokens, two.valid[i].tokens);
    EXPECT_EQ(one.test[i].tokens, two.test[i].tokens);
  }
  // Keeping only some samples gives the same ones, and the same training stream.
  TaskConfig m;
  m.name = "mqar", m.seq_len = 64, m.kv_min = 2, m.kv_max = 16;
  auto mqar = make(m);
  const auto full = hax::make_eval_splits(*mqar, 8, 1500, 1300);
  const auto some = hax::eval_fingerprints(*mqar, 8, 1500, 1300, 3, 1100);
  ASSERT_EQ(some.valid.size(), 3u);
  ASSERT_EQ(some.test.size(), 1100u);
  EXPECT_EQ(some.hashes.size(), 2800u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(some.valid[i].tokens, full.valid[i].tokens);
  for (size_t i = 0; i < 1100; ++i) EXPECT_EQ(some.test[i].tokens, full.test[i].tokens);
  const hax::TrainStream a(*mqar, 8, full), b(*mqar, 8, some);
  for (int64_t i : {0, 7, 999}) EXPECT_EQ(a.at(i).tokens, b.at(i).tokens);
  EXPECT_TRUE(b.in_eval(full.test[1299].tokens));
  EXPECT_TRUE(b.in_eval(full.valid[1499].tokens));
}

TEST(Splits, MqarSplits) {
  TaskConfig c;
  c.name = "mqar", c.seq_len = 64, c.kv_min = 2, c.kv_max = 16;
  auto task = make(c);
  const auto eval = hax::make_eval_splits(*task, 8, 45, 30);
  for (size_t i = 0; i < eval.valid.size(); ++i)
    EXPECT_EQ(eval.valid[i].params["num_kv_pairs"], 2 + (int64_t)i % 15);
  hax::TrainStream train(*task, 8, eval);
  EXPECT_FALSE(train.in_eval(train.at(3).tokens));
}

}  // namespace
