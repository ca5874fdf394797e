// CPU thread control. Debian's LibTorch starts with one intra-op thread unless told otherwise.
#pragma once

namespace hax {

// Number of hardware threads of this machine (at least 1).
int hardware_threads();

// Sets LibTorch's intra-op thread count (OpenBLAS, where loaded, gets one: see threads.cpp). n <= 0 means all
// hardware threads.
void set_threads(int n);

}  // namespace hax
