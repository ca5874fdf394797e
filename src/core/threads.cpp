#include "core/threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <thread>

namespace hax {

int hardware_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : (int)n;
}

void set_threads(int n) {
  if (n <= 0) n = hardware_threads();
  at::set_num_threads(n);
  // OpenBLAS (pthread build) keeps a pool of its own whose threads spin after every matrix
  // product and starve hax's OpenMP kernels of the other cores (measured: the SSD scan ran 1.2x
  // faster on 2 threads instead of 2x). hax's matrix products are small, so BLAS runs on one
  // thread and the parallelism goes to the kernels and LibTorch's own loops.
  // Measured on 2 cores (joint-recall training, tokens/s): pthread OpenBLAS on 1 thread with 2
  // OpenMP threads 50K; everything on 1 thread 34K; the OpenMP build of OpenBLAS on 2 threads 22K.
  using SetFn = void (*)(int);
  if (auto fn = (SetFn)dlsym(RTLD_DEFAULT, "openblas_set_num_threads")) fn(1);
}

}  // namespace hax
