// D (dilated, stride r): keys j <= i with (j - start) mod r = r - 1, the k most recent of them.
#include "patterns/internal.h"
#include "patterns/pattern.h"

namespace hax::patterns {

KeyLists dilated(int64_t B, int64_t H, int64_t L, int64_t k, int64_t stride, const at::Tensor& seq_idx,
                 std::optional<at::Device> device) {
  detail::check_positive("dilated", "stride", stride);
  at::Tensor idx = detail::progression_lists(
      "dilated", ProgressionKind::kDilated, stride, B, H, L, k, seq_idx, device, [k, stride](int64_t s, int64_t i) {
        // The eligible keys are s + t·r - 1 for t = 1..m, m = (i - s + 1) / r; keep the last k.
        const int64_t m = (i - s + 1) / stride, t0 = std::max<int64_t>(1, m - k + 1);
        return detail::Progression{s + t0 * stride - 1, m - t0 + 1, stride};
      });
  return {idx, at::Tensor()};
}

}  // namespace hax::patterns
