// The GPU half of the op harness: every CUDA op, forward and backward, against the CPU op on the same
// inputs (float32, the CPU op being itself checked against float64 definitions), and in bfloat16
// against the float64 definition with a tolerance set by a naive bfloat16 computation. Outputs are
// poisoned (NaN) before each GPU run, so an element a kernel never writes fails.
//
// Without a CUDA device (or a build without the CUDA backend) every GPU test skips, and GoogleTest
// lists it as SKIPPED, never as passed.
#pragma once
#include "op_harness.h"
#include "ops/backend.h"

namespace hax::testing {

#define HAX_REQUIRE_CUDA()                                                                      \
  do {                                                                                          \
    if (!::hax::ops::cuda_available())                                                          \
      GTEST_SKIP() << (::hax::ops::cuda_backend_built() ? "no CUDA device on this machine"      \
                                                        : "this build has no CUDA backend");    \
  } while (0)

// Sets a process-wide on/off switch of the ops (a get/set pair, e.g. a kernel form) while alive,
// and restores it after.
struct ScopedSwitch {
  void (*set)(bool);
  bool before;
  ScopedSwitch(bool (*get)(), void (*set_to)(bool), bool on) : set(set_to), before(get()) { set(on); }
  ~ScopedSwitch() { set(before); }
  ScopedSwitch(const ScopedSwitch&) = delete;
  ScopedSwitch& operator=(const ScopedSwitch&) = delete;
};

// Runs `first`, then `second` from the same state of the default CPU generator (so it sees the
// same random inputs and cotangents), then leaves the generator where `first` alone left it: the
// draws of the checks after them stay those of `first` alone. (For a second kernel form checked
// on the cases of an existing test without changing that test's other cases.)
inline void with_same_draws(const std::function<void()>& first, const std::function<void()>& second) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  const at::Tensor start = gen.get_state();
  first();
  const at::Tensor after = gen.get_state();
  gen.set_state(start);
  second();
  gen.set_state(after);
}

// Copies inputs to `device` in `dtype` (floating ones; integer ones keep theirs), keeping requires_grad.
inline Tensors to_device(const Tensors& in, const at::Device& device, at::ScalarType dtype) {
  Tensors out;
  for (const auto& t : in) {
    if (!t.defined()) {
      out.push_back(t);
      continue;
    }
    at::Tensor c = t.detach();
    c = at::isFloatingType(c.scalar_type()) ? c.to(device, dtype) : c.to(device);
    out.push_back(c.clone().requires_grad_(t.requires_grad()));
  }
  return out;
}

// Runs fn on `inputs` (any device), then backward of Σ_k <out_k, w_k> (w on the CPU, float64);
// returns outputs and input gradients on the CPU in float64.
inline std::pair<Tensors, Tensors> run_on_device(const std::function<Tensors(const Tensors&)>& fn,
                                                 const Tensors& inputs, const Tensors& cotangents) {
  Tensors in = clone_leaves(inputs);
  Tensors out = fn(in);
  std::vector<at::Tensor> roots, grads_in;
  for (size_t k = 0; k < out.size(); ++k) {
    if (!out[k].defined() || !out[k].requires_grad()) continue;
    roots.push_back(out[k]);
    grads_in.push_back(cotangents[k].to(out[k].device(), out[k].scalar_type()));
  }
  if (!roots.empty()) torch::autograd::backward(roots, grads_in);
  Tensors outs, grads;
  for (auto& o : out) outs.push_back(o.defined() ? o.detach().to(at::kCPU, at::kDouble) : o);
  for (const auto& t : in)
    grads.push_back(t.defined() && t.requires_grad() && t.grad().defined() ? t.grad().to(at::kCPU, at::kDouble)
                                                                           : at::Tensor());
  return {outs, grads};
}

// The CUDA op equals the CPU op in float32 within (atol, rtol), outputs and every input gradient;
// atol is relative to the tensor's largest entry (sums over many rows differ in rounding order).
inline void expect_cuda_matches_cpu(const OpCase& c, double atol, double rtol) {
  ops::set_poison_outputs(true);
  Tensors cpu_in = to_device(c.make_inputs(at::kFloat), at::kCPU, at::kFloat);
  Tensors gpu_in = to_device(cpu_in, at::Device(at::kCUDA, 0), at::kFloat);
  Tensors w = random_cotangents(c.op(clone_leaves(cpu_in)));
  auto [ref_out, ref_grads] = run_on_device(c.op, cpu_in, w);
  auto [out, grads] = run_on_device(c.op, gpu_in, w);
  ops::set_poison_outputs(false);
  ASSERT_EQ(out.size(), ref_out.size()) << c.name;
  for (size_t k = 0; k < out.size(); ++k) {
    if (!ref_out[k].defined()) continue;
    ASSERT_EQ(out[k].sizes(), ref_out[k].sizes()) << c.name << " output " << k;
    const double a = atol * std::max(1.0, ref_out[k].numel() ? ref_out[k].abs().max().item<double>() : 0.0);
    EXPECT_LE(rel_err(out[k], ref_out[k], a, rtol), 1.0) << c.name << ": CUDA output " << k << " differs from the CPU's";
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!cpu_in[i].defined() || !cpu_in[i].requires_grad()) continue;
    ASSERT_TRUE(grads[i].defined()) << c.name << ": no CUDA gradient for input " << i;
    const double a = atol * std::max(1.0, ref_grads[i].numel() ? ref_grads[i].abs().max().item<double>() : 0.0);
    EXPECT_LE(rel_err(grads[i], ref_grads[i], a, rtol), 1.0)
        << c.name << ": CUDA gradient of input " << i << " differs from the CPU's";
  }
}

// Max |a - ref| over max |ref| (0 for empty tensors).
inline double scaled_err(const at::Tensor& a, const at::Tensor& ref) {
  if (ref.numel() == 0) return 0;
  const double scale = std::max(ref.abs().max().item<double>(), 1e-30);
  return (a - ref).abs().max().item<double>() / scale;
}

// Two runs (run_on_device's outputs and input gradients) agree: every output, and the gradient of
// every input the reference run has one for, within `tol` of the reference's largest entry.
inline void expect_runs_close(const std::pair<Tensors, Tensors>& run, const std::pair<Tensors, Tensors>& ref,
                              double tol) {
  ASSERT_EQ(run.first.size(), ref.first.size());
  for (size_t k = 0; k < run.first.size(); ++k)
    EXPECT_LE(scaled_err(run.first[k], ref.first[k]), tol) << "output " << k;
  for (size_t i = 0; i < ref.second.size(); ++i) {
    if (!ref.second[i].defined()) continue;
    ASSERT_TRUE(run.second[i].defined()) << "no gradient for input " << i;
    EXPECT_LE(scaled_err(run.second[i], ref.second[i]), tol) << "gradient " << i;
  }
}

// Two runs of the CUDA op on the same inputs (in `dtype`) and cotangents give bit-identical outputs
// and input gradients (backward passes without float atomics).
inline void expect_cuda_runs_bit_identical(const OpCase& c, at::ScalarType dtype) {
  Tensors in = to_device(c.make_inputs(at::kFloat), at::Device(at::kCUDA, 0), dtype);
  Tensors w = random_cotangents(c.op(clone_leaves(in)));
  auto [o1, g1] = run_on_device(c.op, in, w);
  auto [o2, g2] = run_on_device(c.op, in, w);
  for (size_t k = 0; k < o1.size(); ++k) {
    if (o1[k].defined()) {
      EXPECT_TRUE(at::equal(o1[k], o2[k])) << c.name << ": output " << k;
    }
  }
  for (size_t i = 0; i < g1.size(); ++i) {
    if (g1[i].defined()) {
      EXPECT_TRUE(at::equal(g1[i], g2[i])) << c.name << ": gradient " << i;
    }
  }
}

// The CUDA op in bfloat16 against the same op on the CPU in float64, on the same bfloat16-rounded
// inputs and cotangents: every output and gradient within `tol` of the CPU's largest entry (for
// lengths where the dense float64 reference has no room).
inline void expect_cuda_bf16_close_to_cpu_float64(const OpCase& c, double tol) {
  Tensors in = to_device(c.make_inputs(at::kFloat), at::Device(at::kCUDA, 0), at::kBFloat16);
  Tensors w = random_cotangents(c.op(clone_leaves(in)));
  expect_runs_close(run_on_device(c.op, in, w), run_on_device(c.op, to_device(in, at::Device(at::kCPU), at::kDouble), w),
                    tol);
}

// The CUDA op in bfloat16 against the float64 definition on the same (bfloat16-rounded) inputs: each
// output's and gradient's error is at most 2x that of a naive bfloat16 computation (the float64
// definition's result rounded to bfloat16 after every input was), plus `floor` (relative to the
// tensor's largest entry) for outputs that a naive rounding gets exactly.
inline void expect_cuda_bf16_close(const OpCase& c, double floor = 2e-3) {
  ops::set_poison_outputs(true);
  Tensors in64 = c.make_inputs(at::kDouble);
  Tensors in16 = to_device(in64, at::kCPU, at::kBFloat16);
  Tensors ref_in = to_device(in16, at::kCPU, at::kDouble);
  Tensors gpu_in = to_device(in16, at::Device(at::kCUDA, 0), at::kBFloat16);
  Tensors w = random_cotangents(c.reference(clone_leaves(ref_in)));
  // The GPU op receives the cotangents in bfloat16: the reference gets the same rounded values.
  for (auto& t : w)
    if (t.defined()) t = t.to(at::kBFloat16).to(at::kDouble);
  auto [ref_out, ref_grads] = run_on_device(c.reference, ref_in, w);
  auto [out, grads] = run_on_device(c.op, gpu_in, w);
  ops::set_poison_outputs(false);
  auto naive = [](const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kDouble); };
  for (size_t k = 0; k < out.size(); ++k) {
    if (!ref_out[k].defined() || !at::isFloatingType(ref_out[k].scalar_type())) continue;
    const double e = scaled_err(out[k], ref_out[k]), en = scaled_err(naive(ref_out[k]), ref_out[k]);
    EXPECT_LE(e, 2 * en + floor) << c.name << ": bf16 output " << k << " error " << e << " vs naive " << en;
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!in16[i].defined() || !in16[i].requires_grad()) continue;
    ASSERT_TRUE(grads[i].defined()) << c.name << ": no CUDA gradient for input " << i;
    const double e = scaled_err(grads[i], ref_grads[i]), en = scaled_err(naive(ref_grads[i]), ref_grads[i]);
    EXPECT_LE(e, 2 * en + floor) << c.name << ": bf16 gradient of input " << i << " error " << e << " vs naive " << en;
  }
}

}  // namespace hax::testing
