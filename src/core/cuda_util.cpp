#include "core/cuda_util.h"

#include "core/error.h"

#if defined(HAX_TORCH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace hax {

#if defined(HAX_TORCH_CUDA)

double cuda_elapsed_ms(const std::function<void()>& fn, int calls) {
  HAX_CHECK(calls >= 1, "cuda_elapsed_ms: calls {} must be >= 1", calls);
  at::cuda::CUDAEvent start(cudaEventDefault), end(cudaEventDefault);
  start.record();
  for (int i = 0; i < calls; ++i) fn();
  end.record();
  end.synchronize();
  return (double)start.elapsed_time(end) / calls;
}

void cuda_synchronize() { c10::cuda::device_synchronize(); }

void cuda_reset_peak_memory() {
  c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
}

// allocated_bytes[0] is the allocator's aggregate over its pools (StatType::AGGREGATE = 0).
int64_t cuda_peak_memory_bytes() {
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
  return stats.allocated_bytes[0].peak;
}

int64_t cuda_allocated_bytes() {
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
  return stats.allocated_bytes[0].current;
}

std::string cuda_device_name() { return at::cuda::getCurrentDeviceProperties()->name; }

#else

namespace {
[[noreturn]] void no_cuda(const char* what) { fail("{}: this build of hax has no CUDA backend", what); }
}  // namespace
double cuda_elapsed_ms(const std::function<void()>&, int) { no_cuda("cuda_elapsed_ms"); }
void cuda_synchronize() { no_cuda("cuda_synchronize"); }
void cuda_reset_peak_memory() { no_cuda("cuda_reset_peak_memory"); }
int64_t cuda_peak_memory_bytes() { no_cuda("cuda_peak_memory_bytes"); }
int64_t cuda_allocated_bytes() { no_cuda("cuda_allocated_bytes"); }
std::string cuda_device_name() { no_cuda("cuda_device_name"); }

#endif

}  // namespace hax
