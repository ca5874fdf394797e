// One harness for every op: forward and backward of the op under test against an independent
// reference (a brute-force definition written with LibTorch ops, differentiated by autograd, in
// float64), and finite-difference gradient checks of the op itself in float64.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include "core/error.h"
#include <string>
#include <tuple>
#include <vector>

namespace hax::testing {

using Tensors = std::vector<at::Tensor>;

struct OpCase {
  std::string name;
  // Fresh random inputs in `dtype` (float64 for oracles). Tensors that the op differentiates
  // must have requires_grad set; others (indices, masks) must not.
  std::function<Tensors(at::ScalarType dtype)> make_inputs;
  // The op under test and its reference; both return the outputs to compare.
  std::function<Tensors(const Tensors&)> op;
  std::function<Tensors(const Tensors&)> reference;
};

// Attention inputs: q, k (B, L, H, D) and v (B, L, H, Dv), standard normal in `dtype`, each
// requiring a gradient.
inline Tensors random_qkv(int64_t B, int64_t L, int64_t H, int64_t D, int64_t Dv, at::ScalarType dtype) {
  const auto o = at::TensorOptions().dtype(dtype);
  return {at::randn({B, L, H, D}, o).requires_grad_(), at::randn({B, L, H, D}, o).requires_grad_(),
          at::randn({B, L, H, Dv}, o).requires_grad_()};
}

// An attention op as the harness calls it: (q, k, v, scale) -> (out, lse).
using QkvAttention = std::function<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                      const at::Tensor&, double)>;

// The OpCase of such an op and its reference on random_qkv inputs, scale 1/sqrt(D): outputs out
// and lse (out only with out_only), lse passed through lse_map when one is given (for instance to
// make the -inf of queries without keys comparable).
inline OpCase qkv_attention_case(const std::string& name, int64_t B, int64_t L, int64_t H, int64_t D, int64_t Dv,
                                 QkvAttention op, QkvAttention reference, bool out_only,
                                 std::function<at::Tensor(const at::Tensor&)> lse_map = {}) {
  OpCase c;
  c.name = name + (out_only ? " (out only)" : "");
  c.make_inputs = [=](at::ScalarType dt) { return random_qkv(B, L, H, D, Dv, dt); };
  const double scale = 1.0 / std::sqrt(double(D));
  auto outputs = [=](const std::tuple<at::Tensor, at::Tensor>& r) {
    const at::Tensor& lse = std::get<1>(r);
    return out_only ? Tensors{std::get<0>(r)} : Tensors{std::get<0>(r), lse_map ? lse_map(lse) : lse};
  };
  c.op = [=](const Tensors& in) { return outputs(op(in[0], in[1], in[2], scale)); };
  c.reference = [=](const Tensors& in) { return outputs(reference(in[0], in[1], in[2], scale)); };
  return c;
}

// Max |a - b| / (atol + rtol |b|) over all elements; <= 1 passes.
inline double rel_err(const at::Tensor& a, const at::Tensor& b, double atol, double rtol) {
  if (a.numel() == 0) return 0;
  at::Tensor bd = b.to(at::kDouble), ad = a.to(at::kDouble);
  return ((ad - bd).abs() / (atol + rtol * bd.abs())).max().item<double>();
}

inline Tensors clone_leaves(const Tensors& in) {
  Tensors out;
  for (const auto& t : in) {
    if (!t.defined()) {
      out.push_back(t);
      continue;
    }
    at::Tensor c = t.detach().clone();
    if (t.requires_grad()) c.set_requires_grad(true);
    out.push_back(c);
  }
  return out;
}

// Runs fn, then backward of Σ_k <out_k, w_k>; returns outputs and input gradients.
inline std::pair<Tensors, Tensors> run_with_grads(const std::function<Tensors(const Tensors&)>& fn,
                                                  const Tensors& inputs, const Tensors& cotangents) {
  Tensors in = clone_leaves(inputs);
  Tensors out = fn(in);
  at::Tensor loss = at::zeros({}, at::kDouble);
  bool any = false;
  for (size_t k = 0; k < out.size(); ++k) {
    if (!out[k].defined() || !out[k].requires_grad()) continue;
    loss = loss + (out[k].to(at::kDouble) * cotangents[k]).sum();
    any = true;
  }
  if (any) loss.backward();
  Tensors grads;
  for (const auto& t : in) grads.push_back(t.defined() && t.requires_grad() ? t.grad() : at::Tensor());
  Tensors outs;
  for (auto& o : out) outs.push_back(o.defined() ? o.detach() : o);
  return {outs, grads};
}

inline Tensors random_cotangents(const Tensors& outs) {
  Tensors w;
  for (const auto& o : outs) w.push_back(o.defined() ? at::randn(o.sizes(), at::kDouble) : at::Tensor());
  return w;
}

// Forward outputs and all input gradients of the op equal the reference's (both in `dtype`).
inline void expect_matches_reference(const OpCase& c, at::ScalarType dtype, double atol, double rtol) {
  Tensors inputs = c.make_inputs(dtype);
  Tensors ref_out0 = c.reference(clone_leaves(inputs));
  Tensors w = random_cotangents(ref_out0);
  auto [ref_out, ref_grads] = run_with_grads(c.reference, inputs, w);
  auto [out, grads] = run_with_grads(c.op, inputs, w);
  ASSERT_EQ(out.size(), ref_out.size()) << c.name;
  for (size_t k = 0; k < out.size(); ++k) {
    ASSERT_EQ(out[k].sizes(), ref_out[k].sizes()) << c.name << " output " << k;
    EXPECT_LE(rel_err(out[k], ref_out[k], atol, rtol), 1.0) << c.name << ": output " << k << " differs";
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!inputs[i].defined() || !inputs[i].requires_grad()) continue;
    ASSERT_TRUE(grads[i].defined()) << c.name << ": no gradient for input " << i;
    ASSERT_TRUE(ref_grads[i].defined()) << c.name << ": reference gives no gradient for input " << i;
    EXPECT_LE(rel_err(grads[i], ref_grads[i], atol, rtol), 1.0) << c.name << ": gradient of input " << i << " differs";
  }
}

// Directional finite differences of the op in float64: for random directions v_i on every
// differentiable input, (f(x + εv) - f(x - εv)) / 2ε · w equals Σ_i <grad_i, v_i>, and the same
// for each input alone.
inline void expect_gradients_match_finite_differences(const OpCase& c, int directions = 3, double eps = 1e-6,
                                                      double tol = 1e-6) {
  Tensors inputs = c.make_inputs(at::kDouble);
  Tensors out0 = c.op(clone_leaves(inputs));
  Tensors w = random_cotangents(out0);
  auto [out, grads] = run_with_grads(c.op, inputs, w);
  auto value = [&](const Tensors& in) {
    torch::NoGradGuard ng;
    Tensors o = c.op(in);
    double s = 0;
    for (size_t k = 0; k < o.size(); ++k)
      if (o[k].defined() && w[k].defined()) s += (o[k].to(at::kDouble) * w[k]).sum().item<double>();
    return s;
  };
  for (int trial = 0; trial < directions; ++trial) {
    for (int only = -1; only < (int)inputs.size(); ++only) {
      if (only >= 0 && !(inputs[only].defined() && inputs[only].requires_grad())) continue;
      Tensors plus, minus;
      double predicted = 0;
      for (size_t i = 0; i < inputs.size(); ++i) {
        const at::Tensor& t = inputs[i];
        bool diff = t.defined() && t.requires_grad() && (only < 0 || only == (int)i);
        if (!diff) {
          plus.push_back(t.defined() ? t.detach() : t);
          minus.push_back(t.defined() ? t.detach() : t);
          continue;
        }
        at::Tensor v = at::randn(t.sizes(), at::kDouble);
        plus.push_back(t.detach() + eps * v);
        minus.push_back(t.detach() - eps * v);
        predicted += (grads[i] * v).sum().item<double>();
      }
      double numeric = (value(plus) - value(minus)) / (2 * eps);
      EXPECT_NEAR(numeric, predicted, tol * (1 + std::abs(predicted)))
          << c.name << ": finite differences disagree with the backward (input " << only << ", trial " << trial << ")";
    }
  }
}

// Float32 run of the op against the float64 reference on the same inputs (the float64 inputs
// rounded to float32): outputs and all input gradients agree within (atol, rtol).
inline void expect_float32_close_to_reference(const OpCase& c, double atol, double rtol) {
  Tensors in64 = c.make_inputs(at::kDouble);
  Tensors in32 = in64;
  for (size_t i = 0; i < in64.size(); ++i) {
    const at::Tensor t = in64[i];
    if (!t.defined() || !at::isFloatingType(t.scalar_type())) continue;
    const bool grad = t.requires_grad();
    in32[i] = t.detach().to(at::kFloat).requires_grad_(grad);
    in64[i] = in32[i].detach().to(at::kDouble).requires_grad_(grad);
  }
  Tensors w = random_cotangents(c.reference(clone_leaves(in64)));
  auto [ref_out, ref_grads] = run_with_grads(c.reference, in64, w);
  auto [out, grads] = run_with_grads(c.op, in32, w);
  ASSERT_EQ(out.size(), ref_out.size()) << c.name;
  for (size_t k = 0; k < out.size(); ++k) {
    ASSERT_EQ(out[k].sizes(), ref_out[k].sizes()) << c.name << " output " << k;
    EXPECT_EQ(out[k].scalar_type(), at::kFloat) << c.name << " output " << k;
    EXPECT_LE(rel_err(out[k], ref_out[k], atol, rtol), 1.0) << c.name << ": float32 output " << k << " differs";
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!in32[i].defined() || !in32[i].requires_grad()) continue;
    ASSERT_TRUE(grads[i].defined()) << c.name << ": no gradient for input " << i;
    EXPECT_LE(rel_err(grads[i], ref_grads[i], atol, rtol), 1.0)
        << c.name << ": float32 gradient of input " << i << " differs";
  }
}

// Random packed sequence numbers (B, L), int32: each row is split into random-length segments,
// a new one starting at each position t > 0 with probability p.
inline at::Tensor random_packing(int64_t B, int64_t L, double p = 0.08) {
  at::Tensor s = at::zeros({B, L}, at::kInt);
  if (L == 0) return s;
  at::Tensor starts = (at::rand({B, L}, at::kDouble) < p).to(at::kInt);
  starts.select(1, 0).zero_();
  return starts.cumsum(1).to(at::kInt);
}

// fn must throw hax::UsageError whose message contains `needle`.
template <class F>
void expect_usage_error(F&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected a hax::UsageError mentioning \"" << needle << "\"";
  } catch (const hax::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "the message \"" << e.what() << "\" does not mention \"" << needle << "\"";
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a hax::UsageError mentioning \"" << needle << "\", got another exception: " << e.what();
  }
}

// The op gives bit-identical outputs and gradients on 1 and on 2 threads (`dtype` inputs).
inline void expect_deterministic_across_threads(const OpCase& c, at::ScalarType dtype = at::kFloat) {
  Tensors in = c.make_inputs(dtype);
  Tensors w = random_cotangents(c.op(clone_leaves(in)));
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  auto [o1, g1] = run_with_grads(c.op, in, w);
  at::set_num_threads(2);
  auto [o2, g2] = run_with_grads(c.op, in, w);
  at::set_num_threads(before);
  for (size_t k = 0; k < o1.size(); ++k) EXPECT_TRUE(at::equal(o1[k], o2[k])) << c.name << ": output " << k;
  for (size_t i = 0; i < g1.size(); ++i) {
    if (g1[i].defined()) {
      EXPECT_TRUE(at::equal(g1[i], g2[i])) << c.name << ": gradient " << i;
    }
  }
}

}  // namespace hax::testing
