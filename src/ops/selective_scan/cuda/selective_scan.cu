// CUDA kernels of the selective scan (S6); cpu.cpp is the reference, selective_scan.h the definition.
//
// Per channel d and state entry n the scan is a first-order linear recurrence
//   h_t = r_t a_t h_{t-1} + delta_t x_t B_t        a_t = exp(delta_t A), r_t = 0 where a packed
//                                                  sequence starts (t > 0), else 1
// so a stretch [t0, t1) of it maps its entering state h_{t0-1} to h_{t1-1} = P h_{t0-1} + h_loc,
// with P = Π r_t a_t = exp(A Σ delta) (0 if a sequence starts inside, t0 included) and h_loc the
// stretch run from a zero state. A thread owns one channel and up to 16 state entries in registers
// (kNT); channels with N > 16 are spread over kLanes = N/16 lanes (rounded up to a power of two)
// that add their parts of y with warp shuffles.
//
// Forward, L split into segments of kSelectiveScanCudaSegment steps:
//   1. segment_summary: per (row, segment, channel) in parallel, h_loc (N) and Σ delta.
//   2. combine_forward: per (row, channel, n), sequentially over segments, the state entering
//      each segment (h_0 = the initial state) and the final state.
//   3. segment_output: per (row, segment, channel), the segment again from its entering state,
//      writing y_t and the float32 checkpoints (state at t % checkpoint == 0, after a reset there).
//
// Backward, the adjoint u_t = r_t a_t g_t (what flows from h_t back into h_{t-1}), with
// g_t = dy_t C_t + u_{t+1} and u_L = dfinal, is the same recurrence run backward, so it splits the
// same way, over sub-segments of kSelectiveScanCudaSub steps:
//   1. substates: per (row, checkpoint segment, channel), the forward recomputed from its
//      checkpoint, keeping the state entering every sub-segment (after a reset there).
//   2. adjoint_summary: per (row, sub-segment, channel), the adjoint leaving it (u_{t0}) from a
//      zero adjoint entering at its end, and its Σ delta.
//   3. combine_backward: per (row, channel, n), sequentially from the last sub-segment, the adjoint
//      entering each sub-segment at its end (u_{t1}); dinit = u_0.
//   4. sub_backward: one warp per (row, sub-segment, group, chunk of 32/kLanes channels): the
//      sub-segment's states recomputed into shared memory (16 steps x kNT per thread), then walked
//      backward with the adjoint:
//        dx_t = delta_t Σ_n g B_t,   ddelta_t = x_t Σ_n g B_t + Σ_n g A a_t h_{t-1},
//        dA  += g delta_t a_t h_{t-1},   dB_t += g delta_t x_t,   dC_t += dy_t h_t.
//      dB_t and dC_t are summed over the warp's channels by a transposing butterfly (each round
//      every lane trades half of its values with a partner, fixed order), giving one float32
//      partial per (row, position, group, chunk); dA accumulates per thread over the sub-segment
//      into a partial per (row, sub-segment). Fixed-order trees of 32-way sums add the partials
//      and cast them to the input's dtype (deterministic, no atomics).
// Exponentials are exp2f(delta * A log2(e)), the same rounding in every kernel.
#include <climits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ops/cuda/common.cuh"
#include "ops/selective_scan/params.h"

namespace hax::ops {
namespace {

using cuda::from_f32;
using cuda::to_f32;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int64_t kSeg = kSelectiveScanCudaSegment;
constexpr int kSub = (int)kSelectiveScanCudaSub;
constexpr int kThreads = 128;  // threads per block of the per-channel kernels
constexpr int kFan = 32;       // partials added per thread and level of the fixed summation trees

// Whether the packed sequence changes at t (a state reset); seq is the row's seq_idx or null.
__device__ __forceinline__ bool resets(const int32_t* seq, int64_t t) {
  return seq && t > 0 && seq[t] != seq[t - 1];
}
// Whether a reset happens at some t in [t0, t1), t0 < t1 (seq is non-decreasing).
__device__ __forceinline__ bool resets_within(const int32_t* seq, int64_t t0, int64_t t1) {
  return seq && seq[t1 - 1] != seq[t0 > 0 ? t0 - 1 : 0];
}

// Sum over the kLanes lanes of a channel (adjacent lanes of one warp).
template <int kLanes>
__device__ __forceinline__ float lane_sum(float v) {
#pragma unroll
  for (int m = 1; m < kLanes; m <<= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// What one thread of the per-channel kernels works on.
template <int kNT, int kLanes>
struct Slot {
  int64_t b, d, g, n0;  // row, channel, its group, first state entry
  bool active;          // d < D (threads past the last channel only take part in shuffles)
};

// Per-channel kernels: blockIdx.x = row * parts + part (segment or sub-segment), blockIdx.y a tile
// of kThreads / kLanes channels, kLanes adjacent threads per channel.
template <int kNT, int kLanes>
__device__ __forceinline__ Slot<kNT, kLanes> slot_of(const SelectiveScanParams& p, int64_t parts, int64_t& part) {
  Slot<kNT, kLanes> s;
  s.b = blockIdx.x / parts;
  part = blockIdx.x % parts;
  s.d = (int64_t)blockIdx.y * (kThreads / kLanes) + threadIdx.x / kLanes;
  s.active = s.d < p.dim;
  s.g = s.active ? s.d / p.dim_per_group() : 0;
  s.n0 = (int64_t)(threadIdx.x % kLanes) * kNT;
  return s;
}

// a2[e] = A[d, n0+e] log2(e) for the entries in use, else 0 (unused entries then stay 0).
template <class T, int kNT>
__device__ __forceinline__ void load_a2(const SelectiveScanParams& p, int64_t d, int64_t n0, bool active,
                                        float (&a2)[kNT]) {
  const T* A = (const T*)p.A + d * p.dstate;
#pragma unroll
  for (int e = 0; e < kNT; ++e) a2[e] = active && n0 + e < p.dstate ? to_f32(A[n0 + e]) * kLog2e : 0.f;
}

// v[e] = row[n0 + e] for the entries in use, else 0.
template <class T, int kNT>
__device__ __forceinline__ void load_entries(const T* row, int64_t n0, int64_t N, float (&v)[kNT]) {
#pragma unroll
  for (int e = 0; e < kNT; ++e) v[e] = n0 + e < N ? to_f32(row[n0 + e]) : 0.f;
}

// Loads / stores a thread's entries of a float32 (.., D, N) state at `base` (= &state[.., 0, 0]).
template <int kNT>
__device__ __forceinline__ void load_state(const float* base, int64_t d, int64_t n0, int64_t N, bool active,
                                           float (&h)[kNT]) {
#pragma unroll
  for (int e = 0; e < kNT; ++e) h[e] = active && n0 + e < N ? base[d * N + n0 + e] : 0.f;
}
template <int kNT>
__device__ __forceinline__ void store_state(float* base, int64_t d, int64_t n0, int64_t N, bool active,
                                            const float (&h)[kNT]) {
  if (!active) return;
#pragma unroll
  for (int e = 0; e < kNT; ++e)
    if (n0 + e < N) base[d * N + n0 + e] = h[e];
}

// One step h = a h + delta x B of a thread's entries.
template <int kNT>
__device__ __forceinline__ void step(float (&h)[kNT], const float (&a2)[kNT], float dl, float xd,
                                     const float (&bv)[kNT]) {
#pragma unroll
  for (int e = 0; e < kNT; ++e) h[e] = exp2f(dl * a2[e]) * h[e] + xd * bv[e];
}

// ---- forward ----

// Forward 1: the local state (from zero) and Σ delta of every segment.
template <class T, int kNT, int kLanes>
__global__ void __launch_bounds__(kThreads) segment_summary_kernel(SelectiveScanParams p, float* hloc,
                                                                   float* sdelta) {
  const int64_t L = p.seqlen, D = p.dim, N = p.dstate, G = p.ngroups, nseg = (L + kSeg - 1) / kSeg;
  int64_t seg;
  const auto s = slot_of<kNT, kLanes>(p, nseg, seg);
  if (!s.active) return;  // no shuffles in this kernel
  float a2[kNT], h[kNT], bv[kNT];
  load_a2<T>(p, s.d, s.n0, true, a2);
  const T* x = (const T*)p.x + s.b * L * D + s.d;
  const T* delta = (const T*)p.delta + s.b * L * D + s.d;
  const T* Bm = (const T*)p.Bm + (s.b * L * G + s.g) * N;
  const int32_t* seq = p.seq_idx ? p.seq_idx + s.b * L : nullptr;
  const int64_t t0 = seg * kSeg, t1 = min(L, t0 + kSeg);
#pragma unroll
  for (int e = 0; e < kNT; ++e) h[e] = 0.f;
  float sd = 0.f;
  for (int64_t t = t0; t < t1; ++t) {
    if (t > t0 && resets(seq, t)) {
#pragma unroll
      for (int e = 0; e < kNT; ++e) h[e] = 0.f;
    }
    const float dl = to_f32(delta[t * D]);
    sd += dl;
    load_entries<T>(Bm + t * G * N, s.n0, N, bv);
    step(h, a2, dl, dl * to_f32(x[t * D]), bv);
  }
  const int64_t at = s.b * nseg + seg;
  store_state(hloc + at * D * N, s.d, s.n0, N, true, h);
  if (s.n0 == 0) sdelta[at * D + s.d] = sd;
}

// Forward 2: per (row, channel, n), the state entering each segment (overwriting its local state)
// and the final state.
template <class T>
__global__ void combine_forward_kernel(SelectiveScanParams p, float* hloc, const float* sdelta) {
  const int64_t L = p.seqlen, D = p.dim, N = p.dstate, nseg = (L + kSeg - 1) / kSeg;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.batch * D * N) return;
  const int64_t dn = idx % (D * N), d = dn / N, b = idx / (D * N);
  const float a2 = to_f32(((const T*)p.A)[dn]) * kLog2e;
  const int32_t* seq = p.seq_idx ? p.seq_idx + b * L : nullptr;
  float h = p.init_state ? to_f32(((const T*)p.init_state)[idx]) : 0.f;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t at = (b * nseg + s) * D * N + dn;
    const float loc = hloc[at];
    hloc[at] = h;
    const int64_t t0 = s * kSeg, t1 = min(L, t0 + kSeg);
    h = resets_within(seq, t0, t1) ? loc : exp2f(a2 * sdelta[(b * nseg + s) * D + d]) * h + loc;
  }
  ((T*)p.final_state)[idx] = from_f32<T>(h);
}

// Forward 3: every segment from its entering state: y and the checkpoints.
template <class T, int kNT, int kLanes>
__global__ void __launch_bounds__(kThreads) segment_output_kernel(SelectiveScanParams p, const float* henter) {
  const int64_t L = p.seqlen, D = p.dim, N = p.dstate, G = p.ngroups, K = p.checkpoint;
  const int64_t nseg = (L + kSeg - 1) / kSeg, nck = p.nsegments();
  int64_t seg;
  const auto s = slot_of<kNT, kLanes>(p, nseg, seg);  // inactive threads run along (shuffles)
  float a2[kNT], h[kNT], bv[kNT], cv[kNT];
  load_a2<T>(p, s.d, s.n0, s.active, a2);
  load_state(henter + (s.b * nseg + seg) * D * N, s.d, s.n0, N, s.active, h);
  const T* x = (const T*)p.x + s.b * L * D + s.d;
  const T* delta = (const T*)p.delta + s.b * L * D + s.d;
  const T* Bm = (const T*)p.Bm + (s.b * L * G + s.g) * N;
  const T* Cm = (const T*)p.Cm + (s.b * L * G + s.g) * N;
  T* y = (T*)p.y + s.b * L * D + s.d;
  float* ckpt = (float*)p.checkpoints;
  const int32_t* seq = p.seq_idx ? p.seq_idx + s.b * L : nullptr;
  const int64_t t0 = seg * kSeg, t1 = min(L, t0 + kSeg);
  for (int64_t t = t0; t < t1; ++t) {
    if (resets(seq, t)) {
#pragma unroll
      for (int e = 0; e < kNT; ++e) h[e] = 0.f;
    }
    if (ckpt && t % K == 0) store_state(ckpt + (s.b * nck + t / K) * D * N, s.d, s.n0, N, s.active, h);
    float dl = 0.f, xd = 0.f;
    if (s.active) {
      dl = to_f32(delta[t * D]);
      xd = dl * to_f32(x[t * D]);
      load_entries<T>(Bm + t * G * N, s.n0, N, bv);
      load_entries<T>(Cm + t * G * N, s.n0, N, cv);
    } else {
#pragma unroll
      for (int e = 0; e < kNT; ++e) bv[e] = cv[e] = 0.f;
    }
    float yt = 0.f;
#pragma unroll
    for (int e = 0; e < kNT; ++e) {
      h[e] = exp2f(dl * a2[e]) * h[e] + xd * bv[e];
      yt += cv[e] * h[e];
    }
    yt = lane_sum<kLanes>(yt);
    if (s.active && s.n0 == 0) y[t * D] = from_f32<T>(yt);
  }
}

// ---- backward ----

// Backward 1: from each checkpoint, the state entering every sub-segment of its checkpoint
// segment (after a reset at the sub-segment's first step, like the checkpoints).
template <class T, int kNT, int kLanes>
__global__ void __launch_bounds__(kThreads) substate_kernel(SelectiveScanParams p, float* hsub) {
  const int64_t L = p.seqlen, D = p.dim, N = p.dstate, G = p.ngroups, K = p.checkpoint;
  const int64_t nck = p.nsegments(), nsub = (L + kSub - 1) / kSub;
  int64_t seg;
  const auto s = slot_of<kNT, kLanes>(p, nck, seg);
  if (!s.active) return;  // no shuffles in this kernel
  const int64_t t0 = seg * K, t1 = min(L, t0 + K);
  const int64_t t_end = min(t1, (t1 - 1) / kSub * kSub + 1);  // past the segment's last sub-segment start
  if (t_end <= t0) return;  // no sub-segment starts in this segment
  float a2[kNT], h[kNT], bv[kNT];
  load_a2<T>(p, s.d, s.n0, true, a2);
  load_state((const float*)p.checkpoints + (s.b * nck + seg) * D * N, s.d, s.n0, N, true, h);
  const T* x = (const T*)p.x + s.b * L * D + s.d;
  const T* delta = (const T*)p.delta + s.b * L * D + s.d;
  const T* Bm = (const T*)p.Bm + (s.b * L * G + s.g) * N;
  const int32_t* seq = p.seq_idx ? p.seq_idx + s.b * L : nullptr;
  for (int64_t t = t0; t < t_end; ++t) {
    if (t > t0 && resets(seq, t)) {
#pragma unroll
      for (int e = 0; e < kNT; ++e) h[e] = 0.f;
    }
    if (t % kSub == 0) store_state(hsub + (s.b * nsub + t / kSub) * D * N, s.d, s.n0, N, true, h);
    const float dl = to_f32(delta[t * D]);
    load_entries<T>(Bm + t * G * N, s.n0, N, bv);
    step(h, a2, dl, dl * to_f32(x[t * D]), bv);
  }
}

// Backward 2: per sub-segment, the adjoint u_{t0} it passes back when none enters at its end, and
// its Σ delta.
template <class T, int kNT, int kLanes>
__global__ void __launch_bounds__(kThreads) adjoint_summary_kernel(SelectiveScanGradParams gp, float* wsub,
                                                                   float* sdsub) {
  const SelectiveScanParams& p = gp.fwd;
  const int64_t L = p.seqlen, D = p.dim, N = p.dstate, G = p.ngroups, nsub = (L + kSub - 1) / kSub;
  int64_t j;
  const auto s = slot_of<kNT, kLanes>(p, nsub, j);
  if (!s.active) return;  // no shuffles in this kernel
  float a2[kNT], u[kNT], cv[kNT];
  load_a2<T>(p, s.d, s.n0, true, a2);
  const T* delta = (const T*)p.delta + s.b * L * D + s.d;
  const T* dy = (const T*)gp.dy + s.b * L * D + s.d;
  const T* Cm = (const T*)p.Cm + (s.b * L * G + s.g) * N;
  const int32_t* seq = p.seq_idx ? p.seq_idx + s.b * L : nullptr;
  const int64_t t0 = j * kSub, t1 = min(L, t0 + kSub);
#pragma unroll
  for (int e = 0; e < kNT; ++e) u[e] = 0.f;
  float sd = 0.f;
  for (int64_t t = t1 - 1; t >= t0; --t) {
    const float dl = to_f32(delta[t * D]), dyv = to_f32(dy[t * D]);
    sd += dl;
    load_entries<T>(Cm + t * G * N, s.n0, N, cv);
    const bool reset = resets(seq, t);
#pragma unroll
    for (int e = 0; e < kNT; ++e) u[e] = reset ? 0.f : exp2f(dl * a2[e]) * (dyv * cv[e] + u[e]);
  }
  const int64_t at = s.b * nsub + j;
  store_state(wsub + at * D * N, s.d, s.n0, N, true, u);
  if (s.n0 == 0) sdsub[at * D + s.d] = sd;
}

// Backward 3: per (row, channel, n), the adjoint entering each sub-segment at its end (overwriting
// the sub-segment's summary), and dinit.
template <class T>
__global__ void combine_backward_kernel(SelectiveScanGradParams gp, float* wsub, const float* sdsub) {
  const SelectiveScanParams& p = gp.fwd;
  const int64_t L = p.seqlen, D = p.dim, N = p.dstate, nsub = (L + kSub - 1) / kSub;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.batch * D * N) return;
  const int64_t dn = idx % (D * N), d = dn / N, b = idx / (D * N);
  const float a2 = to_f32(((const T*)p.A)[dn]) * kLog2e;
  const int32_t* seq = p.seq_idx ? p.seq_idx + b * L : nullptr;
  float u = gp.dfinal ? to_f32(((const T*)gp.dfinal)[idx]) : 0.f;
  for (int64_t j = nsub - 1; j >= 0; --j) {
    const int64_t at = (b * nsub + j) * D * N + dn;
    const float w = wsub[at];
    wsub[at] = u;
    const int64_t t0 = j * kSub, t1 = min(L, t0 + kSub);
    u = resets_within(seq, t0, t1) ? w : exp2f(a2 * sdsub[(b * nsub + j) * D + d]) * u + w;
  }
  if (gp.dinit) ((T*)gp.dinit)[idx] = from_f32<T>(u);
}

// Sums kCount values per lane over the lanes that differ in the bits kMask, 2 kMask, ... 16 (the
// channel bits), trading halves: in a round where a lane holds c > 1 values, it keeps the lower or
// upper half (by its bit) and adds its partner's copy of that half; with one value left the
// partners just add. Afterwards v[0 ..] holds the sums of the original entries off, off+1, ...
template <int kCount, int kMask>
__device__ __forceinline__ void transpose_reduce(float* v, int lane_id, int& off) {
  if constexpr (kMask < 32) {
    if constexpr (kCount > 1) {
      constexpr int kHalf = kCount / 2;
      const bool upper = lane_id & kMask;
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        const float send = upper ? v[i] : v[i + kHalf];
        const float keep = upper ? v[i + kHalf] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kMask);
      }
      if (upper) off += kHalf;
      transpose_reduce<kHalf, kMask * 2>(v, lane_id, off);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], kMask);
      transpose_reduce<1, kMask * 2>(v, lane_id, off);
    }
  }
}

// Backward 4: one warp per (row, sub-segment, group, chunk): recompute, walk back, write dx,
// ddelta, the dB/dC partials of the chunk and the dA partial of the sub-segment.
template <class T, int kNT, int kLanes>
__global__ void __launch_bounds__(32) sub_backward_kernel(SelectiveScanGradParams gp, float* hsub, const float* uin,
                                                          float* dB_part, float* dC_part) {
  constexpr int kPerWarp = 32 / kLanes;                         // channels per warp
  constexpr int kVals = 2 * kNT;                                // dB and dC entries per lane and step
  constexpr int kLeft = kVals * kLanes / 32 > 0 ? kVals * kLanes / 32 : 1;  // sums a lane ends with
  const SelectiveScanParams& p = gp.fwd;
  const int64_t L = p.seqlen, D = p.dim, N = p.dstate, G = p.ngroups, dpg = p.dim_per_group();
  const int64_t nsub = (L + kSub - 1) / kSub, nchunk = selective_scan_cuda_chunks(p);
  const int64_t b = blockIdx.x / nsub, j = blockIdx.x % nsub;
  const int64_t g = blockIdx.y / nchunk, chunk = blockIdx.y % nchunk;
  const int lane_id = threadIdx.x;
  const int64_t n0 = (int64_t)(lane_id % kLanes) * kNT;
  const int64_t dg = chunk * kPerWarp + lane_id / kLanes;  // channel within the group
  const bool active = dg < dpg;
  const int64_t d = g * dpg + dg;
  const int64_t t0 = j * kSub;
  const int len = (int)min((int64_t)kSub, L - t0);

  __shared__ float hist[kSub][kNT][32];  // h_{t-1} (after a reset at t) of every step
  float a2[kNT], h[kNT], bv[kNT], cv[kNT];
  load_a2<T>(p, d, n0, active, a2);
  float* slot = hsub + (b * nsub + j) * D * N;
  load_state(slot, d, n0, N, active, h);
  const T* x = (const T*)p.x + b * L * D + d;
  const T* delta = (const T*)p.delta + b * L * D + d;
  const T* dy = (const T*)gp.dy + b * L * D + d;
  const T* Bm = (const T*)p.Bm + (b * L * G + g) * N;  // the group is valid for every lane
  const T* Cm = (const T*)p.Cm + (b * L * G + g) * N;
  const int32_t* seq = p.seq_idx ? p.seq_idx + b * L : nullptr;

  for (int i = 0; i < len; ++i) {
    const int64_t t = t0 + i;
    if (i > 0 && resets(seq, t)) {
#pragma unroll
      for (int e = 0; e < kNT; ++e) h[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < kNT; ++e) hist[i][e][lane_id] = h[e];
    const float dl = active ? to_f32(delta[t * D]) : 0.f;
    const float xd = active ? dl * to_f32(x[t * D]) : 0.f;
    load_entries<T>(Bm + t * G * N, n0, N, bv);
    step(h, a2, dl, xd, bv);
  }

  float u[kNT], dA[kNT];
  load_state(uin + (b * nsub + j) * D * N, d, n0, N, active, u);
#pragma unroll
  for (int e = 0; e < kNT; ++e) dA[e] = 0.f;
  T* dx = (T*)gp.dx + b * L * D + d;
  T* ddelta = (T*)gp.ddelta + b * L * D + d;
  for (int i = len - 1; i >= 0; --i) {
    const int64_t t = t0 + i;
    float dl = 0.f, xv = 0.f, dyv = 0.f;
    if (active) dl = to_f32(delta[t * D]), xv = to_f32(x[t * D]), dyv = to_f32(dy[t * D]);
    const float xd = dl * xv;
    load_entries<T>(Bm + t * G * N, n0, N, bv);
    load_entries<T>(Cm + t * G * N, n0, N, cv);
    float v[kVals];  // this channel's dB (first kNT) and dC (last kNT) terms at t
    float sgB = 0.f, sgAah = 0.f;
#pragma unroll
    for (int e = 0; e < kNT; ++e) {
      const float hp = hist[i][e][lane_id];
      const float a = exp2f(dl * a2[e]);
      const float ht = a * hp + xd * bv[e];
      const float gt = dyv * cv[e] + u[e];
      const float gah = gt * a * hp;
      v[e] = gt * xd;
      v[kNT + e] = dyv * ht;
      sgB += gt * bv[e];
      sgAah += a2[e] * gah;
      dA[e] += gah * dl;
      u[e] = a * gt;
    }
    if (resets(seq, t)) {
#pragma unroll
      for (int e = 0; e < kNT; ++e) u[e] = 0.f;
    }
    sgB = lane_sum<kLanes>(sgB);
    sgAah = lane_sum<kLanes>(sgAah);
    if (active && n0 == 0) {
      dx[t * D] = from_f32<T>(dl * sgB);
      ddelta[t * D] = from_f32<T>(xv * sgB + kLn2 * sgAah);  // A = a2 ln 2
    }
    int off = 0;
    transpose_reduce<kVals, kLanes>(v, lane_id, off);
    // With fewer values than channel lanes the last rounds only added: lanes past kLanes * kVals
    // hold copies.
    if (lane_id < kLanes * kVals) {
      const int64_t at = (((b * L + t) * G + g) * nchunk + chunk) * N;
#pragma unroll
      for (int k = 0; k < kLeft; ++k) {
        const int idx = off + k, e = idx % kNT;
        if (n0 + e < N) (idx < kNT ? dB_part : dC_part)[at + n0 + e] = v[k];
      }
    }
  }
  // The sub-segment's dA, into its entering-state slot (read above by this thread only).
  store_state(slot, d, n0, N, active, dA);
}

// One level of a fixed summation tree over parts (O, K, I): for every o and every group of kFan
// partials `step` apart starting at k0 = group * step * kFan, parts[o, k0] = Σ of the group in order.
__global__ void sum_level_kernel(float* parts, int64_t O, int64_t K, int64_t I, int64_t step) {
  const int64_t groups = (K + step * kFan - 1) / (step * kFan);
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= O * groups * I) return;
  const int64_t i = idx % I, r = idx / I, k0 = (r % groups) * step * kFan, o = r / groups;
  float* base = parts + o * K * I + i;
  float acc = 0.f;
  for (int q = 0; q < kFan; ++q) {
    const int64_t k = k0 + q * step;
    if (k >= K) break;
    acc += base[k * I];
  }
  base[k0 * I] = acc;
}

// out[o, i] = parts[o, 0, i] (the tree's total), cast.
template <class T>
__global__ void cast_total_kernel(const float* parts, int64_t O, int64_t K, int64_t I, T* out) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= O * I) return;
  out[idx] = from_f32<T>(parts[(idx / I) * K * I + idx % I]);
}

unsigned blocks_for(int64_t n, int threads) { return (unsigned)cuda::ceil_div(n, threads); }

// out (O, I) = Σ_k parts (O, K, I), added by the fixed tree (parts is overwritten).
template <class T>
void sum_parts(float* parts, int64_t O, int64_t K, int64_t I, T* out, cudaStream_t s) {
  for (int64_t step = 1; step < K; step *= kFan) {
    const int64_t groups = cuda::ceil_div(K, step * kFan);
    sum_level_kernel<<<blocks_for(O * groups * I, 256), 256, 0, s>>>(parts, O, K, I, step);
  }
  cast_total_kernel<T><<<blocks_for(O * I, 256), 256, 0, s>>>(parts, O, K, I, out);
}

// Calls f(integral_constant kNT, integral_constant kLanes) for state size N.
template <class F>
void dispatch_state(int64_t N, F&& f) {
  using std::integral_constant;
  if (N <= 8) return f(integral_constant<int, 8>{}, integral_constant<int, 1>{});
  if (N <= 16) return f(integral_constant<int, 16>{}, integral_constant<int, 1>{});
  if (N <= 32) return f(integral_constant<int, 16>{}, integral_constant<int, 2>{});
  if (N <= 64) return f(integral_constant<int, 16>{}, integral_constant<int, 4>{});
  if (N <= 128) return f(integral_constant<int, 16>{}, integral_constant<int, 8>{});
  if (N <= kSelectiveScanCudaMaxState) return f(integral_constant<int, 16>{}, integral_constant<int, 16>{});
  throw std::invalid_argument("selective_scan: the state size N = " + std::to_string(N) +
                              " exceeds the CUDA kernels' maximum " + std::to_string(kSelectiveScanCudaMaxState));
}

// Grid of a per-channel kernel: (rows x parts, channel tiles).
dim3 channel_grid(const SelectiveScanParams& p, int64_t parts, int64_t lanes, const char* what) {
  const int64_t x = p.batch * parts, y = cuda::ceil_div(p.dim, kThreads / lanes);
  if (x > INT_MAX || y > 65535)
    throw std::runtime_error(std::string(what) + ": the tensors are too large for one launch (B " +
                             std::to_string(p.batch) + ", L " + std::to_string(p.seqlen) + ", D " +
                             std::to_string(p.dim) + ")");
  return dim3((unsigned)x, (unsigned)y);
}

}  // namespace

void selective_scan_forward_cuda(const SelectiveScanParams& p, DType dtype, void* stream) {
  const int64_t L = p.seqlen, D = p.dim, N = p.dstate;
  if (p.batch * L * D * N == 0) return;  // the binding fills the degenerate cases
  const auto s = (cudaStream_t)stream;
  const int64_t nseg = cuda::ceil_div(L, kSeg);
  float* hloc = (float*)p.workspace;          // (B, nseg, D, N), then the entering states
  float* sdelta = hloc + p.batch * nseg * D * N;  // (B, nseg, D)
  dispatch_state(N, [&](auto nt, auto lanes) {
    constexpr int kNT = decltype(nt)::value, kLanes = decltype(lanes)::value;
    const dim3 grid = channel_grid(p, nseg, kLanes, "selective_scan_forward_cuda");
    HAX_DISPATCH_DTYPE(dtype, [&] {
      segment_summary_kernel<scalar_t, kNT, kLanes><<<grid, kThreads, 0, s>>>(p, hloc, sdelta);
      combine_forward_kernel<scalar_t><<<blocks_for(p.batch * D * N, 256), 256, 0, s>>>(p, hloc, sdelta);
      segment_output_kernel<scalar_t, kNT, kLanes><<<grid, kThreads, 0, s>>>(p, hloc);
    });
  });
  cuda::check_launch("selective_scan_forward_cuda");
}

void selective_scan_backward_cuda(const SelectiveScanGradParams& gp, DType dtype, void* stream) {
  const SelectiveScanParams& p = gp.fwd;
  const int64_t B = p.batch, L = p.seqlen, D = p.dim, N = p.dstate, G = p.ngroups;
  if (B * L * D * N == 0) return;  // the binding fills the degenerate cases
  const auto s = (cudaStream_t)stream;
  const int64_t nsub = cuda::ceil_div(L, kSub), nchunk = selective_scan_cuda_chunks(p);
  float* hsub = (float*)gp.workspace;    // (B, nsub, D, N): entering states, then dA partials
  float* wsub = hsub + B * nsub * D * N;  // (B, nsub, D, N): adjoint summaries, then entering adjoints
  float* sdsub = wsub + B * nsub * D * N;  // (B, nsub, D)
  float* dB_part = sdsub + B * nsub * D;   // (B, L, G, nchunk, N)
  float* dC_part = dB_part + B * L * G * nchunk * N;
  if (G * nchunk > 65535 || B * nsub > INT_MAX)
    throw std::runtime_error("selective_scan_backward_cuda: the tensors are too large for one launch");
  dispatch_state(N, [&](auto nt, auto lanes) {
    constexpr int kNT = decltype(nt)::value, kLanes = decltype(lanes)::value;
    const dim3 ck_grid = channel_grid(p, p.nsegments(), kLanes, "selective_scan_backward_cuda");
    const dim3 sub_grid = channel_grid(p, nsub, kLanes, "selective_scan_backward_cuda");
    const dim3 warp_grid((unsigned)(B * nsub), (unsigned)(G * nchunk));
    HAX_DISPATCH_DTYPE(dtype, [&] {
      substate_kernel<scalar_t, kNT, kLanes><<<ck_grid, kThreads, 0, s>>>(p, hsub);
      adjoint_summary_kernel<scalar_t, kNT, kLanes><<<sub_grid, kThreads, 0, s>>>(gp, wsub, sdsub);
      combine_backward_kernel<scalar_t><<<blocks_for(B * D * N, 256), 256, 0, s>>>(gp, wsub, sdsub);
      sub_backward_kernel<scalar_t, kNT, kLanes><<<warp_grid, 32, 0, s>>>(gp, hsub, wsub, dB_part, dC_part);
      sum_parts<scalar_t>(dB_part, B * L * G, nchunk, N, (scalar_t*)gp.dB, s);
      sum_parts<scalar_t>(dC_part, B * L * G, nchunk, N, (scalar_t*)gp.dC, s);
      sum_parts<scalar_t>(hsub, 1, B * nsub, D * N, (scalar_t*)gp.dA, s);
    });
  });
  cuda::check_launch("selective_scan_backward_cuda");
}

}  // namespace hax::ops
