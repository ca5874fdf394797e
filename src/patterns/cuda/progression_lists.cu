// SW, sink and dilated lists: query i of the sequence [s, e) gets the keys first, first + step,
// ... (count of them), -1 after; the formulas are the CPU builders' (sliding_window.cpp, sink.cpp,
// dilated.cpp), written for every (b, h) alike.
//
// A group of G lanes (G = the power of two >= min(k, 32)) writes one query's k slots, lane t
// taking slots t, t + G, ...: consecutive lanes write consecutive slots. No workspace.
#include "patterns/cuda/list_utils.cuh"

namespace hax::patterns {
namespace {

__global__ void progression_kernel(ProgressionParams p, int G) {
  const int64_t rows = p.B * p.H * p.L;  // one list per (b, h, i)
  const int64_t groups_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G;
  for (int64_t r = (int64_t)blockIdx.x * groups_per_block + threadIdx.x / G; r < rows;
       r += (int64_t)gridDim.x * groups_per_block) {
    const int64_t i = r % p.L, b = r / (p.H * p.L);
    const int64_t s = p.start[b * p.L + i];
    int64_t first, count, step = 1;
    switch (p.kind) {
      case ProgressionKind::kSlidingWindow:  // [max(s, i - k + 1), i]
        first = i - p.k + 1 > s ? i - p.k + 1 : s;
        count = i - first + 1;
        break;
      case ProgressionKind::kSink:  // [s, min(i, s + k - 1)]
        first = s;
        count = (i < s + p.k - 1 ? i : s + p.k - 1) - s + 1;
        break;
      default: {  // kDilated: s + t·r - 1 for t = 1..m, m = (i - s + 1) / r; the last k
        const int64_t m = (i - s + 1) / p.stride;
        const int64_t t0 = m - p.k + 1 > 1 ? m - p.k + 1 : 1;
        first = s + t0 * p.stride - 1;
        count = m - t0 + 1;
        step = p.stride;
      }
    }
    int32_t* dst = p.out + r * p.k;
    for (int64_t t = lane; t < p.k; t += G) dst[t] = t < count ? (int32_t)(first + t * step) : -1;
  }
}

}  // namespace

void progression_lists_cuda(const ProgressionParams& p, void* stream) {
  const int64_t rows = p.B * p.H * p.L;
  if (rows == 0 || p.k == 0) return;
  const int G = dev::lanes_per_list(p.k);
  progression_kernel<<<dev::grid_for(rows, dev::kThreads / G), dev::kThreads, 0, (cudaStream_t)stream>>>(p, G);
  ops::cuda::check_launch("progression_lists");
}

}  // namespace hax::patterns
