// The per-step terms of d(cs) that the SSD backward's kernels leave for ddt_kernel
// (SsdScratch::rows, one row of 64 floats per (row, head, sub-chunk) and term; ssd_backward.cu's
// header states the formulas).
#pragma once
#include "ops/ssd/cuda/chunk.cuh"
#include "ops/ssd/cuda/tile.cuh"
#include "ops/ssd/params.h"

namespace hax::ops::ssd_cuda {

// The terms: intra_i (dcb_kernel), v_j and x.dXd (dx_kernel), and u_i: written whole by dx_kernel,
// or, where the wgmma dbdc form computes it (dbdc_wgmma.cuh), as one part per 64 columns of N,
// kU and kU2.
enum Row { kIntra = 0, kV = 1, kU = 2, kXdot = 3, kU2 = 4 };

__device__ __forceinline__ float* row_terms(const SsdParams& p, const SsdScratch& w, Row r, int64_t bhs) {
  return w.rows + ((int64_t)r * p.batch * p.nheads * p.nsubs() + bhs) * kT;
}

// dB/dC's row factor of step i for one head, in both forms of dbdc (mma.sync and wgmma): dB's
// w_i dt_i = [s_i = s_last] exp(cs_last - cs_i) dt_i, dC's re_i = [s_i = s_prev] exp(cs_i).
// Thread i < kT loads its step's inputs into registers (load, a head ahead of their use) and
// computes the factor from them (value); 0 past the sub-chunk.
struct RowFactorIn {
  float cs = 0.f, cs_last = 0.f, dt = 0.f;
  int32_t seq = 0;

  template <class T>
  static __device__ __forceinline__ RowFactorIn load(const SsdParams& p, const SsdScratch& w, int64_t b, int64_t h,
                                                     int64_t s, int64_t S, const Sub& u) {  // S: p.nsubs()
    RowFactorIn in;
    const int i = threadIdx.x;
    if (i < u.len) {
      const int64_t H = p.nheads, L = p.seqlen;
      const float* c = w.cs + ((b * H + h) * S + s) * kT;
      in.cs = c[i], in.cs_last = c[u.len - 1];
      in.dt = to_f32(((const T*)p.dt)[(b * L + u.t0 + i) * H + h]);
      in.seq = p.seq_idx ? p.seq_idx[b * L + u.t0 + i] : 0;
    }
    return in;
  }
  __device__ __forceinline__ float value(const Sub& u, bool is_dc) const {
    return (int)threadIdx.x < u.len ? step_factor(is_dc, u, seq, cs, cs_last, dt) : 0.f;
  }
};

}  // namespace hax::ops::ssd_cuda
