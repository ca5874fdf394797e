// Shared plumbing of the pattern builders (not part of the public API): argument checks, the
// packed-sequence segments of a row, the -1-filled output lists, and the device the lists go to.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/check.h"
#include "patterns/cuda_paths.h"

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

// The device of the lists of a builder that takes only sizes and seq_idx: `device` when given,
// else seq_idx's, else the CPU.
inline at::Device list_device(const at::Tensor& seq_idx, const std::optional<at::Device>& device) {
  return device ? *device : result_device(seq_idx);
}

// Lists are built on the CPU, or on a CUDA device by a build with the CUDA backend.
inline void check_list_device(const char* op, const at::Device& device) {
  if (device.is_cpu()) return;
  HAX_CHECK(device.is_cuda(), "{}: the lists were asked for on {}; hax builds them on the CPU and on CUDA devices only",
            op, device.str());
  HAX_CHECK(ops::cuda_backend_built(),
            "{}: the lists were asked for on {}, but this build of hax has no CUDA kernels (configure it where nvcc "
            "and a CUDA-enabled LibTorch are found, or with -DHAX_CUDA=ON to require them)",
            op, device.str());
}

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

// The lists of a pattern whose keys for query i are an arithmetic progression within i's packed
// sequence [s, e): keys(s, i) returns {first, count, step} (count <= k), the list being first,
// first + step, ...; the same for every (b, h). Checks B, H, L, k and seq_idx and builds the
// (B, H, L, k) lists on list_device(seq_idx, device): on a CUDA device the kernel of `kind`
// (stride: the dilation) computes the same formulas. SW, sink and dilated are such patterns.
struct Progression {
  int64_t first, count, step;
};
template <class F>
at::Tensor progression_lists(const char* op, ProgressionKind kind, int64_t stride, int64_t B, int64_t H, int64_t L,
                             int64_t k, const at::Tensor& seq_idx, const std::optional<at::Device>& device, F&& keys) {
  check_sizes(op, B, H, L);
  check_positive(op, "k", k);
  const at::Device dev = list_device(seq_idx, device);
  check_list_device(op, dev);
  const at::Tensor seq = ops::check_seq_idx(op, on(seq_idx, dev), B, L);
  if (dev.is_cuda()) return progression_lists_device(kind, B, H, L, k, stride, seq, dev);
  at::Tensor idx = empty_lists(B, H, L, k);
  int32_t* out = idx.data_ptr<int32_t>();
  for_each_row(B, H, L, seq, L * k, [&](int64_t b, int64_t h, const auto& segs) {
    int32_t* row = out + (b * H + h) * L * k;
    for (const auto& [s, e] : segs)
      for (int64_t i = s; i < e; ++i) {
        const Progression pr = keys(s, i);
        int32_t* dst = row + i * k;
        for (int64_t t = 0; t < pr.count; ++t) dst[t] = (int32_t)(pr.first + t * pr.step);
      }
  });
  return idx;
}

}  // namespace hax::patterns::detail
