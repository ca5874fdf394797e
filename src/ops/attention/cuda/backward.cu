// CUDA backward of sparse attention over index lists; cpu.cpp is the reference and the formulas'
// home. Per list entry e = (query i, segment s, slot t) with key j, x its base-2 score,
// a = 2^(x - lse_s log2 e) its softmax weight, w = w_s, dO = dout_i:
//   dp_e = dO · v_j,   dw_s = Σ_t a dp,   dscore_e = a (w (dp - dw_s) + dlse_s),
//   dq_i = scale Σ_e dscore_e k_j,   dk_j = scale Σ_{e -> j} dscore_e q_i,
//   dv_j = Σ_{e -> j} w a_e dO_i,   dbias_j = Σ_{e -> j} dscore_e,   dseg_w = dw_s.
//
// Query pass (one group of G lanes per query, laid out as the forward's: forward.cu), per segment:
//   pass 1 over the listed keys (rows k_j, v_j loaded kChunk at a time): x and dp by one butterfly
//     for both, a from the saved lse, dw += a dp, and the two sums A1 = Σ a dp k_j, A2 = Σ a k_j
//     that give dq without a second look at k: Σ dscore k = w A1 + (dlse - w dw) A2. Each entry's
//     (a, dp) is kept by the lane that read its list entry, in shared memory (K·8 bytes per group)
//     or, when that does not fit or in deterministic mode, in the global workspace.
//   pass 2 over the entries, once dw is known: dscore = a (w (dp - dw) + dlse).
// With atomics (the default): dv_j += w a dO in pass 1, dk_j += scale dscore q and dbias_j +=
// dscore in pass 2, float atomics (one 16-byte vector atomic per lane on Hopper) into float32
// accumulators that the binding zeroed.
// Deterministic: pass 2 overwrites the entry's workspace slots with (dscore, w a), and a key pass
// sums, in the fixed order of key_entries (the entries sorted by key, built by the binding),
// dk_j = scale Σ dscore q_i, dv_j = Σ w a dO_i and dbias_j: one group per work chunk of at most
// kAttentionKeyChunk entries of one key (each lane its 4 dims, entries in order; dbias by per-lane
// sums and a butterfly), writing the key's row when it has one chunk, else a partial row that a
// last kernel adds to the others of its key in chunk order. Every key's row is written.
//
// Launch: query pass over B·H·ceil(L / (256/G)) work items of 256 threads, one CTA each (with a
// tile plan, fewer CTAs looping over them: cuda::skip_grid), with (256/G)·K·8 bytes of
// dynamic shared memory when the entries live there (<= 48 KiB); key pass grids of ceil(chunks /
// (256/G)) and ceil(B·H·Lk / (256/G)) CTAs. Workspace: sparse_attention_cuda_workspace() floats,
// entries (B·H, L·S·K) twice; the key chunks' partial rows are allocated by the binding.
#include "ops/attention/cuda/lanes.cuh"

namespace hax::ops {
namespace {

using namespace attn;

// Work item `item` (kThreads / G queries of one (b, h)): the query pass of this group's query.
// Beside the tile path, query_pass_kernel calls it only for the items of overflowing blocks.
template <class T, int G, bool kVec, bool kAtomic>
__device__ __forceinline__ void query_pass_item(const AttentionGradParams& gp, const Layout& lay, int64_t nblk,
                                                int64_t item, float* smem, bool smem_entries) {
  const AttentionParams& p = gp.fwd;
  constexpr int kQueries = kThreads / G;
  const Group<G> g;
  const int grp = threadIdx.x / G;
  const int64_t bh = item / nblk;
  const int64_t r = (int64_t)(item % nblk) * kQueries + grp;
  if (r >= lay.L) return;  // a whole group leaves; no CTA-wide barrier follows
  const int64_t b = bh / lay.H, h = bh % lay.H, BH = p.batch * lay.H, N = lay.L * lay.S * lay.K;
  const int64_t i = p.q_order ? p.q_order[bh * lay.L + r] : r;
  if (i < 0 || i >= lay.L) return;  // not a permutation entry (checked only with check_device_values)
  const int d0 = 4 * g.lane, D = (int)lay.D, Dv = (int)lay.Dv;

  float q[4], dO[4];
  load4<kVec>((const T*)p.q + lay.q(b, i, h), d0, D, q);
  load4<kVec>((const T*)gp.dout + lay.o(b, i, h), d0, Dv, dO);
  const float scale = (float)p.scale, qscale = scale * kLog2e;
  const T* kp = (const T*)p.k;
  const T* vp = (const T*)p.v;
  const T* bias = p.bias ? (const T*)p.bias + bh * lay.Lk : nullptr;
  float* dk_acc = (float*)gp.dk;
  float* dv_acc = (float*)gp.dv;
  float* db_acc = gp.dbias ? (float*)gp.dbias + bh * lay.Lk : nullptr;

  float dq[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t s = 0; s < lay.S; ++s) {
    const int64_t sg = lay.seg(bh, i) + s;
    const int32_t* list = p.idx + lay.list(bh, i) + s * lay.K;
    // This segment's entry slots: (a, dp) after pass 1; (dscore, w a) after pass 2 when !kAtomic.
    float* ea = smem_entries ? smem + (int64_t)grp * 2 * lay.K : gp.workspace + lay.list(bh, i) + s * lay.K;
    float* eb = smem_entries ? ea + lay.K : ea + BH * N;
    const float lse = ((const float*)p.lse)[sg];
    float dw = 0.f;
    if (!(lse > -INFINITY)) {
      // An empty segment (lse = -inf) has no gradient. (Were a listed key's score -inf, its
      // entries still get zeros for the key pass.)
      if (!kAtomic)
        for (int64_t t = g.lane; t < lay.K; t += G)
          if (listed_key(list[t], lay.Lk) >= 0) ea[t] = 0.f, eb[t] = 0.f;
    } else {
      const float lse2 = lse * kLog2e;
      const float w = p.seg_w ? to_f32(((const T*)p.seg_w)[sg]) : 1.f;
      const float dl = gp.dlse ? ((const float*)gp.dlse)[sg] : 0.f;
      float A1[4] = {0.f, 0.f, 0.f, 0.f}, A2[4] = {0.f, 0.f, 0.f, 0.f};
      // Pass 1.
      for (int64_t t0 = 0; t0 < lay.K; t0 += G) {
        const int32_t jl = t0 + g.lane < lay.K ? listed_key(list[t0 + g.lane], lay.Lk) : -1;
        if (!g.any(jl >= 0)) continue;
        float my_a = 0.f, my_dp = 0.f;  // this lane's entry t0 + lane
        for (int c0 = 0; c0 < G; c0 += kChunk) {
          int32_t j[kChunk];
          bool any = false;
#pragma unroll
          for (int u = 0; u < kChunk; ++u) {
            j[u] = g.from(jl, c0 + u);
            any |= j[u] >= 0;
          }
          if (!any) continue;
          float kr[kChunk][4], vr[kChunk][4];
#pragma unroll
          for (int u = 0; u < kChunk; ++u) {
            if (j[u] >= 0) {
              load4<kVec>(kp + lay.k(b, j[u], h), d0, D, kr[u]);
              load4<kVec>(vp + lay.v(b, j[u], h), d0, Dv, vr[u]);
            } else {
#pragma unroll
              for (int e = 0; e < 4; ++e) kr[u][e] = 0.f, vr[u][e] = 0.f;
            }
          }
          float red[2 * kChunk];  // partial q·k, then partial dO·v
#pragma unroll
          for (int u = 0; u < kChunk; ++u) red[u] = dot4(q, kr[u]), red[kChunk + u] = dot4(dO, vr[u]);
          g.sum(red);
#pragma unroll
          for (int u = 0; u < kChunk; ++u) {
            const bool ok = j[u] >= 0;
            const float x2 = red[u] * qscale + (bias && ok ? to_f32(bias[j[u]]) * kLog2e : 0.f);
            const float a = ok ? exp2f(x2 - lse2) : 0.f;
            const float dp = ok ? red[kChunk + u] : 0.f;
            dw += a * dp;
#pragma unroll
            for (int e = 0; e < 4; ++e) A1[e] += a * dp * kr[u][e], A2[e] += a * kr[u][e];
            if (kAtomic && ok) {
              float t[4];
#pragma unroll
              for (int e = 0; e < 4; ++e) t[e] = w * a * dO[e];
              atomic_add4<kVec>(dv_acc + lay.v(b, j[u], h), d0, Dv, t);
            }
            if (g.lane == c0 + u) my_a = a, my_dp = dp;
          }
        }
        if (jl >= 0) ea[t0 + g.lane] = my_a, eb[t0 + g.lane] = my_dp;
      }
      // dq, then pass 2.
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[e] += w * A1[e] + (dl - w * dw) * A2[e];
      for (int64_t t0 = 0; t0 < lay.K; t0 += G) {
        const int32_t jl = t0 + g.lane < lay.K ? listed_key(list[t0 + g.lane], lay.Lk) : -1;
        if (!g.any(jl >= 0)) continue;
        float ds = 0.f;
        if (jl >= 0) {
          const float a = ea[t0 + g.lane], dp = eb[t0 + g.lane];
          ds = a * (w * (dp - dw) + dl);
          if (!kAtomic) {
            ea[t0 + g.lane] = ds, eb[t0 + g.lane] = w * a;
          } else if (db_acc) {
            atomicAdd(db_acc + jl, ds);
          }
        }
        if (kAtomic) {
          for (int c = 0; c < G; ++c) {
            const int32_t j = g.from(jl, c);
            const float dsc = g.from(ds, c) * scale;
            if (j < 0) continue;
            float t[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) t[e] = dsc * q[e];
            atomic_add4<kVec>(dk_acc + lay.k(b, j, h), d0, D, t);
          }
        }
      }
    }
    if (gp.dseg_w && g.lane == 0) ((T*)gp.dseg_w)[sg] = from_f32<T>(dw);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) dq[e] *= scale;
  store4<kVec>((T*)gp.dq + lay.q(b, i, h), d0, D, dq);
}

// Items blockIdx.x, + gridDim.x, ...: one CTA an item, or beside the tile path fewer CTAs
// (cuda::skip_grid) that run only the items of overflowing blocks (for_each_overflow_item, 32
// bytes of static shared memory). A group's shared entries are reused by its next item, after its lanes are
// done with them (__syncwarp over the group).
template <class T, int G, bool kVec, bool kAtomic>
__global__ void __launch_bounds__(kThreads)
    query_pass_kernel(AttentionGradParams gp, Layout lay, int64_t nblk, int64_t items, bool smem_entries) {
  extern __shared__ float smem[];
  const Group<G> g;
  const auto item = [&](int64_t w) {
    query_pass_item<T, G, kVec, kAtomic>(gp, lay, nblk, w, smem, smem_entries);
    __syncwarp(g.mask);
  };
  if (gp.fwd.tile_count)
    for_each_overflow_item<kThreads / G>(gp.fwd.tile_count, gp.fwd.tile_overflow, lay.L, nblk, items, item);
  else
    for (int64_t w = blockIdx.x; w < items; w += gridDim.x) item(w);
}

// Deterministic mode, first half of the key pass: one group per work chunk c (of at most
// kAttentionKeyChunk entries of one key j of one (b, h), in key_entries order) sums the chunk's
// Σ dscore q_i, Σ w a dO_i (each lane its 4 dims, entries in order) and Σ dscore (per-lane partial
// sums, then a butterfly). A key of one chunk (most keys) writes its gradients directly; the chunks
// of a key of several write partial rows, which key_sum_kernel adds in chunk order.
template <class T, int G, bool kVec>
__global__ void __launch_bounds__(kThreads) key_chunk_kernel(AttentionGradParams gp, Layout lay) {
  const AttentionParams& p = gp.fwd;
  constexpr int kPerCta = kThreads / G;
  const Group<G> g;
  const int64_t c = (int64_t)blockIdx.x * kPerCta + threadIdx.x / G;
  if (c >= gp.key_chunks) return;
  const int64_t BH = p.batch * lay.H, N = lay.L * lay.S * lay.K, SK = lay.S * lay.K;
  // The key kk = bh·Lk + j whose chunks hold c: key_chunk_start[kk] <= c < key_chunk_start[kk + 1]
  // (every key has at least one chunk, so the starts increase strictly).
  const int64_t* cs = gp.key_chunk_start;
  int64_t lo = 0, hi = BH * lay.Lk;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (cs[mid] <= c) lo = mid;
    else hi = mid;
  }
  const int64_t kk = lo, bh = kk / lay.Lk, j = kk % lay.Lk, b = bh / lay.H, h = bh % lay.H;
  const int64_t part = c - cs[kk], nparts = cs[kk + 1] - cs[kk];
  const int d0 = 4 * g.lane, D = (int)lay.D, Dv = (int)lay.Dv;
  const int32_t* st = gp.key_start + bh * (lay.Lk + 1);
  const int64_t n0 = st[j] + part * kAttentionKeyChunk, end = st[j + 1];
  const int64_t n1 = end < n0 + kAttentionKeyChunk ? end : n0 + kAttentionKeyChunk;
  const int32_t* ent = gp.key_entries + bh * N;
  const float* ds_ws = gp.workspace + bh * N;
  const float* pw_ws = gp.workspace + BH * N + bh * N;
  const T* qp = (const T*)p.q;
  const T* op = (const T*)gp.dout;

  float dk[4] = {0.f, 0.f, 0.f, 0.f}, dv[4] = {0.f, 0.f, 0.f, 0.f}, db = 0.f;
  for (int64_t n = n0; n < n1; n += G) {
    const int32_t el = n + g.lane < n1 ? ent[n + g.lane] : -1;
    const float dsl = el >= 0 ? ds_ws[el] : 0.f, pwl = el >= 0 ? pw_ws[el] : 0.f;
    db += dsl;
    const int cnt = (int)(n1 - n < G ? n1 - n : G);  // the same for the whole group
    for (int c0 = 0; c0 < cnt; c0 += kChunk) {
      int32_t e[kChunk];
      float ds[kChunk], pw[kChunk], qr[kChunk][4], dor[kChunk][4];
#pragma unroll
      for (int u = 0; u < kChunk; ++u) {
        e[u] = g.from(el, c0 + u);  // -1 past cnt
        ds[u] = g.from(dsl, c0 + u);
        pw[u] = g.from(pwl, c0 + u);
      }
#pragma unroll
      for (int u = 0; u < kChunk; ++u) {
        if (e[u] >= 0) {
          const int64_t i = e[u] / SK;
          load4<kVec>(qp + lay.q(b, i, h), d0, D, qr[u]);
          load4<kVec>(op + lay.o(b, i, h), d0, Dv, dor[u]);
        } else {
#pragma unroll
          for (int x = 0; x < 4; ++x) qr[u][x] = 0.f, dor[u][x] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kChunk; ++u)
#pragma unroll
        for (int x = 0; x < 4; ++x) dk[x] += ds[u] * qr[u][x], dv[x] += pw[u] * dor[u][x];
    }
  }
  db = g.sum(db);
  if (nparts > 1) {
    float* row = gp.key_partials + (gp.key_partial_start[kk] + part) * (lay.D + lay.Dv + 1);
    store4<false>(row, d0, D, dk);
    store4<false>(row + D, d0, Dv, dv);
    if (g.lane == 0) row[D + Dv] = db;
    return;
  }
  const float scale = (float)p.scale;
#pragma unroll
  for (int x = 0; x < 4; ++x) dk[x] *= scale;
  store4<kVec>((float*)gp.dk + lay.k(b, j, h), d0, D, dk);
  store4<kVec>((float*)gp.dv + lay.v(b, j, h), d0, Dv, dv);
  if (gp.dbias && g.lane == 0) ((float*)gp.dbias)[bh * lay.Lk + j] = db;
}

// Deterministic mode, second half: one group per key of several chunks adds its partial rows in
// chunk order and writes the key's gradients.
template <int G, bool kVec>
__global__ void __launch_bounds__(kThreads) key_sum_kernel(AttentionGradParams gp, Layout lay) {
  const AttentionParams& p = gp.fwd;
  constexpr int kPerCta = kThreads / G;
  const Group<G> g;
  const int64_t kk = (int64_t)blockIdx.x * kPerCta + threadIdx.x / G;
  if (kk >= p.batch * lay.H * lay.Lk) return;
  const int64_t r0 = gp.key_partial_start[kk], r1 = gp.key_partial_start[kk + 1];
  if (r1 == r0) return;  // a key of one chunk: written by key_chunk_kernel
  const int64_t bh = kk / lay.Lk, j = kk % lay.Lk, b = bh / lay.H, h = bh % lay.H, W = lay.D + lay.Dv + 1;
  const int d0 = 4 * g.lane, D = (int)lay.D, Dv = (int)lay.Dv;
  float dk[4] = {0.f, 0.f, 0.f, 0.f}, dv[4] = {0.f, 0.f, 0.f, 0.f}, db = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = gp.key_partials + r * W;
    float x[4], y[4];
    load4<false>(row, d0, D, x);
    load4<false>(row + D, d0, Dv, y);
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[e] += x[e], dv[e] += y[e];
    db += row[D + Dv];
  }
  const float scale = (float)p.scale;
#pragma unroll
  for (int e = 0; e < 4; ++e) dk[e] *= scale;
  store4<kVec>((float*)gp.dk + lay.k(b, j, h), d0, D, dk);
  store4<kVec>((float*)gp.dv + lay.v(b, j, h), d0, Dv, dv);
  if (gp.dbias && g.lane == 0) ((float*)gp.dbias)[bh * lay.Lk + j] = db;
}

}  // namespace

void sparse_attention_backward_cuda(const AttentionGradParams& gp, DType dtype, void* stream) {
  const AttentionParams& p = gp.fwd;
  const Layout lay = layout_of(p);
  const int64_t BH = p.batch * p.nheads;
  if (BH * lay.L == 0) return;
  const auto s = (cudaStream_t)stream;
  const int G = attention_cuda_group(p.dim, p.vdim);
  const int64_t per = kThreads / G, nblk = cuda::ceil_div(lay.L, per), nkb = cuda::ceil_div(BH * lay.Lk, per);
  if (BH * nblk > 0x7fffffff || nkb > 0x7fffffff || cuda::ceil_div(gp.key_chunks, per) > 0x7fffffff)
    throw std::runtime_error("sparse_attention_backward_cuda: too many queries or keys for one launch");
  const bool smem = !gp.deterministic && attention_cuda_entries_in_smem(p);
  const size_t smem_bytes = smem ? size_t(per) * size_t(lay.K) * 2 * sizeof(float) : 0;
  if (!smem && lay.S * lay.K > 0 && gp.workspace == nullptr)
    throw std::runtime_error("sparse_attention_backward_cuda: the workspace is missing");
  HAX_DISPATCH_DTYPE(dtype, [&] {
    const int eb = (int)sizeof(scalar_t);
    const bool vec = rows_aligned(p.q, lay.D, eb) && rows_aligned(p.k, lay.D, eb) && rows_aligned(p.v, lay.Dv, eb) &&
                     rows_aligned(gp.dout, lay.Dv, eb) && rows_aligned(gp.dq, lay.D, eb) &&
                     rows_aligned(gp.dk, lay.D, 4) && rows_aligned(gp.dv, lay.Dv, 4);
    dispatch_group(G, [&](auto gc) {
      constexpr int kG = decltype(gc)::value;
      dispatch_bool(vec, [&](auto vc) {
        constexpr bool kV = decltype(vc)::value;
        if (gp.deterministic) {
          const auto kernel = query_pass_kernel<scalar_t, kG, kV, false>;
          cuda::allow_smem(kernel, smem_bytes, "sparse_attention_backward_cuda (queries)", kOverflowItemSmem);
          kernel<<<(unsigned)(BH * nblk), kThreads, smem_bytes, s>>>(gp, lay, nblk, BH * nblk, smem);
          cuda::check_launch("sparse_attention_backward_cuda (queries)");
          if (gp.key_chunks > 0) {
            key_chunk_kernel<scalar_t, kG, kV>
                <<<(unsigned)cuda::ceil_div(gp.key_chunks, per), kThreads, 0, s>>>(gp, lay);
            key_sum_kernel<kG, kV><<<(unsigned)nkb, kThreads, 0, s>>>(gp, lay);
          }
        } else {
          const int64_t grid = p.tile_count ? cuda::skip_grid(BH * nblk) : BH * nblk;
          const auto kernel = query_pass_kernel<scalar_t, kG, kV, true>;
          cuda::allow_smem(kernel, smem_bytes, "sparse_attention_backward_cuda (queries)", kOverflowItemSmem);
          kernel<<<(unsigned)grid, kThreads, smem_bytes, s>>>(gp, lay, nblk, BH * nblk, smem);
        }
      });
    });
  });
  cuda::check_launch("sparse_attention_backward_cuda");
}

}  // namespace hax::ops
