// Scratch memory for the attention kernels' large temporaries, kept between calls per calling
// thread (like oneDNN's global scratchpad). A fresh multi-megabyte buffer costs a page fault and a
// kernel-side zeroing per 4 KiB page at every call, a sizable share of a sparse attention
// backward. What one thread keeps is bounded: after a call that needed more than kKeepBytes in
// all, its buffers are released.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace hax::ops::detail {

class Scratch {
 public:
  static constexpr size_t kKeepBytes = size_t(512) << 20;

  // Buffer number `slot` with room for n values of T (contents undefined). Valid until the next
  // get() of the same slot or release_if_large().
  template <class T>
  T* get(size_t slot, int64_t n) {
    if (slot >= bufs_.size()) bufs_.resize(slot + 1);
    Buf& b = bufs_[slot];
    const size_t bytes = size_t(n > 0 ? n : 1) * sizeof(T);
    if (b.bytes < bytes) {
      b.data.reset();  // free first: the old and the new buffer need not coexist
      b.data.reset(new char[bytes]);
      b.bytes = bytes;
    }
    return reinterpret_cast<T*>(b.data.get());
  }

  // Releases everything when the buffers add up to more than kKeepBytes.
  void release_if_large() {
    size_t total = 0;
    for (const Buf& b : bufs_) total += b.bytes;
    if (total > kKeepBytes) bufs_.clear();
  }

  // The calling thread's scratch.
  static Scratch& local() {
    thread_local Scratch s;
    return s;
  }

 private:
  struct Buf {
    std::unique_ptr<char[]> data;
    size_t bytes = 0;
  };
  std::vector<Buf> bufs_;
};

}  // namespace hax::ops::detail
