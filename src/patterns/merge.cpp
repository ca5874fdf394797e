// Union and difference of two patterns' lists, and the per-query key counts. CUDA lists: cuda/merge_lists.cu.
#include "patterns/internal.h"
#include "patterns/pattern.h"

#include <limits>

namespace hax::patterns {

namespace {

// Entries of a list before its first -1.
int64_t count_listed(const int32_t* list, int64_t k) {
  int64_t n = 0;
  while (n < k && list[n] >= 0) ++n;
  return n;
}

// Both lists int32 (B, H, L, K*) with the same (B, H, L).
void check_pair(const char* op, const KeyLists& a, const KeyLists& b) {
  ops::check_rank(op, "a.idx", a.idx, 4, "(B, H, L, Ka)");
  ops::check_rank(op, "b.idx", b.idx, 4, "(B, H, L, Kb)");
  HAX_CHECK(a.idx.scalar_type() == at::kInt, "{}: a.idx has dtype {} but must be int32", op,
            c10::toString(a.idx.scalar_type()));
  HAX_CHECK(b.idx.scalar_type() == at::kInt, "{}: b.idx has dtype {} but must be int32", op,
            c10::toString(b.idx.scalar_type()));
  ops::check_shape(op, "b.idx", b.idx, {a.idx.size(0), a.idx.size(1), a.idx.size(2), b.idx.size(3)},
                   "(B, H, L, Kb) with a.idx's (B, H, L)");
}

// The band side of both band forms of merge_overflow_rows: a.band (2+, B, H, L), a.k_order and
// a.q_order (B, H, L), block_count (B, H, ceil(L / 64)), all int32 on dev (b's device).
void check_band_rows(const char* op, const LshBand& a, const at::Tensor& block_count, int64_t B, int64_t H, int64_t L,
                     const at::Device& dev) {
  const std::vector<int64_t> rows{B, H, L};
  HAX_CHECK(a.band.dim() == 4 && a.band.size(0) >= 2 && a.band.sizes().slice(1).vec() == rows,
            "{}: a.band has shape {}, expected (2 or more, {}, {}, {})", op, ops::shape_str(a.band.sizes()), B, H, L);
  ops::check_shape(op, "a.k_order", a.k_order, rows, "(B, H, L)");
  ops::check_shape(op, "a.q_order", a.q_order, rows, "(B, H, L)");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"a.band", a.band}, {"a.k_order", a.k_order},
                                {"a.q_order", a.q_order}, {"block_count", block_count}})
    HAX_CHECK(t.scalar_type() == at::kInt && t.device() == dev, "{}: {} must be int32 on {} (got {} on {})", op, name,
              dev.str(), c10::toString(t.scalar_type()), t.device().str());
  ops::check_shape(op, "block_count", block_count, {B, H, ops::attention_tile_blocks(L)}, "(B, H, ceil(L / 64))");
}

}  // namespace

at::Tensor merge_overflow_rows(const KeyLists& a, const KeyLists& b, const at::Tensor& block_count) {
  constexpr const char* kOp = "merge_overflow_rows";
  check_pair(kOp, a, b);
  HAX_CHECK(a.idx.is_cuda(), "{}: a.idx is on {}; the rows of overflowing tile blocks exist on CUDA only", kOp,
            a.idx.device().str());
  ops::check_backend(kOp, "a.idx", a.idx);
  const int64_t B = a.idx.size(0), H = a.idx.size(1), L = a.idx.size(2);
  HAX_CHECK(block_count.scalar_type() == at::kInt && block_count.device() == a.idx.device(),
            "{}: block_count must be int32 on {} (got {} on {})", kOp, a.idx.device().str(),
            c10::toString(block_count.scalar_type()), block_count.device().str());
  ops::check_shape(kOp, "block_count", block_count, {B, H, ops::attention_tile_blocks(L)}, "(B, H, ceil(L / 64))");
  const at::Tensor& q_order = a.q_order.defined() ? a.q_order : b.q_order;
  return detail::merge_overflow_device(a.idx, b.idx, q_order, block_count);
}

at::Tensor merge_overflow_rows(const LshBand& a, int64_t Ka, const KeyLists& b, const at::Tensor& block_count) {
  constexpr const char* kOp = "merge_overflow_rows (band)";
  HAX_CHECK(b.idx.dim() == 4, "{}: b.idx must be (B, H, L, Kb), got {} dims", kOp, b.idx.dim());
  const int64_t B = b.idx.size(0), H = b.idx.size(1), L = b.idx.size(2), Kb = b.idx.size(3);
  HAX_CHECK(b.idx.is_cuda(), "{}: b.idx is on {}; the rows of overflowing tile blocks exist on CUDA only", kOp,
            b.idx.device().str());
  ops::check_backend(kOp, "b.idx", b.idx);
  HAX_CHECK(Ka > 0 && Ka <= 32 && Kb <= 32, "{}: needs 0 < Ka <= 32 and Kb <= 32 (Ka = {}, Kb = {})", kOp, Ka, Kb);
  check_band_rows(kOp, a, block_count, B, H, L, b.idx.device());
  return detail::merge_overflow_band_device(a.band, a.k_order, Ka, b.idx, a.q_order, block_count);
}

at::Tensor merge_overflow_rows(const LshBand& a, int64_t Ka, const KeyIntervals& b, const at::Tensor& block_count) {
  constexpr const char* kOp = "merge_overflow_rows (intervals)";
  HAX_CHECK(Ka > 0 && Ka <= 32, "{}: Ka = {} must be in [1, 32] (a band's keys per query, one a lane)", kOp, Ka);
  HAX_CHECK(b.k >= 1 && b.k <= 32,
            "{}: b.k = {} must be in [1, 32] (Kb = b.k: a row's Key Selection keys, one a lane); for a larger k merge "
            "top_k_prefix's lists (the KeyLists form)",
            kOp, b.k);
  // The extras: only top_k_prefix_intervals on CUDA scores (k < L, k <= kTopKMaxK) gives them.
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"b.leave_at", b.leave_at},
                                {"b.prefix", b.prefix}, {"b.start", b.start}})
    HAX_CHECK(t.defined(),
              "{}: {} is undefined; the intervals must come from top_k_prefix_intervals on CUDA scores with k < L and "
              "k <= {} (their CUDA extras leave_at, prefix and start)",
              kOp, name, kTopKMaxK);
  ops::check_rank(kOp, "b.leave_at", b.leave_at, 3, "(B, H, L)");
  const int64_t B = b.leave_at.size(0), H = b.leave_at.size(1), L = b.leave_at.size(2);
  HAX_CHECK(b.leave_at.is_cuda(), "{}: b.leave_at is on {}; the rows of overflowing tile blocks exist on CUDA only", kOp,
            b.leave_at.device().str());
  ops::check_backend(kOp, "b.leave_at", b.leave_at);
  const at::Device dev = b.leave_at.device();
  ops::check_shape(kOp, "b.prefix", b.prefix, {B, H, ops::attention_tile_blocks(L), b.k},
                   "(B, H, ceil(L / 64), k) with b.leave_at's (B, H, L) and k = b.k");
  ops::check_shape(kOp, "b.start", b.start, {B, L}, "(B, L) with b.leave_at's B and L");
  check_band_rows(kOp, a, block_count, B, H, L, dev);
  HAX_CHECK(b.prefix.scalar_type() == at::kLong && b.prefix.device() == dev, "{}: b.prefix must be int64 on {} (got {} on {})",
            kOp, dev.str(), c10::toString(b.prefix.scalar_type()), b.prefix.device().str());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"b.leave_at", b.leave_at},
                                {"b.start", b.start}})
    HAX_CHECK(t.scalar_type() == at::kInt && t.device() == dev, "{}: {} must be int32 on {} (got {} on {})", kOp, name,
              dev.str(), c10::toString(t.scalar_type()), t.device().str());
  return detail::merge_overflow_intervals_device(a.band, a.k_order, Ka, b, a.q_order, block_count);
}

KeyLists merge(const KeyLists& a, const KeyLists& b) {
  constexpr const char* kOp = "merge";
  check_pair(kOp, a, b);
  const int64_t B = a.idx.size(0), H = a.idx.size(1), L = a.idx.size(2), Ka = a.idx.size(3), Kb = b.idx.size(3);
  if (a.idx.is_cuda()) {
    ops::check_backend(kOp, "a.idx", a.idx);
    return {detail::merge_device(a.idx, b.idx), a.q_order.defined() ? a.q_order : b.q_order};
  }
  const at::Tensor x = a.idx.to(at::kCPU).contiguous(), y = b.idx.to(at::kCPU).contiguous();
  const int64_t K = Ka + Kb;
  at::Tensor idx = at::empty({B, H, L, K}, at::TensorOptions().dtype(at::kInt));  // every entry written below
  const int32_t* xp = x.data_ptr<int32_t>();
  const int32_t* yp = y.data_ptr<int32_t>();
  int32_t* out = idx.data_ptr<int32_t>();
  const int64_t rows = B * H * L;
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      // Both lists are ascending and end at their first -1: a two-way merge that drops repeats,
      // without data-dependent branches (which of two random lists is smaller mispredicts half
      // the time). An exhausted list reads as +inf; an element is kept if it differs from the last.
      constexpr int32_t kEnd = std::numeric_limits<int32_t>::max();
      const int32_t *p = xp + r * Ka, *q = yp + r * Kb;
      const int64_t na = count_listed(p, Ka), nb = count_listed(q, Kb);
      int32_t* dst = out + r * K;
      int64_t ia = 0, ib = 0, n = 0;
      int32_t last = -1;
      for (int64_t t = 0; t < na + nb; ++t) {
        const int32_t va = ia < na ? p[ia] : kEnd, vb = ib < nb ? q[ib] : kEnd;
        const bool take_a = va <= vb;
        const int32_t v = take_a ? va : vb;
        ia += take_a, ib += !take_a;
        dst[n] = v;
        n += v != last;
        last = v;
      }
      for (; n < K; ++n) dst[n] = -1;
    }
  });
  at::Tensor q_order = a.q_order.defined() ? a.q_order : b.q_order;
  return {detail::on(idx, a.idx.device()), q_order};
}

KeyLists exclude(const KeyLists& a, const KeyLists& b) {
  constexpr const char* kOp = "exclude";
  check_pair(kOp, a, b);
  const int64_t B = a.idx.size(0), H = a.idx.size(1), L = a.idx.size(2), Ka = a.idx.size(3), Kb = b.idx.size(3);
  // Computed on the CPU for any device (the CPU attention is its user).
  const at::Tensor x = a.idx.to(at::kCPU).contiguous(), y = b.idx.to(at::kCPU).contiguous();
  at::Tensor idx = at::empty({B, H, L, Ka}, at::TensorOptions().dtype(at::kInt));  // every entry written below
  const int32_t* xp = x.data_ptr<int32_t>();
  const int32_t* yp = y.data_ptr<int32_t>();
  int32_t* out = idx.data_ptr<int32_t>();
  at::parallel_for(0, B * H * L, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, Ka + Kb)), [&](int64_t begin,
                                                                                                 int64_t end) {
    // Row r marks b's keys with its stamp (one random access per key into a small array), then
    // keeps a's unmarked keys, without branches on the data: padding (-1) reads and writes a
    // spare slot.
    int32_t most = 0;
    for (int64_t e = begin * Kb; e < end * Kb; ++e) most = std::max(most, yp[e]);
    for (int64_t e = begin * Ka; e < end * Ka; ++e) most = std::max(most, xp[e]);
    const int32_t spare = most + 1;
    std::vector<int32_t> stamp(spare + 1, -1);
    for (int64_t r = begin; r < end; ++r) {
      const int32_t *p = xp + r * Ka, *q = yp + r * Kb;
      const int32_t mark = int32_t(r - begin);
      for (int64_t t = 0; t < Kb; ++t) stamp[q[t] < 0 ? spare : q[t]] = mark;
      int32_t* dst = out + r * Ka;
      int64_t n = 0;
      for (int64_t t = 0; t < Ka; ++t) {
        dst[n] = p[t];
        n += p[t] >= 0 && stamp[p[t] < 0 ? spare : p[t]] != mark;
      }
      for (; n < Ka; ++n) dst[n] = -1;
    }
  });
  return {detail::on(idx, a.idx.device()), a.q_order};
}

KeyLists exclude_band(const KeyLists& a, const LshBand& band) {
  constexpr const char* kOp = "exclude_band";
  ops::check_rank(kOp, "a.idx", a.idx, 4, "(B, H, L, K)");
  const int64_t B = a.idx.size(0), H = a.idx.size(1), L = a.idx.size(2), K = a.idx.size(3);
  ops::check_shape(kOp, "band.band", band.band, {4, B, H, L}, "(4, B, H, L) with a's (B, H, L)");
  ops::check_shape(kOp, "band.q_order", band.q_order, {B, H, L}, "(B, H, L) with a's");
  ops::check_shape(kOp, "band.k_order", band.k_order, {B, H, L}, "(B, H, L) with a's");
  HAX_CHECK(band.band.device() == a.idx.device(), "{}: the band is on {} but the lists are on {}", kOp,
            band.band.device().str(), a.idx.device().str());
  if (a.idx.numel() == 0) return a;
  if (a.idx.is_cuda()) return {detail::exclude_band_device(a.idx, band), a.q_order};
  // The CPU (and reference) form, with LibTorch ops.
  const auto i64 = a.idx.options().dtype(at::kLong);
  // The sorted rank of every query and key position: the inverses of the two orders.
  const at::Tensor ranks = at::arange(L, i64).expand({B, H, L});
  const at::Tensor q_rank = at::empty({B, H, L}, i64).scatter_(2, band.q_order.to(at::kLong), ranks);
  const at::Tensor k_rank = at::empty({B, H, L}, i64).scatter_(2, band.k_order.to(at::kLong), ranks);
  // Query i's LSH keys are the sorted keys [first, last] of its rank.
  const at::Tensor first = band.band[0].to(at::kLong).gather(2, q_rank).unsqueeze(-1);  // (B, H, L, 1)
  const at::Tensor last = band.band[1].to(at::kLong).gather(2, q_rank).unsqueeze(-1);
  const at::Tensor idx = a.idx.to(at::kLong), valid = idx.ge(0);
  const at::Tensor sk = k_rank.gather(2, idx.clamp_min(0).view({B, H, L * K})).view({B, H, L, K});
  const at::Tensor keep = valid.logical_and(sk.lt(first).logical_or(sk.gt(last)));
  // Kept keys move to the front in their order (slot = kept keys before them); the others go to a
  // spare slot K that is dropped.
  const at::Tensor slot = at::where(keep, keep.cumsum(-1) - 1, at::full_like(idx, K));
  at::Tensor out = at::full({B, H, L, K + 1}, -1, i64).scatter_(3, slot, at::where(keep, idx, at::full_like(idx, -1)));
  return {out.narrow(3, 0, K).to(at::kInt).contiguous(), a.q_order};
}

at::Tensor key_counts(const KeyLists& lists) {
  ops::check_rank("key_counts", "idx", lists.idx, 4, "(B, H, L, K)");
  return lists.idx.ne(-1).sum(-1).to(at::kInt);
}

}  // namespace hax::patterns
