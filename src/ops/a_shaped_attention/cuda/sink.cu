// CUDA kernels of A-shaped attention's sink part in the backward (params.h states the split): the
// keys j <= e_i = min(sink - 1, i - window) of query i, which the window part leaves out. The
// forward needs none of its own: the causal forward takes the sink as one more key tile. bfloat16
// storage on tensor cores (mma.sync, ops/cuda/mma_bf16.cuh), float32 math.
//
//   sink_backward_kernel  one block per (chunk of kASinkChunkTiles query tiles, b, h), with the
//                         union's lse and Δ (the same softmax as the window part's backward):
//                         P = exp(S - lse), dP = dO V_s^T, dS = P (dP - Δ);
//                         dq += scale dS K_s (each row once: read, add, write), and the chunk's
//                         dK_s = scale Σ dS^T Q, dV_s = Σ P^T dO summed in registers over its tiles,
//                         then stored (no atomics).
//   sink_reduce_kernel    dk, dv rows j < sink += the chunks' sums, added in chunk order.
// Every sum has a fixed order: the backward is deterministic. The sink keys and values stay in
// shared memory for a whole block (one 64-row tile, zeros past the sink); P and dS reach their
// second products rounded to bfloat16, as in the causal kernels.
#include "ops/a_shaped_attention/params.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/key_tile.cuh"
#include "ops/cuda/mma_bf16.cuh"

namespace hax::ops {
namespace a_sink_cuda {
namespace {

using bf16 = __nv_bfloat16;
using namespace cuda::mma;
namespace key_tile = cuda::key_tile;

constexpr int kRows = 64;      // queries of a tile; sink keys of a block (padded with zeros)
constexpr int kThreads = 128;  // 4 warps, 16 query rows each
constexpr float kLog2e = 1.4426950408889634f;

// The sizes the kernels index with (checked to fit an int by the launchers).
struct Dims {
  int L = 0, H = 0, D = 0, Dv = 0, Dm = 0;  // length, heads, head dims, max(D, Dv)
  int W = 0, S = 0;                         // window, sink
  int BH = 0, ntiles = 0, chunks = 0;
  float scale = 0, scale2 = 0;              // scale, and scale * log2(e) (scores in base 2)
};

Dims make_dims(const ASinkParams& p) {
  if (p.seqlen >= (1 << 30) || p.batch * p.nheads >= (1 << 30))
    throw std::runtime_error("a_shaped_attention CUDA sink kernels: L = " + std::to_string(p.seqlen) +
                             " must be below 2^30 and B * H below 2^30");
  if (p.sink < 1 || p.sink > kASinkCudaMaxKeys || p.window < 1)
    throw std::runtime_error("a_shaped_attention CUDA sink kernels: sink = " + std::to_string(p.sink) +
                             " must be in [1, 64] and window = " + std::to_string(p.window) + " >= 1");
  if (p.dim % 8 || p.vdim % 8 || p.dim < 8 || p.vdim < 8 || p.dim > 128 || p.vdim > 128)
    throw std::runtime_error("a_shaped_attention CUDA sink kernels: head dims D = " + std::to_string(p.dim) +
                             " and Dv = " + std::to_string(p.vdim) + " must be multiples of 8 in [8, 128]");
  Dims d;
  d.L = (int)p.seqlen, d.H = (int)p.nheads, d.D = (int)p.dim, d.Dv = (int)p.vdim;
  d.Dm = d.D > d.Dv ? d.D : d.Dv;
  d.W = p.window >= p.seqlen ? d.L : (int)p.window;
  d.S = (int)p.sink;
  d.BH = (int)(p.batch * p.nheads);
  d.ntiles = (d.L + kRows - 1) / kRows;
  d.chunks = (int)a_sink_chunks(p);
  d.scale = (float)p.scale;
  d.scale2 = (float)(p.scale * 1.4426950408889634);
  return d;
}

// Element offset of row i of (b, h) in a (B, L, H, Dh) tensor; rows are H Dh apart.
__device__ __forceinline__ int64_t row_base(const Dims& dm, int b, int h, int Dh) {
  return ((int64_t)b * dm.L * dm.H + h) * Dh;
}

// The last sink key query i sees (-1: none; also for rows past L).
__device__ __forceinline__ int last_sink_key(const Dims& dm, int i) {
  return i < dm.L ? min(dm.S - 1, i - dm.W) : -1;
}

// Bits of the 16-key groups that hold keys < nk (for warp_dot / warp_accumulate's `live`).
__device__ __forceinline__ unsigned live_groups(int nk) { return (1u << ((nk + 15) / 16)) - 1u; }

// The tiles of a chunk that have sink work (a tile whose last query is before the window's end
// has none): [first, end).
__device__ __forceinline__ void chunk_tiles(const Dims& dm, int chunk, int per_chunk, int& first, int& end) {
  first = max(chunk * per_chunk, dm.W / kRows);
  end = min((chunk + 1) * per_chunk, dm.ntiles);
}

// cp.async copies of rows i0 .. i0 + 63 of src (row stride `stride`) into the shared tile dst
// (64, DB + 8): columns < cols, rows < limit; zeros elsewhere.
template <int DB>
__device__ __forceinline__ void copy_rows(bf16* dst, const bf16* src, int64_t stride, int i0, int limit, int cols) {
  cuda::TileCopy<kRows, DB, kThreads>::template rows<DB + 8>(dst, src, stride, i0, limit, cols);
}

// Writes the warp's 16 rows of a shared tile (rows r0.., stride S) to dst rows i0 + r0.. in 16-byte
// chunks, only rows i with a sink part (i >= W, i < L; the other rows are unchanged).
template <int DB>
__device__ __forceinline__ void store_sink_rows(bf16* dst, int64_t stride, const bf16* tile, int i0, int r0,
                                                const Dims& dm, int cols) {
  constexpr int S = DB + 8, kChunks = DB / 8;
  for (int x = lane_of(); x < 16 * kChunks; x += 32) {
    const int rr = x / kChunks, c = (x % kChunks) * 8, i = i0 + r0 + rr;
    if (i >= dm.W && i < dm.L && c < cols)
      *reinterpret_cast<uint4*>(dst + (int64_t)i * stride + c) = *reinterpret_cast<const uint4*>(tile + (r0 + rr) * S + c);
  }
}

// Shared memory of the backward: sK, sV, two stages of (sQ, sdO, sdQ), all (64, DB + 8); sP, sdS
// (64, 72); two stages of lse and Δ (64 each).
template <int DB>
constexpr size_t backward_smem() {
  return (size_t)8 * kRows * (DB + 8) * sizeof(bf16) + (size_t)2 * kRows * (kRows + 8) * sizeof(bf16) +
         4 * kRows * sizeof(float);
}


// KG: 16-key groups of the sink (1, 2 or 4). In the dK, dV products warp w takes key group
// w % KG and column part w / KG of CS parts of DW columns (warps past KG CS idle there).
// Grid: chunks * BH blocks, chunk-major; each block takes its chunk's tiles in order, copying the
// next tile's q, dO and dq rows, lse and Δ (cp.async) while it computes on the current one.
// Dynamic shared memory: backward_smem<DB>().
template <int DB, int KG>
__global__ void __launch_bounds__(kThreads) sink_backward_kernel(ASinkGradParams gp, Dims dm) {
  constexpr int S = DB + 8, SP = key_tile::kSP, T = kRows * S;
  constexpr int CS = key_tile::kParts<DB, KG>, DW = DB / CS;
  const ASinkParams& p = gp.fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);  // (64, S) sink keys (zeros past the sink)
  bf16* sV = sK + T;                              // (64, S) sink values
  bf16* sStage = sV + T;                          // stage st: sQ, sdO, sdQ at sStage + 3 T st + 0, T, 2 T
  bf16* sP = sStage + 6 * T;                      // (64 queries, SP) P, bfloat16
  bf16* sdS = sP + kRows * SP;                    // (64 queries, SP) dS, bfloat16
  float* sLse = reinterpret_cast<float*>(sdS + kRows * SP);  // stage st: lse at sLse + 64 st (natural log)
  float* sDl = sLse + 2 * kRows;                              // stage st: Δ at sDl + 64 st
  const int bh = (int)(blockIdx.x % (unsigned)dm.BH), b = bh / dm.H, h = bh % dm.H;
  const int chunk = (int)(blockIdx.x / (unsigned)dm.BH);
  const int64_t qb = row_base(dm, b, h, dm.D), vb = row_base(dm, b, h, dm.Dv);
  const int64_t rs = (int64_t)dm.H * dm.D, rsv = (int64_t)dm.H * dm.Dv;
  const int nk = min(dm.S, dm.L - dm.W);
  const float* lse = p.lse + (int64_t)bh * dm.L;
  const float* delta = gp.delta + (int64_t)bh * dm.L;
  bf16* dq = (bf16*)gp.dq + qb;
  int first, end;
  chunk_tiles(dm, chunk, (int)kASinkChunkTiles, first, end);
  copy_rows<DB>(sK, (const bf16*)p.k + qb, rs, 0, nk, dm.D);
  copy_rows<DB>(sV, (const bf16*)p.v + vb, rsv, 0, nk, dm.Dv);
  cuda::cp_async_commit();
  auto issue = [&](int tile, int st) {
    const int i0 = tile * kRows;
    bf16* sQ = sStage + 3 * T * st;
    copy_rows<DB>(sQ, (const bf16*)p.q + qb, rs, i0, dm.L, dm.D);
    copy_rows<DB>(sQ + T, (const bf16*)gp.dout + vb, rsv, i0, dm.L, dm.Dv);
    copy_rows<DB>(sQ + 2 * T, dq, rs, i0, dm.L, dm.D);
    const int x = threadIdx.x % kRows, i = i0 + x;
    if (threadIdx.x < kRows) cuda::cp_async4(sLse + kRows * st + x, i < dm.L ? lse + i : lse, i < dm.L);
    else cuda::cp_async4(sDl + kRows * st + x, i < dm.L ? delta + i : delta, i < dm.L);
    cuda::cp_async_commit();
  };

  const int warp = threadIdx.x / 32, lane = lane_of(), g = lane / 4, t = lane % 4, r0 = warp * 16;
  const int kg = warp % KG, cp = warp / KG;
  const unsigned live = live_groups(nk);
  float accK[DW / 8][4] = {}, accV[DW / 8][4] = {};
  if (first < end) issue(first, 0);
  for (int tile = first, it = 0; tile < end; ++tile, ++it) {
    const int st = it & 1, i0 = tile * kRows;
    if (tile + 1 < end) {
      issue(tile + 1, st ^ 1);
      cuda::cp_async_wait<1>();
    } else {
      cuda::cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* sQ = sStage + 3 * T * st;
    const bf16* sdO = sQ + T;
    bf16* sdQ = sStage + 3 * T * st + 2 * T;
    const int row[2] = {i0 + r0 + g, i0 + r0 + g + 8};
    const int e[2] = {last_sink_key(dm, row[0]), last_sink_key(dm, row[1])};
    float ps[8][4] = {};  // P, then dS
    if (min(i0 + r0 + 15, dm.L - 1) >= dm.W) {  // (warp-uniform) some row of the warp sees a sink key
      warp_dot<DB, 8, S>(ps, sQ, r0, sK, live);
      float dp[8][4] = {};
      warp_dot<DB, 8, S>(dp, sdO, r0, sV, live);
      float lse2[2], dl[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) lse2[r] = sLse[kRows * st + r0 + g + 8 * r] * kLog2e, dl[r] = sDl[kRows * st + r0 + g + 8 * r];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int r = c / 2, col = nt * 8 + 2 * t + (c & 1);
          const float pr = col <= e[r] ? fast_exp2(ps[nt][c] * dm.scale2 - lse2[r]) : 0.f;
          ps[nt][c] = pr;
          dp[nt][c] = pr * (dp[nt][c] - dl[r]);
        }
      key_tile::store_p_ds(sP, sdS, ps, dp, r0, g, t);
      // dq rows += scale dS K_s: added to the staged rows, then the rows with a sink part go out.
      float acc[DB / 8][4] = {};
      warp_accumulate<DB, 8, S>(acc, dp, sK, live);
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int nt = 0; nt < DB / 8; ++nt) {
          bf16* at = sdQ + (r0 + g + 8 * r) * S + nt * 8 + 2 * t;
          const __nv_bfloat162 old = *reinterpret_cast<const __nv_bfloat162*>(at);
          *reinterpret_cast<uint32_t*>(at) = pack_bf16(__low2float(old) + dm.scale * acc[nt][2 * r],
                                                       __high2float(old) + dm.scale * acc[nt][2 * r + 1]);
        }
      __syncwarp();
      store_sink_rows<DB>(dq, rs, sdQ, i0, r0, dm, dm.D);
    } else {
      // The warp's rows take no part: zeros in P and dS for the key-major products.
      key_tile::store_p_ds<true>(sP, sdS, ps, ps, r0, g, t);
    }
    __syncthreads();
    key_tile::accumulate<DB, KG, S>(accK, accV, sP, sdS, sQ, sdO, warp);
    __syncthreads();  // the next iteration's copies refill this stage; sP and sdS are rewritten
  }
  cuda::cp_async_wait<0>();  // (a chunk without work still issued the sink copies)
  if (cp >= CS) return;
  // The chunk's sums: (chunk, bh, 0 = dK / 1 = dV, key < sink, column < Dm).
  float* part = gp.workspace + ((int64_t)chunk * dm.BH + bh) * 2 * dm.S * dm.Dm;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = 16 * kg + g + 8 * r;
    if (key >= dm.S) continue;
#pragma unroll
    for (int nt = 0; nt < DW / 8; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = cp * DW + nt * 8 + 2 * t + c;
        if (col < dm.D) part[(int64_t)key * dm.Dm + col] = accK[nt][2 * r + c];
        if (col < dm.Dv) part[((int64_t)dm.S + key) * dm.Dm + col] = accV[nt][2 * r + c];
      }
  }
}

// dk (scaled) and dv rows j < min(sink, L) += Σ over chunks in order. One thread per entry of
// (BH, 2, sink, Dm).
__global__ void sink_reduce_kernel(ASinkGradParams gp, Dims dm) {
  const int64_t n = (int64_t)dm.BH * 2 * dm.S * dm.Dm;
  const int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (x >= n) return;
  const int col = (int)(x % dm.Dm), key = (int)(x / dm.Dm % dm.S), which = (int)(x / ((int64_t)dm.Dm * dm.S) % 2);
  const int bh = (int)(x / ((int64_t)dm.Dm * dm.S * 2)), b = bh / dm.H, h = bh % dm.H;
  const int Dh = which ? dm.Dv : dm.D;
  if (col >= Dh || key >= dm.L) return;
  const int64_t stride = (int64_t)dm.BH * 2 * dm.S * dm.Dm;  // between chunks
  const float* part = gp.workspace + x;
  float sum = 0.f;
  for (int c = 0; c < dm.chunks; ++c) sum += part[c * stride];
  bf16* d = (bf16*)(which ? gp.dv : gp.dk) + row_base(dm, b, h, Dh) + (int64_t)key * dm.H * Dh + col;
  *d = __float2bfloat16(__bfloat162float(*d) + (which ? sum : dm.scale * sum));
}

template <class F>
void dispatch_head_dim(int dmax, F&& f) {
  HAX_DISPATCH_HEAD_DIM(dmax, [&] { f(std::integral_constant<int, DB>{}); });
}

}  // namespace
}  // namespace a_sink_cuda

void a_sink_backward_cuda(const ASinkGradParams& gp, void* stream) {
  using namespace a_sink_cuda;
  const ASinkParams& p = gp.fwd;
  if (p.batch * p.nheads * p.seqlen == 0) return;
  const Dims dm = make_dims(p);
  if (dm.W >= dm.L) return;
  const auto s = (cudaStream_t)stream;
  dispatch_head_dim(dm.Dm, [&](auto db) {
    constexpr int DB = decltype(db)::value;
    const size_t smem = backward_smem<DB>();
    const unsigned grid = (unsigned)((int64_t)dm.chunks * dm.BH);
    auto launch = [&](auto kernel) {
      cuda::allow_smem(kernel, smem, "a_shaped_attention sink backward");
      kernel<<<grid, kThreads, smem, s>>>(gp, dm);
    };
    if (dm.S <= 16) launch(sink_backward_kernel<DB, 1>);
    else if (dm.S <= 32) launch(sink_backward_kernel<DB, 2>);
    else launch(sink_backward_kernel<DB, 4>);
  });
  cuda::check_launch("a_sink_backward_cuda");
  const int64_t n = (int64_t)dm.BH * 2 * dm.S * dm.Dm;
  sink_reduce_kernel<<<(unsigned)cuda::ceil_div(n, 256), 256, 0, s>>>(gp, dm);
  cuda::check_launch("a_sink_backward_cuda (reduce)");
}

}  // namespace hax::ops
