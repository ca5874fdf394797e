// LSH buckets of x (B, L, H, N) on the GPU, equal to lsh.cpp's: v = x·proj in float64 with the
// products (exact: float x float fits a double) summed in order of n, exactly as the CPU's
// small_gemm does; then p = v - (Σ_{start..i} v) / (i - start + 1) per column, binned by sign bits
// or argmax. Normalizing is skipped on both sides (it changes neither signs nor the argmax).
//
// The running sums are a segmented scan along positions (reset at every sequence start), per
// (b, column c = head·h + j), in three steps over tiles of kLshTile positions:
//   project_kernel   thread per (b, tile, c): v for the tile's positions (stored in `values`),
//                    and the tile's sum since its last sequence start (in `tiles`);
//   carry_kernel     warp per (b, c): an exclusive segmented scan of the tile sums (each lane
//                    folds a run of tiles, a shuffle scan joins the lanes), leaving in `tiles`
//                    the running sum at the position before each tile (its carry);
//   bin_kernel       a group of G lanes (G = power of two >= h) per (b, tile, head), lane j
//                    owning column j: the running sum continues from the carry position by
//                    position, and the group combines its h values into the bucket by shuffles.
//                    With h > 32 (argmax only) center_kernel writes p into `values` instead and
//                    argmax_kernel bins it, one thread per (b, i, head) in the CPU's loop.
// At a sequence start the sum is reset to 0 before adding, as on the CPU, so the first position
// of a sequence centers to exactly 0. Elsewhere the sums are added in another order than the
// CPU's single running sum, so a value within an ulp of a decision boundary (sign of ~1e-16
// relative size) could bin differently; integer-valued inputs are exact in any order.
#include <cmath>
#include <climits>

#include "patterns/cuda/list_utils.cuh"

namespace hax::patterns {
namespace {

using ops::cuda::to_f32;

template <class T>
__global__ void project_kernel(LshBucketsParams p) {
  const int64_t C = p.H * p.h, nT = lsh_bucket_tiles(p.L);
  const int64_t n = p.B * nT * C;
  const T* x = (const T*)p.x;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = e % C, tile = (e / C) % nT, b = e / (C * nT);
    const int64_t hd = c / p.h, j = c % p.h;
    const int64_t t0 = tile * kLshTile, t1 = t0 + kLshTile < p.L ? t0 + kLshTile : p.L;
    double run = 0.0;  // sum since the tile's start or its last sequence start
    for (int64_t i = t0; i < t1; ++i) {
      const T* xr = x + ((b * p.L + i) * p.H + hd) * p.N;
      double acc = 0.0;
      for (int64_t m = 0; m < p.N; ++m) acc += (double)to_f32(xr[m]) * p.proj[m * p.h + j];
      p.values[(b * p.L + i) * C + c] = acc;
      if (p.start[b * p.L + i] == i) run = 0.0;
      run += acc;
    }
    p.tiles[(b * C + c) * nT + tile] = run;
  }
}

// Whether tile t's last position belongs to a sequence that starts inside the tile (then the
// running sum after the tile does not depend on what came before it).
__device__ __forceinline__ bool tile_resets(const int32_t* start_row, int64_t t, int64_t L) {
  const int64_t t0 = t * kLshTile, last = (t0 + kLshTile < L ? t0 + kLshTile : L) - 1;
  return start_row[last] >= t0;
}

__global__ void carry_kernel(LshBucketsParams p) {
  const int64_t C = p.H * p.h, nT = lsh_bucket_tiles(p.L);
  const int lane = threadIdx.x % 32;
  const int64_t warps = (int64_t)gridDim.x * blockDim.x / 32;
  for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < p.B * C; w += warps) {  // (b, c)
    const int64_t b = w / C;
    double* tiles = p.tiles + w * nT;
    const int32_t* start = p.start + b * p.L;
    // Lane l folds the tiles [t_begin, t_end) into (reset, sum since the last reset).
    const int64_t per = (nT + 31) / 32;
    const int64_t t_begin = lane * per < nT ? lane * per : nT, t_end = t_begin + per < nT ? t_begin + per : nT;
    bool f = false;
    double v = 0.0;
    for (int64_t t = t_begin; t < t_end; ++t) {
      if (tile_resets(start, t, p.L)) f = true, v = tiles[t];
      else v += tiles[t];
    }
    // Inclusive scan over the lanes: (fl, vl) then (f, v) combine to (fl | f, f ? v : vl + v).
    for (int o = 1; o < 32; o <<= 1) {
      const double vl = __shfl_up_sync(dev::kFullMask, v, o);
      const int fl = __shfl_up_sync(dev::kFullMask, (int)f, o);
      if (lane >= o) {
        if (!f) v = vl + v;
        f = f || fl;
      }
    }
    double carry = __shfl_up_sync(dev::kFullMask, v, 1);  // the lanes before this one
    if (lane == 0) carry = 0.0;
    for (int64_t t = t_begin; t < t_end; ++t) {
      const double sum = tiles[t];
      tiles[t] = carry;  // the running sum at the position before tile t
      carry = tile_resets(start, t, p.L) ? sum : carry + sum;
    }
  }
}

// The centered value of column c at every position of the tile, in order: fn(i, s, p_value).
template <class F>
__device__ __forceinline__ void centered_tile(const LshBucketsParams& p, int64_t b, int64_t tile, int64_t c,
                                              bool active, F&& fn) {
  const int64_t C = p.H * p.h, nT = lsh_bucket_tiles(p.L);
  const int64_t t0 = tile * kLshTile, t1 = t0 + kLshTile < p.L ? t0 + kLshTile : p.L;
  double run = active ? p.tiles[(b * C + c) * nT + tile] : 0.0;  // the carry
  for (int64_t i = t0; i < t1; ++i) {
    const int64_t s = p.start[b * p.L + i];
    const double v = active ? p.values[(b * p.L + i) * C + c] : 0.0;
    if (s == i) run = 0.0;
    run += v;
    fn(i, v - run / (double)(i - s + 1));
  }
}

__global__ void bin_kernel(LshBucketsParams p, int G) {
  const int64_t nT = lsh_bucket_tiles(p.L);
  const int j = threadIdx.x % G;
  const unsigned mask = dev::group_mask(G);
  const bool active = j < p.h;
  const int64_t groups = (int64_t)gridDim.x * blockDim.x / G;
  for (int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / G; g < p.B * nT * p.H; g += groups) {
    const int64_t hd = g % p.H, tile = (g / p.H) % nT, b = g / (p.H * nT);  // the group's (b, tile, head)
    centered_tile(p, b, tile, hd * p.h + j, active, [&](int64_t i, double pv) {
      int32_t bucket;
      if (!p.argmax) {  // bit j = p_j > 0
        unsigned bits = active && pv > 0 ? 1u << j : 0u;
        for (int o = 1; o < G; o <<= 1) bits |= __shfl_xor_sync(mask, bits, o);
        bucket = (int32_t)bits;
      } else {
        // The CPU keeps the first j with p_j > p_bucket, starting from 0: the first index of the
        // maximum over the non-NaN values, or 0 when p_0 is NaN.
        double bv = pv;
        int bj = active && !isnan(pv) ? j : INT_MAX;  // INT_MAX: no candidate
        for (int o = 1; o < G; o <<= 1) {
          const double ov = __shfl_xor_sync(mask, bv, o);
          const int oj = __shfl_xor_sync(mask, bj, o);
          if (oj != INT_MAX && (bj == INT_MAX || ov > bv || (ov == bv && oj < bj))) bv = ov, bj = oj;
        }
        const int p0_nan = __shfl_sync(mask, (int)isnan(pv), 0, G);
        bucket = p0_nan ? 0 : bj;
      }
      if (j == 0) p.out[(b * p.L + i) * p.H + hd] = bucket;
    });
  }
}

// h > 32: p into `values`, then one thread per (b, i, head) bins it like the CPU.
__global__ void center_kernel(LshBucketsParams p) {
  const int64_t C = p.H * p.h, nT = lsh_bucket_tiles(p.L);
  const int64_t n = p.B * nT * C;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = e % C, tile = (e / C) % nT, b = e / (C * nT);
    centered_tile(p, b, tile, c, true, [&](int64_t i, double pv) { p.values[(b * p.L + i) * C + c] = pv; });
  }
}

__global__ void argmax_kernel(LshBucketsParams p) {
  const int64_t n = p.B * p.L * p.H;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const double* pv = p.values + e * p.h;  // (b, i, head) row of h centered values
    int64_t bucket = 0;
    for (int64_t j = 1; j < p.h; ++j)
      if (pv[j] > pv[bucket]) bucket = j;
    p.out[e] = (int32_t)bucket;
  }
}

}  // namespace

void lsh_buckets_cuda(const LshBucketsParams& p, DType dtype, void* stream) {
  const int64_t C = p.H * p.h, nT = lsh_bucket_tiles(p.L);
  if (p.B * p.L * p.H == 0) return;
  cudaStream_t st = (cudaStream_t)stream;
  const unsigned t = dev::kThreads;
  HAX_DISPATCH_DTYPE(dtype, [&] {
    project_kernel<scalar_t><<<dev::grid_for(p.B * nT * C, t), t, 0, st>>>(p);
  });
  ops::cuda::check_launch("lsh_buckets (project)");
  carry_kernel<<<dev::grid_for(p.B * C * 32, t), t, 0, st>>>(p);
  ops::cuda::check_launch("lsh_buckets (carry)");
  if (p.h <= 32) {
    const int G = dev::lanes_per_list(p.h);
    bin_kernel<<<dev::grid_for(p.B * nT * p.H * G, t), t, 0, st>>>(p, G);
    ops::cuda::check_launch("lsh_buckets (bin)");
  } else {
    center_kernel<<<dev::grid_for(p.B * nT * C, t), t, 0, st>>>(p);
    ops::cuda::check_launch("lsh_buckets (center)");
    argmax_kernel<<<dev::grid_for(p.B * p.L * p.H, t), t, 0, st>>>(p);
    ops::cuda::check_launch("lsh_buckets (argmax)");
  }
}

}  // namespace hax::patterns
