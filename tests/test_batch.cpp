// Tests of batching: one sample per row and packed rows.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "tasks/batch.h"
#include "tasks/registry.h"

namespace {

using hax::Batch;
using hax::Sample;

// A synthetic sample of `len` tokens with recognizable ids and an irregular mask.
Sample synthetic(int64_t len, int32_t tag) {
  Sample s;
  for (int64_t t = 0; t < len; ++t) {
    s.tokens.push_back(100 * tag + (int32_t)t);
    s.mask.push_back(t > 0 && (t * 7 + tag) % 3 == 0);
  }
  return s;
}

int64_t positions(const Sample& s) { return std::max<int64_t>((int64_t)s.tokens.size() - 1, 0); }

// Checks a batch against its samples using only the tensors (sample_id locates every sample).
void check_batch(const Batch& b, const std::vector<Sample>& samples, bool packed, int64_t pack_len) {
  const int64_t B = b.inputs.size(0), T = b.inputs.size(1);
  for (const auto* t : {&b.targets, &b.loss_mask, &b.sample_id}) {
    ASSERT_EQ(t->sizes(), b.inputs.sizes());
  }
  EXPECT_EQ(b.inputs.scalar_type(), at::kLong);
  EXPECT_EQ(b.targets.scalar_type(), at::kLong);
  EXPECT_EQ(b.loss_mask.scalar_type(), at::kFloat);
  EXPECT_EQ(b.sample_id.scalar_type(), at::kInt);
  EXPECT_EQ(b.seq_idx.defined(), packed);
  if (packed) {
    ASSERT_EQ(b.seq_idx.sizes(), b.inputs.sizes());
    EXPECT_EQ(b.seq_idx.scalar_type(), at::kInt);
  }
  EXPECT_EQ(b.num_samples, (int64_t)samples.size());
  auto in = b.inputs.accessor<int64_t, 2>();
  auto tg = b.targets.accessor<int64_t, 2>();
  auto lm = b.loss_mask.accessor<float, 2>();
  auto sid = b.sample_id.accessor<int32_t, 2>();
  const at::Tensor seq_idx = packed ? b.seq_idx : at::zeros_like(b.sample_id);
  auto seg = seq_idx.accessor<int32_t, 2>();
  // Where each sample lies: (row, first column, count).
  std::map<int32_t, std::tuple<int64_t, int64_t, int64_t>> where;
  int64_t longest = 0, non_pad = 0;
  for (int64_t r = 0; r < B; ++r) {
    int32_t prev = -1;
    int64_t row_len = 0;
    bool in_padding = false;
    int32_t segment = -1;
    for (int64_t t = 0; t < T; ++t) {
      const int32_t i = sid[r][t];
      if (i < 0) {  // padding: only at the row's end
        in_padding = true;
        EXPECT_EQ(in[r][t], 3);
        EXPECT_EQ(tg[r][t], 3);
        EXPECT_EQ(lm[r][t], 0.f);
        if (packed) {
          EXPECT_EQ(seg[r][t], segment + 1) << "padding segment";
        }
        continue;
      }
      ASSERT_FALSE(in_padding) << "sample after padding in row " << r;
      ASSERT_LT(i, (int32_t)samples.size());
      ++row_len;
      if (i != prev) {
        ASSERT_EQ(where.count(i), 0u) << "sample " << i << " split";
        ASSERT_GT(i, prev) << "samples out of order within row " << r;
        where[i] = {r, t, 0};
        ++segment;
        prev = i;
      }
      auto& [row, first, count] = where[i];
      const Sample& s = samples[i];
      const int64_t p = t - first;
      ASSERT_LT(p + 1, (int64_t)s.tokens.size());
      EXPECT_EQ(in[r][t], s.tokens[p]);
      EXPECT_EQ(tg[r][t], s.tokens[p + 1]) << "targets not shifted by one";
      EXPECT_EQ(lm[r][t], s.mask[p + 1] ? 1.f : 0.f);
      if (packed) {
        EXPECT_EQ(seg[r][t], segment);
      }
      ++count;
    }
    if (packed && row_len > pack_len) {
      // Only a lone sample longer than pack_len may exceed it.
      EXPECT_EQ(segment, 0) << "row " << r << " over pack_len with several samples";
    }
    if (!packed) {
      EXPECT_LE(segment, 0) << "several samples in an unpacked row";
    }
    longest = std::max(longest, row_len);
    non_pad += row_len;
  }
  EXPECT_EQ(longest, T) << "rows padded beyond the longest";
  EXPECT_EQ(non_pad, b.num_tokens);
  for (size_t i = 0; i < samples.size(); ++i) {
    const int64_t n = positions(samples[i]);
    if (n == 0) continue;
    ASSERT_EQ(where.count((int32_t)i), 1u) << "sample " << i << " missing";
    EXPECT_EQ(std::get<2>(where[(int32_t)i]), n) << "sample " << i << " incomplete";
    if (!packed) {
      EXPECT_EQ(std::get<0>(where[(int32_t)i]), (int64_t)i);
    }
  }
  if (!packed) return;
  // First fit: sample i sits in the first row that had room when it came.
  std::vector<int64_t> used(B, 0);
  std::vector<bool> opened(B, false);
  for (size_t i = 0; i < samples.size(); ++i) {
    const int64_t n = positions(samples[i]);
    if (n == 0) continue;
    const int64_t r = std::get<0>(where[(int32_t)i]);
    for (int64_t q = 0; q < r; ++q) {
      EXPECT_TRUE(opened[q]) << "row " << q << " empty before row " << r;
      EXPECT_GT(used[q] + n, pack_len) << "sample " << i << " fit in earlier row " << q;
    }
    if (opened[r]) {
      EXPECT_LE(used[r] + n, pack_len);
    }
    opened[r] = true;
    used[r] += n;
  }
}

TEST(BatchUnpacked, ShapesShiftAndPadding) {
  std::vector<Sample> samples = {synthetic(5, 1), synthetic(1, 2), synthetic(9, 3),
                                 synthetic(3, 4), synthetic(2, 5)};
  const Batch b = hax::make_batch(samples);
  EXPECT_EQ(b.inputs.sizes(), (at::IntArrayRef{5, 8}));
  EXPECT_EQ(b.num_tokens, 4 + 0 + 8 + 2 + 1);
  check_batch(b, samples, false, 0);
  EXPECT_EQ(b.inputs[2][7].item<int64_t>(), 307);
  EXPECT_EQ(b.targets[2][7].item<int64_t>(), 308);
  EXPECT_EQ(b.inputs[0][4].item<int64_t>(), 3);
}

TEST(BatchUnpacked, CustomPadAndEmpty) {
  std::vector<Sample> samples = {synthetic(4, 1), synthetic(6, 2)};
  const Batch b = hax::make_batch(samples, 0);
  EXPECT_EQ(b.inputs[0][4].item<int64_t>(), 0);
  EXPECT_EQ(b.targets[0][3].item<int64_t>(), 0);
  const Batch e = hax::make_batch({});
  EXPECT_EQ(e.inputs.size(0), 0);
  EXPECT_EQ(e.num_tokens, 0);
}

TEST(BatchPacked, FirstFitAwkwardLengths) {
  // Input positions 4, 7, 3, 12 (over pack_len), 6, 1, 0, 2 with pack_len 10.
  std::vector<Sample> samples;
  int32_t tag = 1;
  for (int64_t n : {4, 7, 3, 12, 6, 1, 0, 2}) samples.push_back(synthetic(n + 1, tag++));
  const Batch b = hax::make_packed_batch(samples, 10);
  check_batch(b, samples, true, 10);
  // rows: {4,3,1,2} {7} {12} {6}
  EXPECT_EQ(b.inputs.size(0), 4);
  EXPECT_EQ(b.inputs.size(1), 12);
  EXPECT_EQ(b.num_tokens, 4 + 7 + 3 + 12 + 6 + 1 + 2);
}

TEST(BatchPacked, RealSamplesRespectPackLen) {
  auto task = hax::make_task(hax::TaskConfig{});
  std::vector<Sample> samples;
  int64_t supervised = 0;
  for (int64_t i = 0; i < 37; ++i) {
    samples.push_back(task->sample(1, i * 5));
    supervised += (int64_t)samples.back().params["n_c"] * (int64_t)samples.back().params["n_k"];
  }
  for (int64_t pack_len : {1057, 1500, 4099}) {
    const Batch b = hax::make_packed_batch(samples, pack_len);
    check_batch(b, samples, true, pack_len);
    EXPECT_LE(b.inputs.size(1), pack_len);
    EXPECT_EQ(b.loss_mask.sum().item<double>(), supervised);
  }
  const Batch one = hax::make_packed_batch(samples, 100);  // every sample alone
  check_batch(one, samples, true, 100);
  EXPECT_EQ(one.inputs.size(0), 37);
  const Batch u = hax::make_batch(samples);
  check_batch(u, samples, false, 0);
  EXPECT_EQ(u.loss_mask.sum().item<double>(), supervised);
}

TEST(BatchPacked, PackFlagOverload) {
  std::vector<Sample> samples = {synthetic(4, 1), synthetic(6, 2), synthetic(3, 3)};
  const Batch packed = hax::make_batch(samples, true, 8);
  check_batch(packed, samples, true, 8);
  EXPECT_EQ(packed.inputs.size(0), 2);
  const Batch rows = hax::make_batch(samples, false, 8);
  check_batch(rows, samples, false, 0);
  EXPECT_EQ(rows.inputs.size(0), 3);
}

TEST(BatchPacked, InvalidPackLen) {
  EXPECT_THROW(hax::make_packed_batch({synthetic(3, 1)}, 0), hax::UsageError);
}

TEST(Batch, PerSampleAccuracy) {
  std::vector<Sample> samples;
  for (int32_t i = 0; i < 9; ++i) samples.push_back(synthetic(6 + 5 * (i % 4), i + 1));
  samples.push_back(synthetic(2, 21));  // mask[1] = 0: no supervised position
  for (bool packed : {false, true}) {
    const Batch b = packed ? hax::make_packed_batch(samples, 33) : hax::make_batch(samples);
    // Predictions: right except where (input + column) % 4 == 0.
    at::Tensor wrong = (b.inputs + at::arange(b.inputs.size(1))).remainder(4) == 0;
    at::Tensor correct = wrong.logical_not();
    const at::Tensor acc = hax::per_sample_accuracy(b, correct);
    ASSERT_EQ(acc.size(0), (int64_t)samples.size());
    // Expected, from the layout: find each sample's start by scanning sample_id.
    auto sid = b.sample_id.accessor<int32_t, 2>();
    auto cor = correct.accessor<bool, 2>();
    std::vector<double> hits(samples.size(), 0), count(samples.size(), 0);
    for (int64_t r = 0; r < b.inputs.size(0); ++r) {
      for (int64_t t = 0; t < b.inputs.size(1); ++t) {
        const int32_t i = sid[r][t];
        if (i < 0 || b.loss_mask[r][t].item<float>() == 0) continue;
        hits[i] += cor[r][t];
        count[i] += 1;
      }
    }
    for (size_t i = 0; i + 1 < samples.size(); ++i) {
      ASSERT_GT(count[i], 0);
      EXPECT_DOUBLE_EQ(acc[i].item<double>(), hits[i] / count[i]) << "sample " << i;
    }
    EXPECT_TRUE(std::isnan(acc[samples.size() - 1].item<double>()));
    // The host-made weights give the same sum of per-sample accuracies from the supervised
    // positions alone (what the training loss computes on a GPU without a read-back).
    double expect = 0;
    for (size_t i = 0; i + 1 < samples.size(); ++i) expect += hits[i] / count[i];
    ASSERT_EQ(b.supervised_weight.numel(), b.supervised.numel());
    const at::Tensor c_sup = correct.reshape({-1}).index_select(0, b.supervised);
    EXPECT_NEAR((c_sup * b.supervised_weight).sum().item<double>(), expect, 1e-12);
    EXPECT_NEAR(b.supervised_weight.sum().item<double>(), (double)b.supervised_samples, 1e-12);
    EXPECT_EQ(b.supervised_samples, (int64_t)samples.size() - 1);
  }
}

}  // namespace
