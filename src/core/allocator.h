// Process-wide tuning of the C allocator that LibTorch's CPU tensors come from.
#pragma once

namespace hax {

// glibc returns freed blocks of a few MB to the kernel at once (munmap, or a heap trim), so every
// new tensor of that size page-faults its memory in again: the Key Selection scorer's forward at
// L = 16K spent 5 of its 8 ms there, sparse attention forward+backward a quarter of its time.
// This keeps freed memory for reuse (mmap only above 32 MB, trim only above 1 GB of free top).
// Peak memory is unchanged; memory the process no longer uses is kept until it exits or calls
// malloc_trim. Call once at startup.
void keep_freed_memory();

}  // namespace hax
