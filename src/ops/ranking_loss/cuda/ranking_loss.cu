// CUDA kernels of the fused ranking loss; reference.cpp is the definition (see ranking_loss.h).
//
// Forward, three launches, float32 math whatever the storage type:
//   targets_kernel: one warp per (b, c, h); lanes over the positions l = j, j+1, ... of j's
//                   sequence (seq_idx is non-decreasing, so the walk stops at the first other
//                   sequence), one length-N dot product each, summed by a warp reduction -> y.
//   pairs_kernel:   one block per (b, h, tile of kRankingLossTile candidates a); the x_c, y_c of
//                   all candidates pass through shared memory tile by tile; each thread sums its
//                   a's loss terms and gradient over c, writes dx[b, a, h] and the block writes
//                   one partial loss sum.
//   final_kernel:   one block sums the partials in a fixed order (deterministic, no atomics).
// Backward, one launch: scatter_kernel writes g * dx at the candidate positions of a zeroed dscores.
// Candidate positions outside [0, L) are read as absent (x = y = 0, no gradient written).
// A row mask (p.rows): a false row's targets are not computed (y = 0, never read), its pair blocks
// write dx = 0 and a partial sum of 0; the pair blocks of true rows and the final block each count
// R, the true rows, with __syncthreads_count (an exact integer: deterministic) and scale by
// 1 / (R C C H). Without a mask the host passes 1 / (B C C H), the same number for R = B.
#include "ops/cuda/common.cuh"
#include "ops/ranking_loss/params.h"

namespace hax::ops {
namespace {

using cuda::from_f32;
using cuda::to_f32;

constexpr int kWarpsPerBlock = 8;
constexpr int kTile = (int)kRankingLossTile;  // threads of the pair kernel, one per candidate a
constexpr int kFinalThreads = 256;

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

// 1 / (R C C H), the loss's divisor for R counted rows (R = 0 gives 1 / (C C H): nothing is summed
// then). The host (R = B, no mask) and the device compute the same double.
__host__ __device__ inline double inv_pair_count(int64_t rows, int64_t ncand, int64_t nheads) {
  return 1.0 / ((double)((rows > 0 ? rows : 1) * ncand * nheads) * (double)ncand);
}

// R = the number of b < batch with rows[b]. Call from every thread of the block (it synchronizes);
// every thread gets R.
__device__ int64_t count_rows(const bool* rows, int64_t batch) {
  int64_t r = 0;
  for (int64_t b0 = 0; b0 < batch; b0 += blockDim.x) {
    const int64_t b = b0 + threadIdx.x;
    r += __syncthreads_count(b < batch && rows[b]);
  }
  return r;
}

// y[b, c, h] = Σ_{l >= j, seq[l] == seq[j], valid[l]} sigmoid(q[b, l, h, :] · k[b, j, h, :]) (0 on a
// masked row: nothing reads it).
template <class T>
__global__ void targets_kernel(RankingLossParams p) {
  const int64_t H = p.nheads, C = p.ncand, L = p.seqlen, N = p.dim;
  const int64_t task = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;  // (b, c, h)
  if (task >= p.batch * C * H) return;
  const int lane = threadIdx.x % 32;
  const int64_t h = task % H, b = task / H / C;
  const int64_t j = p.cand[task / H];
  float acc = 0;
  if (j >= 0 && j < L && (!p.rows || p.rows[b])) {
    const T* q = (const T*)p.q + b * p.q_stride[0] + h * p.q_stride[2];
    const T* kj = (const T*)p.k + b * p.k_stride[0] + j * p.k_stride[1] + h * p.k_stride[2];  // (N), one
    const int32_t* seq = p.seq_idx ? p.seq_idx + b * L : nullptr;                              // address
    const bool* valid = p.valid ? p.valid + b * L : nullptr;                                   // per warp
    const int32_t s = seq ? seq[j] : 0;
    for (int64_t l = j + lane; l < L; l += 32) {
      if (seq && seq[l] != s) break;  // past the end of j's sequence
      if (valid && !valid[l]) continue;
      const T* ql = q + l * p.q_stride[1];
      float dot = 0;
      for (int64_t n = 0; n < N; ++n) dot += to_f32(ql[n]) * to_f32(kj[n]);
      acc += sigmoid(dot);
    }
  }
  acc = cuda::warp_sum(acc);
  if (lane == 0) p.y[task] = acc;
}

// x[b, c, h] = scores[b, cand[b, c], h] (0 for a position outside [0, L)).
template <class T>
__device__ __forceinline__ float score_at(const RankingLossParams& p, int64_t b, int64_t c, int64_t h) {
  const int64_t j = p.cand[b * p.ncand + c];
  return j >= 0 && j < p.seqlen ? to_f32(((const T*)p.scores)[(b * p.seqlen + j) * p.nheads + h]) : 0.f;
}

// Block (b * H + h, tile): partial[(b * H + h) * tiles + tile] = Σ_{a in tile, c} BCE(z_ac, t_ac);
// dx[b, a, h] = 2 Σ_c (sigmoid(z_ac) - t_ac) * inv_count, inv_count = 1 / (B C C H) from the host
// without a mask, 1 / (R C C H) counted here with one. On a masked row: partial = dx = 0.
template <class T>
__global__ void __launch_bounds__(kTile) pairs_kernel(RankingLossParams p, float inv_count) {
  __shared__ float xs[kTile], ys[kTile];  // one tile of candidates c
  __shared__ float warp_loss[kTile / 32];
  const int64_t H = p.nheads, C = p.ncand;
  const int64_t bh = blockIdx.x, b = bh / H, h = bh % H;
  const int64_t a = (int64_t)blockIdx.y * kTile + threadIdx.x;
  const bool own = a < C;  // threads past the last candidate only load tiles
  if (p.rows) {  // the same branch for the whole block (one row b)
    if (!p.rows[b]) {  // a padding row: no loss, zero gradient
      if (own) p.dx[(b * C + a) * H + h] = 0.f;
      if (threadIdx.x == 0) p.partial[bh * gridDim.y + blockIdx.y] = 0.f;
      return;
    }
    inv_count = (float)inv_pair_count(count_rows(p.rows, p.batch), C, H);
  }
  const float xa = own ? score_at<T>(p, b, a, h) : 0.f, ya = own ? p.y[(b * C + a) * H + h] : 0.f;
  float loss = 0, grad = 0;
  for (int64_t c0 = 0; c0 < C; c0 += kTile) {
    const int64_t c = c0 + threadIdx.x;
    if (c < C) xs[threadIdx.x] = score_at<T>(p, b, c, h), ys[threadIdx.x] = p.y[(b * C + c) * H + h];
    __syncthreads();
    if (own) {
      const int n = (int)min((int64_t)kTile, C - c0);
      for (int i = 0; i < n; ++i) {
        const float z = xa - xs[i], t = 0.5f * ((float)(ya > ys[i]) + (float)(ya >= ys[i]));
        loss += fmaxf(z, 0.f) - z * t + log1pf(expf(-fabsf(z)));
        grad += sigmoid(z) - t;
      }
    }
    __syncthreads();
  }
  if (own) p.dx[(b * C + a) * H + h] = 2.f * grad * inv_count;
  loss = cuda::warp_sum(loss);
  if (threadIdx.x % 32 == 0) warp_loss[threadIdx.x / 32] = loss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0;
    for (int w = 0; w < kTile / 32; ++w) s += warp_loss[w];
    p.partial[bh * gridDim.y + blockIdx.y] = s;
  }
}

// loss = Σ partial * inv_count, summed in a fixed order (double accumulation); inv_count =
// 1 / (R C C H) counted here when `rows` is set (else the host's 1 / (B C C H)).
template <class T>
__global__ void __launch_bounds__(kFinalThreads) final_kernel(const float* partial, int64_t n, double inv_count,
                                                              const bool* rows, int64_t batch, int64_t ncand,
                                                              int64_t nheads, T* loss) {
  __shared__ double sums[kFinalThreads];
  if (rows) inv_count = inv_pair_count(count_rows(rows, batch), ncand, nheads);
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += kFinalThreads) s += partial[i];
  sums[threadIdx.x] = s;
  __syncthreads();
  for (int w = kFinalThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) sums[threadIdx.x] += sums[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = from_f32<T>((float)(sums[0] * inv_count));
}

// dscores[b, cand[b, c], h] = dloss * dx[b, c, h], one thread per (b, c, h).
template <class T>
__global__ void scatter_kernel(RankingLossGradParams p) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.batch * p.ncand * p.nheads) return;
  const int64_t h = i % p.nheads, b = i / p.nheads / p.ncand;
  const int64_t j = p.cand[i / p.nheads];
  if (j < 0 || j >= p.seqlen) return;
  const float g = to_f32(*(const T*)p.dloss);
  ((T*)p.dscores)[(b * p.seqlen + j) * p.nheads + h] = from_f32<T>(g * p.dx[i]);
}

}  // namespace

void ranking_loss_forward_cuda(const RankingLossParams& p, DType score_dtype, DType qk_dtype, void* stream) {
  const int64_t tasks = p.batch * p.ncand * p.nheads, tiles = ranking_loss_tiles(p.ncand);
  if (tasks == 0) return;
  const auto s = (cudaStream_t)stream;
  const double inv_count = inv_pair_count(p.batch, p.ncand, p.nheads);  // 1 / (B C C H) pairs, no mask
  const unsigned grid = (unsigned)cuda::ceil_div(tasks, kWarpsPerBlock);
  HAX_DISPATCH_DTYPE(qk_dtype, [&] { targets_kernel<scalar_t><<<grid, 32 * kWarpsPerBlock, 0, s>>>(p); });
  cuda::check_launch("ranking_loss_forward_cuda (targets)");
  const dim3 pgrid((unsigned)(p.batch * p.nheads), (unsigned)tiles);
  HAX_DISPATCH_DTYPE(score_dtype, [&] {
    pairs_kernel<scalar_t><<<pgrid, kTile, 0, s>>>(p, (float)inv_count);
    final_kernel<scalar_t><<<1, kFinalThreads, 0, s>>>(p.partial, p.batch * p.nheads * tiles, inv_count, p.rows,
                                                       p.batch, p.ncand, p.nheads, (scalar_t*)p.loss);
  });
  cuda::check_launch("ranking_loss_forward_cuda (pairs)");
}

void ranking_loss_backward_cuda(const RankingLossGradParams& p, DType score_dtype, void* stream) {
  const int64_t tasks = p.batch * p.ncand * p.nheads;
  if (tasks == 0) return;
  const unsigned grid = (unsigned)cuda::ceil_div(tasks, 256);
  HAX_DISPATCH_DTYPE(score_dtype,
                     [&] { scatter_kernel<scalar_t><<<grid, 256, 0, (cudaStream_t)stream>>>(p); });
  cuda::check_launch("ranking_loss_backward_cuda");
}

}  // namespace hax::ops
