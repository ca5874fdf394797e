// Binding layer of permute_rows: tensor checks, dispatch, autograd (the gradient of a gather is a
// scatter by the same order, and vice versa).
#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/check.h"
#include "ops/permute_rows/permute_rows.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "permute_rows";

void check_inputs(const at::Tensor& x, const at::Tensor& order) {
  check_rank(kOp, "x", x, 4, "(B, L, H, D)");
  check_floating(kOp, "x", x);
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2);
  check_shape(kOp, "order", order, {B, H, L}, "(B, H, L) with x's (B, L, H)");
  HAX_CHECK(order.scalar_type() == at::kInt, "{}: order must be int32, got {}", kOp,
            c10::toString(order.scalar_type()));
  HAX_CHECK(order.device() == x.device(), "{}: order is on {} but x is on {}; order must be on x's device", kOp,
            order.device().str(), x.device().str());
  if (order.numel() > 0 && (order.is_cpu() || check_device_values())) {  // rows are permutations of [0, L)
    const at::Tensor o = order.to(at::kCPU).contiguous();
    const int32_t* e = o.data_ptr<int32_t>();
    std::vector<int64_t> seen(L, -1);
    for (int64_t r = 0; r < B * H; ++r)
      for (int64_t t = 0; t < L; ++t) {
        const int32_t v = e[r * L + t];
        HAX_CHECK(v >= 0 && v < L && seen[v] != r,
                  "{}: order[{}][{}][{}] = {} repeats or leaves [0, L = {}); each (b, h) row must be a permutation",
                  kOp, r / H, r % H, t, v, L);
        seen[v] = r;
      }
  }
}

at::Tensor run(const at::Tensor& x0, const at::Tensor& order0, bool scatter) {
  const at::Tensor x = x0.contiguous(), order = order0.contiguous();
  at::Tensor out = new_output(x.sizes(), x.options());
  PermuteRowsParams p;
  p.batch = x.size(0), p.seqlen = x.size(1), p.nheads = x.size(2), p.dim = x.size(3);
  p.src = x.data_ptr(), p.dst = out.data_ptr(), p.order = order.data_ptr<int32_t>(), p.scatter = scatter;
  if (x.numel() == 0) return out;
  if (x.is_cuda())
    HAX_CUDA_LAUNCH(kOp, x, permute_rows_cuda(p, kernel_dtype(x), cuda_stream(x)));
  else
    permute_rows_cpu(p, x.scalar_type());
  return out;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct PermuteRowsFunction : public torch::autograd::Function<PermuteRowsFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& order, bool scatter) {
    ctx->saved_data["scatter"] = scatter;
    ctx->save_for_backward({order});
    return run(x, order, scatter);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor order = ctx->get_saved_variables()[0];
    const bool scatter = ctx->saved_data["scatter"].toBool();
    at::Tensor dx = grads[0].defined() ? PermuteRowsFunction::apply(grads[0], order, !scatter) : at::Tensor();
    return {dx, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor permute_rows(const at::Tensor& x, const at::Tensor& order, bool scatter) {
  check_inputs(x, order);
  return PermuteRowsFunction::apply(x, order, scatter);
}

}  // namespace hax::ops
