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
  // OpenBLAS keeps its own pool; set it too when the symbol is present in the process.
  using SetFn = void (*)(int);
  if (auto fn = (SetFn)dlsym(RTLD_DEFAULT, "openblas_set_num_threads")) fn(n);
}

}  // namespace hax
