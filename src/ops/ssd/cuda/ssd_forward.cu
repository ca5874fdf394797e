// CUDA forward of the chunked SSD scan (cpu.cpp is the reference and states the formulas).
//
// The sequence is cut into sub-chunks of at most 64 steps (params.h, kSsdSubChunk); notation in
// chunk.cuh. Five launches:
//   1. prep_kernel        cs (cumsum of dt A) and the decay g of each (row, head, sub-chunk)
//   2. cb_kernel          C B^T per (row, group, sub-chunk), 64 x 64, shared by the group's heads;
//                         on a side stream (ops/cuda/side_stream.cuh) beside 3 and 4, joined before 5
//   3. local_state_kernel the sub-chunks' own contributions Σ_j w_j B_j (dt_j x_j)^T, (N, P) each
//   4. state_pass_kernel  sequential over sub-chunks, parallel over (row, head, state entry): the
//                         state entering each sub-chunk (in place), chunk_states, final_state
//      (3 and 4 are one sweep where it applies: bfloat16, the wgmma sizes, one sub-chunk per chunk;
//      segment_scan_wgmma.cuh, which writes the states once instead of three passes over them)
//   5. chunk_scan_kernel  y = diag(re) C S_enter^T + (C B^T ∘ decay mask) (dt x), into one
//                         accumulator tile; for bfloat16 with P, N multiples of 64 and N <= 128,
//                         chunk_scan_wg_kernel instead (chunk_scan_wgmma.cuh: warpgroup products,
//                         the mask in registers; H200, ncu at 64K: 461 -> 311 us)
// Launch shapes: 64 x 64 tiles on 128 threads (tile.cuh); kernels 2, 3, 5 take one block per
// (sub-chunk, row, head or group[, tile]); the pass takes one thread per state entry.
// Speed: every kernel is bound by getting its operands into shared memory, so staging is
// vectorized (16-byte loads of 8 neighbours, all of a thread's loads issued before its stores;
// kVec, used when P and N are multiples of 8) and register budgets keep 4-6 blocks per SM. The
// states (N x P per sub-chunk, stored in x's dtype: bfloat16 halves their bytes against float32,
// and they enter the products once instead of as hi + lo) are the bulk of the traffic: written
// by 3, read and rewritten by 4 (16-byte accesses, 16 loads per thread in flight), read by 5,
// which (bfloat16) copies its raw tiles by cp.async, a stage ahead. 3 (bfloat16, kVec) puts the
// per-step coefficients on x, staged once per block as one 16-byte store per octet and half, and
// copies B raw by cp.async in its [step][n] layout, two n tiles in flight (chunk.cuh); 3 and 5
// store their outputs through a shared tile in 16-byte runs of rows. At L = 64K (B 1, H 16, P 64,
// N 128, bf16) on an H100, ncu (2026-11-24, blocks in chunk.cuh's heads-fastest order): local_state
// 0.24, pass 0.21, chunk_scan 0.44 ms.
// Workspace (ssd_cuda_scratch): cs, decays, C B^T (float32), and the entering states of the
// sub-chunks when a chunk has several (otherwise chunk_states holds them).
#include "ops/cuda/side_stream.cuh"
#include "ops/ssd/cuda/chunk.cuh"
#include "ops/ssd/cuda/chunk_scan_wgmma.cuh"
#include "ops/ssd/cuda/local_state_wgmma.cuh"
#include "ops/ssd/cuda/segment_scan_wgmma.cuh"
#include "ops/ssd/cuda/state_pass.cuh"

namespace hax::ops {
namespace ssd_cuda {
namespace {

// y for one (row, head, sub-chunk) and 64 columns p of the head dim:
//   y(i, p) = re_i Σ_n C_i[n] S_enter[n][p]  +  Σ_{j<=i, s_j=s_i} (exp(cs_i - cs_j) cb(i, j) dt_j) x_j[p]
// The state part first (C and S_enter as stored), scaled by re_i in registers, then the
// within-sub-chunk part (the bracket split, x as is) into the same accumulators.
// bfloat16 with kVec (kAsync): the raw tiles (C and S_enter per 64-slab of N, then x) come by
// cp.async into a second pair of buffers, the next stage's while the current one multiplies; S
// and x keep global memory's [k][n] layout (mma_slab_kn), and the bracket is staged while x's
// copy is in flight; y goes out through sA in 16-byte runs of its rows (y 16-byte aligned).
// Grid: (S * B * H, ceil(P / 64)); block h + H (s + S b) (chunk.cuh: heads fastest).
template <class T, bool kVec>
__device__ __forceinline__ void chunk_scan_mma(const SsdParams& p, const SsdScratch& w, const T* states) {
  using S_t = typename Operand<T>::S;
  constexpr bool kAsync = kVec && std::is_same_v<T, __nv_bfloat16>;
  __shared__ __align__(16) S_t sA[kSlabSize<T>];
  __shared__ __align__(16) S_t sL[kLoSize<T>];
  __shared__ __align__(16) S_t sB[kSlabSize<T>];
  __shared__ __align__(16) S_t sA2[kAsync ? kSlabSize<T> : 1];  // kAsync: the second buffers
  __shared__ __align__(16) S_t sB2[kAsync ? kSlabSize<T> : 1];
  __shared__ StepVals sv;
  __shared__ float re[kT];
  const int64_t S = p.nsubs(), H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim;
  const HeadSub place = head_sub_of_block(H, S, G);
  const int64_t b = place.b, h = place.h, s = place.s, bh = place.bh, g = place.g;
  const int64_t p0 = (int64_t)blockIdx.y * kT;
  const Sub u = sub_of(p, b, s);
  load_steps<T>(p, w, b, h, s, u, sv);
  __syncthreads();
  if (threadIdx.x < kT) {
    const int i = threadIdx.x;
    re[i] = i < u.len && sv.seq[i] == u.s_prev ? expf(sv.cs[i]) : 0.f;
  }
  __syncthreads();
  const T* x = (const T*)p.x + ((b * p.seqlen + u.t0) * H + h) * P + p0;  // step j at x[j H P]
  const T* C = (const T*)p.Cm + ((b * p.seqlen + u.t0) * G + g) * N;       // step i at C[i G N]
  const float* cb = w.cb + ((b * G + g) * S + s) * kT * kT;
  const T* st = states + (bh * S + s) * N * P + p0;  // entry (n, p) at st[n P + p]
  Acc acc;
  acc.zero();
  const int ks = round16(u.len);
  // The bracket: masked decayed cb times dt_j, A(i, j) (contiguous along j).
  auto stage_bracket = [&](S_t* hi) {
    stage_op<kVec, true, true>(
        hi, sL, ks,
        [&](int i, int j) {
          return i < u.len && j <= i && sv.seq[i] == sv.seq[j] ? cb[i * kT + j] * expf(sv.cs[i] - sv.cs[j]) * sv.dt[j]
                                                               : 0.f;
        },
        [&](int i, int j, float(&v)[8]) {
          const bool row = i < u.len && j <= i;
          load8(cb + i * kT + j, row, v);
          const float ci = sv.cs[i];
          const int32_t si = sv.seq[i];
#pragma unroll
          for (int e = 0; e < 8; ++e)
            v[e] = row && j + e <= i && si == sv.seq[j + e] ? v[e] * expf(ci - sv.cs[j + e]) * sv.dt[j + e] : 0.f;
        });
  };
  if constexpr (kAsync) {
    using Copy = cuda::TileCopy<kT, kT, kThreads>;
    constexpr int ld = Operand<T>::kLd;
    const int slabs = (int)((N + kSlab - 1) / kSlab), stages = slabs + 1;
    const int kp = (int)(P - p0 < kT ? P - p0 : kT);
    auto kn = [&](int t) { return (int)(N - t * kSlab < kSlab ? N - t * kSlab : kSlab); };
    auto bufA = [&](int t) { return t & 1 ? sA2 : sA; };
    auto bufB = [&](int t) { return t & 1 ? sB2 : sB; };
    // Stage t < slabs: A(i, n) = C_i[n], B = S_enter rows n ([k][n]); stage slabs: A = the
    // bracket (hi in bufA, lo in sL), B = x rows j ([k][n]).
    auto issue = [&](int t) {
      if (t < slabs) {
        Copy::template rows<ld>(bufA(t), C + t * kSlab, G * N, 0, u.len, kn(t));
        Copy::template rows<ld>(bufB(t), st + (int64_t)t * kSlab * P, P, 0, kn(t), kp);
      } else {
        Copy::template rows<ld>(bufB(t), x, H * P, 0, u.len, kp);
      }
      cuda::cp_async_commit();
      if (t == slabs) stage_bracket(bufA(t));  // its buffer was last read in stage t - 2
    };
    run_pipeline(stages, issue, [](int) {}, [&](int t) {
      if (t < slabs) {
        mma_slab_kn(acc, bufA(t), bufB(t), round16(kn(t)));
      } else {
        for_each([&](int mi, int ni, int r, int i, int, int, int) { acc.v[mi][ni][r] *= re[i]; });
        mma_slab_kn(acc, bufA(t), bufB(t), ks);
        mma_slab_kn(acc, sL, bufB(t), ks);
      }
    });
  } else {
    // From the entering state: A(i, n) = C_i[n], B(p, n) = S_enter[n][p].
#pragma unroll 1
    for (int64_t n0 = 0; n0 < N; n0 += kSlab) {
      const int kn = (int)(N - n0 < kSlab ? N - n0 : kSlab), kk = round16(kn);
      stage_op<kVec, true, false>(
          sA, sA, kk, [&](int i, int k) { return i < u.len && k < kn ? to_f32(C[i * G * N + n0 + k]) : 0.f; },
          [&](int i, int k, float(&v)[8]) { load8(C + i * G * N + n0 + k, i < u.len && k < kn, v); });
      stage_op<kVec, false, false>(
          sB, sB, kk, [&](int q, int k) { return k < kn && p0 + q < P ? to_f32(st[(n0 + k) * P + q]) : 0.f; },
          [&](int q, int k, float(&v)[8]) { load8(st + (n0 + k) * P + q, k < kn && p0 + q < P, v); });
      __syncthreads();
      mma_slab(acc, sA, sB, kk);
      __syncthreads();
    }
    for_each([&](int mi, int ni, int r, int i, int, int, int) { acc.v[mi][ni][r] *= re[i]; });
    // Within the sub-chunk: A(i, j) = the bracket, B(p, j) = x_j[p].
    stage_bracket(sA);
    stage_op<kVec, false, false>(
        sB, sB, ks, [&](int q, int j) { return j < u.len && p0 + q < P ? to_f32(x[j * H * P + q]) : 0.f; },
        [&](int q, int j, float(&v)[8]) { load8(x + j * H * P + q, j < u.len && p0 + q < P, v); });
    __syncthreads();
    mma_split_a(acc, sA, sL, sB, ks);
  }
  T* y = (T*)p.y + ((b * p.seqlen + u.t0) * H + h) * P + p0;
  if constexpr (kAsync) {
    // With y 16-byte aligned (then so is every row start here: P, p0 multiples of 8), y goes out
    // through sA (free after the pipeline's last barrier): the pairs rounded into it at [i][q],
    // then 16-byte runs of its rows (a warp's pair stores wrote 8 rows x 16 bytes, half sectors).
    if (reinterpret_cast<uintptr_t>(p.y) % 16 == 0) {  // (block-uniform)
      constexpr int ld = Operand<T>::kLd;
      for_each_pair([&](int mi, int ni, int rp, int i, int q) {
        *reinterpret_cast<__nv_bfloat162*>(sA + i * ld + q) =
            __floats2bfloat162_rn(acc.v[mi][ni][2 * rp], acc.v[mi][ni][2 * rp + 1]);
      });
      __syncthreads();
      using Copy = cuda::TileCopy<kT, kT, kThreads>;
      const int c = Copy::col(), kp = (int)(P - p0 < kT ? P - p0 : kT);  // kp a multiple of 8 (kVec)
#pragma unroll
      for (int k = 0; k < Copy::kPer; ++k) {
        const int i = Copy::row(k);
        if (i < u.len && c < kp)
          *reinterpret_cast<uint4*>(y + i * H * P + c) = *reinterpret_cast<const uint4*>(sA + i * ld + c);
      }
      return;
    }
  }
  const bool pairs = kVec && reinterpret_cast<uintptr_t>(y) % 4 == 0;  // P even: every pair is aligned too
  for_each_pair([&](int mi, int ni, int rp, int i, int q) {
    const bool ok0 = i < u.len && p0 + q < P, ok1 = ok0 && p0 + q + 1 < P;
    store_pair(y + i * H * P + q, acc.v[mi][ni][2 * rp], acc.v[mi][ni][2 * rp + 1], ok0, ok1, ok1 && pairs);
  });
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads, kMinScan) chunk_scan_kernel(SsdParams p, SsdScratch w, const T* states) {
  chunk_scan_mma<T, kVec>(p, w, states);
}

// The wgmma form (chunk_scan_wgmma.cuh) where this binary has wgmma; the mma.sync form in builds
// for other GPUs (the host cannot tell which binary a device runs without a probe).
__global__ void __launch_bounds__(kThreads, kMinScanWg)
    chunk_scan_wg_kernel(SsdParams p, SsdScratch w, const __nv_bfloat16* states) {
  if constexpr (cuda::kHaveWgmma) chunk_scan_wg(p, w, states);
  else chunk_scan_mma<__nv_bfloat16, true>(p, w, states);
}

template <class T>
void forward(const SsdParams& p, cudaStream_t stream) {
  const int64_t S = p.nsubs(), B = p.batch, H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim;
  const SsdScratch w = ssd_cuda_scratch(p, false, sizeof(T), (float*)p.workspace);
  // Entering states of the sub-chunks: chunk_states itself when each chunk is one sub-chunk.
  T* states = (T*)(w.states ? w.states : p.chunk_states);
  const int64_t tiles_n = (N + kT - 1) / kT, tiles_p = (P + kT - 1) / kT;
  const unsigned prep_blocks = (unsigned)cuda::ceil_div(B * S * H, 128);
  if (prep_blocks > 0) prep_kernel<T><<<prep_blocks, 128, 0, stream>>>(p, w);
  const bool vec = ssd_vec(p);
  // C B^T is only needed by chunk_scan: it runs on a side stream beside the states' kernels.
  const cudaStream_t side = cuda::SideStream::fork(stream);
  if (B * S * G > 0) {
    if (vec) cb_kernel<T, true><<<(unsigned)(B * S * G), kThreads, 0, side>>>(p, w);
    else cb_kernel<T, false><<<(unsigned)(B * S * G), kThreads, 0, side>>>(p, w);
  }
  if (B * S * H * tiles_n * tiles_p > 0) {
    bool swept = false;  // 3 and 4 as one sweep (segment_scan_wgmma.cuh)
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      if (vec && segment_scan_applies(p, w, states, false)) {
        launch_segment_scan<false>(p, w, (const T*)p.x, states, (const T*)p.init_state, (T*)p.final_state, stream);
        swept = true;
      }
    }
    if (!swept) {
      launch_local_state<T, false>(p, w, (const T*)p.x, states, vec, stream);
      launch_state_pass<T, false>(p, w, states, false, nullptr, nullptr, stream);
    }
  }
  cuda::SideStream::join(stream);
  if (B * S * H * tiles_p > 0) {
    const dim3 grid((unsigned)(B * S * H), (unsigned)tiles_p);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      if (vec && chunk_scan_wg_applies(p, states)) {
        chunk_scan_wg_kernel<<<grid, kThreads, 0, stream>>>(p, w, states);
        cuda::check_launch("ssd_forward_cuda");
        return;
      }
    }
    if (vec) chunk_scan_kernel<T, true><<<grid, kThreads, 0, stream>>>(p, w, states);
    else chunk_scan_kernel<T, false><<<grid, kThreads, 0, stream>>>(p, w, states);
  }
  cuda::check_launch("ssd_forward_cuda");
}

}  // namespace
}  // namespace ssd_cuda

void ssd_forward_cuda(const SsdParams& p, DType dtype, void* stream) {
  if (p.batch * p.seqlen * p.nheads == 0) return;  // the binding fills final_state for empty sequences
  HAX_DISPATCH_DTYPE(dtype, [&] { ssd_cuda::forward<scalar_t>(p, (cudaStream_t)stream); });
}

}  // namespace hax::ops
