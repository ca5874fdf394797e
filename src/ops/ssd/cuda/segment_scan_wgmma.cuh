// The sub-chunks' local states and the sequential pass over them in one sweep (wgmma, sm_90a
// builds): the same states as local_state_wg followed by state_pass_kernel, for bfloat16 with P
// and N multiples of 64, N <= 128, one sub-chunk per chunk and 16-byte aligned tensors
// (segment_scan_applies). Notation in chunk.cuh. Both directions, as local_state_wg:
//   forward (kGrad false): out[s] = the state entering sub-chunk s, from init_state (or zeros);
//     run = g_s run + Σ_j coef_j B_j (x_j)^T,  coef_j = w_j dt_j;  final_state = run at the end
//   backward (kGrad true): out[s] = the gradient of the state leaving sub-chunk s, from dfinal
//     (or zeros) back; run = g_s run + Σ_i coef_i C_i (dy_i)^T,  coef_i = re_i;  dinit at the end
// Why: the two-kernel form writes every local state (N P entries a sub-chunk, bfloat16), and the
// pass reads them and writes the states: three passes over the states' bytes where this form
// writes them once. At L = 64K (B 1, H 16, P 64, N 128) they are 268 MB a pass, and the pass and
// the local states were ~410 us of each direction on an H100 (BENCHMARKS.md, thirty-sixth pass).
//
// The run lives in the wgmma accumulators (float32, 64 rows n x 64 columns p a slab of N) of one
// warpgroup, which walks a segment of the row's sub-chunks in order: per sub-chunk s it stores
// run (rounded) to out[s], scales it by g_s and adds U_s^T (coef V_s) with the products of
// local_state_wg (U = B or C by 64-slabs of N, 128-byte swizzled as stored; coef V split hi + lo,
// about 16 significant bits). U, raw V, coef and g_s come by cp.async through a ring of
// kSegStages sub-chunks, kSegStages - 1 ahead.
// Segments: one warpgroup per (row, head, 64 columns of P) alone would be 16 blocks at B 1, H 16,
// so each row is cut into K segments of consecutive sub-chunks (params.h ssd_segments: about 256
// blocks in all) and the sweep takes two launches:
//   1. aggregates (kScan false), all segments but the one that starts the scan: the segment's run
//      from zeros (float32, no stores) and the product of its g_s;
//   2. scan (kScan true), every segment: the entering run folded from the start (init_state,
//      dfinal or zeros) and the aggregates of the segments before it in scan order (run = D run
//      + A, in order), then the sweep with its stores.
// The states differ from the two-kernel form's by rounding only: the local states are not rounded
// to bfloat16 before they are added, and the runs of later segments are summed in another order.
// Every order is fixed: the result is deterministic for given sizes.
// Measured slower than the two kernels (H200, L = 64K, ncu, pass 37: the forward's states 490 us,
// scan 330 + aggregates 145 + coef 15, against 198 + 153): the walk is bound by each sub-chunk's
// chain in a block (two barriers, the split into shared memory, 16 wgmma waited for), not by
// bytes. Off by default (SsdParams::sweep); see BENCHMARKS.md, thirty-seventh pass.
#pragma once
#include <cuda_bf16.h>

#include "ops/ssd/cuda/wg_tiles.cuh"

namespace hax::ops::ssd_cuda {

constexpr int kSegStages = 3;           // ring depth (sub-chunks) of the sweep's copies
// Whether the sweep takes this call (bfloat16 with vectorized staging, ssd_vec, given): the
// switches (SsdParams::sweep, which the binding resolves from set_ssd_sweep and HAX_SSD_SEGSCAN;
// wg_forms_on), sizes its tiles cover whole, the scratch's pieces, a 16-byte aligned `out`, and in
// the forward one sub-chunk per chunk (the two-kernel pass restarts each chunk from its rounded state).
inline bool segment_scan_applies(const SsdParams& p, const SsdScratch& w, const void* out, bool reverse) {
  return p.sweep && wg_forms_on(p) && wg_sizes(p) && (reverse || p.subs_per_chunk() == 1) && w.coef && w.seg_agg &&
         cuda::aligned16(out);
}

// Bytes of one ring stage: U's kSlabs tiles (1024-aligned, first), raw V (64 x 64, rows of 128
// bytes), coef (64 floats) and g (padded to 1024).
template <int kSlabs>
constexpr size_t kSegStageBytes = (size_t)(kSlabs + 1) * kWgTile * sizeof(__nv_bfloat16) + 1024;
// Dynamic shared memory of the sweep: the ring, the hi and lo tiles of coef V, 1024 to align.
template <int kSlabs>
constexpr size_t kSegSmem = kSegStages * kSegStageBytes<kSlabs> + 2 * kWgTile * sizeof(__nv_bfloat16) + 1024;

// coef of every step of every (row, head, sub-chunk) into w.coef ((B, H, S, 64), zeros past len):
// w_j dt_j (kGrad false) or re_i (kGrad true). One thread a step.
template <bool kGrad>
__global__ void segment_coef_kernel(SsdParams p, SsdScratch w) {
  const int64_t S = p.nsubs(), H = p.nheads;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.batch * H * S * kT) return;
  const int i = (int)(idx & (kT - 1));
  const int64_t bhs = idx >> 6, bh = ssd_div(bhs, S), s = bhs - bh * S, b = ssd_div(bh, H), h = bh - b * H;
  w.coef[idx] = local_coef<kGrad>(p, w, b, h, bhs, sub_of(p, b, s), i);
}

// The sweep of one segment (see the header). Grid: B H PT Kl blocks, heads fastest (block
// h + H (pt + PT (k' + Kl b))), PT = P / 64; Kl = K (kScan) or K - 1 (segment k = k' + 1 when
// kGrad and not kScan: the backward's scan starts from the last segment). v_src: x or dy; start:
// init_state or dfinal ((B, H, P, N) or null); end: final_state or dinit (or null).
template <bool kGrad, bool kScan, int kSlabs>
__device__ __forceinline__ void segment_scan_wg(const SsdParams& p, const SsdScratch& w, const __nv_bfloat16* v_src,
                                                __nv_bfloat16* out, const __nv_bfloat16* start, __nv_bfloat16* end,
                                                int64_t K) {
  using bf16 = __nv_bfloat16;
  using Copy = cuda::TileCopy<kT, kT, kThreads>;
  extern __shared__ unsigned char seg_dyn[];
  // 1024-aligned by pointer arithmetic on the shared array (the pointer stays known as shared).
  unsigned char* const base = seg_dyn + ((1024u - ((unsigned)__cvta_generic_to_shared(seg_dyn) & 1023u)) & 1023u);
  auto stage = [&](int r) { return base + r * kSegStageBytes<kSlabs>; };
  auto sU = [&](int r, int t) { return reinterpret_cast<bf16*>(stage(r)) + t * kWgTile; };  // U_j[64 t + n], rows j
  auto sV = [&](int r) { return reinterpret_cast<bf16*>(stage(r)) + kSlabs * kWgTile; };     // V_j[p0 + q], rows j
  auto sCoef = [&](int r) { return reinterpret_cast<float*>(stage(r) + (kSlabs + 1) * kWgTile * sizeof(bf16)); };
  bf16* const vhi = reinterpret_cast<bf16*>(base + kSegStages * kSegStageBytes<kSlabs>);  // coef V split
  bf16* const vlo = vhi + kWgTile;

  const int64_t S = p.nsubs(), H = p.nheads, G = p.ngroups, N = p.dstate, P = p.headdim, L = p.seqlen;
  const int64_t PT = P / kT, Kl = kScan ? K : K - 1;
  const uint32_t x = blockIdx.x, h = x % (uint32_t)H, q1 = x / (uint32_t)H, pt = q1 % (uint32_t)PT,
                 q2 = q1 / (uint32_t)PT, kl = q2 % (uint32_t)Kl, b = q2 / (uint32_t)Kl;
  const int64_t k = kl + (!kScan && kGrad ? 1 : 0);
  const int64_t bh = (int64_t)b * H + h, g = h / (uint32_t)(H / G), p0 = (int64_t)pt * kT;
  const int64_t s_begin = k * S / K, s_end = (k + 1) * S / K, n_iter = s_end - s_begin;
  auto sub_at = [&](int64_t i) { return kGrad ? s_end - 1 - i : s_begin + i; };

  // The copies of iteration i's sub-chunk into ring slot i % kSegStages (the caller commits).
  const bf16* U0 = (const bf16*)(kGrad ? p.Cm : p.Bm) + ((int64_t)b * L * G + g) * N;  // step t at U0[t G N]
  const bf16* V0 = v_src + ((int64_t)b * L * H + h) * P + p0;  // step t at V0[t H P]
  auto issue = [&](int64_t i) {
    const int r = (int)(i % kSegStages);
    const int64_t s = sub_at(i), t0 = p.sub_start(s);
    const int len = (int)p.sub_size(s);
#pragma unroll
    for (int t = 0; t < kSlabs; ++t) copy_swizzled(sU(r, t), U0 + t0 * G * N + t * kT, G * N, len);
    const int c = Copy::col();
    const bf16* v = V0 + t0 * H * P;
#pragma unroll
    for (int m = 0; m < Copy::kPer; ++m) {
      const int j = Copy::row(m);
      const bool ok = j < len;
      cuda::cp_async16(sV(r) + j * kT + c, ok ? v + j * H * P + c : v, ok);
    }
    if (threadIdx.x < kT / 4) cuda::cp_async16(sCoef(r) + 4 * threadIdx.x, w.coef + (bh * S + s) * kT + 4 * threadIdx.x, true);
    else if (threadIdx.x == kT / 4) cuda::cp_async4(sCoef(r) + kT, w.decay + bh * S + s, true);
  };

  // The thread's accumulator entries: warp w's rows 16 w + lane / 4 (+ 8), columns 8 j + 2 (lane % 4) (+ 1).
  const int lane = threadIdx.x & 31, r0 = 16 * (threadIdx.x >> 5) + (lane >> 2), c0 = 2 * (lane & 3);
  // Entry (t, j, e)'s place in a (B, H, P, N) state (start, end): [(bh P + q) N + n].
  auto pn = [&](int t, int j, int e) {
    const int64_t n = t * kT + r0 + 8 * (e >> 1), q = p0 + 8 * j + c0 + (e & 1);
    return (bh * P + q) * N + n;
  };
  float acc[kSlabs][8][4];
  // The run entering the segment.
  float* const agg = w.seg_agg + ((bh * PT + pt) * K) * (kSlabs * kWgTile);  // + k (kSlabs 4096) + thread's 32 kSlabs
  float* const dprod = w.seg_decay + (bh * PT + pt) * K;
  auto agg_at = [&](int64_t kk) { return reinterpret_cast<float4*>(agg + kk * (kSlabs * kWgTile) + threadIdx.x * (kSlabs * 32)); };
#pragma unroll
  for (int t = 0; t < kSlabs; ++t)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[t][j][e] = kScan && start ? cuda::to_f32(start[pn(t, j, e)]) : 0.f;
      }
  if constexpr (kScan) {
    // Fold the aggregates of the segments before this one in scan order (their order is fixed).
    const int64_t first = kGrad ? K - 1 : 0;
    for (int64_t m = 0; m < (kGrad ? K - 1 - k : k); ++m) {
      const int64_t kk = kGrad ? first - m : first + m;
      const float d = dprod[kk];
      const float4* a = agg_at(kk);
#pragma unroll
      for (int t = 0; t < kSlabs; ++t)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float4 v = a[t * 8 + j];
          acc[t][j][0] = d * acc[t][j][0] + v.x, acc[t][j][1] = d * acc[t][j][1] + v.y;
          acc[t][j][2] = d * acc[t][j][2] + v.z, acc[t][j][3] = d * acc[t][j][3] + v.w;
        }
    }
  }

  // The sweep.
#pragma unroll
  for (int i = 0; i < kSegStages - 1; ++i) {
    if (i < n_iter) issue(i);
    cuda::cp_async_commit();
  }
  float dp = 1.f;  // product of the segment's g (kScan false)
#pragma unroll 1
  for (int64_t i = 0; i < n_iter; ++i) {
    const int r = (int)(i % kSegStages);
    cuda::cp_async_wait<kSegStages - 2>();
    __syncthreads();  // slot r landed for every thread; slot (i - 1) % stages and vhi, vlo free
    if (i + kSegStages - 1 < n_iter) issue(i + kSegStages - 1);
    cuda::cp_async_commit();
    // coef V, split, into the swizzled hi and lo tiles (one 16-byte store each per octet).
    {
      const int c = Copy::col();
      const float* cf = sCoef(r);
#pragma unroll
      for (int m = 0; m < Copy::kPer; ++m) {
        const int j = Copy::row(m);
        store_split_octet(vhi, vlo, j, c, *reinterpret_cast<const uint4*>(sV(r) + j * kT + c), cf[j]);
      }
    }
    const int64_t s = sub_at(i);
    if constexpr (kScan) {  // out[s] = run, rounded: (N, P) entry (n, q) at [n P + q]
      bf16* o = out + (bh * S + s) * N * P + p0;
#pragma unroll
      for (int t = 0; t < kSlabs; ++t)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            *reinterpret_cast<uint32_t*>(o + (t * kT + r0 + 8 * e) * P + 8 * j + c0) =
                pack_bf16(acc[t][j][2 * e], acc[t][j][2 * e + 1]);
    }
    cuda::fence_proxy_async_shared();
    __syncthreads();  // vhi, vlo written
    const float gs = sCoef(r)[kT];
    dp *= gs;
#pragma unroll
    for (int t = 0; t < kSlabs; ++t)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][j][e] *= gs;
    wg_local_product<kSlabs>(acc, sU(r, 0), vhi, vlo, true);
  }
  cuda::cp_async_wait<0>();  // (the empty groups)

  if constexpr (!kScan) {  // the aggregate and its decay
    float4* a = agg_at(k);
#pragma unroll
    for (int t = 0; t < kSlabs; ++t)
#pragma unroll
      for (int j = 0; j < 8; ++j) a[t * 8 + j] = make_float4(acc[t][j][0], acc[t][j][1], acc[t][j][2], acc[t][j][3]);
    if (threadIdx.x == 0) dprod[k] = dp;
  } else if (end && k == (kGrad ? 0 : K - 1)) {  // final_state or dinit, (B, H, P, N)
#pragma unroll
    for (int t = 0; t < kSlabs; ++t)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) end[pn(t, j, e)] = cuda::from_f32<bf16>(acc[t][j][e]);
  }
}

template <bool kGrad, bool kScan, int kSlabs>
__global__ void __launch_bounds__(kThreads, 2)
    segment_scan_kernel(SsdParams p, SsdScratch w, const __nv_bfloat16* v_src, __nv_bfloat16* out,
                        const __nv_bfloat16* start, __nv_bfloat16* end, int64_t K) {
  if constexpr (cuda::kHaveWgmma) segment_scan_wg<kGrad, kScan, kSlabs>(p, w, v_src, out, start, end, K);
}

// Launches the sweep (coef, the aggregates where there are several segments, the scan); the
// caller checked segment_scan_applies.
template <bool kGrad, int kSlabs>
void launch_segment_scan_slabs(const SsdParams& p, const SsdScratch& w, const __nv_bfloat16* v_src,
                               __nv_bfloat16* out, const __nv_bfloat16* start, __nv_bfloat16* end,
                               cudaStream_t stream) {
  const int64_t S = p.nsubs(), BH = p.batch * p.nheads, per = BH * (p.headdim / kT), K = ssd_segments(p);
  const int64_t steps = BH * S * kT;
  segment_coef_kernel<kGrad><<<(unsigned)cuda::ceil_div(steps, 256), 256, 0, stream>>>(p, w);
  constexpr size_t smem = kSegSmem<kSlabs>;
  if (K > 1) {
    cuda::allow_smem(segment_scan_kernel<kGrad, false, kSlabs>, smem, "ssd (segment aggregates)");
    segment_scan_kernel<kGrad, false, kSlabs><<<(unsigned)(per * (K - 1)), kThreads, smem, stream>>>(p, w, v_src, out,
                                                                                                  start, end, K);
  }
  cuda::allow_smem(segment_scan_kernel<kGrad, true, kSlabs>, smem, "ssd (segment scan)");
  segment_scan_kernel<kGrad, true, kSlabs><<<(unsigned)(per * K), kThreads, smem, stream>>>(p, w, v_src, out, start, end,
                                                                                            K);
}

template <bool kGrad>
void launch_segment_scan(const SsdParams& p, const SsdScratch& w, const __nv_bfloat16* v_src, __nv_bfloat16* out,
                         const __nv_bfloat16* start, __nv_bfloat16* end, cudaStream_t stream) {
  if (p.dstate == kT) launch_segment_scan_slabs<kGrad, 1>(p, w, v_src, out, start, end, stream);
  else launch_segment_scan_slabs<kGrad, 2>(p, w, v_src, out, start, end, stream);
}

}  // namespace hax::ops::ssd_cuda
