// Binding layer of the causal conv1d: tensor checks, dispatch to the kernels, autograd.
#include <torch/torch.h>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/check.h"
#include "ops/conv1d/conv1d.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "conv1d";

struct Dims {
  int64_t B, L, C, W;
};

Dims check_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& init) {
  check_rank(kOp, "x", x, 3, "(B, L, C)");
  check_floating(kOp, "x", x);
  Dims d{x.size(0), x.size(1), x.size(2), 0};
  check_rank(kOp, "weight", weight, 2, "(C, W)");
  d.W = weight.size(1);
  HAX_CHECK(d.W >= 1, "conv1d: the kernel width W = {} (weight's dim 1) must be at least 1", d.W);
  HAX_CHECK(!x.is_cuda() || d.W <= kConv1dCudaMaxWidth,
            "conv1d: the kernel width W = {} (weight's dim 1) exceeds the CUDA kernels' maximum {}", d.W,
            kConv1dCudaMaxWidth);
  check_shape(kOp, "weight", weight, {d.C, d.W}, "(C, W)");
  check_same(kOp, "weight", weight, x);
  if (bias.defined()) {
    check_shape(kOp, "bias", bias, {d.C}, "(C)");
    check_same(kOp, "bias", bias, x);
  }
  if (init.defined()) {
    check_shape(kOp, "init_state", init, {d.B, d.W - 1, d.C}, "(B, W-1, C)");
    check_same(kOp, "init_state", init, x);
  }
  return d;
}

Conv1dParams make_params(const Dims& d, bool silu, const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias, const at::Tensor& init, const at::Tensor& seq) {
  Conv1dParams p;
  p.batch = d.B, p.seqlen = d.L, p.channels = d.C, p.width = d.W, p.silu = silu;
  p.x = x.data_ptr(), p.weight = weight.data_ptr();
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.init_state = init.defined() ? init.data_ptr() : nullptr;
  p.seq_idx = seq.defined() ? seq.data_ptr<int32_t>() : nullptr;
  return p;
}

at::Tensor contiguous_or_absent(const at::Tensor& t) { return t.defined() ? t.contiguous() : t; }

// seq_idx checked and converted to contiguous int32 on x's device (or undefined).
at::Tensor seq_on_device(const at::Tensor& seq_idx, const at::Tensor& x, const Dims& d) {
  at::Tensor seq = check_seq_idx(kOp, seq_idx, d.B, d.L);
  return seq.defined() ? seq.to(x.device()).contiguous() : seq;
}

// Σ over dim 0 of per-row partial sums, one row after another (a fixed order).
at::Tensor sum_rows_in_order(const at::Tensor& parts) {
  if (parts.size(0) == 0) return parts.sum(0);
  at::Tensor acc = parts[0].clone();
  for (int64_t i = 1; i < parts.size(0); ++i) acc.add_(parts[i]);
  return acc;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> causal_conv1d_forward(const at::Tensor& x0, const at::Tensor& weight0,
                                                         const at::Tensor& bias0, const at::Tensor& init0,
                                                         const at::Tensor& seq_idx, bool silu) {
  Dims d = check_inputs(x0, weight0, bias0, init0);
  at::Tensor x = x0.contiguous(), weight = weight0.contiguous(), bias = contiguous_or_absent(bias0),
             init = contiguous_or_absent(init0);
  at::Tensor seq = seq_on_device(seq_idx, x, d);
  Conv1dParams p = make_params(d, silu, x, weight, bias, init, seq);
  at::Tensor out = new_output({d.B, d.L, d.C}, x.options());
  at::Tensor fin = new_output({d.B, d.W - 1, d.C}, x.options());
  p.out = out.data_ptr(), p.final_state = fin.data_ptr();
  if (d.B * d.C == 0) return {out, fin};
  if (x.is_cuda())
    HAX_CUDA_LAUNCH(kOp, x, conv1d_forward_cuda(p, kernel_dtype(x), cuda_stream(x)));
  else
    conv1d_forward_cpu(p, x.scalar_type());
  return {out, fin};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Conv1dFunction : public torch::autograd::Function<Conv1dFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor weight, at::Tensor bias,
                               at::Tensor init, at::Tensor seq_idx, bool silu) {
    // Absent optional tensors arrive as empty 1-d tensors (LibTorch's autograd needs defined ones).
    auto present = [](const at::Tensor& t) { return !(t.dim() == 1 && t.numel() == 0); };
    if (!present(bias)) bias = at::Tensor();
    if (!present(init)) init = at::Tensor();
    x = x.contiguous();  // once: the forward and the saved copy share it
    if (!present(seq_idx)) seq_idx = at::Tensor();
    auto [out, fin] = causal_conv1d_forward(x, weight, bias, init, seq_idx, silu);
    at::Tensor seq = seq_on_device(seq_idx, x, {x.size(0), x.size(1), x.size(2), weight.size(1)});
    ctx->saved_data["silu"] = silu;
    ctx->saved_data["has_bias"] = bias.defined();
    ctx->saved_data["has_init"] = init.defined();
    ctx->saved_data["has_seq"] = seq.defined();
    at::Tensor none = at::zeros({0}, x.options());
    ctx->save_for_backward({x.contiguous(), weight.contiguous(), bias.defined() ? bias.contiguous() : none,
                            init.defined() ? init.contiguous() : none,
                            seq.defined() ? seq : at::zeros({0}, x.options().dtype(at::kInt))});
    ctx->mark_non_differentiable({fin});
    return {out, fin};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &weight = s[1];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const bool has_init = ctx->saved_data["has_init"].toBool();
    const bool has_seq = ctx->saved_data["has_seq"].toBool();
    at::Tensor bias = has_bias ? s[2] : at::Tensor();
    at::Tensor init = has_init ? s[3] : at::Tensor();
    at::Tensor seq = has_seq ? s[4] : at::Tensor();
    Dims d{x.size(0), x.size(1), x.size(2), weight.size(1)};
    at::Tensor dout = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(x);

    Conv1dGradParams gp;
    gp.fwd = make_params(d, ctx->saved_data["silu"].toBool(), x, weight, bias, init, seq);
    gp.dout = dout.data_ptr();
    if (x.is_cuda()) return backward_cuda(gp, d, x, weight, has_bias, init);
    at::Tensor dx = at::zeros_like(x);
    at::Tensor dw_part = at::zeros({d.B, d.C, d.W}, x.options());
    at::Tensor db_part = has_bias ? at::zeros({d.B, d.C}, x.options()) : at::Tensor();
    at::Tensor dinit = has_init ? at::zeros_like(init) : at::Tensor();
    gp.dx = dx.data_ptr(), gp.dweight_part = dw_part.data_ptr();
    gp.dbias_part = has_bias ? db_part.data_ptr() : nullptr;
    gp.dinit = has_init ? dinit.data_ptr() : nullptr;
    if (d.B * d.C > 0) conv1d_backward_cpu(gp, x.scalar_type());
    at::Tensor dweight = sum_rows_in_order(dw_part);
    at::Tensor dbias = has_bias ? sum_rows_in_order(db_part) : at::Tensor();
    return {dx, dweight, dbias, dinit, at::Tensor(), at::Tensor()};
  }

  // The CUDA backward: every gradient written by the kernels, dweight and dbias reduced inside.
  static variable_list backward_cuda(Conv1dGradParams& gp, const Dims& d, const at::Tensor& x,
                                     const at::Tensor& weight, bool has_bias, const at::Tensor& init) {
    const bool has_init = init.defined();
    if (d.B * d.L * d.C == 0) {  // nothing reaches the weights; the initial state reaches nothing
      return {at::zeros_like(x), at::zeros_like(weight), has_bias ? at::zeros({d.C}, x.options()) : at::Tensor(),
              has_init ? at::zeros_like(init) : at::Tensor(), at::Tensor(), at::Tensor()};
    }
    at::Tensor dx = new_output_like(x), dweight = new_output_like(weight);
    at::Tensor dbias = has_bias ? new_output({d.C}, x.options()) : at::Tensor();
    at::Tensor dinit = has_init ? new_output_like(init) : at::Tensor();
    at::Tensor work = at::empty({conv1d_cuda_workspace(gp.fwd)}, x.options().dtype(at::kFloat));
    gp.dx = dx.data_ptr(), gp.dweight = dweight.data_ptr();
    gp.dbias = has_bias ? dbias.data_ptr() : nullptr;
    gp.dinit = has_init ? dinit.data_ptr() : nullptr;
    gp.workspace = work.data_ptr();
    HAX_CUDA_LAUNCH(kOp, x, conv1d_backward_cuda(gp, kernel_dtype(x), cuda_stream(x)));
    return {dx, dweight, dbias, dinit, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> causal_conv1d(const at::Tensor& x, const at::Tensor& weight,
                                                 const at::Tensor& bias, const at::Tensor& init_state,
                                                 const at::Tensor& seq_idx, bool silu) {
  HAX_CHECK(x.defined(), "{}: tensor x is missing", kOp);
  if (autocast_cast_needed({x, weight, bias, init_state}))
    return causal_conv1d(autocast_cast(x), autocast_cast(weight), autocast_cast(bias), autocast_cast(init_state),
                         seq_idx, silu);
  auto absent = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, x.options()); };
  auto out = Conv1dFunction::apply(x, weight, absent(bias), absent(init_state), absent(seq_idx), silu);
  return {out[0], out[1]};
}

}  // namespace hax::ops
