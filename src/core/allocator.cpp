#include "core/allocator.h"

#include <malloc.h>

namespace hax {

void keep_freed_memory() {
#ifdef __GLIBC__
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest allowed value on 64-bit
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
}

}  // namespace hax
