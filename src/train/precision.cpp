#include "train/precision.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include "core/error.h"
#include "ops/backend.h"

namespace hax {

void check_precision(const std::string& precision, const at::Device& device) {
  HAX_CHECK(precision == "fp32" || precision == "bf16", "--precision {} is unknown; choose fp32 or bf16", precision);
  HAX_CHECK(precision == "fp32" || device.is_cuda(),
            "--precision bf16 runs on CUDA only (hax's CPU kernels compute in float32/float64); use --device cuda "
            "or --precision fp32");
}

namespace {

void set_cuda_autocast(bool on) {
#if TORCH_VERSION_MAJOR >= 2 && TORCH_VERSION_MINOR >= 4 || TORCH_VERSION_MAJOR > 2
  at::autocast::set_autocast_enabled(at::kCUDA, on);
  if (on) at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
#else
  at::autocast::set_enabled(on);
  if (on) at::autocast::set_autocast_gpu_dtype(at::kBFloat16);
#endif
}

}  // namespace

AutocastScope::AutocastScope(const std::string& precision, const at::Device& device) {
  check_precision(precision, device);
  if (precision != "bf16") return;
  on_ = true;
  was_enabled_ = ops::cuda_autocast_enabled();
  set_cuda_autocast(true);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!on_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_cuda_autocast(was_enabled_);
}

bool autocast_enabled(const at::Device& device) { return device.is_cuda() && ops::cuda_autocast_enabled(); }

}  // namespace hax
