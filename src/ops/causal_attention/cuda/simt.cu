// Causal attention on float32 FMA tiles (float32 or bfloat16 storage, float32 math): the path of
// float32 tensors, and of bfloat16 ones when tensor cores are switched off. cpu.cpp is the
// reference and has the formulas; tiles.cuh defines the visible ranges.
//
// Every kernel works on 64 x 64 tiles with 256 threads in a 16 x 16 grid (tx = thread % 16,
// ty = thread / 16). In a score tile, thread (ty, tx) owns rows 4ty..4ty+3 and columns
// 4tx..4tx+3; in a (64, DB) accumulator it owns rows 4ty..4ty+3 and columns tx + 16e. Operands of
// score tiles sit in shared memory transposed ((DB, 64 + 4): float4 reads along the tile), value
// tiles row-major. Head dims are padded with zeros to the bucket DB in {16, 32, 64, 128}.
//
// forward, one block per (b, h, query tile): for each key tile the queries see (lo_{i0} to the
//   diagonal), S = Q K^T, masked, online softmax in base 2 (running max m per row, the partial
//   row sums l kept per thread and summed across the row's 16 threads at the end), P^T through
//   shared memory, acc = acc * alpha + P V. out = acc / l, lse = (m + log2 l) ln 2 (float32).
// backward, with Δ_i = dO_i · O_i - dlse_i precomputed (launch.cu) and P = exp2(S scale2 - lse2):
//   dQ: one block per (b, h, query tile), looping over the same key tiles as the forward:
//       dS = P ∘ (dO V^T - Δ), dQ += dS K;
//   dK, dV: one block per (b, h, key tile), looping over the query tiles that see it (the
//       diagonal to hi_{j1}), with transposed tiles S^T = K Q^T and dP^T = V dO^T:
//       dV += P^T dO, dK += dS^T Q.
// Each gradient entry is summed by one thread in a fixed order: no atomics, deterministic.
#include <algorithm>

#include "ops/causal_attention/cuda/kernels.cuh"
#include "ops/causal_attention/cuda/tiles.cuh"

namespace hax::ops::causal_cuda {
namespace {

using cuda::from_f32;
using cuda::to_f32;

constexpr int kT = 64;          // queries and keys per tile
constexpr int kThreads = 256;   // 16 x 16
constexpr int kTP = kT + 4;     // row stride of a transposed tile (a multiple of 4: float4 reads)

__device__ __forceinline__ float max16(float v) {  // max over the 16 lanes sharing ty
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float sum16(float v) {
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// s[a][b] = Σ_d X[d][4ty + a] Y[d][4tx + b] over DB dims, X and Y transposed tiles (DB, kTP).
template <int DB>
__device__ __forceinline__ void tile_dot(float (&s)[4][4], const float* X, const float* Y, int tx, int ty) {
#pragma unroll 4
  for (int d = 0; d < DB; ++d) {
    const float4 x = *reinterpret_cast<const float4*>(X + d * kTP + 4 * ty);
    const float4 y = *reinterpret_cast<const float4*>(Y + d * kTP + 4 * tx);
    const float xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) s[a][b] = fmaf(xs[a], ys[b], s[a][b]);
  }
}

// Stores a score tile transposed: dst[(4tx + b) * kTP + 4ty + a] = s[a][b].
__device__ __forceinline__ void store_transposed(float* dst, const float (&s)[4][4], int tx, int ty) {
#pragma unroll
  for (int b = 0; b < 4; ++b)
    *reinterpret_cast<float4*>(dst + (4 * tx + b) * kTP + 4 * ty) = make_float4(s[0][b], s[1][b], s[2][b], s[3][b]);
}

// acc[a][e] += Σ_c P[c][4ty + a] V(c, tx + 16e) over the kT columns c of a score tile, with P
// stored by store_transposed and V(c, n) = V[c * vs + n * ns] (row-major: vs = DB, ns = 1;
// transposed: vs = 1, ns = kTP).
template <int DB>
__device__ __forceinline__ void tile_accumulate(float (&acc)[4][DB / 16], const float* P, const float* V, int vs,
                                                int ns, int tx, int ty) {
#pragma unroll 4
  for (int c = 0; c < kT; ++c) {
    const float4 pc = *reinterpret_cast<const float4*>(P + c * kTP + 4 * ty);
    const float ps[4] = {pc.x, pc.y, pc.z, pc.w};
#pragma unroll
    for (int e = 0; e < DB / 16; ++e) {
      const float v = V[c * vs + (tx + 16 * e) * ns];
#pragma unroll
      for (int a = 0; a < 4; ++a) acc[a][e] = fmaf(ps[a], v, acc[a][e]);
    }
  }
}

template <int DB>
constexpr size_t forward_smem() {  // sQt, sKt (DB, kTP); sV (kT, DB); sPt (kT, kTP)
  return sizeof(float) * (2 * DB * kTP + kT * DB + kT * kTP);
}

template <class T, int DB>
__global__ void __launch_bounds__(kThreads) forward_kernel(CausalAttentionParams p, Dims dm) {
  extern __shared__ float4 smem_f4[];
  float* sQt = reinterpret_cast<float*>(smem_f4);
  float* sKt = sQt + DB * kTP;
  float* sV = sKt + DB * kTP;
  float* sPt = sV + kT * DB;
  const int L = dm.L, H = dm.H, tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int bh = bh_of(dm), b = bh / H, h = bh % H, i0 = tile_of(dm, true) * kT;
  const int64_t sqk = (int64_t)H * dm.D, sv = (int64_t)H * dm.Dv;  // row strides
  const T* q = (const T*)p.q + ((int64_t)b * L * H + h) * dm.D;
  const T* k = (const T*)p.k + ((int64_t)b * L * H + h) * dm.D;
  const T* v = (const T*)p.v + ((int64_t)b * L * H + h) * dm.Dv;
  const Visibility vis = visibility(p, dm, b, bh);

  int lo[4], hi[4];  // the keys each of the thread's rows sees (empty past the end)
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int i = i0 + 4 * ty + a;
    lo[a] = i < L ? vis.first_key(i) : INT_MAX;
    hi[a] = i < L ? vis.last_key(i) : -1;
  }
  int kt_begin, kt_end;
  tile_span(vis.first_key(i0), vis.last_key(min(i0 + kT - 1, L - 1)), kT, L, kt_begin, kt_end);
  load_cols_f32(sQt, kTP, q, sqk, i0, kT, L, dm.D, DB);

  float m[4], l[4], acc[4][DB / 16];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    m[a] = -INFINITY, l[a] = 0.f;
#pragma unroll
    for (int e = 0; e < DB / 16; ++e) acc[a][e] = 0.f;
  }
  for (int kt = kt_begin; kt <= kt_end; ++kt) {
    const int j0 = kt * kT;
    __syncthreads();  // the previous tile's sKt, sV, sPt are read
    load_cols_f32(sKt, kTP, k, sqk, j0, kT, L, dm.D, DB);
    load_rows_f32(sV, DB, v, sv, j0, kT, L, dm.Dv, DB);
    __syncthreads();
    float s[4][4] = {};
    tile_dot<DB>(s, sQt, sKt, tx, ty);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = j0 + 4 * tx + c;
        s[a][c] = (j <= hi[a] && j >= lo[a]) ? s[a][c] * dm.scale2 : -INFINITY;
        mx = fmaxf(mx, s[a][c]);
      }
      const float m_new = fmaxf(m[a], max16(mx));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with no visible key yet
      const float alpha = exp2f(m[a] - m_use);
      m[a] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[a][c] = exp2f(s[a][c] - m_use);
        sum += s[a][c];
      }
      l[a] = l[a] * alpha + sum;
#pragma unroll
      for (int e = 0; e < DB / 16; ++e) acc[a][e] *= alpha;
    }
    store_transposed(sPt, s, tx, ty);
    __syncthreads();
    tile_accumulate<DB>(acc, sPt, sV, DB, 1, tx, ty);
  }

  T* out = (T*)p.out + ((int64_t)b * L * H + h) * dm.Dv;
  float* lse = (float*)p.lse + (int64_t)bh * L;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const float lsum = sum16(l[a]);
    const int i = i0 + 4 * ty + a;
    if (i >= L) continue;
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;  // a row that sees no key (a band's) outputs 0
#pragma unroll
    for (int e = 0; e < DB / 16; ++e) {
      const int d = tx + 16 * e;
      if (d < dm.Dv) out[(int64_t)i * sv + d] = from_f32<T>(acc[a][e] * inv);
    }
    if (tx == 0) lse[i] = lsum > 0.f ? m[a] * kLn2 + logf(lsum) : -INFINITY;
  }
}

template <int DB>
constexpr size_t dq_smem() {  // sQt, sdOt, sKt, sVt (DB, kTP); sdSt (kT, kTP)
  return sizeof(float) * (4 * DB * kTP + kT * kTP);
}

template <class T, int DB>
__global__ void __launch_bounds__(kThreads) dq_kernel(CausalAttentionGradParams gp, Dims dm) {
  const CausalAttentionParams& p = gp.fwd;
  extern __shared__ float4 smem_f4[];
  float* sQt = reinterpret_cast<float*>(smem_f4);
  float* sdOt = sQt + DB * kTP;
  float* sKt = sdOt + DB * kTP;
  float* sVt = sKt + DB * kTP;
  float* sdSt = sVt + DB * kTP;
  const int L = dm.L, H = dm.H, tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int bh = bh_of(dm), b = bh / H, h = bh % H, i0 = tile_of(dm, true) * kT;
  const int64_t sqk = (int64_t)H * dm.D, sv = (int64_t)H * dm.Dv;
  const int64_t off_qk = ((int64_t)b * L * H + h) * dm.D, off_v = ((int64_t)b * L * H + h) * dm.Dv;
  const T* q = (const T*)p.q + off_qk;
  const T* k = (const T*)p.k + off_qk;
  const T* v = (const T*)p.v + off_v;
  const T* dout = (const T*)gp.dout + off_v;
  const float* lse = (const float*)p.lse + (int64_t)bh * L;
  const float* delta = (const float*)gp.workspace + (int64_t)bh * L;
  const Visibility vis = visibility(p, dm, b, bh);

  int lo[4], hi[4];
  float lse2[4], dl[4];  // lse in base 2 and Δ of the thread's rows
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int i = i0 + 4 * ty + a;
    lo[a] = i < L ? vis.first_key(i) : INT_MAX;
    hi[a] = i < L ? vis.last_key(i) : -1;
    lse2[a] = i < L ? lse[i] * kLog2e : 0.f;
    dl[a] = i < L ? delta[i] : 0.f;
  }
  int kt_begin, kt_end;
  tile_span(vis.first_key(i0), vis.last_key(min(i0 + kT - 1, L - 1)), kT, L, kt_begin, kt_end);
  load_cols_f32(sQt, kTP, q, sqk, i0, kT, L, dm.D, DB);
  load_cols_f32(sdOt, kTP, dout, sv, i0, kT, L, dm.Dv, DB);

  float acc[4][DB / 16] = {};
  for (int kt = kt_begin; kt <= kt_end; ++kt) {
    const int j0 = kt * kT;
    __syncthreads();
    load_cols_f32(sKt, kTP, k, sqk, j0, kT, L, dm.D, DB);
    load_cols_f32(sVt, kTP, v, sv, j0, kT, L, dm.Dv, DB);
    __syncthreads();
    float s[4][4] = {}, dp[4][4] = {};
    tile_dot<DB>(s, sQt, sKt, tx, ty);
    tile_dot<DB>(dp, sdOt, sVt, tx, ty);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = j0 + 4 * tx + c;
        const float pr = (j <= hi[a] && j >= lo[a]) ? exp2f(s[a][c] * dm.scale2 - lse2[a]) : 0.f;
        s[a][c] = pr * (dp[a][c] - dl[a]);  // dS
      }
    }
    store_transposed(sdSt, s, tx, ty);
    __syncthreads();
    tile_accumulate<DB>(acc, sdSt, sKt, 1, kTP, tx, ty);  // dQ += dS K
  }

  T* dq = (T*)gp.dq + off_qk;
  const float scale = (float)p.scale;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int i = i0 + 4 * ty + a;
    if (i >= L) continue;
#pragma unroll
    for (int e = 0; e < DB / 16; ++e) {
      const int d = tx + 16 * e;
      if (d < dm.D) dq[(int64_t)i * sqk + d] = from_f32<T>(acc[a][e] * scale);
    }
  }
}

template <int DB>
constexpr size_t dkdv_smem() {  // sKt, sVt, sQt, sdOt (DB, kTP); sP (kT, kTP); lse2, Δ (kT)
  return sizeof(float) * (4 * DB * kTP + kT * kTP + 2 * kT);
}

template <class T, int DB>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(CausalAttentionGradParams gp, Dims dm) {
  const CausalAttentionParams& p = gp.fwd;
  extern __shared__ float4 smem_f4[];
  float* sKt = reinterpret_cast<float*>(smem_f4);
  float* sVt = sKt + DB * kTP;
  float* sQt = sVt + DB * kTP;
  float* sdOt = sQt + DB * kTP;
  float* sP = sdOt + DB * kTP;  // P^T, then dS^T, stored transposed: sP[query][key]
  float* sLse2 = sP + kT * kTP;
  float* sDl = sLse2 + kT;
  const int L = dm.L, H = dm.H, tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int bh = bh_of(dm), b = bh / H, h = bh % H, j0 = tile_of(dm, false) * kT;
  const int64_t sqk = (int64_t)H * dm.D, sv = (int64_t)H * dm.Dv;
  const int64_t off_qk = ((int64_t)b * L * H + h) * dm.D, off_v = ((int64_t)b * L * H + h) * dm.Dv;
  const T* q = (const T*)p.q + off_qk;
  const T* k = (const T*)p.k + off_qk;
  const T* v = (const T*)p.v + off_v;
  const T* dout = (const T*)gp.dout + off_v;
  const float* lse = (const float*)p.lse + (int64_t)bh * L;
  const float* delta = (const float*)gp.workspace + (int64_t)bh * L;
  const Visibility vis = visibility(p, dm, b, bh);

  int lo[4], hi[4];  // the queries that see each of the thread's keys (empty past the end)
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int j = j0 + 4 * ty + a;
    lo[a] = j < L ? vis.first_query(j) : INT_MAX;
    hi[a] = j < L ? vis.last_query(j) : -1;
  }
  int qt_begin, qt_end;
  tile_span(vis.first_query(j0), vis.last_query(min(j0 + kT - 1, L - 1)), kT, L, qt_begin, qt_end);
  load_cols_f32(sKt, kTP, k, sqk, j0, kT, L, dm.D, DB);
  load_cols_f32(sVt, kTP, v, sv, j0, kT, L, dm.Dv, DB);

  float dk[4][DB / 16] = {}, dv[4][DB / 16] = {};
  for (int qt = qt_begin; qt <= qt_end; ++qt) {
    const int i0 = qt * kT;
    __syncthreads();  // the previous tile's sQt, sdOt, sP, sLse2, sDl are read
    load_cols_f32(sQt, kTP, q, sqk, i0, kT, L, dm.D, DB);
    load_cols_f32(sdOt, kTP, dout, sv, i0, kT, L, dm.Dv, DB);
    for (int c = threadIdx.x; c < kT; c += kThreads) {
      const int i = i0 + c;
      sLse2[c] = i < L ? lse[i] * kLog2e : 0.f;
      sDl[c] = i < L ? delta[i] : 0.f;
    }
    __syncthreads();
    float st[4][4] = {}, dpt[4][4] = {};  // rows: keys 4ty + a; columns: queries 4tx + c
    tile_dot<DB>(st, sKt, sQt, tx, ty);
    tile_dot<DB>(dpt, sVt, sdOt, tx, ty);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int i = i0 + 4 * tx + c;
        const float pr = (i >= lo[a] && i <= hi[a]) ? exp2f(st[a][c] * dm.scale2 - sLse2[4 * tx + c]) : 0.f;
        st[a][c] = pr;
        dpt[a][c] = pr * (dpt[a][c] - sDl[4 * tx + c]);  // dS^T
      }
    }
    store_transposed(sP, st, tx, ty);
    __syncthreads();
    tile_accumulate<DB>(dv, sP, sdOt, 1, kTP, tx, ty);  // dV += P^T dO
    __syncthreads();
    store_transposed(sP, dpt, tx, ty);
    __syncthreads();
    tile_accumulate<DB>(dk, sP, sQt, 1, kTP, tx, ty);  // dK += dS^T Q
  }

  T* dkp = (T*)gp.dk + off_qk;
  T* dvp = (T*)gp.dv + off_v;
  const float scale = (float)p.scale;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int j = j0 + 4 * ty + a;
    if (j >= L) continue;
#pragma unroll
    for (int e = 0; e < DB / 16; ++e) {
      const int d = tx + 16 * e;
      if (d < dm.D) dkp[(int64_t)j * sqk + d] = from_f32<T>(dk[a][e] * scale);
      if (d < dm.Dv) dvp[(int64_t)j * sv + d] = from_f32<T>(dv[a][e]);
    }
  }
}

}  // namespace

void forward_simt(const CausalAttentionParams& p, DType dtype, cudaStream_t stream) {
  const Dims dm = make_dims(p, kT);
  const unsigned grid = grid_size(dm);
  HAX_DISPATCH_DTYPE(dtype, [&] {
    HAX_CAUSAL_DISPATCH_HEAD_DIM(std::max(dm.D, dm.Dv), [&] {
      constexpr size_t smem = forward_smem<DB>();
      allow_smem(forward_kernel<scalar_t, DB>, smem, "causal_attention_forward_cuda");
      forward_kernel<scalar_t, DB><<<grid, kThreads, smem, stream>>>(p, dm);
    });
  });
  cuda::check_launch("causal_attention_forward_cuda (FMA tiles)");
}

void backward_simt(const CausalAttentionGradParams& gp, DType dtype, cudaStream_t stream) {
  const Dims dm = make_dims(gp.fwd, kT);
  const unsigned grid = grid_size(dm);
  HAX_DISPATCH_DTYPE(dtype, [&] {
    HAX_CAUSAL_DISPATCH_HEAD_DIM(std::max(dm.D, dm.Dv), [&] {
      constexpr size_t smem_q = dq_smem<DB>(), smem_kv = dkdv_smem<DB>();
      allow_smem(dq_kernel<scalar_t, DB>, smem_q, "causal_attention_backward_cuda");
      allow_smem(dkdv_kernel<scalar_t, DB>, smem_kv, "causal_attention_backward_cuda");
      dq_kernel<scalar_t, DB><<<grid, kThreads, smem_q, stream>>>(gp, dm);
      dkdv_kernel<scalar_t, DB><<<grid, kThreads, smem_kv, stream>>>(gp, dm);
    });
  });
  cuda::check_launch("causal_attention_backward_cuda (FMA tiles)");
}

}  // namespace hax::ops::causal_cuda
