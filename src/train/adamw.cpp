#include "train/adamw.h"

#include <torch/version.h>

#include <cmath>
#include <optional>

#include "core/error.h"
#include "ops/check.h"

// LibTorch's fused multi-tensor kernels (_fused_adamw_, _foreach_norm, _foreach_mul_ by a device
// scalar) with the signatures used here: 2.4 and later. Debian's LibTorch 1.13 takes the per-tensor path.
#if defined(TORCH_VERSION_MAJOR) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))
#define HAX_FUSED_OPTIM 1
#else
#define HAX_FUSED_OPTIM 0
#endif

namespace hax {

bool fused_optimizer_built() { return HAX_FUSED_OPTIM != 0; }

AdamW::AdamW(std::map<std::string, at::Tensor> params, AdamWOptions opts) : params_(std::move(params)), o_(opts) {
  for (auto& [name, p] : params_) {
    m_[name] = at::zeros_like(p, at::MemoryFormat::Contiguous).detach();
    v_[name] = at::zeros_like(p, at::MemoryFormat::Contiguous).detach();
  }
  fused_ = HAX_FUSED_OPTIM && o_.fused && !params_.empty();
  for (auto& [name, p] : params_)
    fused_ = fused_ && p.is_cuda() && p.scalar_type() == at::kFloat && p.is_contiguous() &&
             p.device() == params_.begin()->second.device();
  if (fused_) {
    for (auto& [name, p] : params_) {
      ps_.push_back(p);
      ms_.push_back(m_[name]);
      vs_.push_back(v_[name]);
      step_counts_.push_back(at::zeros({1}, p.options().dtype(at::kFloat)));
    }
  }
}

void AdamW::step(double lr, const at::Tensor& skip) {
  if (fused_) return fused_step(lr, skip);
  torch::NoGradGuard ng;
  if (skip.defined() && skip.item<double>() != 0) return;  // reads the device (only off the fused path)
  ++t_;
  const double bc1 = 1.0 - std::pow(o_.beta1, (double)t_);
  const double bc2 = 1.0 - std::pow(o_.beta2, (double)t_);
  for (auto& [name, p] : params_) {
    at::Tensor g = p.grad();
    if (!g.defined()) g = at::zeros_like(p);
    at::Tensor& m = m_[name];
    at::Tensor& v = v_[name];
    p.mul_(1.0 - lr * o_.weight_decay);
    m.mul_(o_.beta1).add_(g, 1.0 - o_.beta1);
    v.mul_(o_.beta2).addcmul_(g, g, 1.0 - o_.beta2);
    at::Tensor denom = (v.sqrt() / std::sqrt(bc2)).add_(o_.eps);
    p.addcdiv_(m, denom, -lr / bc1);
  }
}

// The fused update with the learning rate as a number (lr_t undefined) or read on the device.
void AdamW::fused_update(double lr, const at::Tensor& lr_t, const at::Tensor& skip) {
#if HAX_FUSED_OPTIM
  torch::NoGradGuard ng;
  std::vector<at::Tensor> gs;
  gs.reserve(ps_.size());
  for (auto& p : ps_) {
    at::Tensor g = p.grad();
    gs.push_back(g.defined() ? g : at::zeros_like(p));
  }
  // The kernel reads each parameter's step count on the device (bias corrections 1 - beta^t);
  // with found_inf non-zero it leaves parameters and moments untouched (the counts still advance:
  // the trainer stops at such a step).
  at::_foreach_add_(step_counts_, 1.0);
  std::optional<at::Tensor> found_inf;
  if (skip.defined()) found_inf = skip.to(ps_[0].device(), at::kFloat).reshape({1});
  if (lr_t.defined())
    at::_fused_adamw_(ps_, gs, ms_, vs_, /*max_exp_avg_sqs=*/at::TensorList(), step_counts_, lr_t, o_.beta1,
                      o_.beta2, o_.weight_decay, o_.eps, /*amsgrad=*/false, /*maximize=*/false,
                      /*grad_scale=*/std::nullopt, found_inf);
  else
    at::_fused_adamw_(ps_, gs, ms_, vs_, /*max_exp_avg_sqs=*/at::TensorList(), step_counts_, lr, o_.beta1, o_.beta2,
                      o_.weight_decay, o_.eps, /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt,
                      found_inf);
#else
  (void)lr, (void)lr_t, (void)skip;
  fail("AdamW: the fused optimizer needs LibTorch >= 2.4");
#endif
}

void AdamW::step_on_device(const at::Tensor& lr, const at::Tensor& skip) {
  HAX_CHECK(fused_, "AdamW::step_on_device needs the fused CUDA path (float32 CUDA parameters, LibTorch >= 2.4)");
  fused_update(0.0, lr, skip);
}

void AdamW::fused_step(double lr, const at::Tensor& skip) {
  ++t_;
  fused_update(lr, at::Tensor(), skip);
}

void AdamW::zero_grad() {
  for (auto& [name, p] : params_)
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
}

std::map<std::string, at::Tensor> AdamW::state_tensors() const {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, m] : m_) out["optim.exp_avg." + name] = m;
  for (auto& [name, v] : v_) out["optim.exp_avg_sq." + name] = v;
  return out;
}

void AdamW::load_state(const std::map<std::string, at::Tensor>& tensors, int64_t steps, const std::string& what) {
  torch::NoGradGuard ng;
  for (auto* slot : {&m_, &v_}) {
    const std::string prefix = slot == &m_ ? "optim.exp_avg." : "optim.exp_avg_sq.";
    for (auto& [name, t] : *slot) {
      auto it = tensors.find(prefix + name);
      HAX_CHECK(it != tensors.end(), "{} has no optimizer state {}{}", what, prefix, name);
      HAX_CHECK(it->second.sizes() == t.sizes(), "{}: optimizer state {}{} has shape {} but the model needs {}", what,
                prefix, name, ops::shape_str(it->second.sizes()), ops::shape_str(t.sizes()));
      t.copy_(it->second);
    }
  }
  t_ = steps;
  for (auto& s : step_counts_) s.fill_((double)steps);
}

namespace {

// The reference: per-tensor float64 sums of squares, one read-back, per-tensor scaling.
double clip_reference(const std::map<std::string, at::Tensor>& params, double max_norm) {
  torch::NoGradGuard ng;
  std::vector<at::Tensor> sums;  // on the parameters' device: one transfer at the end
  for (auto& [name, p] : params)
    if (p.grad().defined()) sums.push_back(p.grad().to(at::kDouble).pow(2).sum());
  const double norm = sums.empty() ? 0.0 : std::sqrt(at::stack(sums).sum().item<double>());
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (auto& [name, p] : params)
      if (p.grad().defined()) p.mutable_grad().mul_(scale);
  }
  return norm;
}

}  // namespace

double clip_grad_norm(const std::map<std::string, at::Tensor>& params, double max_norm) {
  return clip_grad_norm_async(params, max_norm).item<double>();
}

at::Tensor clip_grad_norm_async(const std::map<std::string, at::Tensor>& params, double max_norm) {
  torch::NoGradGuard ng;
  std::vector<at::Tensor> gs;
  bool fused = HAX_FUSED_OPTIM;
  for (auto& [name, p] : params) {
    if (!p.grad().defined()) continue;
    gs.push_back(p.grad());
    fused = fused && gs.back().is_cuda() && gs.back().scalar_type() == at::kFloat &&
            gs.back().device() == gs.front().device();
  }
  if (!fused || gs.empty()) {
    const at::Device dev = !gs.empty()      ? gs.front().device()
                           : params.empty() ? at::Device(at::kCPU)
                                            : params.begin()->second.device();
    return at::scalar_tensor(clip_reference(params, max_norm), at::TensorOptions().dtype(at::kDouble).device(dev));
  }
#if HAX_FUSED_OPTIM
  // Per-tensor L2 norms in one multi-tensor launch, combined in float64.
  const at::Tensor norm = at::stack(at::_foreach_norm(gs, 2)).to(at::kDouble).pow(2).sum().sqrt();
  if (max_norm > 0) {
    const at::Tensor scale = at::where(norm > max_norm, (norm + 1e-6).reciprocal() * max_norm, at::ones_like(norm));
    at::_foreach_mul_(gs, scale.to(at::kFloat));
  }
  return norm;
#else
  return at::Tensor();
#endif
}

}  // namespace hax
