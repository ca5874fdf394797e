// CUDA kernel of permute_rows (permute_rows.h): G = row bytes / 16 lanes copy one row, 16 bytes
// each (rows of 128 bytes: 8 lanes, 4 rows a warp), where D·size is a multiple of 16 and both
// tensors are 16-byte aligned; otherwise a thread per element. The order entry is read once per
// row; reads and writes of a row are whole 16-byte chunks.
#include "ops/cuda/common.cuh"
#include "ops/permute_rows/params.h"

namespace hax::ops {
namespace {

constexpr int kThreads = 256;

// Row e = (b·H + h)·L + t of the order: its source and destination offsets, in elements.
__device__ __forceinline__ void row_offsets(const PermuteRowsParams& p, int64_t e, int64_t& from, int64_t& to) {
  const int64_t L = p.seqlen, H = p.nheads, b = e / (H * L), h = e / L % H, t = e % L, o = p.order[e];
  const int64_t a = p.scatter ? t : o, z = p.scatter ? o : t;
  from = ((b * L + a) * H + h) * p.dim;
  to = ((b * L + z) * H + h) * p.dim;
}

__global__ void permute_vec_kernel(PermuteRowsParams p, int64_t rows, int chunks, int elem) {
  const int64_t x = (int64_t)blockIdx.x * kThreads + threadIdx.x, e = x / chunks;
  if (e >= rows) return;
  const int c = (int)(x % chunks);
  int64_t from, to;
  row_offsets(p, e, from, to);
  const uint4* s = reinterpret_cast<const uint4*>((const char*)p.src + from * elem) + c;
  uint4* d = reinterpret_cast<uint4*>((char*)p.dst + to * elem) + c;
  *d = __ldg(s);
}

template <class T>
__global__ void permute_kernel(PermuteRowsParams p, int64_t rows) {
  const int64_t x = (int64_t)blockIdx.x * kThreads + threadIdx.x, e = x / p.dim;
  if (e >= rows) return;
  int64_t from, to;
  row_offsets(p, e, from, to);
  const int64_t d = x % p.dim;
  ((T*)p.dst)[to + d] = ((const T*)p.src)[from + d];
}

}  // namespace

void permute_rows_cuda(const PermuteRowsParams& p, DType dtype, void* stream) {
  const int64_t rows = p.batch * p.nheads * p.seqlen;
  if (rows == 0 || p.dim == 0) return;
  const auto s = (cudaStream_t)stream;
  const int elem = dtype == DType::kBF16 ? 2 : 4;
  const int64_t bytes = p.dim * elem;
  if (bytes % 16 == 0 && cuda::aligned16(p.src) && cuda::aligned16(p.dst)) {
    const int chunks = (int)(bytes / 16);
    const unsigned grid = (unsigned)cuda::ceil_div(rows * chunks, kThreads);
    permute_vec_kernel<<<grid, kThreads, 0, s>>>(p, rows, chunks, elem);
  } else {
    const unsigned grid = (unsigned)cuda::ceil_div(rows * p.dim, kThreads);
    HAX_DISPATCH_DTYPE(dtype, [&] { permute_kernel<scalar_t><<<grid, kThreads, 0, s>>>(p, rows); });
  }
  cuda::check_launch("permute_rows");
}

}  // namespace hax::ops
