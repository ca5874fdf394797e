// LSH buckets of x (B, L, H, N) on the GPU, equal to lsh.cpp's: v = x·proj in float64 with the
// products (exact: float x float fits a double) summed in order of n, exactly as the CPU's
// small_gemm does; then p = v - (Σ_{start..i} v) / (i - start + 1) per column, binned by sign bits
// or argmax. Normalizing is skipped on both sides (it changes neither signs nor the argmax).
//
// The running sums are a segmented scan along positions (reset at every sequence start), per
// (b, column c = head·h + j), in three steps over tiles of kLshTile positions:
//   project_tile_kernel  block of 128 threads per (b, tile, group of heads), in passes of 512
//                        (position, head) rows: the rows (64 bytes of each at a time) and proj's
//                        matching rows are copied by cp.async into shared memory, double buffered;
//                        a thread accumulates 4 rows x 8 columns, its proj values read as
//                        broadcasts from shared memory (one per 4 DFMAs). The values go to shared
//                        memory, where threads 0..63 sum each column over the tile since its last
//                        sequence start (`tiles`) while threads 64..127 copy them to `values`
//                        (coalesced). Meant to be bound by the 192 MiB of memory traffic and the
//                        DFMAs: at B=1, L=64K, H=16, N=64, h=8, bfloat16 it takes 98 us on an
//                        H100 under ncu (the previous version, 2 rows a thread with proj read
//                        through __ldg, took 370 us).
//                        (project_kernel, thread per (b, tile, c), serves h > kTileCols.)
//   carry_kernel         block per (b, c): an exclusive segmented scan of the tile sums (each thread
//                        folds kCarryPer consecutive tiles, warp shuffles and the block's warp totals
//                        join them), leaving in `tiles` the running sum before each tile (its carry);
//   bin_signs_kernel     (sign bits, h <= 32) a group of G lanes (G = power of two >= h) per
//                        (b, tile, head), lane j owning column j: the running sum continues from
//                        the carry position by position, the sign of each p (decided without the
//                        division unless p is within ulps of 0) a bit of the lane's 64-bit mask;
//                        the group then assembles each position's bucket from its lanes' masks.
//                        bin_kernel does argmax (h <= 32) in such groups, by shuffles at every
//                        position. With h > 32 (argmax only) center_kernel writes p into `values`
//                        instead and argmax_kernel bins it, one thread per (b, i, head) in the
//                        CPU's loop.
// At a sequence start the sum is reset to 0 before adding, as on the CPU, so the first position
// of a sequence centers to exactly 0. Elsewhere the sums are added in another order than the
// CPU's single running sum, so a value within an ulp of a decision boundary (sign of ~1e-16
// relative size) could bin differently; integer-valued inputs are exact in any order.
#include <cmath>
#include <climits>

#include "ops/cuda/cp_async.cuh"
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

// project_tile_kernel: a block of kProjThreads threads computes passes of kPassRows rows (r =
// position in tile · nh + head in group), a thread the rows r0 + rr · kProjThreads (rr <
// kTileRows), kColChunk columns at once: each proj value read feeds kTileRows DFMAs, each x
// element is converted to double once per column chunk. The rows come kChunkBytes of each at a
// time through shared memory (two buffers: cp.async fills one while the other is computed,
// consecutive threads copying consecutive 16-byte pieces), with proj's rows of the chunk beside
// them, read by every lane at one address (a broadcast).
constexpr int kProjThreads = 128;
constexpr int kTileRows = 4;
constexpr int kPassRows = kProjThreads * kTileRows;  // 512
constexpr int kChunkBytes = 64;                      // of each row per stage: kPieces 16-byte pieces
constexpr int kPieces = kChunkBytes / 16;
constexpr int kSvStride = kColChunk + 1;  // doubles per row of the pass's values (odd: no bank conflicts)
static_assert(kPieces == 4, "the swizzle below spreads 4 pieces of 8 consecutive rows over the 32 banks");
static_assert(kProjThreads >= 2 * kTileCols && kProjThreads >= kLshTile, "column and copy threads, resets");

// Shared memory of project_tile_kernel<T> (68 KiB: 3 blocks per SM): xs (2, kPassRows, kPieces)
// 16-byte pieces, ps (2, kM, kColChunk) doubles, runs (kTileCols) doubles, resets (kLshTile); sv
// (kPassRows, kSvStride) doubles lies over xs once the pass's elements are consumed.
template <class T>
struct ProjSmem {
  static constexpr int kM = kChunkBytes / (int)sizeof(T);  // elements of a row per stage
  static constexpr size_t kXs = 2 * kPassRows * kChunkBytes;
  static constexpr size_t kPs = 2 * kM * kColChunk * sizeof(double);
  static constexpr size_t kBytes = kXs + kPs + kTileCols * sizeof(double) + kLshTile;
  static_assert(kPassRows * kSvStride * sizeof(double) <= kXs, "sv fits over xs");
};

// Piece u of row rl of a stage buffer, swizzled so that the 8 rows of a quarter warp read (and
// cp.async writes) 8 different 16-byte bank groups.
__device__ __forceinline__ int piece_at(int rl, int u) { return rl * kPieces + (u ^ ((rl >> 1) & 3)); }

// Rows r, r + step, r + 2·step, ... of a block: r = pi·nh + hl, at offset `off` of x (elements).
struct RowWalk {
  int r, hl;
  int64_t off;
  int step, dhl;
  int64_t doff, wrap;  // offset steps: (step / nh, step % nh) rows, and back over nh heads
  __device__ __forceinline__ RowWalk(const LshBucketsParams& p, int64_t base, int r_, int step_, int nh)
      : r(r_), hl(r_ % nh), step(step_), dhl(step_ % nh) {
    off = base + (r_ / nh) * p.x_sl + hl * p.x_sh;
    doff = (step_ / nh) * p.x_sl + dhl * p.x_sh;
    wrap = p.x_sl - nh * p.x_sh;
  }
  __device__ __forceinline__ void next(int nh) {
    r += step, hl += dhl, off += doff;
    if (hl >= nh) hl -= nh, off += wrap;
  }
};

// Block per (b, tile, group of HB heads), HB·h <= kTileCols. Per chunk of kColChunk columns and
// pass of kPassRows rows: acc[rr][jj] = Σ_m x_r[m] · proj[m, j0 + jj] summed in order of m (the
// CPU's order; the staged zeros past N and past h add +0 to sums that are never -0, changing
// nothing); then the values go to sv, and threads [0, kTileCols) continue the column sums of the
// tile (since its last sequence start) while threads [kTileCols, 2 kTileCols) copy sv to `values`.
// With `vec`, the rows are copied 16 bytes at a time (N a multiple of the vector, the rows 16-byte
// aligned), else element by element.
template <class T>
__global__ void __launch_bounds__(kProjThreads, 3) project_tile_kernel(LshBucketsParams p, int HB, bool vec) {
  using S = ProjSmem<T>;
  constexpr int kM = S::kM, V = 16 / (int)sizeof(T);
  extern __shared__ uint4 smem[];
  uint4* xs = smem;
  double* ps = (double*)(smem + 2 * kPassRows * kPieces);
  double* runs = ps + 2 * kM * kColChunk;              // column sums carried from pass to pass
  bool* resets = (bool*)(runs + kTileCols);            // the position starts a sequence
  double* sv = (double*)smem;
  const int tid = threadIdx.x;
  const int64_t C = p.H * p.h, nT = lsh_bucket_tiles(p.L), nG = (p.H + HB - 1) / HB;
  const int h = (int)p.h, nch = (int)((p.N + kM - 1) / kM);
  for (int64_t blk = blockIdx.x; blk < p.B * nT * nG; blk += gridDim.x) {
    const int64_t g = blk % nG, tile = (blk / nG) % nT, b = blk / (nG * nT);
    const int64_t h0 = g * HB, t0 = tile * kLshTile;
    const int nh = (int)(HB < p.H - h0 ? HB : p.H - h0), np = (int)(t0 + kLshTile < p.L ? kLshTile : p.L - t0);
    const int nrows = np * nh;
    const int64_t xbase = b * p.x_sb + t0 * p.x_sl + h0 * p.x_sh;
    if (tid < np) resets[tid] = p.start[b * p.L + t0 + tid] == t0 + tid;
    for (int j0 = 0; j0 < h; j0 += kColChunk) {
      const int nj = h - j0 < kColChunk ? h - j0 : kColChunk;
      for (int r0 = 0; r0 < nrows; r0 += kPassRows) {
        const int prow = nrows - r0 < kPassRows ? nrows - r0 : kPassRows;
        // Stage chunk ch (elements [ch·kM, ch·kM + kM) of the pass's rows, zeros past N and past
        // prow; proj's rows of them, zeros past N and h) into buffer buf.
        auto stage = [&](int ch, int buf) {
          const int64_t m0 = (int64_t)ch * kM;
          uint4* xb = xs + buf * kPassRows * kPieces;
          if (vec) {
            constexpr int kStep = kProjThreads / kPieces, kPer = kPassRows / kStep;
            const int u = tid % kPieces;
            const bool in_n = m0 + u * V < p.N;
            RowWalk w(p, xbase, r0 + tid / kPieces, kStep, nh);
#pragma unroll 4
            for (int k = 0; k < kPer; ++k, w.next(nh)) {
              const bool ok = in_n && w.r < r0 + prow;
              ops::cuda::cp_async16(xb + piece_at(w.r - r0, u), ok ? (const T*)p.x + w.off + m0 + u * V : p.x, ok);
            }
          } else {
            constexpr int kStep = kProjThreads / kM, kPer = kPassRows / kStep, kBatch = 8;
            const int e = tid % kM;
            const bool in_n = m0 + e < p.N;
            RowWalk w(p, xbase, r0 + tid / kM, kStep, nh);
            for (int k0 = 0; k0 < kPer; k0 += kBatch) {
              T v[kBatch];
              int rl[kBatch];
#pragma unroll
              for (int k = 0; k < kBatch; ++k, w.next(nh)) {
                rl[k] = w.r - r0;
                v[k] = in_n && w.r < r0 + prow ? ((const T*)p.x)[w.off + m0 + e] : T(0.0f);
              }
#pragma unroll
              for (int k = 0; k < kBatch; ++k) ((T*)(xb + piece_at(rl[k], e / V)))[e % V] = v[k];
            }
          }
          double* pb = ps + buf * kM * kColChunk;
          for (int q = tid; q < kM * kColChunk; q += kProjThreads) {
            const int64_t m = m0 + q / kColChunk;
            const int j = q % kColChunk;
            const bool ok = m < p.N && j < nj;
            ops::cuda::cp_async8(pb + q, ok ? p.proj + m * h + j0 + j : p.proj, ok);
          }
          ops::cuda::cp_async_commit();
        };
        double acc[kTileRows][kColChunk];
#pragma unroll
        for (int rr = 0; rr < kTileRows; ++rr)
#pragma unroll
          for (int q = 0; q < kColChunk; ++q) acc[rr][q] = 0.0;
        stage(0, 0);
        for (int ch = 0; ch < nch; ++ch) {
          ops::cuda::cp_async_wait<0>();
          __syncthreads();  // chunk ch is in, and the other buffer's chunk ch - 1 is consumed
          if (ch + 1 < nch) stage(ch + 1, (ch + 1) & 1);
          const uint4* xb = xs + (ch & 1) * kPassRows * kPieces;
          const double2* pb = (const double2*)(ps + (ch & 1) * kM * kColChunk);
#pragma unroll 1
          for (int u = 0; u < kPieces; ++u) {
            uint4 raw[kTileRows];
#pragma unroll
            for (int rr = 0; rr < kTileRows; ++rr) raw[rr] = xb[piece_at(rr * kProjThreads + tid, u)];
#pragma unroll
            for (int e = 0; e < V; ++e) {
              double pj[kColChunk];
#pragma unroll
              for (int q = 0; q < kColChunk / 2; ++q) {
                const double2 d = pb[(u * V + e) * (kColChunk / 2) + q];
                pj[2 * q] = d.x, pj[2 * q + 1] = d.y;
              }
#pragma unroll
              for (int rr = 0; rr < kTileRows; ++rr) {
                const double xm = (double)elem_of(raw[rr], e, (const T*)nullptr);
#pragma unroll
                for (int q = 0; q < kColChunk; ++q) acc[rr][q] += xm * pj[q];
              }
            }
          }
        }
        __syncthreads();  // the last chunk consumed: sv may overwrite xs
#pragma unroll
        for (int rr = 0; rr < kTileRows; ++rr) {
          const int rl = rr * kProjThreads + tid;
          if (rl < prow)
#pragma unroll
            for (int q = 0; q < kColChunk; ++q)
              if (q < nj) sv[rl * kSvStride + q] = acc[rr][q];
        }
        __syncthreads();
        // Column c = (head hl, j0 + jj) of the chunk: summed by thread c, copied by thread kTileCols + c.
        const int c = tid % kTileCols, hl = c / nj, jj = c % nj;
        if (c < nh * nj) {
          // Column c's rows r = pi·nh + hl of this pass, in order of position.
          int pi = r0 / nh;
          if (pi * nh + hl < r0) ++pi;
          if (tid < kTileCols) {
            double run = r0 == 0 ? 0.0 : runs[c];  // the sum since the tile's start or its last sequence start
#pragma unroll 8
            for (int r = pi * nh + hl; r < r0 + prow; r += nh, ++pi) {
              if (resets[pi]) run = 0.0;
              run += sv[(r - r0) * kSvStride + jj];
            }
            if (r0 + kPassRows < nrows)
              runs[c] = run;
            else
              p.tiles[(b * C + (h0 + hl) * h + j0 + jj) * nT + tile] = run;
          } else {
            double* dst = p.values + (b * p.L + t0 + pi) * C + (h0 + hl) * h + j0 + jj;
#pragma unroll 8
            for (int r = pi * nh + hl; r < r0 + prow; r += nh, dst += C) *dst = sv[(r - r0) * kSvStride + jj];
          }
        }
        __syncthreads();  // sv and resets read
      }
    }
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
// v - run / cnt (the CPU's p). (Loading 4 or 8 positions' values and starts before using them
// measured slower on the H100: 47 us a call of bin_signs_kernel as here, 47 and 50 us batched.)
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

// Groups of G lanes, one per (b, tile, head) of the buckets, over the grid (grid-strided):
// f(b, tile, head) in each lane of the group; the lane's column is threadIdx.x % G.
template <class F>
__device__ __forceinline__ void for_each_lane_group(const LshBucketsParams& p, int G, F&& f) {
  const int64_t nT = lsh_bucket_tiles(p.L), groups = (int64_t)gridDim.x * blockDim.x / G;
  for (int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / G; g < p.B * nT * p.H; g += groups)
    f(g / (p.H * nT), (g / p.H) % nT, g % p.H);
}

// Argmax with h <= 32: a group of G lanes per (b, tile, head), lane j owning column j, the group's
// best column found by shuffles at each position.
__global__ void bin_kernel(LshBucketsParams p, int G) {
  const int j = threadIdx.x % G;
  const unsigned mask = dev::group_mask(G);
  const bool active = j < p.h;
  for_each_lane_group(p, G, [&](int64_t b, int64_t tile, int64_t hd) {
    centered_tile(p, b, tile, hd * p.h + j, active, [&](int64_t i, double v, double run, double cnt) {
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
      if (j == 0) p.out[(b * p.L + i) * p.H + hd] = p0_nan ? 0 : bj;
    });
  });
}

// Sign bits (h <= 32, not argmax): groups as bin_kernel's, but a lane first collects its column's
// signs over the tile into one 64-bit mask, with no work across lanes a position; then lane j
// assembles the buckets of positions P j .. P j + P - 1 (P = 64 / G) from the group's G masks and
// stores them. (Sign bits by shuffles at every position, as bin_kernel's argmax, took 72-93 us a
// call at L = 64K x 16 heads, h = 8, on the H100; this kernel 47 us.)
template <int G>
__global__ void bin_signs_kernel(LshBucketsParams p) {
  static_assert(kLshTile == 64, "a lane's signs of a tile are one 64-bit mask");
  constexpr int P = (int)kLshTile / G;  // positions whose buckets a lane assembles
  const int j = threadIdx.x % G;
  const unsigned mask = dev::group_mask(G);
  const bool active = j < p.h;
  for_each_lane_group(p, G, [&](int64_t b, int64_t tile, int64_t hd) {
    const int64_t t0 = tile * kLshTile, t1 = t0 + kLshTile < p.L ? t0 + kLshTile : p.L;
    uint64_t signs = 0;  // bit i - t0: p_j > 0 at position i
    centered_tile(p, b, tile, hd * p.h + j, active, [&](int64_t i, double v, double run, double cnt) {
      if (active && centered_positive(v, run, cnt)) signs |= 1ull << (i - t0);
    });
    uint32_t bucket[P];
#pragma unroll
    for (int k = 0; k < P; ++k) bucket[k] = 0;
#pragma unroll
    for (int o = 0; o < G; ++o) {
      const uint64_t mo = __shfl_sync(mask, signs, o, G);
      const uint64_t part = P == 64 ? mo : (mo >> (P * j)) & ((1ull << (P % 64)) - 1);
#pragma unroll
      for (int k = 0; k < P; ++k) bucket[k] |= (uint32_t)((part >> k) & 1u) << o;
    }
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int64_t i = t0 + P * j + k;
      if (i < t1) p.out[(b * p.L + i) * p.H + hd] = (int32_t)bucket[k];
    }
  });
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
      const auto kernel = project_tile_kernel<scalar_t>;
      constexpr size_t smem = ProjSmem<scalar_t>::kBytes;
      ops::cuda::allow_smem(kernel, smem, "lsh_buckets (project)");
      kernel<<<dev::grid_for(p.B * nT * groups, 1), kProjThreads, smem, st>>>(p, (int)HB, vec);
    } else {
      project_kernel<scalar_t><<<dev::grid_for(p.B * nT * C, t), t, 0, st>>>(p);
    }
  });
  ops::cuda::check_launch("lsh_buckets (project)");
  carry_kernel<<<dev::grid_for(p.B * C, 1), kCarryThreads, 0, st>>>(p);
  ops::cuda::check_launch("lsh_buckets (carry)");
  if (p.h <= 32 && !p.argmax) {
    const int G = dev::lanes_per_list(p.h);
    const unsigned grid = dev::grid_for(p.B * nT * p.H * G, t);
    switch (G) {
      case 1: bin_signs_kernel<1><<<grid, t, 0, st>>>(p); break;
      case 2: bin_signs_kernel<2><<<grid, t, 0, st>>>(p); break;
      case 4: bin_signs_kernel<4><<<grid, t, 0, st>>>(p); break;
      case 8: bin_signs_kernel<8><<<grid, t, 0, st>>>(p); break;
      case 16: bin_signs_kernel<16><<<grid, t, 0, st>>>(p); break;
      default: bin_signs_kernel<32><<<grid, t, 0, st>>>(p); break;
    }
    ops::cuda::check_launch("lsh_buckets (bin signs)");
  } else if (p.h <= 32) {
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
