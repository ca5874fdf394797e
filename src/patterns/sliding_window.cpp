// SW: the k most recent keys of the query's own sequence, self included.
#include "patterns/internal.h"
#include "patterns/pattern.h"

namespace hax::patterns {

KeyLists sliding_window(int64_t B, int64_t H, int64_t L, int64_t k, const at::Tensor& seq_idx) {
  constexpr const char* kOp = "sliding_window";
  detail::check_sizes(kOp, B, H, L);
  detail::check_positive(kOp, "k", k);
  const at::Tensor seq = ops::check_seq_idx(kOp, seq_idx, B, L);
  at::Tensor idx = detail::empty_lists(B, H, L, k);
  int32_t* out = idx.data_ptr<int32_t>();
  detail::for_each_row(B, H, L, seq, L * k, [&](int64_t b, int64_t h, const auto& segs) {
    int32_t* row = out + (b * H + h) * L * k;
    for (const auto& [s, e] : segs)
      for (int64_t i = s; i < e; ++i) {
        const int64_t first = std::max(s, i - k + 1);
        int32_t* dst = row + i * k;
        for (int64_t j = first; j <= i; ++j) *dst++ = (int32_t)j;
      }
  });
  return {detail::on(idx, detail::result_device(seq_idx)), at::Tensor()};
}

}  // namespace hax::patterns
