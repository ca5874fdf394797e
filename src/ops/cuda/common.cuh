// Shared device helpers of hax's CUDA kernels: element loads and stores that accumulate in float32
// whatever the storage type, warp reductions, and launch error checks. No LibTorch here.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "ops/kernel_dtype.h"

namespace hax::ops::cuda {

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A kernel-form switch from the environment variable `name` (for timing comparisons): `fallback`
// when unset, else an integer 0..max, with a clear error otherwise (`meaning` says what the values
// choose). Read it once (a static) where a launch consults it.
inline int env_switch(const char* name, int fallback, int max, const char* meaning) {
  const char* e = std::getenv(name);
  if (!e) return fallback;
  char* end = nullptr;
  const long m = std::strtol(e, &end, 10);
  if (end == e || *end != '\0' || m < 0 || m > max)
    throw std::runtime_error(std::string(name) + " = '" + e + "' must be an integer 0.." + std::to_string(max) +
                             " (" + meaning + ")");
  return (int)m;
}

// Whether ptr is non-null and 16-byte aligned (16-byte vector loads and stores, cp.async).
__host__ __device__ inline bool aligned16(const void* ptr) {
  return ptr && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

// Streaming multiprocessors of the current device (queried once per device).
inline int sm_count() {
  int dev = 0;
  cudaGetDevice(&dev);
  static std::atomic<int> cache[64];
  int n = dev >= 0 && dev < 64 ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    n = n > 0 ? n : 1;
    if (dev >= 0 && dev < 64) cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

// The grid of a per-query kernel beside the tile path (params.h, tile_count): most of its work
// items are blocks the tile kernels compute, which it only checks and skips. One CTA per item
// made those checks cost whole CTA launches (at 64K x 16 heads, 65536 CTAs: ~120 us for a
// forward that computes nothing), so such kernels loop over their items on a grid of at most
// kSkipCtasPerSm CTAs an SM.
constexpr int kSkipCtasPerSm = 32;
inline int64_t skip_grid(int64_t items) {
  const int64_t cap = (int64_t)sm_count() * kSkipCtasPerSm;
  return items < cap ? items : cap;
}

// Throws (the binding layer turns it into the op's error) if the last launch failed.
inline void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": CUDA launch failed: " + cudaGetErrorString(e));
}

// Raises the dynamic shared memory limit of `kernel` to `bytes`, or throws naming `what`. Needed
// when the dynamic bytes plus the kernel's static shared memory (static_bytes, or a bound on it)
// pass 48 KiB: the default limit of the dynamic part is 48 KiB less the static part. The limit
// set so far is kept per (kernel, device) and only ever raised, so that a launch that calls this
// every time pays for cudaFuncSetAttribute once. (The SSD's host-bound fwd+bwd at L = 4K read
// 0.36 ms with the attribute set before every dB/dC launch and 0.26-0.30 with it set once, in
// different sessions on an H200: BENCHMARKS.md, thirtieth pass.)
template <class K>
inline void allow_smem(K kernel, size_t bytes, const char* what, size_t static_bytes = 0) {
  if (bytes + static_bytes <= 48 * 1024) return;  // the default limit holds static and dynamic together
  int dev = 0;
  cudaGetDevice(&dev);
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> raised;  // (kernel, device) -> limit set
  std::lock_guard<std::mutex> lock(mu);
  size_t& have = raised[{(const void*)kernel, dev}];
  if (bytes <= have) return;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear it, so that later launches and copies do not report it
    throw std::runtime_error(std::string(what) + ": cannot get " + std::to_string(bytes) +
                             " bytes of shared memory: " + cudaGetErrorString(e));
  }
  have = bytes;
}

// Launch shapes computed once per (device, key) by make(device) and kept (occupancy and attribute
// queries cost host time on every call otherwise); thread-safe. make raises the kernel's dynamic
// shared memory limit with allow_smem, which only ever raises it: the attribute is the kernel's,
// not a shape's, and lowered for a smaller shape it failed the next launch of a larger, cached one.
template <class Shape>
class LaunchShapeCache {
 public:
  template <class Make>
  Shape get(int64_t key, Make&& make) {
    int dev = 0;
    cudaGetDevice(&dev);
    std::lock_guard<std::mutex> lock(mu_);
    const auto k = std::make_pair(dev, key);
    if (auto it = shapes_.find(k); it != shapes_.end()) return it->second;
    const Shape s = make(dev);
    shapes_.emplace(k, s);
    return s;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<int, int64_t>, Shape> shapes_;
};

}  // namespace hax::ops::cuda

// Runs `body` with `scalar_t` = float or __nv_bfloat16 according to a DType.
#define HAX_DISPATCH_DTYPE(dtype, ...)                        \
  do {                                                        \
    if ((dtype) == ::hax::ops::DType::kF32) {                 \
      using scalar_t = float;                                 \
      __VA_ARGS__();                                          \
    } else {                                                  \
      using scalar_t = __nv_bfloat16;                         \
      __VA_ARGS__();                                          \
    }                                                         \
  } while (0)
