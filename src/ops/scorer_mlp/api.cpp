// Binding layer of the scorer MLP: checks, dispatch (the fused CUDA kernel or the LibTorch
// definition), autograd.
#include <torch/torch.h>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/check.h"
#include "ops/scorer_mlp/params.h"
#include "ops/scorer_mlp/scorer_mlp.h"

namespace hax::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kOp = "scorer_mlp";

// Shapes and dtypes of every argument (the error names the tensor and the constraint).
void check_args(const at::Tensor& k, const at::Tensor& u, const at::Tensor& w1, const at::Tensor& b1,
                const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& w3, const at::Tensor& b3) {
  HAX_CHECK(k.defined() && k.dim() >= 1, "{}: k must have shape (..., N), got {}", kOp,
            k.defined() ? shape_str(k.sizes()) : std::string("an undefined tensor"));
  check_floating(kOp, "k", k);
  check_shape(kOp, "u", u, k.sizes().vec(), "k's shape (..., N)");
  const int64_t N = k.size(-1);
  check_rank(kOp, "w1", w1, 2, "(hidden, 2N)");
  const int64_t hidden = w1.size(0);
  check_shape(kOp, "w1", w1, {hidden, 2 * N}, "(hidden, 2N)");
  check_shape(kOp, "w2", w2, {hidden, hidden}, "(hidden, hidden)");
  check_shape(kOp, "w3", w3, {1, hidden}, "(1, hidden)");
  if (b1.defined()) check_shape(kOp, "b1", b1, {hidden}, "(hidden)");
  if (b2.defined()) check_shape(kOp, "b2", b2, {hidden}, "(hidden)");
  if (b3.defined()) check_shape(kOp, "b3", b3, {1}, "(1)");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"u", u}, {"w1", w1}, {"w2", w2}, {"w3", w3}})
    HAX_CHECK(t.device() == k.device(), "{}: {} is on {} but k is on {}; all tensors must be on one device", kOp, name,
              t.device().str(), k.device().str());
}

bool all_bf16(std::initializer_list<at::Tensor> ts) {
  for (const auto& t : ts)
    if (t.defined() && t.scalar_type() != at::kBFloat16) return false;
  return true;
}

// The definition in the arguments' dtype (no checks).
at::Tensor formula(const at::Tensor& k, const at::Tensor& u, const at::Tensor& w1, const at::Tensor& b1,
                   const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& w3, const at::Tensor& b3) {
  at::Tensor h = at::relu(at::linear(at::cat({k, u}, -1), w1, b1));
  h = at::relu(at::linear(h, w2, b2));
  return at::linear(h, w3, b3).squeeze(-1);
}

// Biases arrive as empty tensors when absent (LibTorch 1.13's apply cannot take undefined ones).
struct ScorerMlpFunction : public torch::autograd::Function<ScorerMlpFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor k, at::Tensor u, at::Tensor w1, at::Tensor b1,
                               at::Tensor w2, at::Tensor b2, at::Tensor w3, at::Tensor b3) {
    k = k.contiguous(), u = u.contiguous(), w1 = w1.contiguous(), w2 = w2.contiguous(), w3 = w3.contiguous();
    b1 = b1.contiguous(), b2 = b2.contiguous(), b3 = b3.contiguous();
    const int64_t N = k.size(-1);
    std::vector<int64_t> out_sizes(k.sizes().begin(), k.sizes().end() - 1);
    at::Tensor out = new_output(out_sizes, k.options());
    ScorerMlpParams p;
    p.rows = k.numel() / std::max<int64_t>(1, N), p.half = N, p.hidden = w1.size(0);
    p.k = k.data_ptr(), p.u = u.data_ptr();
    p.w1 = w1.data_ptr(), p.b1 = b1.numel() ? b1.data_ptr() : nullptr;
    p.w2 = w2.data_ptr(), p.b2 = b2.numel() ? b2.data_ptr() : nullptr;
    p.w3 = w3.data_ptr(), p.b3 = b3.numel() ? b3.data_ptr() : nullptr;
    p.out = out.data_ptr();
    HAX_CUDA_LAUNCH(kOp, k, scorer_mlp_forward_cuda(p, cuda_stream(k)));
    ctx->save_for_backward({k, u, w1, b1, w2, b2, w3});
    return {out};
  }

  // Recomputes the activations in float32 (LibTorch products) and returns the weights' and
  // biases' gradients in their dtype; k and u get none. float32, not the inputs' bfloat16: a
  // bfloat16 recompute moves pre-activations near 0 across the ReLU, and each such flip adds a
  // whole ds w3 term to the sums over rows (bias gradients 4-11% off a float64 reference).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto f = [](const at::Tensor& t) { return t.to(at::kFloat); };
    const at::Tensor w1 = f(s[2]), b1 = f(s[3]), w2 = f(s[4]), b2 = f(s[5]), w3 = f(s[6]);
    const at::Tensor ds = f(grads[0]).reshape({-1, 1});                    // (R, 1)
    const at::Tensor x = f(at::cat({s[0], s[1]}, -1)).reshape({ds.size(0), -1});  // (R, 2N)
    const at::Tensor h1 = at::relu(b1.numel() ? at::addmm(b1, x, w1.t()) : at::mm(x, w1.t()));
    const at::Tensor h2 = at::relu(b2.numel() ? at::addmm(b2, h1, w2.t()) : at::mm(h1, w2.t()));
    const at::Tensor dz2 = at::threshold_backward(at::mm(ds, w3), h2, 0);  // (R, hidden)
    const at::Tensor dz1 = at::threshold_backward(at::mm(dz2, w2), h1, 0);
    const auto dt = s[2].scalar_type();
    auto out = [&](const at::Tensor& g) { return g.to(dt); };
    return {at::Tensor(),
            at::Tensor(),
            out(at::mm(dz1.t(), x)),
            b1.numel() ? out(dz1.sum(0)) : at::Tensor(),
            out(at::mm(dz2.t(), h1)),
            b2.numel() ? out(dz2.sum(0)) : at::Tensor(),
            out(at::mm(ds.t(), h2)),
            ctx->needs_input_grad(7) ? out(ds.sum(0)) : at::Tensor()};
  }
};

}  // namespace

bool scorer_mlp_fused_applies(const at::Tensor& k, const at::Tensor& u, const at::Tensor& w1, const at::Tensor& w2) {
  if (!cuda_backend_built() || !k.defined() || !k.is_cuda() || k.dim() < 1 || !u.defined() || !w1.defined() ||
      w1.dim() != 2)
    return false;
  const bool dtypes = all_bf16({k, u, w1, w2}) || cuda_autocast_enabled();
  const auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  return dtypes && scorer_mlp_cuda_supports(k.size(-1), w1.size(0)) && aligned(k) && aligned(u);
}

at::Tensor scorer_mlp(const at::Tensor& k, const at::Tensor& u, const at::Tensor& w1, const at::Tensor& b1,
                      const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& w3, const at::Tensor& b3) {
  check_args(k, u, w1, b1, w2, b2, w3, b3);
  if (autocast_cast_needed({k, u, w1, b1, w2, b2, w3, b3}))
    return scorer_mlp(autocast_cast(k), autocast_cast(u), autocast_cast(w1), autocast_cast(b1), autocast_cast(w2),
                      autocast_cast(b2), autocast_cast(w3), autocast_cast(b3));
  const at::Tensor kd = k.detach(), ud = u.detach();
  if (!scorer_mlp_fused_applies(kd, ud, w1, w2) || !all_bf16({kd, ud, w1, b1, w2, b2, w3, b3}))
    return formula(kd, ud, w1, b1, w2, b2, w3, b3);
  const at::Tensor none = at::empty({0}, k.options());
  return ScorerMlpFunction::apply(kd, ud, w1, b1.defined() ? b1 : none, w2, b2.defined() ? b2 : none, w3,
                                  b3.defined() ? b3 : none)[0];
}

at::Tensor scorer_mlp_reference(const at::Tensor& k, const at::Tensor& u, const at::Tensor& w1, const at::Tensor& b1,
                                const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& w3,
                                const at::Tensor& b3) {
  return formula(k.detach(), u.detach(), w1, b1, w2, b2, w3, b3);
}

}  // namespace hax::ops
