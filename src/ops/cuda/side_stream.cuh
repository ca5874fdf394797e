// A second stream, for kernels that do not depend on the caller's next kernels, so that the two
// run at the same time: a memory-bound kernel of a few blocks (the SSD's state pass) leaves most
// of each SM's issue slots free for the other stream's blocks.
//
//   cudaStream_t side = SideStream::fork(main);   // side waits for the work queued on main so far
//   kernel<<<..., side>>>(...);                   // runs beside main's next kernels
//   SideStream::join(main);                       // main's later kernels wait for side's work
//
// fork and join are stream operations (an event recorded on one stream and waited for by the
// other), so a CUDA graph capture of `main` takes the side stream's kernels in as a branch of the
// graph. One side stream per thread and device (two threads never share its events), created at
// its first use (also during a capture: in relaxed capture mode for that call), non-blocking, at
// the default priority.
// HAX_SIDE_STREAM=0 runs everything on `main` instead (fork returns main and join does nothing),
// for comparisons.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace hax::ops::cuda {

class SideStream {
 public:
  static cudaStream_t fork(cudaStream_t main) {
    if (!enabled()) return main;
    SideStream& s = current();
    check(cudaEventRecord(s.fork_, main), "cudaEventRecord");
    check(cudaStreamWaitEvent(s.stream_, s.fork_, 0), "cudaStreamWaitEvent");
    return s.stream_;
  }
  static void join(cudaStream_t main) {
    if (!enabled()) return;
    SideStream& s = current();
    check(cudaEventRecord(s.join_, s.stream_), "cudaEventRecord");
    check(cudaStreamWaitEvent(main, s.join_, 0), "cudaStreamWaitEvent");
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;

  static bool enabled() {
    const char* e = std::getenv("HAX_SIDE_STREAM");  // read at each call: a test compares both
    return !(e && e[0] == '0' && e[1] == '\0');
  }
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw std::runtime_error(std::string("side stream: ") + what + ": " + cudaGetErrorString(e));
    }
  }
  static SideStream& current() {
    thread_local std::unordered_map<int, SideStream> by_device;  // (never destroyed: streams outlive threads' use)
    int dev = 0;
    check(cudaGetDevice(&dev), "cudaGetDevice");
    SideStream& s = by_device[dev];
    if (!s.stream_) {
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;  // creation is allowed in a capture
      check(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
      cudaError_t e = cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s.fork_, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s.join_, cudaEventDisableTiming);
      cudaThreadExchangeStreamCaptureMode(&mode);
      if (e != cudaSuccess) s = SideStream{};  // (tried again at the next use)
      check(e, "creating the stream and its events");
    }
    return s;
  }
};

}  // namespace hax::ops::cuda
