// Peak memory of a piece of work on the CPU, measured through /proc/self (Linux): the kernel's
// high-water mark of resident memory (VmHWM), reset before the work.
#pragma once
#include <cstdint>
#include <functional>

namespace hax {

// Resident memory (bytes) that `fn` added at its peak over what the process held before it: freed
// heap memory is first returned to the system (malloc_trim), then VmHWM is reset to the current
// resident size, `fn` runs, and the result is VmHWM minus that size. -1 where /proc/self cannot
// tell (not Linux, or clear_refs not writable). Exceptions from `fn` propagate.
int64_t peak_memory_added(const std::function<void()>& fn);

}  // namespace hax
