#include "ops/backend.h"

#include <atomic>
#include <climits>
#include <cstdlib>
#include <limits>
#include <string>

#include "core/error.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <torch/version.h>

#if defined(HAX_TORCH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace hax::ops {
namespace {
std::atomic<bool> g_poison{false};
std::atomic<bool> g_deterministic{false};
}

bool cuda_backend_built() {
#if defined(HAX_CUDA_KERNELS) && defined(HAX_TORCH_CUDA)
  return true;
#else
  return false;
#endif
}

bool cuda_available() { return cuda_backend_built() && at::hasCUDA(); }

[[noreturn]] void no_cuda_kernels(const char* op, const at::Tensor& t) {
  fail("{}: the tensors are on {}, but this build of hax has no CUDA kernels (configure it where nvcc and a "
       "CUDA-enabled LibTorch are found, or with -DHAX_CUDA=ON to require them)",
       op, t.device().str());
}

void check_backend(const char* op, const char* name, const at::Tensor& t) {
  if (t.device().is_cpu()) return;
  HAX_CHECK(t.device().is_cuda(), "{}: {} is on {}; hax runs on the CPU and on CUDA devices only", op, name,
            t.device().str());
  if (!cuda_backend_built()) no_cuda_kernels(op, t);
}

DType kernel_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    default: fail("CUDA kernels take float32 or bfloat16 tensors, not {}", c10::toString(t.scalar_type()));
  }
}

void* cuda_stream(const at::Tensor& t) {
#if defined(HAX_TORCH_CUDA)
  c10::cuda::set_device(t.device().index());
  return (void*)c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#else
  no_cuda_kernels("cuda_stream", t);
#endif
}

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (g_poison.load(std::memory_order_relaxed) && t.numel() > 0) {
    if (at::isFloatingType(t.scalar_type())) t.fill_(std::numeric_limits<double>::quiet_NaN());
    else t.fill_(INT_MIN);
  }
  return t;
}

at::Tensor new_output_like(const at::Tensor& t) { return new_output(t.sizes(), t.options()); }

at::Tensor aligned_contiguous(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone(at::MemoryFormat::Contiguous);
}

bool cuda_autocast_enabled() {
#if TORCH_VERSION_MAJOR >= 2 && TORCH_VERSION_MINOR >= 4 || TORCH_VERSION_MAJOR > 2
  return at::autocast::is_autocast_enabled(at::kCUDA);
#else
  return at::autocast::is_enabled();
#endif
}

bool autocast_cast_needed(std::initializer_list<at::Tensor> ts) {
  bool any_cuda = false, any_other = false;
  for (const at::Tensor& t : ts) {
    if (!t.defined() || !at::isFloatingType(t.scalar_type())) continue;
    any_cuda = any_cuda || t.is_cuda();
    any_other = any_other || t.scalar_type() != at::kBFloat16;
  }
  return any_cuda && any_other && cuda_autocast_enabled();
}

at::Tensor autocast_cast(const at::Tensor& t) {
  return t.defined() && at::isFloatingType(t.scalar_type()) ? t.to(at::kBFloat16) : t;
}

void set_deterministic(bool on) {
  g_deterministic.store(on);
  const char* e = std::getenv("HAX_TORCH_DETERMINISTIC");
  const bool torch_too = on && !(e && std::string(e) == "0");
  if (torch_too) setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::globalContext().setDeterministicAlgorithms(torch_too, /*warn_only=*/false);
}
bool deterministic() { return g_deterministic.load(); }

void set_poison_outputs(bool on) { g_poison.store(on); }
bool poison_outputs() { return g_poison.load(); }

}  // namespace hax::ops
