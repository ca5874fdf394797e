// Sink: the first k keys of the query's own sequence (those <= i).
#include "patterns/internal.h"
#include "patterns/pattern.h"

namespace hax::patterns {

KeyLists sink(int64_t B, int64_t H, int64_t L, int64_t k, const at::Tensor& seq_idx, std::optional<at::Device> device) {
  at::Tensor idx = detail::progression_lists("sink", ProgressionKind::kSink, 1, B, H, L, k, seq_idx, device,
                                             [k](int64_t s, int64_t i) {
                                               return detail::Progression{s, std::min(i, s + k - 1) - s + 1, 1};
                                             });
  return {idx, at::Tensor()};
}

}  // namespace hax::patterns
