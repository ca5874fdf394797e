// A ring of shared-memory tile buffers filled by the TMA unit (sm_90) and consumed by the warps
// of a block each at its own pace, with no block-wide barrier per tile.
//
//   fill:    lane 0 of one warp announces the fill's bytes on the buffer's mbarrier `full` and
//            issues its tensor-map copies (tma_load_2d, tma_load_4d); the other 31 lanes arrive
//            (32 arrivals a phase).
//   wait:    a warp waits for tile t on full[t % NB], phase parity (t / NB) & 1.
//   release: after its last read of tile t, a warp counts itself in released[t % NB]; the warp
//            that counts last refills the buffer with tile t + NB.
// A warp reaches tile t + NB only after every warp released tile t, so warps are at most NB - 1
// tiles apart and the parity names the fill without ambiguity. Every warp must wait for every
// tile in order (even one whose rows see none of it) before it releases it: the wait is what
// guarantees that the previous fill of the buffer was counted out.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>

#include <cstdint>

namespace hax::ops::cuda {

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// Makes barrier initializations visible to the copy engine (a __syncthreads must follow).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// One arrival that also announces `bytes` of copies completing on the barrier in this phase.
__device__ __forceinline__ void mbar_arrive_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// The box of a 2-d tensor map at coordinates (c0, c1) (innermost first) into dst, as tma_load_4d.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}

// The box of a 4-d tensor map at coordinates (c0, c1, c2, c3) (innermost first) into dst by the
// TMA unit, counted on bar when it lands (entries outside the tensor are zeros). `map` is the
// address of a __grid_constant__ kernel parameter.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
      : "memory");
}

// The ring's barriers (in shared memory, 8-byte aligned) for NB buffers and WARPS consumer warps.
template <int NB, int WARPS>
struct TileRing {
  uint64_t full[NB];
  int released[NB];

  // By thread 0 before the block's first __syncthreads (mbar_init_fence included).
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      mbar_init(&full[b], 32);
      released[b] = 0;
    }
    mbar_init_fence();
  }
  __device__ __forceinline__ uint64_t* bar(int t) { return &full[t % NB]; }
  __device__ __forceinline__ int buffer(int t) const { return t % NB; }
  __device__ __forceinline__ void wait(int t) { mbar_wait(bar(t), (unsigned)(t / NB) & 1u); }
  // The calling warp is done reading tile t; true on every lane of the warp that released last
  // (whose job it is to refill the buffer).
  __device__ __forceinline__ bool release(int t) {
    __syncwarp();
    int last = 0;
    if ((threadIdx.x & 31) == 0) {
      __threadfence_block();  // this warp's reads of the buffer come before the count
      last = atomicAdd(&released[t % NB], 1) == WARPS - 1;
      if (last) atomicExch(&released[t % NB], 0);
    }
    return __shfl_sync(0xffffffffu, last, 0) != 0;
  }
  // Fill of tile t by the calling warp: lane 0 announces `bytes` on the tile's barrier and makes
  // the copies, issue(bar) (TMA tensor copies counted on bar); the other 31 lanes arrive.
  template <class Issue>
  __device__ __forceinline__ void fill(int t, unsigned bytes, Issue&& issue) {
    if ((threadIdx.x & 31) == 0) {
      mbar_arrive_expect(bar(t), bytes);
      issue(bar(t));
    } else {
      mbar_arrive(bar(t));
    }
  }
  // By the whole block, before its first wait: thread 0 sets the barriers up, then warp w makes
  // fill_tile(w) for the first min(NB, tiles) of the block's `tiles` tiles.
  template <class FillTile>
  __device__ __forceinline__ void start(int tiles, FillTile&& fill_tile) {
    if (threadIdx.x == 0) init();
    __syncthreads();
    const int w = (int)threadIdx.x / 32;
    if (w < NB && w < tiles) fill_tile(w);
  }
  // The calling warp is done with tile t: release it, and if it released last and tile t + NB
  // is one of the block's `tiles`, refill the buffer with it.
  template <class FillTile>
  __device__ __forceinline__ void advance(int t, int tiles, FillTile&& fill_tile) {
    if (release(t) && t + NB < tiles) fill_tile(t + NB);
  }
};

}  // namespace hax::ops::cuda
