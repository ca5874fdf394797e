// Key Selection: every query sees the k highest-scoring keys of its causal prefix (ties: the
// earlier position). The selected set changes by at most one key per step, so it is kept
// incrementally: a new key enters when the set is not full, or replaces the current worst member
// when it scores higher. O(L·k) per (b, h), no per-query sort. CUDA scores: cuda/top_k_prefix.cu.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "patterns/cuda_params.h"
#include "patterns/internal.h"
#include "patterns/pattern.h"

namespace hax::patterns {
namespace {

// The incremental top k of one sequence, positions [s, e) of a row whose position i scores
// sc[i * H]: the selected keys, ascending by position, in pos/val (k entries each). Calls
// left(j, i) when key j leaves the set at query i (the query whose set no longer holds it) and
// then seen(i, m, entered) with the set of query i in pos[0 .. m) (entered: key i joined it).
// Returns the size of the set at the sequence's end.
template <class T, class Left, class Seen>
int64_t scan_top_k(const T* sc, int64_t H, int64_t s, int64_t e, int64_t k, std::vector<int32_t>& pos,
                std::vector<double>& val, Left&& left, Seen&& seen) {
  int64_t m = 0;       // number selected
  int64_t worst = -1;  // index in pos/val of the member a newcomer must beat (when m == k)
  for (int64_t i = s; i < e; ++i) {
    double v = (double)sc[i * H];
    if (std::isnan(v)) v = -std::numeric_limits<double>::infinity();  // NaN ranks lowest
    bool changed = false;
    if (m < k) {
      pos[m] = (int32_t)i, val[m] = v, ++m;
      changed = true;
    } else if (v > val[worst]) {
      // Drop the worst member; the newcomer, the latest position, goes last.
      left(pos[worst], i);
      std::move(pos.begin() + worst + 1, pos.begin() + m, pos.begin() + worst);
      std::move(val.begin() + worst + 1, val.begin() + m, val.begin() + worst);
      pos[m - 1] = (int32_t)i, val[m - 1] = v;
      changed = true;
    }
    if (changed && m == k) {
      // The worst: the lowest score, and of equal scores the latest position (earlier wins).
      worst = 0;
      for (int64_t t = 1; t < m; ++t)
        if (val[t] <= val[worst]) worst = t;
    }
    seen(i, m, changed);
  }
  return m;
}

template <class T>
void top_k_kernel(const at::Tensor& scores, int64_t k, const at::Tensor& seq, at::Tensor& idx) {
  const int64_t B = scores.size(0), L = scores.size(1), H = scores.size(2);
  const T* sp = scores.data_ptr<T>();
  int32_t* out = idx.data_ptr<int32_t>();
  detail::for_each_row(B, H, L, seq, L * k, [&](int64_t b, int64_t h, const auto& segs) {
    int32_t* row = out + (b * H + h) * L * k;
    std::vector<int32_t> pos(k);
    std::vector<double> val(k);
    for (const auto& [s, e] : segs)
      scan_top_k(
          sp + b * L * H + h, H, s, e, k, pos, val, [](int32_t, int64_t) {},
          [&](int64_t i, int64_t m, bool) { std::copy(pos.begin(), pos.begin() + m, row + i * k); });
  });
}

// Each row's keys that ever enter their sequence's top k, with the query where each leaves it
// (or the sequence's end), in (key, leave) pairs in rows[b * H + h], ascending by key.
template <class T>
void top_k_intervals_kernel(const at::Tensor& scores, int64_t k, const at::Tensor& seq,
                            std::vector<std::vector<std::pair<int32_t, int32_t>>>& rows) {
  const int64_t B = scores.size(0), L = scores.size(1), H = scores.size(2);
  const T* sp = scores.data_ptr<T>();
  detail::for_each_row(B, H, L, seq, L * k, [&](int64_t b, int64_t h, const auto& segs) {
    auto& out = rows[b * H + h];
    std::vector<int32_t> pos(k), at_of(L, -1);  // at_of[j]: key j's index in out
    std::vector<double> val(k);
    for (const auto& [s, e] : segs) {
      const int64_t m = scan_top_k(
          sp + b * L * H + h, H, s, e, k, pos, val, [&](int32_t j, int64_t i) { out[at_of[j]].second = (int32_t)i; },
          [&](int64_t i, int64_t, bool entered) {
            if (entered) at_of[i] = (int32_t)out.size(), out.push_back({(int32_t)i, -1});
          });
      for (int64_t t = 0; t < m; ++t) out[at_of[pos[t]]].second = (int32_t)e;  // still held at the end
    }
  });
}

// The checks of both entry points: scores (B, L, H) floating, k > 0, sizes that fit.
void check_top_k_inputs(const char* op, const at::Tensor& scores, int64_t k) {
  ops::check_rank(op, "scores", scores, 3, "(B, L, H)");
  ops::check_floating(op, "scores", scores);
  detail::check_positive(op, "k", k);
  detail::check_sizes(op, scores.size(0), scores.size(2), scores.size(1));
}

}  // namespace

KeyLists top_k_prefix(const at::Tensor& scores0, int64_t k, const at::Tensor& seq_idx) {
  constexpr const char* kOp = "top_k_prefix";
  check_top_k_inputs(kOp, scores0, k);
  const int64_t B = scores0.size(0), L = scores0.size(1), H = scores0.size(2);
  // CUDA scores: the kernels of patterns/cuda/top_k_prefix.cu, save for a k (< L) too large for
  // their shared memory, which the CPU loop below serves (the lists then move to the device).
  if (scores0.is_cuda() && (k >= L || k <= kTopKMaxK)) {
    const at::Tensor seq = ops::check_seq_idx(kOp, detail::on(seq_idx, scores0.device()), B, L);
    return {detail::top_k_prefix_device(scores0, k, seq), at::Tensor()};
  }
  const at::Tensor seq = detail::on(ops::check_seq_idx(kOp, seq_idx, B, L), at::kCPU);
  // (float32 and below as float32: the loop reads float or double)
  const at::Tensor scores =
      scores0.detach().to(at::kCPU, scores0.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).contiguous();
  at::Tensor idx = detail::empty_lists(B, H, L, k);
  if (scores.scalar_type() == at::kDouble)
    top_k_kernel<double>(scores, k, seq, idx);
  else
    top_k_kernel<float>(scores, k, seq, idx);
  return {detail::on(idx, scores0.device()), at::Tensor()};
}

}  // namespace hax::patterns

namespace hax::patterns {

static_assert(kTopKBlocksMaxK == kTopKPlanMaxK, "the public and the kernels' limits of the block form");

ops::TileBlocks top_k_prefix_blocks(const at::Tensor& scores, int64_t k, const at::Tensor& seq_idx,
                                    const LshBand* exclude) {
  constexpr const char* kOp = "top_k_prefix_blocks";
  ops::check_rank(kOp, "scores", scores, 3, "(B, L, H)");
  ops::check_floating(kOp, "scores", scores);
  detail::check_positive(kOp, "k", k);
  HAX_CHECK(k <= kTopKPlanMaxK,
            "{}: k = {} must be at most {} (a block's keys, its prefix's top k and its own 64 positions, must fit the "
            "512 of a block); use top_k_prefix's lists",
            kOp, k, kTopKPlanMaxK);
  const int64_t B = scores.size(0), L = scores.size(1), H = scores.size(2);
  detail::check_sizes(kOp, B, H, L);
  if (exclude) {
    ops::check_shape(kOp, "exclude.band", exclude->band, {4, B, H, L}, "(4, B, H, L)");
    HAX_CHECK(exclude->band.device() == scores.device(), "{}: exclude.band is on {} but scores are on {}", kOp,
              exclude->band.device().str(), scores.device().str());
  }
  if (scores.is_cuda() && k < L) {
    const at::Tensor seq = ops::check_seq_idx(kOp, detail::on(seq_idx, scores.device()), B, L);
    return detail::top_k_prefix_blocks_device(scores, k, seq, exclude);
  }
  KeyLists lists = top_k_prefix(scores, k, seq_idx);
  if (exclude) lists = exclude_band(lists, *exclude);
  return ops::tile_blocks_from_lists(lists.idx, L);
}

KeyIntervals top_k_prefix_intervals(const at::Tensor& scores0, int64_t k, const at::Tensor& seq_idx) {
  constexpr const char* kOp = "top_k_prefix_intervals";
  check_top_k_inputs(kOp, scores0, k);
  const int64_t B = scores0.size(0), L = scores0.size(1), H = scores0.size(2);
  // CUDA scores: the kernels of patterns/cuda/top_k_intervals.cu (with the extras), save for the k
  // they do not take, which the CPU loop below serves (its tensors then move to the device).
  if (scores0.is_cuda() && k < L && k <= kTopKMaxK) {
    const at::Tensor seq = ops::check_seq_idx(kOp, detail::on(seq_idx, scores0.device()), B, L);
    return detail::top_k_prefix_intervals_device(scores0, k, seq);
  }
  const at::Tensor seq = detail::on(ops::check_seq_idx(kOp, seq_idx, B, L), at::kCPU);
  // (bfloat16 CUDA scores: their float32 values, exactly.)
  const at::Tensor scores =
      scores0.detach().to(at::kCPU, scores0.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).contiguous();
  std::vector<std::vector<std::pair<int32_t, int32_t>>> rows(B * H);
  if (scores.scalar_type() == at::kDouble)
    top_k_intervals_kernel<double>(scores, k, seq, rows);
  else
    top_k_intervals_kernel<float>(scores, k, seq, rows);
  int64_t most = 0;
  for (const auto& r : rows) most = std::max<int64_t>(most, (int64_t)r.size());
  KeyIntervals iv;
  iv.count = at::empty({B, H}, at::kInt);
  iv.key = at::full({B, H, most}, -1, at::kInt);
  iv.leave = at::full({B, H, most}, -1, at::kInt);
  auto c = iv.count.accessor<int32_t, 2>();
  auto kk = iv.key.accessor<int32_t, 3>();
  auto lv = iv.leave.accessor<int32_t, 3>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const auto& r = rows[b * H + h];
      c[b][h] = (int32_t)r.size();
      for (size_t t = 0; t < r.size(); ++t) kk[b][h][t] = r[t].first, lv[b][h][t] = r[t].second;
    }
  const at::Device dev = scores0.device();
  iv.count = detail::on(iv.count, dev), iv.key = detail::on(iv.key, dev), iv.leave = detail::on(iv.leave, dev);
  iv.k = k;
  return iv;
}

}  // namespace hax::patterns
