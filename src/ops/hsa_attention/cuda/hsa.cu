// CUDA kernels of HSA attention (params.h has the plan and the order of the launches): per chunk,
// 64 (query, slot) pairs at a time against the chunk's C <= 64 keys, bfloat16 storage on tensor
// cores (mma.sync, ops/cuda/mma_bf16.cuh) and float32 math. A chunk's keys are one tile, so each
// pair's softmax is exact in one step (no running max); P and dS enter their second products
// rounded to bfloat16, as in the other attention kernels.
//
//   forward_kernel   (tile, head): S = Q K^T of the tile's gathered query rows, P = softmax over
//                    the chunk's keys, o_p = P V and lse_p of every pair
//   combine_kernel   (query, head): Σ over the query's valid slots of w_p o_p (out) or dq_p (dq),
//                    in slot order, 0 without any
//   dots_kernel      (pair): d_p,h = dout · o_p,h (Δ of the pair's softmax), dw_p = Σ_h d_p,h
//   backward_kernel  (group of tiles of one chunk, head): dq_p = scale w_p (P ∘ (dout V^T - d_p)) K
//                    per tile (stored per pair), the chunk's dK = scale Σ dS^T Q and dV = Σ w P^T
//                    dout over the group's tiles in registers; stored, or kept as the group's slot
//   reduce_kernel    (chunk of several groups, head): dk, dv rows = Σ of its slots in group order
// Every sum has a fixed order: the backward is deterministic.
#include <cmath>
#include <stdexcept>
#include <string>

#include "ops/cuda/common.cuh"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/key_tile.cuh"
#include "ops/cuda/mma_bf16.cuh"
#include "ops/hsa_attention/params.h"

namespace hax::ops {
namespace hsa_cuda {
namespace {

using bf16 = __nv_bfloat16;
using namespace cuda::mma;
namespace key_tile = cuda::key_tile;

constexpr int kRows = (int)kHsaTilePairs;  // pairs of a tile; keys of a chunk (padded with zeros)
constexpr int kThreads = 128;               // 4 warps, 16 pairs each
constexpr int kGroup = (int)kHsaGroupTiles;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kRows == 64 && kHsaCudaMaxChunk == 64, "a chunk's keys are one 64-row tile");

// The sizes the kernels index with (checked to fit an int by the launchers).
struct Dims {
  int B = 0, L = 0, H = 0, D = 0, Dv = 0, Dm = 0;  // batch, length, heads, head dims, max(D, Dv)
  int S = 0, NC = 0, C = 0, U = 0, P = 0;          // slots, chunks a row, chunk length, keys B NC, pairs B L S
  float scale = 0, scale2 = 0;                     // scale, and scale * log2(e) (scores in base 2)
};

Dims make_dims(const HsaParams& p) {
  const int64_t P = p.batch * p.seqlen * p.nslots, U = p.batch * p.nchunks;
  if (P >= (int64_t(1) << 30) || U >= (int64_t(1) << 30) || p.batch * p.seqlen * p.nheads >= (int64_t(1) << 30) ||
      P * p.nheads >= (int64_t(1) << 31))
    throw std::runtime_error("hsa_attention CUDA kernels: B L S = " + std::to_string(P) + ", B NC = " +
                             std::to_string(U) + " and B L H must be below 2^30 (pairs times heads below 2^31)");
  if (p.chunk < 1 || p.chunk > kHsaCudaMaxChunk)
    throw std::runtime_error("hsa_attention CUDA kernels: chunk = " + std::to_string(p.chunk) + " must be in [1, 64]");
  if (p.dim % 8 || p.vdim % 8 || p.dim < 8 || p.vdim < 8 || p.dim > 128 || p.vdim > 128)
    throw std::runtime_error("hsa_attention CUDA kernels: head dims D = " + std::to_string(p.dim) + " and Dv = " +
                             std::to_string(p.vdim) + " must be multiples of 8 in [8, 128]");
  Dims d;
  d.B = (int)p.batch, d.L = (int)p.seqlen, d.H = (int)p.nheads, d.D = (int)p.dim, d.Dv = (int)p.vdim;
  d.Dm = d.D > d.Dv ? d.D : d.Dv;
  d.S = (int)p.nslots, d.NC = (int)p.nchunks, d.C = (int)p.chunk, d.U = (int)U, d.P = (int)P;
  d.scale = (float)p.scale;
  d.scale2 = (float)(p.scale * 1.4426950408889634);
  return d;
}

// The key u whose range of the prefix sums `ends` (U entries, inclusive) holds item x, and the
// items before that key; false when x is past the last item (the grids are upper bounds).
__device__ __forceinline__ bool find_key(const int32_t* ends, int U, int x, int& u, int& before) {
  if (U == 0 || x >= ends[U - 1]) return false;
  int lo = 0, hi = U - 1;  // the first u with ends[u] > x
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (ends[mid] > x) hi = mid;
    else lo = mid + 1;
  }
  u = lo;
  before = lo > 0 ? ends[lo - 1] : 0;
  return true;
}

// Element offset of row 0 of (b, h) in a (B, L, H, Dh) tensor; rows are H Dh apart.
__device__ __forceinline__ int64_t row_base(const Dims& dm, int b, int h, int Dh) {
  return ((int64_t)b * dm.L * dm.H + h) * Dh;
}

// Bits of the 16-key groups that hold keys < nk (for warp_dot / warp_accumulate's `live`).
__device__ __forceinline__ unsigned live_groups(int nk) { return (1u << ((nk + 15) / 16)) - 1u; }

// The position i of pair `pid` in its row (pid = (b L + i) S + s), or -1 for no pair.
__device__ __forceinline__ int pair_row(const Dims& dm, int pid) { return pid >= 0 ? pid / dm.S % dm.L : -1; }


// Shared memory of the forward: sQ, sK, sV (64, DB + 8).
template <int DB>
constexpr size_t forward_smem() {
  return (size_t)3 * kRows * (DB + 8) * sizeof(bf16);
}

// Grid: max_tiles * H blocks, heads fastest (a tile's query rows are adjacent across heads).
template <int DB>
__global__ void __launch_bounds__(kThreads) forward_kernel(HsaParams p, HsaPlan plan, Dims dm) {
  constexpr int S = DB + 8, T = kRows * S;
  using Copy = cuda::TileCopy<kRows, DB, kThreads>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK = sQ + T;
  bf16* sV = sK + T;
  __shared__ int32_t sPid[kRows];
  const int h = (int)(blockIdx.x % (unsigned)dm.H), tile = (int)(blockIdx.x / (unsigned)dm.H);
  int u, before;
  if (!find_key(plan.tile_end, dm.U, tile, u, before)) return;
  const int lt = tile - before, p0 = plan.first[u] + lt * kRows, n = min(kRows, plan.count[u] - lt * kRows);
  const int b = u / dm.NC, j0 = p.start[u], kend = min(j0 + dm.C, dm.L), nk = kend - j0;
  const int64_t qb = row_base(dm, b, h, dm.D), vb = row_base(dm, b, h, dm.Dv);
  const int64_t rs = (int64_t)dm.H * dm.D, rsv = (int64_t)dm.H * dm.Dv;
  int32_t pos[Copy::kPer];
#pragma unroll
  for (int k = 0; k < Copy::kPer; ++k) {
    const int r = Copy::row(k);
    pos[k] = pair_row(dm, r < n ? plan.order[p0 + r] : -1);
  }
  Copy::template gather<S>(sQ, (const bf16*)p.q + qb, rs, pos, dm.D);
  Copy::template rows<S>(sK, (const bf16*)p.k + qb, rs, j0, kend, dm.D);
  Copy::template rows<S>(sV, (const bf16*)p.v + vb, rsv, j0, kend, dm.Dv);
  cuda::cp_async_commit();
  if (threadIdx.x < kRows) sPid[threadIdx.x] = (int)threadIdx.x < n ? plan.order[p0 + threadIdx.x] : -1;
  cuda::cp_async_wait<0>();
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = lane_of(), g = lane / 4, t = lane % 4, r0 = warp * 16;
  if (r0 >= n) return;  // (no barrier follows)
  const unsigned live = live_groups(nk);
  float s[8][4] = {};
  warp_dot<DB, 8, S>(s, sQ, r0, sK, live);
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (nt * 8 + 2 * t + (e & 1) >= nk) s[nt][e] = -INFINITY;
      mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
    }
  float m[2], l[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) m[r] = max4(mx[r]) * dm.scale2;  // finite: a chunk has a key
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = fast_exp2(fmaf(s[nt][e], dm.scale2, -m[e / 2]));
      l[e / 2] += s[nt][e];
    }
  float o[DB / 8][4] = {};
  warp_accumulate<DB, 8, S>(o, s, sV, live);
  float inv[2];
  const int row[2] = {sPid[r0 + g], sPid[r0 + g + 8]};  // pair ids (-1: none)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = sum4(l[r]);
    inv[r] = 1.f / l[r];
  }
  // o_p rows (P, H, Dv) through the warp's own rows of sQ (read by this warp only).
  store_rows_staged<DB, S>(sQ + r0 * S, (bf16*)p.o_pair + (int64_t)h * dm.Dv, (int64_t)dm.H * dm.Dv, o, row, inv,
                           dm.P, dm.Dv, t);
#pragma unroll
  for (int r = 0; r < 2; ++r)
    if (t == 0 && row[r] >= 0) p.lse_pair[(int64_t)row[r] * dm.H + h] = m[r] * kLn2 + logf(l[r]);
}

// dst[b, i, h, 8 c .. 8 c + 7] = Σ over the valid slots s of (w ? w_p : 1) src[p, h, 8 c ..], p =
// (b L + i) S + s, in slot order (0 without any). One thread per 8 entries; Dh % 8 == 0.
__global__ void combine_kernel(const bf16* src, const float* w, const int32_t* pair_key, bf16* dst, Dims dm, int Dh) {
  const int per = Dh / 8;
  const int64_t n = (int64_t)dm.B * dm.L * dm.H * per;
  const int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (x >= n) return;
  const int c = (int)(x % per);
  const int64_t rh = x / per, row = rh / dm.H;  // row = b L + i
  const int h = (int)(rh % dm.H);
  float acc[8] = {};
  for (int s = 0; s < dm.S; ++s) {
    const int64_t pid = row * dm.S + s;
    if (pair_key[pid] >= dm.U) continue;
    const float wt = w ? w[pid] : 1.f;
    const uint4 raw = *reinterpret_cast<const uint4*>(src + (pid * dm.H + h) * Dh + c * 8);
    const bf16* e = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += wt * __bfloat162float(e[j]);
  }
  uint4 out;
  bf16* oe = reinterpret_cast<bf16*>(&out);
#pragma unroll
  for (int j = 0; j < 8; ++j) oe[j] = __float2bfloat16(acc[j]);
  *reinterpret_cast<uint4*>(dst + rh * Dh + c * 8) = out;
}

// One warp per pair: lane h (h, h + 32, ...) forms d_p,h = dout[b, i, h] · o_p,h (stored in
// delta), and the warp's fixed shuffle tree sums them into dw_p (0 for an invalid pair).
__global__ void dots_kernel(HsaGradParams gp, HsaPlan plan, Dims dm) {
  const int64_t pid = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = lane_of();
  if (pid >= dm.P) return;
  const int64_t row = pid / dm.S;  // b L + i
  float tot = 0.f;
  if (plan.pair_key[pid] < dm.U) {
    for (int h = lane; h < dm.H; h += 32) {
      const bf16* a = (const bf16*)gp.dout + (row * dm.H + h) * dm.Dv;
      const bf16* o = (const bf16*)gp.fwd.o_pair + (pid * dm.H + h) * dm.Dv;
      float d = 0.f;
      for (int c = 0; c < dm.Dv; c += 8) {
        const uint4 ra = *reinterpret_cast<const uint4*>(a + c), ro = *reinterpret_cast<const uint4*>(o + c);
        const bf16* ea = reinterpret_cast<const bf16*>(&ra);
        const bf16* eo = reinterpret_cast<const bf16*>(&ro);
#pragma unroll
        for (int j = 0; j < 8; ++j) d += __bfloat162float(ea[j]) * __bfloat162float(eo[j]);
      }
      gp.delta[pid * dm.H + h] = d;
      tot += d;
    }
  }
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) tot += __shfl_xor_sync(0xffffffffu, tot, off);
  if (lane == 0) gp.dw[pid] = tot;
}

// Shared memory of the backward: sK, sV, two stages of (sQ, sdO), all (64, DB + 8); sP, sdS
// (64, 72); two stages of lse, Δ and w (float32) and of the pair ids. At DB = 64 that is 74 KB,
// so that three blocks fit an SM (with the register cap of the launch bounds).
template <int DB>
constexpr size_t backward_smem() {
  return (size_t)6 * kRows * (DB + 8) * sizeof(bf16) + (size_t)2 * kRows * (kRows + 8) * sizeof(bf16) +
         (size_t)2 * kRows * (3 * sizeof(float) + sizeof(int32_t));
}


// KG: 16-key groups of the chunk (1, 2 or 4). In the dK, dV products warp w takes key group w % KG
// and column part w / KG of CS parts of DW columns (warps past KG CS idle there).
// Grid: max_groups * H blocks, heads fastest; a block takes its group's tiles in order, copying
// the next tile's query and dout rows, lse, Δ and w (cp.async) while it computes on the current one.
template <int DB, int KG>
__global__ void __launch_bounds__(kThreads, DB <= 64 ? 3 : 1) backward_kernel(HsaGradParams gp, HsaPlan plan, Dims dm) {
  constexpr int S = DB + 8, SP = key_tile::kSP, T = kRows * S;
  constexpr int CS = key_tile::kParts<DB, KG>, DW = DB / CS;
  using Copy = cuda::TileCopy<kRows, DB, kThreads>;
  const HsaParams& p = gp.fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);  // (64, S) the chunk's keys (zeros past them)
  bf16* sV = sK + T;                              // (64, S) its values
  bf16* sStage = sV + T;                          // stage st: sQ, sdO at sStage + 2 T st + 0, T
  bf16* sP = sStage + 4 * T;                             // (64 pairs, SP) w P, bfloat16
  bf16* sdS = sP + kRows * SP;                    // (64 pairs, SP) dS, bfloat16
  float* sLse = reinterpret_cast<float*>(sdS + kRows * SP);  // stage st at + 64 st (natural log)
  float* sDl = sLse + 2 * kRows;                              // Δ (d_p) likewise
  float* sW = sDl + 2 * kRows;                                // w_p likewise
  int32_t* sPid = reinterpret_cast<int32_t*>(sW + 2 * kRows);  // pair ids likewise (-1: none)
  const int h = (int)(blockIdx.x % (unsigned)dm.H), grp = (int)(blockIdx.x / (unsigned)dm.H);
  int u, before;
  if (!find_key(plan.group_end, dm.U, grp, u, before)) return;
  const int lg = grp - before, cnt = plan.count[u], ntiles = (cnt + kRows - 1) / kRows;
  const int ngroups = (ntiles + kGroup - 1) / kGroup, tb = lg * kGroup, te = min(ntiles, tb + kGroup);
  const int b = u / dm.NC, j0 = p.start[u], kend = min(j0 + dm.C, dm.L), nk = kend - j0;
  const int64_t qb = row_base(dm, b, h, dm.D), vb = row_base(dm, b, h, dm.Dv);
  const int64_t rs = (int64_t)dm.H * dm.D, rsv = (int64_t)dm.H * dm.Dv;
  Copy::template rows<S>(sK, (const bf16*)p.k + qb, rs, j0, kend, dm.D);
  Copy::template rows<S>(sV, (const bf16*)p.v + vb, rsv, j0, kend, dm.Dv);
  cuda::cp_async_commit();
  auto issue = [&](int tile, int st) {
    const int p0 = plan.first[u] + tile * kRows, n = min(kRows, cnt - tile * kRows);
    int32_t pos[Copy::kPer];
#pragma unroll
    for (int k = 0; k < Copy::kPer; ++k) {
      const int r = Copy::row(k);
      pos[k] = pair_row(dm, r < n ? plan.order[p0 + r] : -1);
    }
    bf16* sQ = sStage + 2 * T * st;
    Copy::template gather<S>(sQ, (const bf16*)p.q + qb, rs, pos, dm.D);
    Copy::template gather<S>(sQ + T, (const bf16*)gp.dout + vb, rsv, pos, dm.Dv);
    if (threadIdx.x < kRows) {
      const int r = threadIdx.x, pid = r < n ? plan.order[p0 + r] : -1;
      const bool ok = pid >= 0;
      const int64_t ph = (int64_t)(ok ? pid : 0) * dm.H + h;
      sPid[kRows * st + r] = pid;
      cuda::cp_async4(sLse + kRows * st + r, p.lse_pair + ph, ok);
      cuda::cp_async4(sDl + kRows * st + r, gp.delta + ph, ok);
      cuda::cp_async4(sW + kRows * st + r, p.w + (ok ? pid : 0), ok);
    }
    cuda::cp_async_commit();
  };

  const int warp = threadIdx.x / 32, lane = lane_of(), g = lane / 4, t = lane % 4, r0 = warp * 16;
  const int kg = warp % KG, cp = warp / KG;
  const unsigned live = live_groups(nk);
  float accK[DW / 8][4] = {}, accV[DW / 8][4] = {};
  if (tb < te) issue(tb, 0);
  for (int tile = tb, it = 0; tile < te; ++tile, ++it) {
    const int st = it & 1, n = min(kRows, cnt - tile * kRows);
    if (tile + 1 < te) {
      issue(tile + 1, st ^ 1);
      cuda::cp_async_wait<1>();
    } else {
      cuda::cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* sQ = sStage + 2 * T * st;
    const bf16* sdO = sQ + T;
    if (r0 < n) {  // (warp-uniform) the warp has pairs
      float ps[8][4] = {}, dp[8][4] = {};
      warp_dot<DB, 8, S>(ps, sQ, r0, sK, live);
      warp_dot<DB, 8, S>(dp, sdO, r0, sV, live);
      float lse2[2], dl[2], wt[2];
      bool ok[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int rr = r0 + g + 8 * r;
        ok[r] = rr < n;
        lse2[r] = sLse[kRows * st + rr] * kLog2e, dl[r] = sDl[kRows * st + rr], wt[r] = sW[kRows * st + rr];
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int r = c / 2, col = nt * 8 + 2 * t + (c & 1);
          const float pr = ok[r] && col < nk ? fast_exp2(ps[nt][c] * dm.scale2 - lse2[r]) : 0.f;
          ps[nt][c] = wt[r] * pr;                  // w P (for dV)
          dp[nt][c] = wt[r] * pr * (dp[nt][c] - dl[r]);  // dS
        }
      key_tile::store_p_ds(sP, sdS, ps, dp, r0, g, t);
      // dq_p = scale dS K, stored per pair (P, H, D), two columns a store.
      float acc[DB / 8][4] = {};
      warp_accumulate<DB, 8, S>(acc, dp, sK, live);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!ok[r]) continue;
        bf16* dst = (bf16*)gp.dq_pair + ((int64_t)sPid[kRows * st + r0 + g + 8 * r] * dm.H + h) * dm.D + 2 * t;
#pragma unroll
        for (int nt = 0; nt < DB / 8; ++nt)
          if (nt * 8 < dm.D)
            *reinterpret_cast<uint32_t*>(dst + nt * 8) = pack_bf16(dm.scale * acc[nt][2 * r], dm.scale * acc[nt][2 * r + 1]);
      }
    } else {
      // No pairs in the warp's rows: zeros in P and dS for the key-major products.
      const float none[8][4] = {};
      key_tile::store_p_ds<true>(sP, sdS, none, none, r0, g, t);
    }
    __syncthreads();
    key_tile::accumulate<DB, KG, S>(accK, accV, sP, sdS, sQ, sdO, warp);
    __syncthreads();  // the next iteration's copies refill this stage; sP and sdS are rewritten
  }
  cuda::cp_async_wait<0>();  // (the chunk's key copies of a block without tiles)
  if (cp >= CS) return;
  float* part = ngroups > 1 ? gp.workspace + ((int64_t)(plan.slot_end[u] - ngroups + lg) * dm.H + h) * 2 * kRows * dm.Dm
                            : nullptr;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = 16 * kg + g + 8 * r;
    if (key >= nk) continue;
    bf16* dk = (bf16*)gp.dk + qb + (int64_t)(j0 + key) * rs;
    bf16* dv = (bf16*)gp.dv + vb + (int64_t)(j0 + key) * rsv;
#pragma unroll
    for (int nt = 0; nt < DW / 8; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = cp * DW + nt * 8 + 2 * t + c;
        const float vk = accK[nt][2 * r + c], vv = accV[nt][2 * r + c];
        if (part) {
          if (col < dm.D) part[(int64_t)key * dm.Dm + col] = vk;
          if (col < dm.Dv) part[(int64_t)(kRows + key) * dm.Dm + col] = vv;
        } else {
          if (col < dm.D) dk[col] = __float2bfloat16(dm.scale * vk);
          if (col < dm.Dv) dv[col] = __float2bfloat16(vv);
        }
      }
  }
}

// Grid: U * H blocks; a chunk of several groups sums its slots in group order into its dk (scaled)
// and dv rows; the others return at once.
__global__ void reduce_kernel(HsaGradParams gp, HsaPlan plan, Dims dm) {
  const int h = (int)(blockIdx.x % (unsigned)dm.H), u = (int)(blockIdx.x / (unsigned)dm.H);
  const int ntiles = (plan.count[u] + kRows - 1) / kRows, ngroups = (ntiles + kGroup - 1) / kGroup;
  if (ngroups <= 1) return;
  const int b = u / dm.NC, j0 = gp.fwd.start[u], nk = min(j0 + dm.C, dm.L) - j0;
  const int64_t slot0 = plan.slot_end[u] - ngroups, per = (int64_t)dm.H * 2 * kRows * dm.Dm;
  const float* part = gp.workspace + (slot0 * dm.H + h) * 2 * kRows * dm.Dm;
  for (int x = threadIdx.x; x < 2 * nk * dm.Dm; x += blockDim.x) {
    const int which = x / (nk * dm.Dm), key = x / dm.Dm % nk, col = x % dm.Dm;
    const int Dh = which ? dm.Dv : dm.D;
    if (col >= Dh) continue;
    const float* src = part + (int64_t)(which * kRows + key) * dm.Dm + col;
    float sum = 0.f;
    for (int g = 0; g < ngroups; ++g) sum += src[g * per];
    bf16* d = (bf16*)(which ? gp.dv : gp.dk) + row_base(dm, b, h, Dh) + (int64_t)(j0 + key) * dm.H * Dh + col;
    *d = __float2bfloat16(which ? sum : dm.scale * sum);
  }
}

template <class F>
void dispatch_head_dim(int dmax, F&& f) {
  HAX_DISPATCH_HEAD_DIM(dmax, [&] { f(std::integral_constant<int, DB>{}); });
}

unsigned grid_of(int64_t blocks, const char* what) {
  if (blocks >= (int64_t(1) << 31)) throw std::runtime_error(std::string(what) + ": grid too large");
  return (unsigned)blocks;
}

}  // namespace
}  // namespace hsa_cuda

void hsa_forward_cuda(const HsaParams& p, const HsaPlan& plan, void* out, void* stream) {
  using namespace hsa_cuda;
  if (p.batch * p.seqlen * p.nheads == 0) return;
  const Dims dm = make_dims(p);
  const auto s = (cudaStream_t)stream;
  if (dm.P > 0 && dm.U > 0) {
    dispatch_head_dim(dm.Dm, [&](auto db) {
      constexpr int DB = decltype(db)::value;
      const size_t smem = forward_smem<DB>();
      cuda::allow_smem(forward_kernel<DB>, smem, "hsa_attention forward");
      forward_kernel<DB><<<grid_of(plan.max_tiles * dm.H, "hsa_attention forward"), kThreads, smem, s>>>(p, plan, dm);
    });
    cuda::check_launch("hsa_forward_cuda");
  }
  const int64_t n = (int64_t)dm.B * dm.L * dm.H * (dm.Dv / 8);
  combine_kernel<<<grid_of(cuda::ceil_div(n, 256), "hsa_attention combine"), 256, 0, s>>>(
      (const bf16*)p.o_pair, p.w, plan.pair_key, (bf16*)out, dm, dm.Dv);
  cuda::check_launch("hsa_forward_cuda (combine)");
}

void hsa_backward_cuda(const HsaGradParams& gp, const HsaPlan& plan, void* stream) {
  using namespace hsa_cuda;
  const HsaParams& p = gp.fwd;
  if (p.batch * p.seqlen * p.nheads == 0) return;
  const Dims dm = make_dims(p);
  const auto s = (cudaStream_t)stream;
  if (dm.P > 0) {
    dots_kernel<<<grid_of(cuda::ceil_div((int64_t)dm.P * 32, 256), "hsa_attention dots"), 256, 0, s>>>(gp, plan, dm);
    cuda::check_launch("hsa_backward_cuda (dots)");
  }
  if (dm.P > 0 && dm.U > 0) {
    dispatch_head_dim(dm.Dm, [&](auto db) {
      constexpr int DB = decltype(db)::value;
      const size_t smem = backward_smem<DB>();
      const unsigned grid = grid_of(plan.max_groups * dm.H, "hsa_attention backward");
      auto launch = [&](auto kernel) {
        cuda::allow_smem(kernel, smem, "hsa_attention backward");
        kernel<<<grid, kThreads, smem, s>>>(gp, plan, dm);
      };
      if (dm.C <= 16) launch(backward_kernel<DB, 1>);
      else if (dm.C <= 32) launch(backward_kernel<DB, 2>);
      else launch(backward_kernel<DB, 4>);
    });
    cuda::check_launch("hsa_backward_cuda");
    reduce_kernel<<<grid_of((int64_t)dm.U * dm.H, "hsa_attention reduce"), 256, 0, s>>>(gp, plan, dm);
    cuda::check_launch("hsa_backward_cuda (reduce)");
  }
  const int64_t n = (int64_t)dm.B * dm.L * dm.H * (dm.D / 8);
  combine_kernel<<<grid_of(cuda::ceil_div(n, 256), "hsa_attention dq"), 256, 0, s>>>(
      (const bf16*)gp.dq_pair, nullptr, plan.pair_key, (bf16*)gp.dq, dm, dm.D);
  cuda::check_launch("hsa_backward_cuda (dq)");
}

}  // namespace hax::ops
