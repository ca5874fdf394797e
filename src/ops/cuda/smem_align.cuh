// Aligning a pointer into shared memory without losing what the compiler knows about it.
#pragma once
#include <cstddef>
#include <cstdint>

namespace hax::ops::cuda {

// p + offset, rounded up to a multiple of `align` bytes (a power of two), as a T*. The result is p
// plus a number of bytes, not an integer cast back to a pointer, so that a pointer into shared
// memory stays one the compiler knows: through such a cast every access became a generic one,
// with 64-bit address arithmetic (the tile backward's dS^T stores, 4.2 M generic ST.E a launch at
// 64K on the H100, pass 36).
template <class T, class U>
__device__ __forceinline__ T* align_up(U* p, size_t offset, size_t align) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) + offset;
  const size_t pad = ((a + align - 1) & ~uintptr_t(align - 1)) - reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(p) + pad);
}

}  // namespace hax::ops::cuda
