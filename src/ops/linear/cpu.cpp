// CPU kernels of the linear op: row blocks of x times W^T through small_gemm.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "core/small_gemm.h"
#include "ops/linear/linear.h"

namespace hax::ops {
namespace {

constexpr int64_t kRowBlock = 64;  // rows per forward work item

// The fixed row partition of the weight-gradient reduction: depends on `rows` only, so results do
// not depend on the thread count.
int64_t grad_blocks(int64_t rows) { return std::max<int64_t>(1, std::min<int64_t>(16, rows / 256)); }

template <class T>
void forward_impl(const LinearParams& p) {
  const int64_t M = p.rows, K = p.in, N = p.out;
  std::vector<T> wt(K * N);  // W^T (in, out)
  transpose<T>(N, K, (const T*)p.w, K, wt.data(), N);
  const T* b = (const T*)p.b;
  T* y = (T*)p.y;
  at::parallel_for(0, (M + kRowBlock - 1) / kRowBlock, 1, [&](int64_t s, int64_t e) {
    for (int64_t blk = s; blk < e; ++blk) {
      const int64_t r0 = blk * kRowBlock, rows = std::min(kRowBlock, M - r0);
      T* yb = y + r0 * N;
      if (b)
        for (int64_t r = 0; r < rows; ++r) std::copy(b, b + N, yb + r * N);
      small_gemm<T>(rows, N, K, (const T*)p.x + r0 * K, K, wt.data(), N, yb, N, b != nullptr);
      if (p.relu) {
#pragma omp simd
        for (int64_t e = 0; e < rows * N; ++e) yb[e] = yb[e] > T(0) ? yb[e] : T(0);
      }
    }
  });
}

template <class T>
void backward_impl(const LinearGradParams& g) {
  const LinearParams& p = g.fwd;
  const int64_t M = p.rows, K = p.in, N = p.out;
  const T* x = (const T*)p.x;
  const T* dy = (const T*)g.dy;
  if (g.dx) {  // dX = dY W: (M, N) x (N, K)
    at::parallel_for(0, (M + kRowBlock - 1) / kRowBlock, 1, [&](int64_t s, int64_t e) {
      for (int64_t blk = s; blk < e; ++blk) {
        const int64_t r0 = blk * kRowBlock, rows = std::min(kRowBlock, M - r0);
        small_gemm<T>(rows, K, N, dy + r0 * N, N, (const T*)p.w, K, (T*)g.dx + r0 * K, K, false);
      }
    });
  }
  if (g.dw || g.db) {  // dW = dY^T X: partial sums over fixed row blocks, then summed in order
    const int64_t nb = grad_blocks(M), per = (M + nb - 1) / nb;
    std::vector<T> part_w(g.dw ? nb * N * K : 0), part_b(g.db ? nb * N : 0, T(0));
    at::parallel_for(0, nb, 1, [&](int64_t s, int64_t e) {
      std::vector<T> dyt;
      for (int64_t blk = s; blk < e; ++blk) {
        const int64_t r0 = blk * per, rows = std::max<int64_t>(0, std::min(per, M - r0));
        if (g.dw) {
          T* pw = part_w.data() + blk * N * K;
          if (rows == 0) {
            std::fill(pw, pw + N * K, T(0));
          } else {
            dyt.resize(N * rows);
            transpose<T>(rows, N, dy + r0 * N, N, dyt.data(), rows);
            small_gemm<T>(N, K, rows, dyt.data(), rows, x + r0 * K, K, pw, K, false);
          }
        }
        if (g.db) {
          T* pb = part_b.data() + blk * N;
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t o = 0; o < N; ++o) pb[o] += dy[(r0 + r) * N + o];
        }
      }
    });
    if (g.dw) {
      T* dw = (T*)g.dw;
      std::copy(part_w.begin(), part_w.begin() + N * K, dw);
      for (int64_t blk = 1; blk < nb; ++blk)
        for (int64_t i = 0; i < N * K; ++i) dw[i] += part_w[blk * N * K + i];
    }
    if (g.db) {
      T* db = (T*)g.db;
      std::copy(part_b.begin(), part_b.begin() + N, db);
      for (int64_t blk = 1; blk < nb; ++blk)
        for (int64_t o = 0; o < N; ++o) db[o] += part_b[blk * N + o];
    }
  }
}

}  // namespace

void linear_forward_cpu(const LinearParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return forward_impl<double>(p);
  return forward_impl<float>(p);
}

void linear_backward_cpu(const LinearGradParams& p, at::ScalarType dtype) {
  if (dtype == at::kDouble) return backward_impl<double>(p);
  return backward_impl<float>(p);
}

}  // namespace hax::ops
