// CUDA backward of the chunked SSD scan (cpu.cpp's backward_impl is the reference and states the
// gradient formulas; notation in chunk.cuh). Per (row, head, sub-chunk), with M = cb ∘ Gm the
// masked decayed matrix (Gm_ij = [j<=i][s_i=s_j] exp(cs_i - cs_j)), dS the gradient of the state
// leaving the sub-chunk and S the state entering it:
//   dXd_j   = w_j Σ_n B_j[n] dS[n][.] + Σ_i M_ij dy_i              dx = dt dXd
//   dM_ij   = dy_i . Xd_j,  dCB = dM ∘ Gm (summed over the group's heads)
//   dB_j    = Σ_heads w_j Xd_j^T dS + Σ_i dCB_ij C_i,   dC_i = Σ_heads re_i dy_i^T S + Σ_j dCB_ij B_j
//   dS_enter = g dS + Σ_i re_i C_i dy_i^T  (the reverse pass over sub-chunks; dinit at the start)
//   d(cs_i)  = intra_i + u_i - v_i + [i = last] (Σ_j v_j + g <dS, S>), with
//     intra_i = Σ_j dM_ij M_ij - Σ_j dM_ji M_ji,  v_j = Xd_j . (Σ_n w_j B_j[n] dS[n][.]),
//     u_i = dy_i . (re_i Σ_n C_i[n] S[n][.])
//   da_t = Σ_{i>=t} d(cs_i);  ddt_t = da_t A + x_t . dXd_t;  dA = Σ_t da_t dt_t.
// Launches, in order:
//   1-2. prep_kernel, cb_kernel (as the forward; skipped when p.prepped: the autograd op keeps
//        the forward's cs, decay and cb, 20 MB at L = 64K, H 16, and saves their ~40 us)
//   3.   with several sub-chunks per chunk: local states + a pass restarted from chunk_states at
//        each chunk, giving the entering state of every sub-chunk (else chunk_states has them)
//   4.   local_state_kernel<kGrad>: Σ_i re_i C_i dy_i^T per sub-chunk (or its wgmma form,
//        local_state_wgmma.cuh, launch_local_state)
//   5.   state_pass_kernel<kReverse>: dS of every sub-chunk, dinit
//        (4 and 5 are one sweep for bfloat16 at the wgmma sizes: segment_scan_wgmma.cuh)
//   6.   dx_kernel    per (row, head, sub-chunk): dx, and the per-step v, u, x.dXd, and g <dS, S>
//                    (g not where 8 runs its joint form: kDot false, dx then reads no states)
//                    (u not where 8 runs its wgmma form: kY false); in dx.cuh
//   7.   dcb_kernel   per (row, group, sub-chunk), heads in order: dM, intra_i, dCB summed over heads
//                    (launched after 4 on a side stream, ops/cuda/side_stream.cuh: it needs neither
//                    states nor dx's results, and runs beside 5 and 6; joined before 8); in dcb.cuh
//   8.   dbdc_kernel  per (row, group, sub-chunk, 64 columns of N, dB or dC): heads summed in the
//                    product's k (no atomics), in dbdc.cuh; its wgmma form (dbdc_wgmma.cuh) also
//                    gives u, in a part per 64 columns of N (grad_rows.cuh)
//                    or the joint form (dbdc_joint_wgmma.cuh, the default where wgmma applies): one
//                    block per (row, group, sub-chunk, 64 columns of N) for dB, dC, u and g
//   9.   ddt_kernel   one thread per (row, head, sub-chunk): d(cs), its reverse cumsum, ddt, dA
//  10.   da_kernel    block per (row, head): dA_part summed over sub-chunks (fixed order)
// Every reduction has a fixed order: the backward is deterministic.
// Speed: as in the forward, staging is vectorized where P and N are multiples of 8 (kVec) and
// register budgets keep 4-6 blocks per SM. dx_kernel runs its two state products one after the
// other (Y folded into u before X starts) so that one accumulator tile is live at a time. dcb
// and dbdc (bfloat16) copy their raw tiles by cp.async, the next head's while the current one
// multiplies. At L = 64K (B 1, H 16, P 64, N 128, bf16) on an H100, ncu, in ms: local_state 0.46,
// pass 0.20, dx 1.50, dcb 0.29, dbdc 0.52, the rest about 0.15. Three forms of dx measured no
// faster there and are not used (BENCHMARKS.md, tenth pass): every raw tile copied by cp.async
// up front (1.79 ms at 2 blocks an SM; branch exp/ssd-async), the stages double-buffered as in
// dbdc (1.53; exp/ssd-dx-stages), and the epilogue in pairs of columns (1.60: more spills).
// Since (H100, 2026-11-23: `hax bench ssm` fwd+bwd at 64K 3.85 -> 3.50 ms; 3.52 without the dx
// stores through the tile): dx_kernel (bfloat16, kVec) copies its dy and x tiles (the sub-chunk's
// steps x 64 columns) by cp.async at the start of each 64 columns, in flight during the Y product;
// its three epilogues read them from shared memory in pairs of columns, where they were scalar
// 2-byte global loads consumed at once (42% of the warp samples stalled on long_sb in an ncu
// source profile, the top ones on those loads), and the intra product takes dy from its tile as
// stored (mma_slab_kn) instead of staging it again; dx goes out through the dy tile, 16 bytes a
// store (the 2-byte stores of the accumulator layout used a quarter of each sector). Static shared
// memory 48128 bytes a block (was 29696; the static limit is 49152): 4 blocks an SM still fit,
// and ptxas spills less (4 bytes of stores, was 52). The dx 1.50 ms above is from before this.
// Then, as local_state's vectorized form: dx_kernel (bfloat16, kVec) stages no operand
// transposed. S and dS enter in their [n][p] layout (S by 16-byte stores, dS by cp.async) and M as
// [i][j] rows, all read by ldmatrix.trans; same buffers, same shared memory. H100, ncu, 2026-11-23:
// dx 1.04 -> 0.91 ms; local_state (gradient) is 0.25 ms now, dbdc 0.52, dcb 0.30, pass 0.20.
// With chunk.cuh's heads-fastest block order and dbdc's row factors loaded a head ahead
// (2026-11-24): dx 0.83, dbdc 0.37, local_state (gradient) 0.23, dcb 0.30, pass 0.20 ms.
// With the wgmma forms (H200, ncu, L = 64K, 2026-11-29, BENCHMARKS.md pass 29): local_state
// (either direction) 0.25 -> 0.20 ms; dB/dC 0.38 (mma.sync) -> 0.42 ms with u moved into it, and dx
// without the Y product 0.83 -> 0.67 ms; `hax bench ssm` fwd+bwd at 64K 2.33-2.37 -> 2.10-2.19 ms.
#include <atomic>

#include "ops/cuda/side_stream.cuh"
#include "ops/ssd/cuda/dbdc.cuh"
#include "ops/ssd/cuda/dbdc_joint_wgmma.cuh"
#include "ops/ssd/cuda/dbdc_wgmma.cuh"
#include "ops/ssd/cuda/dcb.cuh"
#include "ops/ssd/cuda/dx.cuh"
#include "ops/ssd/cuda/grad_rows.cuh"
#include "ops/ssd/cuda/local_state_wgmma.cuh"
#include "ops/ssd/cuda/segment_scan_wgmma.cuh"
#include "ops/ssd/cuda/state_pass.cuh"

namespace hax::ops {
namespace ssd_cuda {
namespace {

// The wgmma form (dbdc_wgmma.cuh) where this binary has wgmma; the mma.sync form in builds for
// other GPUs.
__global__ void __launch_bounds__(kThreads, kMinDbdcWg)
    dbdc_wg_kernel(SsdGradParams gp, SsdScratch w, const __nv_bfloat16* states) {
  if constexpr (cuda::kHaveWgmma) dbdc_wg(gp, w, states);
  else dbdc_mma<__nv_bfloat16, true>(gp, w, states);
}

// The joint dB/dC (dbdc_joint_wgmma.cuh) where this binary has wgmma; elsewhere it traps and is
// never launched (joint_built).
__global__ void __launch_bounds__(kThreads, 2) dbdc_joint_kernel(SsdGradParams gp, SsdScratch w, const __nv_bfloat16* states) {
  if constexpr (cuda::kHaveWgmma) dbdc_joint_wg(gp, w, states);
  else __trap();
}

// Whether the current device runs a binary of this file built with wgmma: only there does the
// joint kernel have static shared memory (its row factors), which the runtime reports for the
// binary it picked (no launch). The answer is cached per device; a failed query is not (it says
// no this time and clears only its own error: backward calls this before its first launch).
bool joint_built() {
  int dev = 0;
  cudaGetDevice(&dev);
  static std::atomic<int> cache[64];  // 0 unknown, 1 no, 2 yes
  int v = dev >= 0 && dev < 64 ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (v == 0) {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, dbdc_joint_kernel) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    v = attr.sharedSizeBytes > 0 ? 2 : 1;
    if (dev >= 0 && dev < 64) cache[dev].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

// d(cs) of one (row, head, sub-chunk), its reverse cumsum da, ddt and the sub-chunk's dA.
// One thread each, index ((b S + s) H + h), steps in the CPU's order. The thread's rows of v (all
// of it, for vsum) and then, 16 steps at a time from the end, of intra, u, x.dXd and dt are loaded
// into registers first, as independent loads (16 bytes each for the rows): loaded one step at a
// time inside the loops, each load waited on before the next (the ddt stores may alias them for
// the compiler), the kernel took 45 us at L = 64K, H = 16 on the H100.
// u_split: u comes in two parts (kU + kU2: dbdc_wg with N = 128 and dx_kernel<.., false>);
// g_split: so does g (dg + dg2: the joint dB/dC with N = 128).
template <class T>
__global__ void ddt_kernel(SsdGradParams gp, SsdScratch w, bool u_split, bool g_split) {
  const SsdParams& p = gp.fwd;
  const int64_t H = p.nheads, S = p.nsubs();
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.batch * S * H) return;
  const int64_t q = ssd_div(idx, H), h = idx - q * H, b = ssd_div(q, S), s = q - b * S, bhs = (b * H + h) * S + s;
  const Sub u = sub_of(p, b, s);
  const int len = u.len;
  // (each row is kT floats, 256-byte aligned: SsdScratch::rows)
  const float4* intra = reinterpret_cast<const float4*>(row_terms(p, w, kIntra, bhs));
  const float4* vrow = reinterpret_cast<const float4*>(row_terms(p, w, kV, bhs));
  const float4* uu = reinterpret_cast<const float4*>(row_terms(p, w, kU, bhs));
  const float4* uu2 = reinterpret_cast<const float4*>(row_terms(p, w, kU2, bhs));
  const float4* xd = reinterpret_cast<const float4*>(row_terms(p, w, kXdot, bhs));
  const float A = to_f32(((const T*)p.A)[h]);
  const T* dt = (const T*)p.dt + (b * p.seqlen + u.t0) * H + h;
  T* ddt = (T*)gp.ddt + (b * p.seqlen + u.t0) * H + h;
  auto at = [](const float4& q, int e) { return e == 0 ? q.x : e == 1 ? q.y : e == 2 ? q.z : q.w; };
  float v[kT];
#pragma unroll
  for (int i = 0; i < kT / 4; ++i) {
    const float4 q = vrow[i];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[4 * i + e] = at(q, e);
  }
  float vsum = 0.f;
#pragma unroll
  for (int i = 0; i < kT; ++i)
    if (i < len) vsum += v[i];
  constexpr int kC = 16;  // steps per batch of loads
  float run = 0.f, dA = 0.f;
#pragma unroll
  for (int c = kT / kC - 1; c >= 0; --c) {
    if (c * kC >= len) continue;
    float in[kC], uv[kC], xv[kC], dv[kC];
#pragma unroll
    for (int i = 0; i < kC / 4; ++i) {
      const float4 a4 = intra[c * kC / 4 + i], u4 = uu[c * kC / 4 + i], x4 = xd[c * kC / 4 + i];
#pragma unroll
      for (int e = 0; e < 4; ++e) in[4 * i + e] = at(a4, e), uv[4 * i + e] = at(u4, e), xv[4 * i + e] = at(x4, e);
      if (u_split) {
        const float4 u4b = uu2[c * kC / 4 + i];
#pragma unroll
        for (int e = 0; e < 4; ++e) uv[4 * i + e] += at(u4b, e);
      }
    }
#pragma unroll
    for (int i = 0; i < kC; ++i) dv[i] = c * kC + i < len ? to_f32(dt[(c * kC + i) * H]) : 0.f;
#pragma unroll
    for (int i = kC - 1; i >= 0; --i) {
      const int t = c * kC + i;
      if (t >= len) continue;
      float d = in[i] + uv[i] - v[t];
      if (t == len - 1) d += vsum + w.dg[bhs] + (g_split ? w.dg2[bhs] : 0.f);
      run += d;
      ddt[t * H] = from_f32<T>(run * A + xv[i]);
      dA += run * dv[i];
    }
  }
  w.dA_sub[bhs] = dA;
}

// dA_part(b, h) = Σ_s dA of sub-chunk s: a block per (row, head); thread t sums s = t, t + 256,
// ... in order, then a fixed tree over the threads (deterministic). One thread per (row, head)
// summing all S in order took 65 us at L = 64K (S = 1024) on the H100.
constexpr int kDaThreads = 256;
__global__ void __launch_bounds__(kDaThreads) da_kernel(SsdGradParams gp, SsdScratch w) {
  __shared__ float part[kDaThreads];
  const int64_t S = gp.fwd.nsubs(), bh = blockIdx.x;
  const float* src = w.dA_sub + bh * S;
  float acc = 0.f;
  for (int64_t s = threadIdx.x; s < S; s += kDaThreads) acc += src[s];
  part[threadIdx.x] = acc;
  __syncthreads();
#pragma unroll
  for (int n = kDaThreads / 2; n > 0; n /= 2) {
    if ((int)threadIdx.x < n) part[threadIdx.x] += part[threadIdx.x + n];
    __syncthreads();
  }
  if (threadIdx.x == 0) ((float*)gp.dA_part)[bh] = part[0];
}

template <class T>
void backward(const SsdGradParams& gp, cudaStream_t stream) {
  const SsdParams& p = gp.fwd;
  const int64_t S = p.nsubs(), B = p.batch, H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim;
  const SsdScratch w = ssd_cuda_scratch(p, true, sizeof(T), (float*)p.workspace);
  const int64_t tiles_n = (N + kT - 1) / kT;
  const bool has_states = N * P > 0;
  const unsigned thread_blocks = (unsigned)cuda::ceil_div(B * S * H, 128);

  const bool vec = ssd_vec(p, gp.dy);
  // (before any launch of this call: the probe may clear an error of its own)
  const bool joint_ok = std::is_same_v<T, __nv_bfloat16> && p.joint_dbdc && vec && joint_built();
  if (!p.prepped) {  // (else the forward's cs, decay and cb are in p.prep)
    prep_kernel<T><<<thread_blocks, 128, 0, stream>>>(p, w);
    if (vec) cb_kernel<T, true><<<(unsigned)(B * S * G), kThreads, 0, stream>>>(p, w);
    else cb_kernel<T, false><<<(unsigned)(B * S * G), kThreads, 0, stream>>>(p, w);
  }
  // The state entering each sub-chunk.
  T* states = (T*)p.chunk_states;
  if (w.states) {
    states = (T*)w.states;
    if (has_states) {
      launch_local_state<T, false>(p, w, (const T*)p.x, states, vec, stream);
      launch_state_pass<T, false>(p, w, states, true, nullptr, nullptr, stream);
    }
  }
  // The gradient of the state leaving each sub-chunk, and dinit. dcb needs neither states nor
  // dx's results: it runs on a side stream beside the pass (memory-bound, a block an SM) and dx.
  // With the sweep (segment_scan_wgmma.cuh), 4 and 5 are one pass over the sub-chunks.
  bool sweep = false;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) sweep = has_states && vec && segment_scan_applies(p, w, w.dstates, true);
  if (has_states && !sweep) {
    launch_local_state<T, true>(p, w, (const T*)gp.dy, (T*)w.dstates, vec, stream);
  }
  const cudaStream_t side = cuda::SideStream::fork(stream);
  if (vec) dcb_kernel<T, true><<<(unsigned)(B * S * G), kThreads, 0, side>>>(gp, w);
  else dcb_kernel<T, false><<<(unsigned)(B * S * G), kThreads, 0, side>>>(gp, w);
  if (sweep) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      launch_segment_scan<true>(p, w, (const T*)gp.dy, (T*)w.dstates, (const T*)gp.dfinal, (T*)gp.dinit, stream);
  } else if (has_states) {
    launch_state_pass<T, true>(p, w, (T*)w.dstates, false, (const T*)gp.dfinal, (T*)gp.dinit, stream);
  }
  // With dbdc's wgmma form, u comes from it (kU, and kU2 for the second 64 columns of N).
  // With the joint form (dbdc_joint_wgmma.cuh), g comes from it too and dx reads no S.
  bool wg_dbdc = false, joint = false;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    wg_dbdc = vec && tiles_n > 0 && dbdc_wg_applies(gp, states, w.dstates);
    joint = joint_ok && wg_dbdc;  // (joint_ok: the switch and the binary; wg_dbdc: dbdc_wg's conditions)
    if (joint) dx_kernel<T, true, false, false><<<(unsigned)(B * S * H), kThreads, 0, stream>>>(gp, w, states);
    else if (wg_dbdc) dx_kernel<T, true, false><<<(unsigned)(B * S * H), kThreads, 0, stream>>>(gp, w, states);
  }
  if (!wg_dbdc) {
    if (vec) dx_kernel<T, true><<<(unsigned)(B * S * H), kThreads, 0, stream>>>(gp, w, states);
    else dx_kernel<T, false><<<(unsigned)(B * S * H), kThreads, 0, stream>>>(gp, w, states);
  }
  cuda::SideStream::join(stream);  // dbdc reads dcb
  if (tiles_n > 0) {
    const unsigned grid = (unsigned)(B * S * G * tiles_n * 2);
    if (joint) {
      cuda::allow_smem(dbdc_joint_kernel, kJointSmem, "ssd_backward_cuda (joint dB, dC)", sizeof(float) * (4 * kT + 8));
      dbdc_joint_kernel<<<(unsigned)(B * S * G * tiles_n), kThreads, kJointSmem, stream>>>(gp, w,
                                                                                          (const __nv_bfloat16*)states);
    } else if (wg_dbdc) {
      cuda::allow_smem(dbdc_wg_kernel, kDbdcWgSmem, "ssd_backward_cuda (dB, dC)", sizeof(float) * 2 * kT);
      dbdc_wg_kernel<<<grid, kThreads, kDbdcWgSmem, stream>>>(gp, w, (const __nv_bfloat16*)states);
    } else if (vec) dbdc_kernel<T, true><<<grid, kThreads, 0, stream>>>(gp, w, states);
    else dbdc_kernel<T, false><<<grid, kThreads, 0, stream>>>(gp, w, states);
  }
  ddt_kernel<T><<<thread_blocks, 128, 0, stream>>>(gp, w, wg_dbdc && tiles_n == 2, joint && tiles_n == 2);
  da_kernel<<<(unsigned)(B * H), kDaThreads, 0, stream>>>(gp, w);
  cuda::check_launch("ssd_backward_cuda");
}

}  // namespace
}  // namespace ssd_cuda

void ssd_backward_cuda(const SsdGradParams& gp, DType dtype, void* stream) {
  const SsdParams& p = gp.fwd;
  if (p.batch * p.seqlen * p.nheads == 0) return;  // the binding handles empty sequences
  HAX_DISPATCH_DTYPE(dtype, [&] { ssd_cuda::backward<scalar_t>(gp, (cudaStream_t)stream); });
}

}  // namespace hax::ops
