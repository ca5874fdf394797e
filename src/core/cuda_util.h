// CUDA utilities for benchmarks and the trainer, usable from code that also builds without CUDA
// (each call then fails with a clear error; check ops::cuda_available() first).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace hax {

// Milliseconds between CUDA events recorded on the current stream before and after `calls`
// back-to-back calls of fn (which enqueues GPU work), divided by `calls`; waits for the end event.
// With calls > 1 the host enqueues the next call while the GPU runs the last, so host overhead
// shorter than a call's GPU time is hidden (as in a training loop); calls = 1 includes it.
double cuda_elapsed_ms(const std::function<void()>& fn, int calls = 1);
void cuda_synchronize();
// Peak bytes allocated by LibTorch's CUDA allocator since the last reset (current device).
void cuda_reset_peak_memory();
int64_t cuda_peak_memory_bytes();
int64_t cuda_allocated_bytes();
std::string cuda_device_name();

}  // namespace hax
