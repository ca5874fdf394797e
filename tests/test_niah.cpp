// Tests of the needle-in-a-haystack task: the layout of every variant (checked by an independent
// parser of the documented format), needle depths, determinism, awkward lengths and errors.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>
#include <set>

#include "core/error.h"
#include "tasks/niah.h"
#include "tasks/registry.h"
#include "task_checks.h"

namespace {

using hax::Sample;
using hax::TaskConfig;

TaskConfig niah(const std::string& variant, int64_t seq_len, double depth = -1) {
  TaskConfig c;
  c.name = "niah";
  c.niah_variant = variant;
  c.seq_len = seq_len;
  c.niah_depth = depth;
  return c;
}

// ---- an independent parser of the documented layout ------------------------------------------------

struct Needle {
  int64_t pos = 0;             // position of its N marker
  std::vector<int32_t> key;
  std::vector<int32_t> value;
};

struct Parsed {
  int64_t haystack = 0;                       // R
  std::vector<Needle> needles;                // in haystack order
  std::vector<std::vector<int32_t>> queries;  // queried keys, in order
  std::vector<std::vector<int32_t>> answers;  // the answer digits of each query
  std::set<int64_t> answer_positions;
  std::map<int32_t, int64_t> filler_counts;
};

// Query section length by the documented rule.
int64_t query_len(const TaskConfig& c) {
  const int64_t one = c.niah_key_len + 2 + c.niah_value_len;
  if (c.niah_variant == "multivalue") return c.niah_key_len + 2 + c.niah_values * c.niah_value_len;
  if (c.niah_variant == "multiquery") return c.niah_needles * one;
  return one;
}

int64_t needle_count(const TaskConfig& c) {
  if (c.niah_variant == "single") return 1;
  if (c.niah_variant == "multivalue") return c.niah_values;
  return c.niah_needles;
}

bool is_key(const TaskConfig& c, int32_t t) { return t >= 20 && t < 20 + c.niah_key_vocab; }
bool is_digit(int32_t t) { return t >= 10 && t < 20; }
bool is_filler(const TaskConfig& c, int32_t t) {
  return t >= 20 + c.niah_key_vocab && t < 20 + c.niah_key_vocab + c.niah_vocab;
}

// Parses and checks the token-level format and the mask; the variant's semantics are checked by
// check_niah below.
Parsed parse_niah(const Sample& s, const TaskConfig& c) {
  Parsed p;
  const auto& tok = s.tokens;
  EXPECT_EQ((int64_t)tok.size(), c.seq_len + 1);
  EXPECT_EQ(s.mask.size(), tok.size());
  if ((int64_t)tok.size() != c.seq_len + 1 || s.mask.size() != tok.size()) return p;
  EXPECT_EQ(tok[0], 1) << "bos";
  const int64_t K = c.niah_key_len, P = c.niah_value_len;
  p.haystack = c.seq_len - query_len(c);
  const int64_t R = p.haystack;
  for (int64_t t = 1; t <= R;) {
    if (tok[t] == 5) {
      Needle n;
      n.pos = t++;
      for (int64_t k = 0; k < K; ++k, ++t) {
        EXPECT_TRUE(t <= R && is_key(c, tok[t])) << "needle key token at " << t;
        n.key.push_back(tok[t]);
      }
      EXPECT_EQ(tok[t], 6) << "value marker at " << t;
      ++t;
      for (int64_t k = 0; k < P; ++k, ++t) {
        EXPECT_TRUE(t <= R && is_digit(tok[t])) << "needle digit at " << t;
        n.value.push_back(tok[t]);
      }
      p.needles.push_back(n);
      continue;
    }
    EXPECT_TRUE(is_filler(c, tok[t])) << "token " << tok[t] << " at " << t << " is no filler";
    ++p.filler_counts[tok[t]];
    ++t;
  }
  // Query section.
  int64_t t = 1 + R;
  const int64_t T = c.seq_len + 1;
  while (t < T) {
    EXPECT_EQ(tok[t], 7) << "query marker at " << t;
    ++t;
    std::vector<int32_t> key(tok.begin() + t, tok.begin() + std::min(T, t + K));
    for (auto k : key) EXPECT_TRUE(is_key(c, k));
    t += K;
    EXPECT_EQ(tok[t], 6) << "query value marker at " << t;
    ++t;
    const int64_t digits = c.niah_variant == "multivalue" ? c.niah_values * P : P;
    std::vector<int32_t> answer;
    for (int64_t k = 0; k < digits && t < T; ++k, ++t) {
      EXPECT_TRUE(is_digit(tok[t])) << "answer digit at " << t;
      answer.push_back(tok[t]);
      p.answer_positions.insert(t);
    }
    p.queries.push_back(key);
    p.answers.push_back(answer);
  }
  EXPECT_EQ(t, T);
  for (int64_t i = 0; i < T; ++i) EXPECT_EQ(s.mask[i] != 0, p.answer_positions.count(i) > 0) << "mask at " << i;
  return p;
}

// The needle index (haystack order) with this key; -1 if none, -2 if several.
int64_t find_key(const Parsed& p, const std::vector<int32_t>& key) {
  int64_t found = -1;
  for (size_t i = 0; i < p.needles.size(); ++i)
    if (p.needles[i].key == key) found = found == -1 ? (int64_t)i : -2;
  return found;
}

// Checks the layout and the variant's semantics; with a fixed depth, also the position of the
// queried needles. Returns the parse.
Parsed check_niah(const Sample& s, const TaskConfig& c) {
  Parsed p = parse_niah(s, c);
  const int64_t m = needle_count(c), Ln = c.niah_key_len + c.niah_value_len + 2;
  EXPECT_EQ((int64_t)p.needles.size(), m);
  if ((int64_t)p.needles.size() != m) return p;
  std::vector<int64_t> queried;  // needle indices in query order
  if (c.niah_variant == "multivalue") {
    EXPECT_EQ(p.queries.size(), 1u);
    for (const auto& n : p.needles) EXPECT_EQ(n.key, p.queries[0]) << "multivalue needles share the queried key";
    std::vector<int32_t> expected;
    for (const auto& n : p.needles) expected.insert(expected.end(), n.value.begin(), n.value.end());
    EXPECT_EQ(p.answers[0], expected) << "passkeys not in haystack order";
    for (int64_t i = 0; i < m; ++i) queried.push_back(i);
  } else {
    std::set<std::vector<int32_t>> keys;
    for (const auto& n : p.needles) keys.insert(n.key);
    EXPECT_EQ((int64_t)keys.size(), m) << "keys not distinct";
    EXPECT_EQ((int64_t)p.queries.size(), c.niah_variant == "multiquery" ? m : 1);
    std::set<int64_t> asked;
    for (size_t q = 0; q < p.queries.size(); ++q) {
      const int64_t i = find_key(p, p.queries[q]);
      EXPECT_GE(i, 0) << "queried key is not in the haystack exactly once";
      if (i < 0) return p;
      EXPECT_EQ(p.answers[q], p.needles[i].value) << "wrong passkey for query " << q;
      EXPECT_TRUE(asked.insert(i).second) << "needle queried twice";
      queried.push_back(i);
    }
  }
  // params
  std::vector<int64_t> positions;
  for (const auto& n : p.needles) positions.push_back(n.pos);
  EXPECT_EQ(s.params["variant"], c.niah_variant);
  EXPECT_EQ(s.params["seq_len"], c.seq_len);
  EXPECT_EQ(s.params["needle_positions"].get<std::vector<int64_t>>(), positions);
  EXPECT_EQ(s.params["queried"].get<std::vector<int64_t>>(), queried);
  // Needles never overlap (the parser would have failed) and lie inside the haystack.
  for (const auto& n : p.needles) EXPECT_LE(n.pos + Ln - 1, p.haystack);
  if (c.niah_depth >= 0) {
    // The queried needles form one block of B tokens starting at 1 + d * (R - B), +-1 token.
    const int64_t targets = (int64_t)queried.size(), B = targets * Ln;
    const double expected = 1 + c.niah_depth * (double)(p.haystack - B);
    int64_t first = INT64_MAX, last = 0;
    for (int64_t i : queried) first = std::min(first, p.needles[i].pos), last = std::max(last, p.needles[i].pos);
    EXPECT_LE(std::abs((double)first - expected), 1.0) << "depth " << c.niah_depth << " R " << p.haystack;
    EXPECT_EQ(last - first, (targets - 1) * Ln) << "queried needles not contiguous";
    EXPECT_DOUBLE_EQ(s.params["depth"].get<double>(), c.niah_depth);
  } else {
    const double depth = s.params["depth"].get<double>();
    const int64_t first = p.needles[queried[0]].pos;
    EXPECT_NEAR(depth, p.haystack > Ln ? (double)(first - 1) / (p.haystack - Ln) : 0.0, 1e-12);
  }
  return p;
}

std::unique_ptr<hax::Task> make(const TaskConfig& c) { return hax::make_task(c); }

const std::vector<std::string> kVariants = {"single", "multikey", "multivalue", "multiquery"};

// ---- layout ----------------------------------------------------------------------------------------

TEST(TaskNiah, DefaultsAndVocabulary) {
  auto task = make(niah("single", 256));
  EXPECT_EQ(task->name(), "niah");
  EXPECT_EQ(task->min_vocab(), 100);  // 20 + 16 key ids + 64 filler ids: the default model's vocabulary
  EXPECT_EQ(task->max_length(), 257);
  EXPECT_EQ(task->grid_size(), 1);
  const Sample s = task->sample(1, 0);
  for (int32_t t : s.tokens) EXPECT_TRUE(t >= 0 && t < 100) << t;
  check_niah(s, niah("single", 256));
  const auto d = task->describe();
  EXPECT_EQ(d["name"], "niah");
  EXPECT_EQ(d["variant"], "single");
  EXPECT_EQ(d["seq_len"], 256);
  EXPECT_FALSE(d.contains("needles"));
  TaskConfig c = niah("multikey", 256);
  c.niah_key_vocab = 30, c.niah_vocab = 200;
  EXPECT_EQ(make(c)->min_vocab(), 250);
  EXPECT_EQ(make(c)->describe()["needles"], 4);
}

TEST(TaskNiah, EveryVariantAtFixedDepths) {
  for (const auto& v : kVariants) {
    for (int64_t len : {97, 256, 1025}) {
      for (double d : {0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0}) {
        const TaskConfig c = niah(v, len, d);
        auto task = make(c);
        for (int64_t i = 0; i < 6; ++i) {
          check_niah(task->sample(3, i), c);
          if (HasFailure()) {
            ADD_FAILURE() << v << " seq_len " << len << " depth " << d << " index " << i;
            return;
          }
        }
      }
    }
  }
}

TEST(TaskNiah, EveryVariantAtRandomDepths) {
  for (const auto& v : kVariants) {
    for (int64_t len : {63, 97, 128, 1025}) {
      TaskConfig c = niah(v, len);
      if (v == "multiquery") c.niah_needles = 3;  // 4 need seq_len >= 64
      auto task = make(c);
      for (int64_t i = 0; i < 40; ++i) {
        check_niah(task->sample(5, i), c);
        if (HasFailure()) {
          ADD_FAILURE() << v << " seq_len " << len << " index " << i;
          return;
        }
      }
    }
  }
}

TEST(TaskNiah, DepthEndsAreExact) {
  // Depth 0: the needle right after bos; depth 1: it ends right before the query section.
  const TaskConfig c0 = niah("single", 300, 0), c1 = niah("single", 300, 1);
  const Parsed a = check_niah(make(c0)->sample(1, 2), c0);
  const Parsed b = check_niah(make(c1)->sample(1, 2), c1);
  ASSERT_EQ(a.needles.size(), 1u);
  ASSERT_EQ(b.needles.size(), 1u);
  EXPECT_EQ(a.needles[0].pos, 1);
  EXPECT_EQ(b.needles[0].pos + 8 - 1, b.haystack);
  // Multiquery at depth 1: the block of 4 needles ends at the haystack's end.
  const TaskConfig q = niah("multiquery", 300, 1);
  const Parsed m = check_niah(make(q)->sample(1, 2), q);
  ASSERT_EQ(m.needles.size(), 4u);
  EXPECT_EQ(m.needles.back().pos + 8 - 1, m.haystack);
  EXPECT_EQ(m.needles.front().pos, m.haystack - 4 * 8 + 1);
}

TEST(TaskNiah, SameSampleAtAnotherDepthMovesOnlyTheNeedle) {
  // single: keys, passkey and filler come first from the stream, so only the needle moves.
  const TaskConfig a = niah("single", 200, 0.2), b = niah("single", 200, 0.8);
  const Parsed pa = check_niah(make(a)->sample(9, 4), a), pb = check_niah(make(b)->sample(9, 4), b);
  ASSERT_EQ(pa.needles.size(), 1u);
  ASSERT_EQ(pb.needles.size(), 1u);
  EXPECT_EQ(pa.needles[0].key, pb.needles[0].key);
  EXPECT_EQ(pa.needles[0].value, pb.needles[0].value);
  EXPECT_LT(pa.needles[0].pos, pb.needles[0].pos);
}

TEST(TaskNiah, MultikeyDistractorsOnBothSides) {
  TaskConfig c = niah("multikey", 512, 0.5);
  c.niah_needles = 8;
  auto task = make(c);
  int64_t before = 0, after = 0;
  for (int64_t i = 0; i < 50; ++i) {
    const Parsed p = check_niah(task->sample(2, i), c);
    if (HasFailure()) return;
    const int64_t q = find_key(p, p.queries[0]);
    before += q;
    after += (int64_t)p.needles.size() - 1 - q;
  }
  // About 7/2 distractors on each side on average.
  EXPECT_GT(before, 100);
  EXPECT_GT(after, 100);
}

TEST(TaskNiah, RandomDepthsAreUniform) {
  const TaskConfig c = niah("single", 128);
  auto task = make(c);
  std::vector<int64_t> quarter(4, 0);
  const int64_t n = 4000;
  for (int64_t i = 0; i < n; ++i) {
    const double d = task->sample(8, i).params["depth"].get<double>();
    ASSERT_TRUE(d >= 0 && d <= 1) << d;
    ++quarter[std::min<int64_t>(3, (int64_t)(d * 4))];
  }
  for (int q = 0; q < 4; ++q) EXPECT_NEAR(quarter[q], n / 4.0, 5 * std::sqrt(n * 0.25 * 0.75)) << "quarter " << q;
  // multiquery: the query order is not the haystack order.
  const TaskConfig mq = niah("multiquery", 256);
  auto mtask = make(mq);
  int64_t in_order = 0;
  for (int64_t i = 0; i < 50; ++i) {
    const auto queried = mtask->sample(8, i).params["queried"].get<std::vector<int64_t>>();
    in_order += std::is_sorted(queried.begin(), queried.end());
  }
  EXPECT_LT(in_order, 10);  // 1 in 24 by chance
  // ... nor at a fixed depth.
  const TaskConfig mqd = niah("multiquery", 256, 0.5);
  auto dtask = make(mqd);
  in_order = 0;
  for (int64_t i = 0; i < 50; ++i) {
    const auto queried = dtask->sample(8, i).params["queried"].get<std::vector<int64_t>>();
    in_order += std::is_sorted(queried.begin(), queried.end());
  }
  EXPECT_LT(in_order, 10);
}

TEST(TaskNiah, FillerIsRandom) {
  const TaskConfig c = niah("single", 4096);
  auto task = make(c);
  const Parsed a = check_niah(task->sample(1, 0), c), b = check_niah(task->sample(1, 1), c);
  EXPECT_EQ(a.filler_counts.size(), 64u) << "every filler id used";
  for (const auto& [id, count] : a.filler_counts) EXPECT_NEAR(count, (a.haystack - 8) / 64.0, 30) << id;
  EXPECT_NE(task->sample(1, 0).tokens, task->sample(1, 1).tokens);
  EXPECT_NE(a.needles[0].value, b.needles[0].value);  // 1 in 10^4 to be equal by chance
}

TEST(TaskNiah, AwkwardSizes) {
  TaskConfig c = niah("multivalue", 181, 0.37);
  c.niah_values = 3, c.niah_key_len = 1, c.niah_value_len = 7, c.niah_key_vocab = 3, c.niah_vocab = 5;
  for (int64_t i = 0; i < 20; ++i) check_niah(make(c)->sample(4, i), c);
  c.niah_variant = "multiquery", c.niah_needles = 3;  // exactly 3 distinct 1-token keys
  for (int64_t i = 0; i < 20; ++i) check_niah(make(c)->sample(4, i), c);
  c.niah_variant = "multikey", c.niah_depth = -0.5;  // any negative depth is random
  for (int64_t i = 0; i < 20; ++i) check_niah(make(c)->sample(4, i), c);
  c.niah_key_len = 5, c.niah_value_len = 1, c.niah_needles = 9, c.niah_depth = 0.999;
  for (int64_t i = 0; i < 20; ++i) check_niah(make(c)->sample(4, i), c);
}

TEST(TaskNiah, SmallestValidLength) {
  for (const auto& v : kVariants) {
    TaskConfig c = niah(v, 10);
    const hax::NiahShape shape = hax::niah_shape(c);
    const int64_t Ln = 8, m = needle_count(c);
    EXPECT_EQ(shape.needle_len, Ln);
    EXPECT_EQ(shape.query_len, query_len(c));
    EXPECT_EQ(shape.min_seq_len(), m * Ln + query_len(c) + (v == "multikey" ? Ln - 1 : 0)) << v;
    c.seq_len = shape.min_seq_len();
    for (double d : {-1.0, 0.0, 0.3, 0.5, 1.0}) {
      c.niah_depth = d;
      auto task = make(c);
      for (int64_t i = 0; i < 30; ++i) {
        check_niah(task->sample(6, i), c);
        if (HasFailure()) {
          ADD_FAILURE() << v << " depth " << d << " index " << i;
          return;
        }
      }
    }
    c.seq_len -= 1;
    c.niah_depth = -1;
    try {
      c.validate();
      ADD_FAILURE() << v << ": seq_len below the minimum accepted";
    } catch (const hax::UsageError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("--seq-len " + std::to_string(c.seq_len)), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(c.seq_len + 1)), std::string::npos) << msg;
      EXPECT_NE(msg.find("--niah-variant " + v), std::string::npos) << msg;
    }
  }
}

TEST(TaskNiah, LongSequencesAreFast) {
  TaskConfig c = niah("multikey", 65536, 0.5);
  c.niah_needles = 64;
  auto task = make(c);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < 10; ++i) task->sample(1, i);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 2.0) << "10 samples of 64K tokens";
  check_niah(task->sample(1, 10), c);
}

// ---- determinism -----------------------------------------------------------------------------------

TEST(TaskNiah, PureFunctionOfSeedAndIndex) {
  for (const auto& v : kVariants) {
    const TaskConfig c = niah(v, 300);
    auto task = make(c);
    for (int64_t i : {0, 5, 1000003}) {
      const Sample a = task->sample(42, i), b = task->sample(42, i);
      EXPECT_EQ(a.tokens, b.tokens);
      EXPECT_EQ(a.mask, b.mask);
      EXPECT_EQ(a.params, b.params);
      EXPECT_NE(a.tokens, task->sample(43, i).tokens) << v;
      EXPECT_NE(a.tokens, task->sample(42, i + 1).tokens) << v;
    }
    EXPECT_EQ(make(c)->sample(7, 7).tokens, task->sample(7, 7).tokens);  // a second instance agrees
  }
}

// ---- config ----------------------------------------------------------------------------------------

using hax::testing::expect_invalid;

TEST(TaskNiah, Errors) {
  const TaskConfig base = niah("single", 256);
  TaskConfig c = base;
  c.niah_variant = "multi";
  expect_invalid(c, {"--niah-variant 'multi'", "single, multikey, multivalue or multiquery"});
  c = base, c.niah_depth = 1.5;
  expect_invalid(c, {"--niah-depth 1.5", "<= 1"});
  c = base, c.niah_depth = std::nan("");
  expect_invalid(c, {"--niah-depth nan"});
  c = base, c.niah_key_len = 0;
  expect_invalid(c, {"--niah-key-len 0", "[1, 64]"});
  c = base, c.niah_value_len = 65;
  expect_invalid(c, {"--niah-value-len 65", "[1, 64]"});
  c = base, c.niah_key_vocab = 0;
  expect_invalid(c, {"--niah-key-vocab 0"});
  c = base, c.niah_vocab = 0;
  expect_invalid(c, {"--niah-vocab 0"});
  c = niah("multikey", 256), c.niah_needles = 0;
  expect_invalid(c, {"--niah-needles 0", "--niah-variant multikey"});
  c = niah("multiquery", 4096), c.niah_needles = 300;
  expect_invalid(c, {"--niah-needles 300", "--niah-key-vocab 16", "--niah-key-len 2", "256"});
  c.niah_needles = 256;
  EXPECT_NO_THROW(c.validate());
  c = niah("multivalue", 256), c.niah_values = 0;
  expect_invalid(c, {"--niah-values 0"});
  c = niah("multiquery", 100), c.niah_needles = 8;  // 8 needles + 8 queries of 8 tokens = 128
  expect_invalid(c, {"--seq-len 100", "--niah-variant multiquery", "--niah-needles 8", "128"});
  c = niah("multikey", 40);  // 4 needles (32) + query (8) + 7 filler = 47
  expect_invalid(c, {"--seq-len 40", "--niah-needles 4", "47", "filler"});
  c = base, c.seq_len = 15;
  expect_invalid(c, {"--seq-len 15", "16"});
  c = base, c.seq_len = (int64_t)1 << 31;
  expect_invalid(c, {"--seq-len 2147483648"});
  // Fields of the variant not chosen are not checked.
  c = base, c.niah_needles = 0, c.niah_values = 0;
  EXPECT_NO_THROW(c.validate());
  // Nor the NIAH fields by other tasks.
  c = TaskConfig{}, c.niah_depth = 5;
  EXPECT_NO_THROW(c.validate());
}

TEST(TaskNiah, JsonRoundTrip) {
  TaskConfig c = niah("multivalue", 777, 0.123456789);
  c.niah_needles = 5, c.niah_values = 6, c.niah_key_len = 3, c.niah_value_len = 7, c.niah_key_vocab = 11;
  c.niah_vocab = 99;
  const nlohmann::json j = hax::task_config_to_json(c);
  for (const char* key : {"niah_variant", "niah_needles", "niah_values", "niah_key_len", "niah_value_len",
                          "niah_key_vocab", "niah_vocab", "niah_depth"})
    EXPECT_TRUE(j.contains(key)) << key;
  const TaskConfig back = hax::task_config_from_json(nlohmann::json::parse(j.dump()));
  EXPECT_EQ(hax::task_config_to_json(back), j);
  EXPECT_EQ(back.niah_depth, c.niah_depth);
  EXPECT_EQ(back.niah_variant, "multivalue");
  EXPECT_EQ(make(back)->sample(3, 3).tokens, make(c)->sample(3, 3).tokens);
}

}  // namespace
