// CPU kernels of the (gated) RMSNorm: forward and hand-written backward.
//
// Per row and group, with s = silu(z) (1 without z), u = x s, r = rstd, n = u r, a = dout w:
//   dw  += dout n,      du = r (a - n mean(a n)),      dx = du s,
//   dz   = du x σ(z) (1 + z (1 - σ(z)))               (silu' = σ (1 + z (1 - σ)))
// Rows are split into fixed blocks (a function of the row count only); each block writes its
// own dweight partial, and the partials are summed over blocks in order.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/rmsnorm/rmsnorm.h"

namespace hax::ops {
namespace {

// Rows per block of the backward's dweight partials: at most 256 blocks, at least 8 rows each.
int64_t rows_per_block(int64_t rows) { return std::max<int64_t>(8, (rows + 255) / 256); }

template <class T>
T sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

// u = x * silu(z) (or x) for one row.
template <class T>
void gated_row(const T* x, const T* z, int64_t D, T* u) {
  if (!z) {
    std::copy(x, x + D, u);
    return;
  }
  for (int64_t i = 0; i < D; ++i) u[i] = x[i] * z[i] * sigmoid(z[i]);
}

template <class T>
void forward_impl(const RmsNormParams& p) {
  const int64_t D = p.dim, gs = p.group_size, ng = p.ngroups();
  const T eps = (T)p.eps;
  const T* weight = (const T*)p.weight;
  at::parallel_for(0, p.rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> u(D);
    for (int64_t m = begin; m < end; ++m) {
      gated_row((const T*)p.x + m * D, p.z ? (const T*)p.z + m * D : nullptr, D, u.data());
      T* o = (T*)p.out + m * D;
      for (int64_t g = 0; g < ng; ++g) {
        const T* ug = &u[g * gs];
        T ss = 0;
        for (int64_t i = 0; i < gs; ++i) ss += ug[i] * ug[i];
        const T r = T(1) / std::sqrt(ss / T(gs) + eps);
        if (p.rstd) ((T*)p.rstd)[m * ng + g] = r;
        const T* w = weight + g * gs;
        T* og = o + g * gs;
        for (int64_t i = 0; i < gs; ++i) og[i] = ug[i] * r * w[i];
      }
    }
  });
}

template <class T>
void backward_impl(const RmsNormGradParams& gp) {
  const RmsNormParams& p = gp.fwd;
  const int64_t M = p.rows, D = p.dim, gs = p.group_size, ng = p.ngroups();
  const int64_t rpb = rows_per_block(M), nblk = (M + rpb - 1) / rpb;
  const T* weight = (const T*)p.weight;
  const T* rstd = (const T*)p.rstd;
  std::vector<T> dw_part(nblk * D, T(0));  // (blocks, D)
  at::parallel_for(0, nblk, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> u(D), a(D);
    for (int64_t blk = begin; blk < end; ++blk) {
      T* dw = &dw_part[blk * D];
      for (int64_t m = blk * rpb; m < std::min(M, (blk + 1) * rpb); ++m) {
        const T* x = (const T*)p.x + m * D;
        const T* z = p.z ? (const T*)p.z + m * D : nullptr;
        const T* dout = (const T*)gp.dout + m * D;
        gated_row(x, z, D, u.data());
        T* dx = (T*)gp.dx + m * D;
        for (int64_t g = 0; g < ng; ++g) {
          const int64_t o = g * gs;
          const T r = rstd[m * ng + g];
          T dot = 0;  // Σ a n over the group
          for (int64_t i = o; i < o + gs; ++i) {
            const T n = u[i] * r;
            a[i] = dout[i] * weight[i];
            dw[i] += dout[i] * n;
            dot += a[i] * n;
          }
          const T mean = dot / T(gs);
          for (int64_t i = o; i < o + gs; ++i) u[i] = r * (a[i] - u[i] * r * mean);  // u becomes du
        }
        if (!z) {
          std::copy(u.begin(), u.end(), dx);
          continue;
        }
        T* dz = (T*)gp.dz + m * D;
        for (int64_t i = 0; i < D; ++i) {
          const T sg = sigmoid(z[i]);
          dx[i] = u[i] * z[i] * sg;
          dz[i] = u[i] * x[i] * sg * (T(1) + z[i] * (T(1) - sg));
        }
      }
    }
  });
  // dweight: the block partials summed in block order, columns in parallel.
  T* dweight = (T*)gp.dweight;
  at::parallel_for(0, D, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T s = 0;
      for (int64_t blk = 0; blk < nblk; ++blk) s += dw_part[blk * D + i];
      dweight[i] = s;
    }
  });
}

}  // namespace

void rmsnorm_forward_cpu(const RmsNormParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return forward_impl<double>(p);
  return forward_impl<float>(p);
}

void rmsnorm_backward_cpu(const RmsNormGradParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return backward_impl<double>(p);
  return backward_impl<float>(p);
}

}  // namespace hax::ops
