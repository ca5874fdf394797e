// The packed sequence of every position: start = its first position, end = one past its last.
//
// seq_idx rows are non-decreasing, so a sequence is a run of equal numbers and both bounds are
// binary searches in the row for seq[b, i]: start = the first j <= i with seq[b, j] == seq[b, i],
// end = the first j > i with seq[b, j] > seq[b, i]. One thread per position, no workspace.
#include "patterns/cuda/list_utils.cuh"

namespace hax::patterns {
namespace {

__global__ void sequence_bounds_kernel(SequenceBoundsParams p) {
  const int64_t n = p.B * p.L;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    if (!p.seq) {  // one sequence per row
      p.start[e] = 0;
      p.end[e] = (int32_t)p.L;
      continue;
    }
    const int64_t b = e / p.L, i = e % p.L;
    const int32_t* row = p.seq + b * p.L;
    const int32_t v = row[i];
    p.start[e] = (int32_t)dev::lower_bound(row, 0, i, v);
    p.end[e] = (int32_t)dev::upper_bound(row, i + 1, p.L, v);
  }
}

}  // namespace

void sequence_bounds_cuda(const SequenceBoundsParams& p, void* stream) {
  const int64_t n = p.B * p.L;
  if (n == 0) return;
  sequence_bounds_kernel<<<dev::grid_for(n, dev::kThreads), dev::kThreads, 0, (cudaStream_t)stream>>>(p);
  ops::cuda::check_launch("sequence_bounds");
}

}  // namespace hax::patterns
