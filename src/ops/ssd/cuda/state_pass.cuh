// The sequential pass of states over the sub-chunks (notation in chunk.cuh): the forward turns
// local states into the state entering each sub-chunk, the backward local state gradients into
// the gradient of the state leaving each one. One chain per state entry (1024 sub-chunks at
// L = 64K), bound by how many bytes it keeps in flight: the loads of the next kAhead = 8
// sub-chunks sit in registers while the current 8 update, and the group after next is prefetched
// into L2. (A ring of 64 sub-chunks in shared memory filled by cp.async, no registers held, was
// bit-identical and slower: 193 against 160 us at 64K on an H200, DRAM 55 against 66 % of peak;
// experiments/ssd-state-pass-ring.patch.)
#pragma once
#include "ops/cuda/common.cuh"
#include "ops/ssd/cuda/chunk.cuh"

namespace hax::ops::ssd_cuda {

constexpr int kPassThreads = 128;  // threads of a state-passing kernel's block

// V consecutive state entries moved as one load or store: 16 bytes (V = 16 / sizeof(T)) or a
// single entry (V = 1). The pass keeps them packed (Raw) while their loads are in flight.
template <class T, int V>
struct StateVec {
  using Raw = std::conditional_t<V == 1, T, uint4>;
  static __device__ __forceinline__ Raw load(const T* p) { return *reinterpret_cast<const Raw*>(p); }
  static __device__ __forceinline__ void unpack(const Raw& r, float (&v)[V]) {
    if constexpr (V == 1) {
      v[0] = to_f32(r);
    } else {
      const uint32_t u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (V == 8) {  // bfloat16: two entries a word
          v[2 * e] = __uint_as_float(u[e] << 16);
          v[2 * e + 1] = __uint_as_float(u[e] & 0xffff0000u);
        } else {  // float32
          v[e] = __uint_as_float(u[e]);
        }
      }
    }
  }
  static __device__ __forceinline__ void store(T* p, const float (&v)[V]) {
    if constexpr (V == 1) {
      *p = from_f32<T>(v[0]);
    } else {
      uint32_t u[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) u[e] = V == 8 ? pack_bf16(v[2 * e], v[2 * e + 1]) : __float_as_uint(v[e]);
      *reinterpret_cast<uint4*>(p) = make_uint4(u[0], u[1], u[2], u[3]);
    }
  }
};

// The sequential pass over sub-chunks in float32, V consecutive state entries (n, p) of a
// (row, head) per thread; the states it reads and writes (and chunk_states) are in x's dtype:
//   kReverse false: states[s] holds the local states; replaced by the state entering each
//     sub-chunk, run = g run + local from the initial state (zeros without one). Without
//     `seed`: writes the final state and, when chunks have several sub-chunks, chunk_states.
//     With `seed` (backward recompute): run restarts from chunk_states at each chunk.
//   kReverse true (backward): states[s] holds the local state gradients; replaced by the gradient
//     of the state leaving each sub-chunk, from dfinal (zeros without one) back to dinit.
// The pass is bound by load latency (one chain per entry, 1024 sub-chunks at L = 64K): 16-byte
// accesses and the loads of the next kAhead sub-chunks in flight keep the bytes in flight up, and
// the group after next is prefetched into L2, so that its loads, issued a group later,
// find it there. H100, L = 64K, ncu: 205 -> 187 us a pass with the prefetch (kAhead 16 without it:
// 192; 16 with it: 196; 4 with it: 204-212).
// Grid: B * H * ceil(N P / (V kPassThreads)) blocks of kPassThreads (launch_state_pass).
template <class T, bool kReverse, int V>
__global__ void __launch_bounds__(kPassThreads) state_pass_kernel(SsdParams p, SsdScratch w, T* states,
                                                                   bool seed, const T* dfinal, T* dinit) {
  using Vec = StateVec<T, V>;
  const int64_t S = p.nsubs(), N = p.dstate, P = p.headdim, NP = N * P;
  const int64_t per = (ssd_div(NP, V) + kPassThreads - 1) / kPassThreads;
  const int64_t bh = ssd_div(blockIdx.x, per), e = ((blockIdx.x - bh * per) * kPassThreads + threadIdx.x) * V;
  if (e >= NP) return;
  const int64_t n = ssd_div(e, P), q = e - n * P;  // the V entries share n (V divides P when V > 1)
  const int64_t spc = p.subs_per_chunk();
  T* st = states + bh * S * NP + e;
  const float* dec = w.decay + bh * S;
  T* cst = (T*)p.chunk_states + bh * p.nchunks() * NP + e;
  auto pn = [&](int c) { return (bh * P + q + c) * N + n; };  // entry (q + c, n) of a (B, H, P, N) state
  // Sub-chunks go in groups of kAhead; the loads of the next group are issued before the
  // dependent updates of the current one.
  constexpr int kAhead = 8;
  typename Vec::Raw loc[kAhead];
  float dg[kAhead];
  // Loads group grp (sub-chunks grp kAhead + m, reversed for kReverse) into l, d.
  auto load = [&](int64_t grp, typename Vec::Raw(&l)[kAhead], float(&d)[kAhead]) {
#pragma unroll
    for (int m = 0; m < kAhead; ++m) {
      const int64_t s0 = grp * kAhead + m, s = kReverse ? S - 1 - s0 : s0;
      if (s0 < S) l[m] = Vec::load(st + s * NP), d[m] = dec[s];
    }
  };
  const int64_t groups = (S + kAhead - 1) / kAhead;
  load(0, loc, dg);
  float run[V];
  const T* start = kReverse ? dfinal : (seed ? nullptr : (const T*)p.init_state);
#pragma unroll
  for (int c = 0; c < V; ++c) run[c] = start ? to_f32(start[pn(c)]) : 0.f;
  for (int64_t grp = 0; grp < groups; ++grp) {
    typename Vec::Raw nloc[kAhead];
    float ndg[kAhead];
    if (grp + 1 < groups) load(grp + 1, nloc, ndg);
    if (grp + 2 < groups) {  // the group after next into L2 (no registers held)
#pragma unroll
      for (int m = 0; m < kAhead; ++m) {
        const int64_t s0 = (grp + 2) * kAhead + m, s = kReverse ? S - 1 - s0 : s0;
        if (s0 < S) asm volatile("prefetch.global.L2 [%0];" ::"l"(st + s * NP));
      }
    }
#pragma unroll
    for (int m = 0; m < kAhead; ++m) {
      const int64_t s0 = grp * kAhead + m, s = kReverse ? S - 1 - s0 : s0;
      if (s0 >= S) break;
      if (!kReverse && spc > 1 && s % spc == 0) {
        // Several sub-chunks a chunk: the run restarts from the saved (rounded) chunk state, as
        // the backward's recompute (seed) does, so that both see the same states.
        T* c = cst + (s / spc) * NP;
        if (!seed) Vec::store(c, run);
        Vec::unpack(Vec::load(c), run);
      }
      Vec::store(st + s * NP, run);
      float l[V];
      Vec::unpack(loc[m], l);
#pragma unroll
      for (int c = 0; c < V; ++c) run[c] = dg[m] * run[c] + l[c];
    }
#pragma unroll
    for (int m = 0; m < kAhead; ++m) loc[m] = nloc[m], dg[m] = ndg[m];
  }
  T* end = kReverse ? dinit : (seed ? nullptr : (T*)p.final_state);
  if (end)
#pragma unroll
    for (int c = 0; c < V; ++c) end[pn(c)] = from_f32<T>(run[c]);
}

// Launches the pass over `states` with 16-byte accesses where N P and the buffers allow them.
template <class T, bool kReverse>
void launch_state_pass(const SsdParams& p, const SsdScratch& w, T* states, bool seed, const T* dfinal, T* dinit,
                       cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  auto aligned = [](const void* a) { return reinterpret_cast<uintptr_t>(a) % 16 == 0; };
  const int64_t NP = p.dstate * p.headdim;
  const bool wide = p.headdim % V == 0 && aligned(states) && (p.subs_per_chunk() == 1 || aligned(p.chunk_states));
  const int64_t threads_per_bh = wide ? NP / V : NP;
  const unsigned blocks = (unsigned)(p.batch * p.nheads * cuda::ceil_div(threads_per_bh, kPassThreads));
  if (blocks == 0) return;
  if (wide) state_pass_kernel<T, kReverse, V><<<blocks, kPassThreads, 0, stream>>>(p, w, states, seed, dfinal, dinit);
  else state_pass_kernel<T, kReverse, 1><<<blocks, kPassThreads, 0, stream>>>(p, w, states, seed, dfinal, dinit);
}

}  // namespace hax::ops::ssd_cuda
