#include "train/adamw.h"

#include <cmath>

#include "core/error.h"
#include "ops/check.h"

namespace hax {

AdamW::AdamW(std::map<std::string, at::Tensor> params, AdamWOptions opts) : params_(std::move(params)), o_(opts) {
  for (auto& [name, p] : params_) {
    m_[name] = at::zeros_like(p, at::MemoryFormat::Contiguous).detach();
    v_[name] = at::zeros_like(p, at::MemoryFormat::Contiguous).detach();
  }
}

void AdamW::step(double lr) {
  torch::NoGradGuard ng;
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
}

double clip_grad_norm(const std::map<std::string, at::Tensor>& params, double max_norm) {
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

}  // namespace hax
