// Binding layer of the linear op: checks, dispatch, autograd.
#include <torch/torch.h>

#include "core/error.h"
#include "ops/check.h"
#include "ops/linear/linear.h"

namespace hax::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

LinearParams make_params(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b) {
  LinearParams p;
  p.rows = x2.size(0), p.in = x2.size(1), p.out = w.size(0);
  p.x = x2.data_ptr(), p.w = w.data_ptr(), p.b = b.numel() ? b.data_ptr() : nullptr;
  return p;
}

struct LinearFunction : public torch::autograd::Function<LinearFunction> {
  // b arrives as an empty tensor when absent (LibTorch 1.13's apply cannot take undefined ones).
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor w, at::Tensor b, bool relu) {
    const int64_t in = w.size(1), out = w.size(0);
    at::Tensor x2 = x.reshape({-1, in}).contiguous(), wc = w.contiguous(), bc = b.contiguous();
    auto sizes = x.sizes().vec();
    sizes.back() = out;
    at::Tensor y = at::empty({x2.size(0), out}, x.options());
    LinearParams p = make_params(x2, wc, bc);
    p.y = y.data_ptr();
    p.relu = relu;
    if (p.rows > 0) linear_forward_cpu(p, x.scalar_type());
    ctx->save_for_backward({x2, wc, bc, relu ? y : at::empty({0}, x.options())});
    ctx->saved_data["relu"] = relu;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return {y.view(sizes)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &x2 = s[0], &w = s[1], &b = s[2];
    auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    at::Tensor dy = grads[0].reshape({-1, w.size(0)}).contiguous();
    if (ctx->saved_data["relu"].toBool()) dy = dy * (s[3] > 0).to(dy.scalar_type());  // relu' from the output
    LinearGradParams g;
    g.fwd = make_params(x2, w, b);
    at::Tensor dx = at::empty_like(x2), dw = at::empty_like(w), db = b.numel() ? at::empty_like(b) : at::Tensor();
    g.dy = dy.data_ptr(), g.dx = dx.data_ptr(), g.dw = dw.data_ptr();
    g.db = db.defined() ? db.data_ptr() : nullptr;
    if (x2.size(0) > 0) {
      linear_backward_cpu(g, x2.scalar_type());
    } else {
      dw.zero_();
      if (db.defined()) db.zero_();
    }
    return {dx.view(x_sizes), dw, db, at::Tensor()};
  }
};

}  // namespace

namespace {

// Checks the arguments of `op`; true when the CPU kernels take them (float32/float64 on the CPU).
bool check_linear(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  check_rank(op, "w", w, 2, "(out, in)");
  HAX_CHECK(x.dim() >= 1 && x.size(-1) == w.size(1), "{}: x has shape {} but its last dim must be in = {}", op,
            shape_str(x.sizes()), w.size(1));
  if (b.defined()) check_shape(op, "b", b, {w.size(0)}, "(out)");
  return x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) &&
         w.scalar_type() == x.scalar_type() && (!b.defined() || b.scalar_type() == x.scalar_type());
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  if (!check_linear("linear", x, w, b)) return at::linear(x, w, b);
  return LinearFunction::apply(x, w, b.defined() ? b : at::empty({0}, x.options()), false)[0];
}

at::Tensor linear_relu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  if (!check_linear("linear_relu", x, w, b)) return at::relu(at::linear(x, w, b));
  return LinearFunction::apply(x, w, b.defined() ? b : at::empty({0}, x.options()), true)[0];
}

}  // namespace hax::ops
