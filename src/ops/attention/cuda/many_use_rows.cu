// The rows of the tile backward's key sums that need work outside it (params.h,
// sparse_attention_many_use_rows_cuda). With a plan's key_uses, the tile backward stores the sums
// of a key of one block into the bfloat16 gradients, adds those of a key of two blocks there with
// bfloat16 atomics, and adds the others to the float32 accumulators dk, dv (B, Lk, H, D or Dv).
// So instead of a fill of the bfloat16 gradients and a fill and a cast of the whole accumulators:
//   before (finish false): the bfloat16 rows of keys of no block or of two (they get added to, or
//                          nothing) and the float32 rows of keys of many blocks are zeroed;
//   after (finish true):   the float32 rows of keys of many blocks are cast into the bfloat16 rows.
// A thread per (b, h, key) reads its key_uses entry (coalesced along keys); the warp then takes the
// rows of its keys that need work one after the other, its lanes over the row's entries (a thread
// walking its own row took 60 us at 64K x 16 heads: every load waited).
#include "ops/attention/params.h"
#include "ops/cuda/common.cuh"

#include <climits>
#include <stdexcept>
#include <string>

namespace hax::ops {
namespace {

constexpr int kThreads = 256;

// Grid (ceil(Lk / kThreads), B*H): thread j of (b, h) reads key j's count; 32-bit index math (the
// first form's 64-bit divisions per row cost more than its stores). Lanes take entries lane,
// lane + 32, ... of a row, all of a lane's loads issued before its stores.
template <bool kFinish>
__global__ void many_use_rows_kernel(AttentionGradParams gp) {
  const AttentionParams& p = gp.fwd;
  const int Lk = (int)p.keylen, H = (int)p.nheads, bh = (int)blockIdx.y, h = bh % H, b = bh / H;
  const int j = (int)blockIdx.x * kThreads + (int)threadIdx.x, lane = (int)threadIdx.x % 32;
  const int32_t u = j < Lk ? gp.key_uses[(int64_t)bh * Lk + j] : 1;
  const bool many = u > kAttentionKeyFewUses;
  const bool work = kFinish ? many : u != 1;  // (every key but those of one block, whose rows are stored)
  for (uint32_t todo = __ballot_sync(0xffffffffu, work); todo; todo &= todo - 1) {
    const int src = __ffs(todo) - 1;
    const int key = __shfl_sync(0xffffffffu, j, src);
    const bool f32 = __shfl_sync(0xffffffffu, many, src);
    const int64_t rowi = ((int64_t)b * Lk + key) * H + h;  // (b, key, h) of (B, Lk, H)
    auto row = [&](void* acc, void* out, int dim) {
      float* a = (float*)acc + rowi * dim;
      __nv_bfloat16* o = (__nv_bfloat16*)out + rowi * dim;
      constexpr int kPer = (int)kAttentionCudaMaxDim / 32;  // entries a lane takes, at most
      if (kFinish) {
        float x[kPer];
#pragma unroll
        for (int e = 0; e < kPer; ++e) x[e] = lane + 32 * e < dim ? a[lane + 32 * e] : 0.f;
#pragma unroll
        for (int e = 0; e < kPer; ++e)
          if (lane + 32 * e < dim) o[lane + 32 * e] = cuda::from_f32<__nv_bfloat16>(x[e]);
      } else {
#pragma unroll
        for (int e = 0; e < kPer; ++e)
          if (lane + 32 * e < dim) {
            if (f32)
              a[lane + 32 * e] = 0.f;
            else
              o[lane + 32 * e] = cuda::from_f32<__nv_bfloat16>(0.f);
          }
      }
    };
    row(gp.dk, gp.dk_bf16, (int)p.dim);
    row(gp.dv, gp.dv_bf16, (int)p.vdim);
  }
}

}  // namespace

void sparse_attention_many_use_rows_cuda(const AttentionGradParams& gp, bool finish, void* stream) {
  const int64_t BH = gp.fwd.batch * gp.fwd.nheads, Lk = gp.fwd.keylen;
  if (BH * Lk == 0 || gp.key_uses == nullptr) return;
  if (BH > 65535 || Lk >= INT32_MAX || gp.fwd.dim > kAttentionCudaMaxDim || gp.fwd.vdim > kAttentionCudaMaxDim)
    throw std::runtime_error("sparse_attention many-use rows: B*H = " + std::to_string(BH) + " must be <= 65535, Lk = " +
                             std::to_string(Lk) + " below 2^31 and head dims <= " +
                             std::to_string(kAttentionCudaMaxDim));
  const dim3 grid((unsigned)((Lk + kThreads - 1) / kThreads), (unsigned)BH);
  if (finish)
    many_use_rows_kernel<true><<<grid, kThreads, 0, (cudaStream_t)stream>>>(gp);
  else
    many_use_rows_kernel<false><<<grid, kThreads, 0, (cudaStream_t)stream>>>(gp);
  cuda::check_launch("sparse_attention many-use rows");
}

}  // namespace hax::ops
