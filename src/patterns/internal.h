// Shared plumbing of the pattern builders (not part of the public API): argument checks, the
// packed-sequence segments of a row, and the -1-filled output lists.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/error.h"
#include "ops/check.h"

namespace hax::patterns::detail {

// [begin, end) of every packed sequence of row b, in order. `seq` is the checked seq_idx
// (contiguous int32 CPU, from ops::check_seq_idx) or undefined (one sequence [0, L)).
inline std::vector<std::pair<int64_t, int64_t>> segments(const at::Tensor& seq, int64_t b, int64_t L) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (L == 0) return out;
  if (!seq.defined()) {
    out.emplace_back(0, L);
    return out;
  }
  const int32_t* s = seq.data_ptr<int32_t>() + b * L;
  int64_t begin = 0;
  for (int64_t i = 1; i < L; ++i)
    if (s[i] != s[i - 1]) {
      out.emplace_back(begin, i);
      begin = i;
    }
  out.emplace_back(begin, L);
  return out;
}

// B, H, L must be >= 0 and L must fit the int32 key positions.
inline void check_sizes(const char* op, int64_t B, int64_t H, int64_t L) {
  HAX_CHECK(B >= 0, "{}: the batch size B = {} must be >= 0", op, B);
  HAX_CHECK(H >= 0, "{}: the number of heads H = {} must be >= 0", op, H);
  HAX_CHECK(L >= 0, "{}: the sequence length L = {} must be >= 0", op, L);
  HAX_CHECK(L <= INT32_MAX, "{}: the sequence length L = {} must fit int32 key positions (<= {})", op, L,
            INT32_MAX);
}

// A count argument (`name` = its name, e.g. "k") must be >= 1.
inline void check_positive(const char* op, const char* name, int64_t v) {
  HAX_CHECK(v >= 1, "{}: {} = {} must be at least 1", op, name, v);
}

// (B, H, L, K) int32 lists, all -1.
inline at::Tensor empty_lists(int64_t B, int64_t H, int64_t L, int64_t K) {
  return at::full({B, H, L, K}, -1, at::TensorOptions().dtype(at::kInt));
}

// The device the result of a builder whose only tensor argument is seq_idx goes to.
inline at::Device result_device(const at::Tensor& like) { return like.defined() ? like.device() : at::Device(at::kCPU); }

// Lists built on the CPU, moved to `device`.
inline at::Tensor on(const at::Tensor& t, at::Device device) {
  return (!t.defined() || t.device() == device) ? t : t.to(device);
}

// Runs fn(b, h, segments of row b) for every (b, h), in parallel over (b, h); `work` is the cost
// of one (b, h) in elementary steps (it sets the grain).
template <class F>
void for_each_row(int64_t B, int64_t H, int64_t L, const at::Tensor& seq, int64_t work, F&& fn) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, work));
  std::vector<std::vector<std::pair<int64_t, int64_t>>> segs(B);
  for (int64_t b = 0; b < B; ++b) segs[b] = segments(seq, b, L);
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r / H, r % H, segs[r / H]);
  });
}

}  // namespace hax::patterns::detail
