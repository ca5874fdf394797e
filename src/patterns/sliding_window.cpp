// SW: the k most recent keys of the query's own sequence, self included.
#include "patterns/internal.h"
#include "patterns/pattern.h"

namespace hax::patterns {

KeyLists sliding_window(int64_t B, int64_t H, int64_t L, int64_t k, const at::Tensor& seq_idx,
                        std::optional<at::Device> device) {
  at::Tensor idx = detail::progression_lists("sliding_window", ProgressionKind::kSlidingWindow, 1, B, H, L, k, seq_idx,
                                             device, [k](int64_t s, int64_t i) {
                                               const int64_t first = std::max(s, i - k + 1);
                                               return detail::Progression{first, i - first + 1, 1};
                                             });
  return {idx, at::Tensor()};
}

}  // namespace hax::patterns
