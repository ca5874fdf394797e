// D (dilated, stride r): keys j <= i with (j - start) mod r = r - 1, the k most recent of them.
#include "patterns/internal.h"
#include "patterns/pattern.h"

namespace hax::patterns {

KeyLists dilated(int64_t B, int64_t H, int64_t L, int64_t k, int64_t stride, const at::Tensor& seq_idx) {
  constexpr const char* kOp = "dilated";
  detail::check_sizes(kOp, B, H, L);
  detail::check_positive(kOp, "k", k);
  detail::check_positive(kOp, "stride", stride);
  const at::Tensor seq = ops::check_seq_idx(kOp, seq_idx, B, L);
  at::Tensor idx = detail::empty_lists(B, H, L, k);
  int32_t* out = idx.data_ptr<int32_t>();
  detail::for_each_row(B, H, L, seq, L * k, [&](int64_t b, int64_t h, const auto& segs) {
    int32_t* row = out + (b * H + h) * L * k;
    for (const auto& [s, e] : segs)
      for (int64_t i = s; i < e; ++i) {
        // The eligible keys are s + t·r - 1 for t = 1..m, m = (i - s + 1) / r; keep the last k.
        const int64_t m = (i - s + 1) / stride;
        int32_t* dst = row + i * k;
        for (int64_t t = std::max<int64_t>(1, m - k + 1); t <= m; ++t) *dst++ = (int32_t)(s + t * stride - 1);
      }
  });
  return {detail::on(idx, detail::result_device(seq_idx)), at::Tensor()};
}

}  // namespace hax::patterns
