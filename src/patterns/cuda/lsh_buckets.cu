// LSH buckets of x (B, L, H, N) on the GPU, equal to lsh.cpp's: v = x·proj in float64 with the
// products (exact: float x float fits a double) summed in order of n, exactly as the CPU's
// small_gemm does; then p = v - (Σ_{start..i} v) / (i - start + 1) per column, binned by sign bits
// or argmax. Normalizing is skipped on both sides (it changes neither signs nor the argmax).
//
// The running sums are a segmented scan along positions (reset at every sequence start), per
// (b, column c = head·h + j), in three steps over tiles of kLshTile positions:
//   project_tile_kernel  block per (b, tile, group of heads): a thread per kTileRows (position,
//                        head) rows computes their h values (the rows sharing the loads of proj,
//                        16-byte loads of x where aligned, up to 8 columns accumulated at once),
//                        stored in `values` and in shared memory; then a thread per column sums
//                        the tile since its last sequence start (`tiles`).
//                        (project_kernel, thread per (b, tile, c), serves h > kTileCols.)
//   carry_kernel         block per (b, c): an exclusive segmented scan of the tile sums (each thread
//                        folds kCarryPer consecutive tiles, warp shuffles and the block's warp totals
//                        join them), leaving in `tiles` the running sum before each tile (its carry);
//   bin_kernel           a group of G lanes (G = power of two >= h) per (b, tile, head), lane j
//                        owning column j: the running sum continues from the carry position by
//                        position, and the group combines its h values into the bucket by shuffles
//                        (the sign of p decided without the division unless p is within ulps of 0).
//                        With h > 32 (argmax only) center_kernel writes p into `values` instead and
//                        argmax_kernel bins it, one thread per (b, i, head) in the CPU's loop.
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

constexpr int kTileCols = 64;    // the most columns (heads x h) of one project_tile_kernel block (32 KiB of values)
constexpr int kColChunk = 8;     // columns one thread accumulates at once
constexpr int kCarryPer = 4;     // consecutive tiles per carry_kernel thread
constexpr int kCarryThreads = 256;

// Row (b, i, hd) of x.
template <class T>
__device__ __forceinline__ const T* x_row(const LshBucketsParams& p, int64_t b, int64_t i, int64_t hd) {
  return (const T*)p.x + b * p.x_sb + i * p.x_sl + hd * p.x_sh;
}

// Element e of 16 bytes of float32 / bfloat16 values as a float.
__device__ __forceinline__ uint32_t word_of(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}
__device__ __forceinline__ float elem_of(const uint4& v, int e, const float*) { return __uint_as_float(word_of(v, e)); }
__device__ __forceinline__ float elem_of(const uint4& v, int e, const __nv_bfloat16*) {
  const uint32_t w = word_of(v, e / 2);
  return __uint_as_float(e % 2 ? (w & 0xffff0000u) : (w << 16));  // bfloat16: a float's high half
}

constexpr int kRowLoads = 2;   // 16-byte loads of a row issued at once
// Rows per project_tile_kernel thread (H100, 64K x 16 heads x 64, h = 8: 1 row 456 us, 2 rows 308 us).
constexpr int kTileRows = 2;

// acc[rr][0..nj) = Σ_m x_rr[m] · proj[m, j0 + jj] for kRows rows x_rr, summed in order of m (the
// CPU's order). With `vec`, the rows are read 16 bytes at a time (N a multiple of the vector, the
// rows 16-byte aligned).
template <class T, int kRows>
__device__ __forceinline__ void project_rows(const T* const (&xr)[kRows], const double* __restrict__ proj, int64_t N,
                                             int64_t h, int64_t j0, int nj, bool vec,
                                             double (&acc)[kRows][kColChunk]) {
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr)
#pragma unroll
    for (int jj = 0; jj < kColChunk; ++jj) acc[rr][jj] = 0.0;
  auto add = [&](int64_t m, const float (&xv)[kRows]) {
    const double* pr = proj + m * h + j0;
    double pj[kColChunk];
#pragma unroll
    for (int jj = 0; jj < kColChunk; ++jj) pj[jj] = jj < nj ? __ldg(pr + jj) : 0.0;
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      const double xm = (double)xv[rr];
#pragma unroll
      for (int jj = 0; jj < kColChunk; ++jj)
        if (jj < nj) acc[rr][jj] += xm * pj[jj];
    }
  };
  constexpr int V = 16 / sizeof(T);
  if (vec) {
    for (int64_t m0 = 0; m0 < N; m0 += kRowLoads * V) {
      uint4 raw[kRows][kRowLoads];
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr)
#pragma unroll
        for (int u = 0; u < kRowLoads; ++u)
          raw[rr][u] = m0 + u * V < N ? __ldg((const uint4*)(xr[rr] + m0 + u * V)) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < kRowLoads; ++u)
        if (m0 + u * V < N) {
#pragma unroll
          for (int e = 0; e < V; ++e) {
            float xv[kRows];
#pragma unroll
            for (int rr = 0; rr < kRows; ++rr) xv[rr] = elem_of(raw[rr][u], e, (const T*)nullptr);
            add(m0 + u * V + e, xv);
          }
        }
    }
  } else {
    for (int64_t m = 0; m < N; ++m) {
      float xv[kRows];
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr) xv[rr] = to_f32(xr[rr][m]);
      add(m, xv);
    }
  }
}

// Block per (b, tile, group of HB heads), HB·h <= kTileCols; a thread projects kRows rows at once.
template <class T, int kRows>
__global__ void project_tile_kernel(LshBucketsParams p, int HB, bool vec) {
  __shared__ double sv[kLshTile * kTileCols];  // (position in tile, column of the group)
  __shared__ bool resets[kLshTile];            // the position starts a sequence
  const int64_t C = p.H * p.h, nT = lsh_bucket_tiles(p.L), nG = (p.H + HB - 1) / HB;
  for (int64_t blk = blockIdx.x; blk < p.B * nT * nG; blk += gridDim.x) {
    const int64_t g = blk % nG, tile = (blk / nG) % nT, b = blk / (nG * nT);
    const int64_t h0 = g * HB, nh = HB < p.H - h0 ? HB : p.H - h0, cols = nh * p.h;
    const int64_t t0 = tile * kLshTile, np = t0 + kLshTile < p.L ? kLshTile : p.L - t0;
    if (threadIdx.x < np) resets[threadIdx.x] = p.start[b * p.L + t0 + threadIdx.x] == t0 + threadIdx.x;
    // Rows r = (position in tile)·nh + head in group; this thread's: r0 + rr·blockDim.
    for (int64_t r0 = threadIdx.x; r0 < np * nh; r0 += kRows * (int64_t)blockDim.x) {
      const T* xr[kRows];
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr) {
        const int64_t r = r0 + rr * (int64_t)blockDim.x < np * nh ? r0 + rr * (int64_t)blockDim.x : r0;
        xr[rr] = x_row<T>(p, b, t0 + r / nh, h0 + r % nh);
      }
      for (int64_t j0 = 0; j0 < p.h; j0 += kColChunk) {
        const int nj = (int)(p.h - j0 < kColChunk ? p.h - j0 : kColChunk);
        double acc[kRows][kColChunk];
        project_rows<T, kRows>(xr, p.proj, p.N, p.h, j0, nj, vec, acc);
#pragma unroll
        for (int rr = 0; rr < kRows; ++rr) {
          const int64_t r = r0 + rr * (int64_t)blockDim.x;
          if (r >= np * nh) continue;
          const int64_t pi = r / nh, hl = r % nh;
          double* dst = p.values + (b * p.L + t0 + pi) * C + (h0 + hl) * p.h;
#pragma unroll
          for (int jj = 0; jj < kColChunk; ++jj)
            if (jj < nj) {
              dst[j0 + jj] = acc[rr][jj];
              sv[pi * cols + hl * p.h + j0 + jj] = acc[rr][jj];
            }
        }
      }
    }
    __syncthreads();
    for (int64_t cl = threadIdx.x; cl < cols; cl += blockDim.x) {
      double run = 0.0;  // sum since the tile's start or its last sequence start
      for (int64_t pi = 0; pi < np; ++pi) {
        if (resets[pi]) run = 0.0;
        run += sv[pi * cols + cl];
      }
      p.tiles[(b * C + h0 * p.h + cl) * nT + tile] = run;
    }
    __syncthreads();
  }
}

// Thread per (b, tile, c): the general case (h > kTileCols).
template <class T>
__global__ void project_kernel(LshBucketsParams p) {
  const int64_t C = p.H * p.h, nT = lsh_bucket_tiles(p.L);
  const int64_t n = p.B * nT * C;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = e % C, tile = (e / C) % nT, b = e / (C * nT);
    const int64_t hd = c / p.h, j = c % p.h;
    const int64_t t0 = tile * kLshTile, t1 = t0 + kLshTile < p.L ? t0 + kLshTile : p.L;
    double run = 0.0;  // sum since the tile's start or its last sequence start
    for (int64_t i = t0; i < t1; ++i) {
      const T* xr = x_row<T>(p, b, i, hd);
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

// (f, v) then (f2, v2) of a segmented sum: (f | f2, f2 ? v2 : v + v2).
__device__ __forceinline__ void seg_join(bool f, double v, bool& f2, double& v2) {
  if (!f2) v2 = v + v2;
  f2 = f2 || f;
}

// Block of kCarryThreads per (b, c).
__global__ void carry_kernel(LshBucketsParams p) {
  __shared__ double wsum[kCarryThreads / 32];
  __shared__ bool wflag[kCarryThreads / 32];
  const int64_t C = p.H * p.h, nT = lsh_bucket_tiles(p.L);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  for (int64_t w = blockIdx.x; w < p.B * C; w += gridDim.x) {  // (b, c)
    const int64_t b = w / C;
    double* tiles = p.tiles + w * nT;
    const int32_t* start = p.start + b * p.L;
    double carry = 0.0;  // the running sum before this round's tiles
    for (int64_t base = 0; base < nT; base += (int64_t)blockDim.x * kCarryPer) {
      const int64_t t_begin = base + (int64_t)threadIdx.x * kCarryPer;
      double v[kCarryPer];
      bool f[kCarryPer];
#pragma unroll
      for (int q = 0; q < kCarryPer; ++q) {
        const int64_t t = t_begin + q;
        v[q] = t < nT ? tiles[t] : 0.0;
        f[q] = t < nT && tile_resets(start, t, p.L);
      }
      bool F = false;  // this thread's tiles folded: (a reset among them, the sum since the last)
      double V = 0.0;
#pragma unroll
      for (int q = 0; q < kCarryPer; ++q) {
        bool fq = f[q];
        double vq = v[q];
        seg_join(F, V, fq, vq);
        F = fq, V = vq;
      }
      for (int o = 1; o < 32; o <<= 1) {  // inclusive scan over the warp's lanes
        const double vl = __shfl_up_sync(dev::kFullMask, V, o);
        const bool fl = __shfl_up_sync(dev::kFullMask, (int)F, o);
        if (lane >= o) seg_join(fl, vl, F, V);
      }
      if (lane == 31) wsum[warp] = V, wflag[warp] = F;
      __syncthreads();
      double run = carry;  // the running sum before this warp's tiles
      for (int u = 0; u < warp; ++u) run = wflag[u] ? wsum[u] : run + wsum[u];
      double after = run;  // ... and after the whole round
      for (int u = warp; u < nwarps; ++u) after = wflag[u] ? wsum[u] : after + wsum[u];
      const double vl = __shfl_up_sync(dev::kFullMask, V, 1);
      const bool fl = __shfl_up_sync(dev::kFullMask, (int)F, 1);
      if (lane > 0) run = fl ? vl : run + vl;  // before this thread's tiles
#pragma unroll
      for (int q = 0; q < kCarryPer; ++q) {
        const int64_t t = t_begin + q;
        if (t < nT) tiles[t] = run;  // the running sum at the position before tile t
        run = f[q] ? v[q] : run + v[q];
      }
      carry = after;
      __syncthreads();
    }
  }
}

// Column c at every position of the tile, in order: fn(i, v, run, cnt), its centered value being
// v - run / cnt (the CPU's p).
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
    fn(i, v, run, (double)(i - s + 1));
  }
}

// Whether v - fl(run / cnt) > 0, i.e. fl(run / cnt) < v (cnt >= 1), without the division unless
// the quotient is within a few ulps of v: e = fma(v, cnt, -run) has the sign of v·cnt - run (the
// exact value is a multiple of 2^-1074, so it rounds to 0 only when it is 0); e <= 0 means
// run / cnt >= v, and e above thr puts run / cnt more than ulp(v) below v, so it rounds below v.
// NaN and infinities fail both tests and take the division.
__device__ __forceinline__ bool centered_positive(double v, double run, double cnt) {
  const double e = fma(v, cnt, -run);
  if (e > cnt * (fabs(v) * 0x1p-50 + 0x1p-1000)) return true;
  if (e <= 0.0) return false;
  return v - run / cnt > 0;
}

__global__ void bin_kernel(LshBucketsParams p, int G) {
  const int64_t nT = lsh_bucket_tiles(p.L);
  const int j = threadIdx.x % G;
  const unsigned mask = dev::group_mask(G);
  const bool active = j < p.h;
  const int64_t groups = (int64_t)gridDim.x * blockDim.x / G;
  for (int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / G; g < p.B * nT * p.H; g += groups) {
    const int64_t hd = g % p.H, tile = (g / p.H) % nT, b = g / (p.H * nT);  // the group's (b, tile, head)
    centered_tile(p, b, tile, hd * p.h + j, active, [&](int64_t i, double v, double run, double cnt) {
      int32_t bucket;
      if (!p.argmax) {  // bit j = p_j > 0
        unsigned bits = active && centered_positive(v, run, cnt) ? 1u << j : 0u;
        for (int o = 1; o < G; o <<= 1) bits |= __shfl_xor_sync(mask, bits, o);
        bucket = (int32_t)bits;
      } else {
        // The CPU keeps the first j with p_j > p_bucket, starting from 0: the first index of the
        // maximum over the non-NaN values, or 0 when p_0 is NaN.
        const double pv = v - run / cnt;
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
    centered_tile(p, b, tile, c, true, [&](int64_t i, double v, double run, double cnt) {
      p.values[(b * p.L + i) * C + c] = v - run / cnt;
    });
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
    if (p.h <= kTileCols) {
      // Heads per block: as many as kTileCols columns hold, spread evenly over the groups.
      const int64_t most = kTileCols / p.h, groups = (p.H + most - 1) / most, HB = (p.H + groups - 1) / groups;
      constexpr int64_t V = 16 / sizeof(scalar_t);
      const bool vec = p.N % V == 0 && p.x_sb % V == 0 && p.x_sl % V == 0 && p.x_sh % V == 0 &&
                       (uintptr_t)p.x % 16 == 0;
      project_tile_kernel<scalar_t, kTileRows><<<dev::grid_for(p.B * nT * groups, 1), t, 0, st>>>(p, (int)HB, vec);
    } else {
      project_kernel<scalar_t><<<dev::grid_for(p.B * nT * C, t), t, 0, st>>>(p);
    }
  });
  ops::cuda::check_launch("lsh_buckets (project)");
  carry_kernel<<<dev::grid_for(p.B * C, 1), kCarryThreads, 0, st>>>(p);
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
