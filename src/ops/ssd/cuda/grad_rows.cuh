// The per-step terms of d(cs) that the SSD backward's kernels leave for ddt_kernel
// (SsdScratch::rows, one row of 64 floats per (row, head, sub-chunk) and term; ssd_backward.cu's
// header states the formulas).
#pragma once
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

}  // namespace hax::ops::ssd_cuda
