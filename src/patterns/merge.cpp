// Union of two patterns' lists, and the per-query key counts. CUDA lists: cuda/merge_lists.cu.
#include "patterns/internal.h"
#include "patterns/pattern.h"

namespace hax::patterns {

KeyLists merge(const KeyLists& a, const KeyLists& b) {
  constexpr const char* kOp = "merge";
  ops::check_rank(kOp, "a.idx", a.idx, 4, "(B, H, L, Ka)");
  ops::check_rank(kOp, "b.idx", b.idx, 4, "(B, H, L, Kb)");
  HAX_CHECK(a.idx.scalar_type() == at::kInt, "{}: a.idx has dtype {} but must be int32", kOp,
            c10::toString(a.idx.scalar_type()));
  HAX_CHECK(b.idx.scalar_type() == at::kInt, "{}: b.idx has dtype {} but must be int32", kOp,
            c10::toString(b.idx.scalar_type()));
  const int64_t B = a.idx.size(0), H = a.idx.size(1), L = a.idx.size(2), Ka = a.idx.size(3), Kb = b.idx.size(3);
  ops::check_shape(kOp, "b.idx", b.idx, {B, H, L, Kb}, "(B, H, L, Kb) with a.idx's (B, H, L)");
  if (a.idx.is_cuda()) {
    ops::check_backend(kOp, "a.idx", a.idx);
    return {detail::merge_device(a.idx, b.idx), a.q_order.defined() ? a.q_order : b.q_order};
  }
  const at::Tensor x = a.idx.to(at::kCPU).contiguous(), y = b.idx.to(at::kCPU).contiguous();
  const int64_t K = Ka + Kb;
  at::Tensor idx = detail::empty_lists(B, H, L, K);
  const int32_t* xp = x.data_ptr<int32_t>();
  const int32_t* yp = y.data_ptr<int32_t>();
  int32_t* out = idx.data_ptr<int32_t>();
  const int64_t rows = B * H * L;
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      // Both lists are ascending and end at their first -1: a two-way merge that drops repeats.
      const int32_t *p = xp + r * Ka, *pe = p + Ka, *q = yp + r * Kb, *qe = q + Kb;
      int32_t* dst = out + r * K;
      int32_t last = -1;
      while (true) {
        const bool has_p = p != pe && *p >= 0, has_q = q != qe && *q >= 0;
        if (!has_p && !has_q) break;
        int32_t v;
        if (has_p && (!has_q || *p <= *q))
          v = *p++;
        else
          v = *q++;
        if (v != last) *dst++ = last = v;
      }
    }
  });
  at::Tensor q_order = a.q_order.defined() ? a.q_order : b.q_order;
  return {detail::on(idx, a.idx.device()), q_order};
}

at::Tensor key_counts(const KeyLists& lists) {
  ops::check_rank("key_counts", "idx", lists.idx, 4, "(B, H, L, K)");
  return lists.idx.ne(-1).sum(-1).to(at::kInt);
}

}  // namespace hax::patterns
