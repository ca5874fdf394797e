// The rows of the tile backward's key sums that need work outside it (params.h,
// sparse_attention_many_use_rows_cuda). With a plan's key_uses, the tile backward stores the sums
// of a key of one block into the bfloat16 gradients, adds those of a key of two blocks there with
// bfloat16 atomics, and adds the others to the float32 accumulators dk, dv (B, Lk, H, D or Dv).
// So instead of a fill of the bfloat16 gradients and a fill and a cast of the whole accumulators:
//   before (finish false): the bfloat16 rows of keys of no block or of two (they get added to, or
//                          nothing) and the float32 rows of keys of many blocks are zeroed;
//   after (finish true):   the float32 rows of keys of many blocks are cast into the bfloat16 rows.
// A thread per (b, h, key) reads its key_uses entry (coalesced along keys); the warp then compacts
// its keys that need work and spreads their rows' entries over its lanes, four consecutive entries
// a lane at a time (8-byte bfloat16 and 16-byte float32 accesses where the head dims are multiples
// of 4; single entries otherwise). (Lanes over one row at a time, 2-byte stores, took 74 us before
// and 36 us after the tile backward at 64K x 16 heads, for rows of 128 bytes.)
#include "ops/attention/params.h"
#include "ops/cuda/common.cuh"

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

namespace hax::ops {
namespace {

constexpr int kThreads = 256;

// Grid (ceil(Lk / kThreads), min(B*H, 65535)): thread j of (b, h) reads key j's count, the grid's
// rows taking (b, h) = blockIdx.y, + gridDim.y, ...; 32-bit index math within a (b, h) (the first
// form's 64-bit divisions per row cost more than its stores). kVec: entries go V = 4 at a time.
template <bool kFinish, bool kVec>
__global__ void many_use_rows_kernel(AttentionGradParams gp) {
  constexpr int V = kVec ? 4 : 1;
  __shared__ int s_key[kThreads / 32][32];
  __shared__ bool s_f32[kThreads / 32][32];
  const AttentionParams& p = gp.fwd;
  const int Lk = (int)p.keylen, H = (int)p.nheads;
  const int j = (int)blockIdx.x * kThreads + (int)threadIdx.x, lane = (int)threadIdx.x % 32, warp = (int)threadIdx.x / 32;
  for (int64_t bh = blockIdx.y; bh < p.batch * H; bh += gridDim.y) {
    const int64_t h = bh % H, b = bh / H;
    const int32_t u = j < Lk ? gp.key_uses[(int64_t)bh * Lk + j] : 1;
    const bool many = u > kAttentionKeyFewUses;
    const bool work = kFinish ? many : u != 1;  // (every key but those of one block, whose rows are stored)
    const unsigned todo = __ballot_sync(0xffffffffu, work);
    if (work) {
      const int at = __popc(todo & ((1u << lane) - 1u));
      s_key[warp][at] = j, s_f32[warp][at] = many;
    }
    __syncwarp();
    const int n = __popc(todo), gk = (int)p.dim / V, gv = (int)p.vdim / V, g = gk + gv;  // groups of V a key
    for (int x = lane; x < n * g; x += 32) {
      const int m = x / g, e = x - m * g, key = s_key[warp][m];
      const bool f32 = s_f32[warp][m], is_k = e < gk;
      const int dim = is_k ? (int)p.dim : (int)p.vdim, c = V * (is_k ? e : e - gk);
      const int64_t at = (((int64_t)b * Lk + key) * H + h) * dim + c;  // (b, key, h, c) of (B, Lk, H, dim)
      float* a = (float*)(is_k ? gp.dk : gp.dv) + at;
      __nv_bfloat16* o = (__nv_bfloat16*)(is_k ? gp.dk_bf16 : gp.dv_bf16) + at;
      if constexpr (kVec) {
        if (kFinish) {
          const float4 v = *(const float4*)a;
          __nv_bfloat162 w[2] = {__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
          *(uint2*)o = *(const uint2*)w;
        } else if (f32) {
          *(float4*)a = make_float4(0.f, 0.f, 0.f, 0.f);
        } else {
          *(uint2*)o = make_uint2(0u, 0u);
        }
      } else {
        if (kFinish) *o = cuda::from_f32<__nv_bfloat16>(*a);
        else if (f32) *a = 0.f;
        else *o = cuda::from_f32<__nv_bfloat16>(0.f);
      }
    }
    __syncwarp();  // (the warp's s_key, s_f32 are rewritten for the next (b, h))
  }
}

}  // namespace

void sparse_attention_many_use_rows_cuda(const AttentionGradParams& gp, bool finish, void* stream) {
  const int64_t BH = gp.fwd.batch * gp.fwd.nheads, Lk = gp.fwd.keylen;
  if (BH * Lk == 0 || gp.key_uses == nullptr) return;
  if (Lk >= INT32_MAX - kThreads || gp.fwd.dim > kAttentionCudaMaxDim || gp.fwd.vdim > kAttentionCudaMaxDim)
    throw std::runtime_error("sparse_attention many-use rows: Lk = " + std::to_string(Lk) +
                             " must be below 2^31 - " + std::to_string(kThreads) + " and head dims (" +
                             std::to_string(gp.fwd.dim) + ", " + std::to_string(gp.fwd.vdim) + ") <= " +
                             std::to_string(kAttentionCudaMaxDim));
  const dim3 grid((unsigned)((Lk + kThreads - 1) / kThreads), (unsigned)std::min<int64_t>(BH, 65535));
  const bool vec = gp.fwd.dim % 4 == 0 && gp.fwd.vdim % 4 == 0;  // (the tensors' 16-byte aligned starts)
  const auto s = (cudaStream_t)stream;
  if (finish && vec) many_use_rows_kernel<true, true><<<grid, kThreads, 0, s>>>(gp);
  else if (finish) many_use_rows_kernel<true, false><<<grid, kThreads, 0, s>>>(gp);
  else if (vec) many_use_rows_kernel<false, true><<<grid, kThreads, 0, s>>>(gp);
  else many_use_rows_kernel<false, false><<<grid, kThreads, 0, s>>>(gp);
  cuda::check_launch("sparse_attention many-use rows");
}

}  // namespace hax::ops
