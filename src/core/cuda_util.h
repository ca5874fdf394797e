// CUDA utilities for benchmarks and the trainer, usable from code that also builds without CUDA
// (each call then fails with a clear error; check ops::cuda_available() first).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace hax {

// Milliseconds between CUDA events recorded on the current stream before and after fn (which
// enqueues GPU work); waits for the end event.
double cuda_elapsed_ms(const std::function<void()>& fn);
void cuda_synchronize();
// Peak bytes allocated by LibTorch's CUDA allocator since the last reset (current device).
void cuda_reset_peak_memory();
int64_t cuda_peak_memory_bytes();
int64_t cuda_allocated_bytes();
std::string cuda_device_name();

}  // namespace hax
