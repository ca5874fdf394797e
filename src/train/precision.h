// Mixed precision: --precision fp32 (everything in float32) or bf16 (LibTorch autocast on CUDA:
// matrix products run in bfloat16, hax's own kernels take bfloat16 activations and accumulate in
// float32, the weights and the optimizer state stay float32).
#pragma once
#include <ATen/ATen.h>

#include <string>

namespace hax {

// Checks a --precision value for a device ("fp32" anywhere, "bf16" on CUDA only).
void check_precision(const std::string& precision, const at::Device& device);

// Autocast on `device` for the scope's lifetime when precision is "bf16"; nothing for "fp32".
class AutocastScope {
 public:
  AutocastScope(const std::string& precision, const at::Device& device);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool on_ = false;
  bool was_enabled_ = false;
};

// Whether autocast is on for `device` now (ops cast their inputs to bfloat16 then).
bool autocast_enabled(const at::Device& device);

}  // namespace hax
