// Binding layer of the linear op: checks, dispatch, autograd.
#include <torch/torch.h>

#include "core/error.h"
#include "ops/backend.h"
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
  // CPU: hax's kernels. CUDA: the products through cuBLAS (at::addmm / at::mm, and
  // at::_addmm_activation for bias + ReLU), in one autograd node instead of LibTorch's linear,
  // matmul, view and transpose nodes; dx is skipped there when x needs no gradient (the scorer's
  // detached inputs).
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor w, at::Tensor b, bool relu) {
    const int64_t in = w.size(1), out = w.size(0);
    const bool cuda = x.is_cuda();
    at::Tensor x2 = x.reshape({-1, in}), y;
    if (cuda) {
      if (relu && b.numel()) {
        // Bias and ReLU in the product's epilogue (cuBLASLt where LibTorch's conditions allow,
        // else addmm then relu): no separate pass over y.
        y = at::_addmm_activation(b, x2, w.t(), 1, 1, /*use_gelu=*/false);
      } else {
        y = b.numel() ? at::addmm(b, x2, w.t()) : at::mm(x2, w.t());
        if (relu) y.relu_();
      }
    } else {
      x2 = x2.contiguous(), w = w.contiguous(), b = b.contiguous();
      y = at::empty({x2.size(0), out}, x.options());
      LinearParams p = make_params(x2, w, b);
      p.y = y.data_ptr();
      p.relu = relu;
      if (p.rows > 0) linear_forward_cpu(p, x.scalar_type());
    }
    ctx->save_for_backward({x2, w, b, relu ? y : at::empty({0}, x.options())});
    ctx->saved_data["cuda"] = cuda;
    ctx->saved_data["relu"] = relu;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    auto sizes = x.sizes().vec();
    sizes.back() = out;
    return {y.view(sizes)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &x2 = s[0], &w = s[1], &b = s[2];
    const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    at::Tensor dy = grads[0].reshape({-1, w.size(0)});
    if (ctx->saved_data["relu"].toBool()) dy = at::threshold_backward(dy, s[3], 0);  // relu' from the output
    if (ctx->saved_data["cuda"].toBool()) {
      at::Tensor dx = ctx->needs_input_grad(0) ? at::mm(dy, w).view(x_sizes) : at::Tensor();
      at::Tensor dw = ctx->needs_input_grad(1) ? at::mm(dy.t(), x2) : at::Tensor();
      at::Tensor db = b.numel() && ctx->needs_input_grad(2) ? dy.sum(0) : at::Tensor();
      return {dx, dw, db, at::Tensor()};
    }
    dy = dy.contiguous();
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

// Checks the arguments of `op`; true when LinearFunction takes them: float32/float64 on the CPU
// (hax's kernels), float32/bfloat16 on CUDA (cuBLAS), one dtype and device for all.
bool check_linear(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  check_rank(op, "w", w, 2, "(out, in)");
  HAX_CHECK(x.dim() >= 1 && x.size(-1) == w.size(1), "{}: x has shape {} but its last dim must be in = {}", op,
            shape_str(x.sizes()), w.size(1));
  if (b.defined()) check_shape(op, "b", b, {w.size(0)}, "(out)");
  const auto dt = x.scalar_type();
  const bool same = w.scalar_type() == dt && w.device() == x.device() &&
                    (!b.defined() || (b.scalar_type() == dt && b.device() == x.device()));
  if (x.device().is_cpu()) return same && (dt == at::kFloat || dt == at::kDouble);
  return same && x.is_cuda() && (dt == at::kFloat || dt == at::kBFloat16);
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  // Under autocast the CUDA products take bfloat16 copies, as LibTorch's own linear would.
  if (autocast_cast_needed({x, w, b})) return linear(autocast_cast(x), autocast_cast(w), autocast_cast(b));
  if (!check_linear("linear", x, w, b)) return at::linear(x, w, b);
  return LinearFunction::apply(x, w, b.defined() ? b : at::empty({0}, x.options()), false)[0];
}

at::Tensor linear_relu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  if (autocast_cast_needed({x, w, b})) return linear_relu(autocast_cast(x), autocast_cast(w), autocast_cast(b));
  if (!check_linear("linear_relu", x, w, b)) return at::relu(at::linear(x, w, b));
  return LinearFunction::apply(x, w, b.defined() ? b : at::empty({0}, x.options()), true)[0];
}

}  // namespace hax::ops
