// Backend selection in the ops' binding layers: which device a tensor is on, whether this build has
// the CUDA kernels, which element type and stream a kernel gets, and output allocation (poisoned in
// tests, so that an element a kernel forgets to write fails the comparison).
#pragma once
#include <ATen/ATen.h>

#include <initializer_list>

#include "ops/kernel_dtype.h"

namespace hax::ops {

// Whether this build compiled the CUDA kernels and links a LibTorch that can hold CUDA tensors.
bool cuda_backend_built();
// Whether a CUDA device is usable now (the backend is built and a GPU is present).
bool cuda_available();

// `t` must be on the CPU, or on a CUDA device when this build has the CUDA kernels; a clear error
// names the op and tensor otherwise.
void check_backend(const char* op, const char* name, const at::Tensor& t);

// The kernel element type of a CUDA tensor (float32 or bfloat16; checked by check_floating).
DType kernel_dtype(const at::Tensor& t);

// Makes t's device current and returns LibTorch's current stream on it (a cudaStream_t), so hax's
// kernels order with LibTorch's own work. Only for CUDA tensors.
void* cuda_stream(const at::Tensor& t);

// at::empty, filled with NaN (floating) or INT_MIN (integer) while poisoning is on (tests).
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options);
at::Tensor new_output_like(const at::Tensor& t);
// A contiguous copy of t whose data is 16-byte aligned (kernels with cp.async or 16-byte loads
// and stores need it): t itself when it already is.
at::Tensor aligned_contiguous(const at::Tensor& t);
void set_poison_outputs(bool on);
bool poison_outputs();

// Deterministic mode (hax train --deterministic): backward kernels that would sum with float atomics
// (whose order varies run to run) use a fixed-order reduction instead. Off by default on CUDA; the
// CPU kernels are always deterministic. It also switches LibTorch's deterministic algorithms on or
// off (its own ops on CUDA: gather's and index_select's backward, index_add, ...; an op
// without a deterministic form then fails with LibTorch's error instead of varying silently), and,
// turning it on, sets CUBLAS_WORKSPACE_CONFIG=:4096:8 where the environment does not set it
// (LibTorch refuses cuBLAS calls in that mode without it). HAX_TORCH_DETERMINISTIC=0 leaves
// LibTorch's setting off (only hax's kernels are then deterministic), for an op LibTorch refuses.
void set_deterministic(bool on);
bool deterministic();
// Sets deterministic mode for a scope and puts the previous mode back when it ends.
class DeterministicScope {
 public:
  explicit DeterministicScope(bool on) : before_(deterministic()) { set_deterministic(on); }
  ~DeterministicScope() { set_deterministic(before_); }
  DeterministicScope(const DeterministicScope&) = delete;
  DeterministicScope& operator=(const DeterministicScope&) = delete;

 private:
  bool before_;
};

// Mixed precision (hax train --precision bf16): whether LibTorch's autocast is on for CUDA now.
bool cuda_autocast_enabled();
// Under autocast on CUDA, hax's ops take every float input in bfloat16 (the kernels accumulate in
// float32): true when one of `ts` is a CUDA float tensor of another dtype, which the op's public
// function then casts with autocast_cast and calls itself again.
bool autocast_cast_needed(std::initializer_list<at::Tensor> ts);
at::Tensor autocast_cast(const at::Tensor& t);  // bfloat16 copy of a float tensor (others unchanged)

// The error for a CUDA tensor in a build without the CUDA kernels.
[[noreturn]] void no_cuda_kernels(const char* op, const at::Tensor& t);

}  // namespace hax::ops

// Calls a CUDA kernel launcher when this build has them; otherwise reports that it has none.
// HAX_CUDA_LAUNCH(op, tensor, launcher(args...));
#if defined(HAX_CUDA_KERNELS)
#define HAX_CUDA_LAUNCH(op, t, ...) __VA_ARGS__
#else
#define HAX_CUDA_LAUNCH(op, t, ...) ::hax::ops::no_cuda_kernels(op, t)
#endif
