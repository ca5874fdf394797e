// Binding layer of the (gated) RMSNorm: tensor checks, dispatch to the kernels, autograd.
#include <torch/torch.h>

#include <cmath>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/check.h"
#include "ops/rmsnorm/rmsnorm.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "rmsnorm";

struct Dims {
  int64_t M, D, gs;
};

Dims check_inputs(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps,
                  int64_t group_size) {
  HAX_CHECK(x.defined(), "rmsnorm: tensor x is missing; it must be (..., D)");
  HAX_CHECK(x.dim() >= 1, "rmsnorm: x has shape {} but must have at least one dimension (..., D)",
            shape_str(x.sizes()));
  check_floating(kOp, "x", x);
  const int64_t D = x.size(-1);
  check_shape(kOp, "weight", weight, {D}, "(D)");
  check_same(kOp, "weight", weight, x);
  if (z.defined()) {
    HAX_CHECK(z.sizes() == x.sizes(), "rmsnorm: z has shape {} but must have x's shape {}", shape_str(z.sizes()),
              shape_str(x.sizes()));
    check_same(kOp, "z", z, x);
  }
  HAX_CHECK(group_size >= 0, "rmsnorm: group_size {} must be positive (or 0 for the whole last dim {})", group_size,
            D);
  const int64_t gs = group_size == 0 ? D : group_size;
  HAX_CHECK(D == 0 || D % gs == 0, "rmsnorm: group_size {} must divide the last dim {}", group_size, D);
  HAX_CHECK(std::isfinite(eps) && eps >= 0, "rmsnorm: eps {} must be finite and non-negative", eps);
  return {D > 0 ? x.numel() / D : 0, D, gs};
}

RmsNormParams make_params(const Dims& d, double eps, const at::Tensor& x, const at::Tensor& z,
                          const at::Tensor& weight) {
  RmsNormParams p;
  p.rows = d.M, p.dim = d.D, p.group_size = d.gs, p.eps = eps;
  p.x = x.data_ptr(), p.weight = weight.data_ptr();
  p.z = z.defined() ? z.data_ptr() : nullptr;
  return p;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rmsnorm_forward(const at::Tensor& x0, const at::Tensor& z0,
                                                   const at::Tensor& weight0, double eps, int64_t group_size) {
  Dims d = check_inputs(x0, z0, weight0, eps, group_size);
  at::Tensor x = x0.contiguous(), weight = weight0.contiguous(), z = z0.defined() ? z0.contiguous() : z0;
  RmsNormParams p = make_params(d, eps, x, z, weight);
  at::Tensor out = new_output_like(x);
  // rstd is float32 on CUDA (the kernels' math type), x's dtype on the CPU.
  at::Tensor rstd = new_output({d.M, p.ngroups()}, x.is_cuda() ? x.options().dtype(at::kFloat) : x.options());
  p.out = out.data_ptr(), p.rstd = rstd.data_ptr();
  if (d.M * d.D == 0) return {out, rstd};
  if (x.is_cuda())
    HAX_CUDA_LAUNCH(kOp, x, rmsnorm_forward_cuda(p, kernel_dtype(x), cuda_stream(x)));
  else
    rmsnorm_forward_cpu(p, x.scalar_type());
  return {out, rstd};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor z, at::Tensor weight, double eps,
                               int64_t group_size, bool has_z) {
    // An absent z arrives as an empty tensor (LibTorch's autograd needs defined ones).
    if (!has_z) z = at::Tensor();
    // Contiguous once here: the forward and the saved copies share them.
    x = x.contiguous();
    if (has_z) z = z.contiguous();
    auto [out, rstd] = rmsnorm_forward(x, z, weight, eps, group_size);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["has_z"] = has_z;
    ctx->save_for_backward({x.contiguous(), has_z ? z.contiguous() : at::zeros({0}, x.options()),
                            weight.contiguous(), rstd});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &weight = s[2], &rstd = s[3];
    const bool has_z = ctx->saved_data["has_z"].toBool();
    at::Tensor z = has_z ? s[1] : at::Tensor();
    const double eps = ctx->saved_data["eps"].toDouble();
    Dims d = check_inputs(x, z, weight, eps, ctx->saved_data["group_size"].toInt());
    at::Tensor dout = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(x);
    RmsNormGradParams gp;
    gp.fwd = make_params(d, eps, x, z, weight);
    gp.fwd.rstd = rstd.data_ptr();
    at::Tensor dx = new_output_like(x), dz = has_z ? new_output_like(z) : at::Tensor();
    // dweight is reduced in float32 on CUDA, in x's dtype on the CPU.
    // (The CUDA kernels write every entry when there are rows.)
    const bool cuda_writes = x.is_cuda() && d.M * d.D > 0;
    at::Tensor dweight = cuda_writes ? new_output(weight.sizes(), weight.options().dtype(at::kFloat))
                                     : at::zeros(weight.sizes(), x.is_cuda() ? weight.options().dtype(at::kFloat)
                                                                             : weight.options());
    gp.dout = dout.data_ptr();
    gp.dx = dx.data_ptr(), gp.dz = has_z ? dz.data_ptr() : nullptr, gp.dweight = dweight.data_ptr();
    if (d.M * d.D == 0) {
      dx.zero_(), has_z ? dz.zero_() : dz;
    } else if (x.is_cuda()) {
      at::Tensor work = at::empty({rmsnorm_cuda_workspace(gp.fwd)}, x.options().dtype(at::kFloat));
      gp.workspace = work.data_ptr();
      HAX_CUDA_LAUNCH(kOp, x, rmsnorm_backward_cuda(gp, kernel_dtype(x), cuda_stream(x)));
    } else {
      rmsnorm_backward_cpu(gp, x.scalar_type());
    }
    return {dx, dz, dweight.to(weight.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps,
                   int64_t group_size) {
  HAX_CHECK(x.defined(), "rmsnorm: tensor x is missing; it must be (..., D)");
  if (autocast_cast_needed({x, z, weight}))
    return rmsnorm(autocast_cast(x), autocast_cast(z), autocast_cast(weight), eps, group_size);
  at::Tensor zz = z.defined() ? z : at::empty({0}, x.options());
  return RmsNormFunction::apply(x, zz, weight, eps, group_size, z.defined())[0];
}

}  // namespace hax::ops
