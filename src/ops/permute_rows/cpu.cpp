// CPU kernel of permute_rows: a copy of D elements per (b, t, h), parallel over (b, h, t).
#include <ATen/Parallel.h>

#include <algorithm>

#include "ops/permute_rows/permute_rows.h"

namespace hax::ops {
namespace {

template <class T>
void permute_impl(const PermuteRowsParams& p) {
  const int64_t B = p.batch, L = p.seqlen, H = p.nheads, D = p.dim;
  const T* src = (const T*)p.src;
  T* dst = (T*)p.dst;
  at::parallel_for(0, B * H * L, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t b = e / (H * L), h = e / L % H, t = e % L, o = p.order[e];
      const int64_t from = p.scatter ? t : o, to = p.scatter ? o : t;
      const T* s = src + ((b * L + from) * H + h) * D;
      std::copy(s, s + D, dst + ((b * L + to) * H + h) * D);
    }
  });
}

}  // namespace

void permute_rows_cpu(const PermuteRowsParams& p, at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return permute_impl<double>(p);
    case at::kFloat: return permute_impl<float>(p);
    default: return permute_impl<at::BFloat16>(p);
  }
}

}  // namespace hax::ops
