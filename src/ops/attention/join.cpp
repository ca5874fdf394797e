// join_by_lse (attention.h): attention over the union of two disjoint key sets from the attention
// over each. On the CPU and on CUDA (cuda/join.cu: float32 lse, float32 or bfloat16 outputs) one
// fused pass forward and one backward (the LibTorch formula, kept for other cases, makes about
// eight passes over the (B, L, H, Dv) outputs):
//   w = sigmoid(lse_1 - lse_2) (1/2 when both are -inf: both outputs are then 0),
//   out = o_2 + w (o_1 - o_2);
//   backward: do_1 = w dout, do_2 = (1 - w) dout, g = dout · (o_1 - o_2),
//             dlse_1 = g w (1 - w) = -dlse_2.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>

#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/backend.h"
#include "ops/check.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "join_by_lse";

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <class T>
T weight_of(T l1, T l2) {
  const T d = l1 - l2;
  return std::isnan(d) ? T(0.5) : T(1) / (T(1) + std::exp(-d));
}

// Calls fn(row, b, i, h) for every (b, i, h) of (B, L, H) rows, in parallel.
template <class F>
void for_rows(int64_t B, int64_t L, int64_t H, F fn) {
  at::parallel_for(0, B * L, 256, [&](int64_t begin, int64_t end) {
    for (int64_t bi = begin; bi < end; ++bi)
      for (int64_t h = 0; h < H; ++h) fn(bi * H + h, bi / L, bi % L, h);
  });
}

template <class T>
void join_forward(const T* o1, const T* l1, const T* o2, const T* l2, T* out, T* w, int64_t B, int64_t L, int64_t H,
                  int64_t Dv) {
  for_rows(B, L, H, [&](int64_t row, int64_t b, int64_t i, int64_t h) {
    const int64_t s = (b * H + h) * L + i;  // lse (B, H, L, 1)
    const T wt = weight_of(l1[s], l2[s]);
    w[row] = wt;
    const T *x1 = o1 + row * Dv, *x2 = o2 + row * Dv;
    T* y = out + row * Dv;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) y[d] = x2[d] + wt * (x1[d] - x2[d]);
  });
}

template <class T>
void join_backward(const T* o1, const T* o2, const T* w, const T* dout, T* d1, T* d2, T* dl1, int64_t B, int64_t L,
                   int64_t H, int64_t Dv) {
  for_rows(B, L, H, [&](int64_t row, int64_t b, int64_t i, int64_t h) {
    const T wt = w[row];
    const T *x1 = o1 + row * Dv, *x2 = o2 + row * Dv, *g = dout + row * Dv;
    T *y1 = d1 + row * Dv, *y2 = d2 + row * Dv;
    T dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < Dv; ++d) {
      y1[d] = wt * g[d];
      y2[d] = g[d] - y1[d];
      dot += g[d] * (x1[d] - x2[d]);
    }
    dl1[(b * H + h) * L + i] = dot * wt * (1 - wt);
  });
}

struct JoinFunction : public torch::autograd::Function<JoinFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor o1, at::Tensor lse1, at::Tensor o2, at::Tensor lse2) {
    o1 = o1.contiguous(), o2 = o2.contiguous(), lse1 = lse1.contiguous(), lse2 = lse2.contiguous();
    const int64_t B = o1.size(0), L = o1.size(1), H = o1.size(2), Dv = o1.size(3);
    at::Tensor out = at::empty_like(o1), w = at::empty({B, L, H}, o1.options());
    AT_DISPATCH_FLOATING_TYPES(o1.scalar_type(), kOp, [&] {
      join_forward(o1.data_ptr<scalar_t>(), lse1.data_ptr<scalar_t>(), o2.data_ptr<scalar_t>(), lse2.data_ptr<scalar_t>(),
                   out.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), B, L, H, Dv);
    });
    ctx->save_for_backward({o1, o2, w});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &o1 = s[0], &o2 = s[1], &w = s[2];
    const int64_t B = o1.size(0), L = o1.size(1), H = o1.size(2), Dv = o1.size(3);
    const at::Tensor dout = grads[0].contiguous();
    at::Tensor d1 = at::empty_like(o1), d2 = at::empty_like(o2), dl1 = at::empty({B, H, L, 1}, o1.options());
    AT_DISPATCH_FLOATING_TYPES(o1.scalar_type(), kOp, [&] {
      join_backward(o1.data_ptr<scalar_t>(), o2.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(),
                    d1.data_ptr<scalar_t>(), d2.data_ptr<scalar_t>(), dl1.data_ptr<scalar_t>(), B, L, H, Dv);
    });
    return {d1, dl1, d2, -dl1};
  }
};

// CUDA: the kernels of cuda/join.cu (o1, o2 float32 or bfloat16; lse1, lse2 float32).
struct JoinCudaFunction : public torch::autograd::Function<JoinCudaFunction> {
  static JoinParams params(const at::Tensor& o1, const at::Tensor& o2) {
    JoinParams p;
    p.batch = o1.size(0), p.seqlen = o1.size(1), p.nheads = o1.size(2), p.vdim = o1.size(3);
    p.o1 = o1.data_ptr(), p.o2 = o2.data_ptr();
    return p;
  }
  static variable_list forward(AutogradContext* ctx, at::Tensor o1, at::Tensor lse1, at::Tensor o2, at::Tensor lse2) {
    o1 = o1.contiguous(), o2 = o2.contiguous(), lse1 = lse1.contiguous(), lse2 = lse2.contiguous();
    at::Tensor out = new_output(o1.sizes(), o1.options());
    at::Tensor w = at::empty({o1.size(0), o1.size(1), o1.size(2)}, o1.options().dtype(at::kFloat));
    JoinParams p = params(o1, o2);
    p.lse1 = lse1.data_ptr<float>(), p.lse2 = lse2.data_ptr<float>();
    p.out = out.data_ptr(), p.w = w.data_ptr<float>();
    HAX_CUDA_LAUNCH(kOp, o1, join_by_lse_forward_cuda(p, kernel_dtype(o1), cuda_stream(o1)));
    ctx->save_for_backward({o1, o2, w});
    return {out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &o1 = s[0], &o2 = s[1], &w = s[2];
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor dout = grads[0].to(o1.scalar_type()).contiguous();
    at::Tensor d1 = new_output(o1.sizes(), o1.options()), d2 = new_output(o2.sizes(), o2.options());
    at::Tensor dl1 = new_output({o1.size(0), o1.size(2), o1.size(1), 1}, w.options());
    JoinParams p = params(o1, o2);
    p.w = w.data_ptr<float>(), p.dout = dout.data_ptr(), p.do1 = d1.data_ptr(), p.do2 = d2.data_ptr();
    p.dlse1 = dl1.data_ptr<float>();
    HAX_CUDA_LAUNCH(kOp, o1, join_by_lse_backward_cuda(p, kernel_dtype(o1), cuda_stream(o1)));
    return {d1, dl1, d2, -dl1};
  }
};

}  // namespace

at::Tensor join_by_lse(const at::Tensor& o1, const at::Tensor& lse1, const at::Tensor& o2, const at::Tensor& lse2) {
  check_rank(kOp, "o1", o1, 4, "(B, L, H, Dv)");
  check_same(kOp, "o2", o2, o1);
  const int64_t B = o1.size(0), L = o1.size(1), H = o1.size(2);
  check_shape(kOp, "lse1", lse1, {B, H, L, 1}, "(B, H, L, 1) with o1's (B, L, H)");
  check_shape(kOp, "lse2", lse2, {B, H, L, 1}, "(B, H, L, 1) with o1's (B, L, H)");
  if (o1.is_cpu() && at::isFloatingType(o1.scalar_type()) && o1.scalar_type() != at::kHalf &&
      o1.scalar_type() != at::kBFloat16 && lse1.scalar_type() == o1.scalar_type() &&
      lse2.scalar_type() == o1.scalar_type())
    return JoinFunction::apply(o1, lse1, o2, lse2)[0];
  if (o1.is_cuda() && (o1.scalar_type() == at::kFloat || o1.scalar_type() == at::kBFloat16) &&
      lse1.scalar_type() == at::kFloat && lse2.scalar_type() == at::kFloat && o1.numel() > 0)
    return JoinCudaFunction::apply(o1, lse1, o2, lse2)[0];
  const at::Tensor w1 = at::sigmoid((lse1 - lse2).permute({0, 2, 1, 3}).nan_to_num(0.0)).to(o1.scalar_type());
  return o2 + w1 * (o1 - o2);
}

}  // namespace hax::ops
