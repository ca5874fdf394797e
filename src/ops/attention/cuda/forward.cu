// CUDA forward of sparse attention over index lists; cpu.cpp is the reference and attention.h the
// definition.
//
// A group of G lanes (lanes.cuh; G = 4, 8, 16 or 32 by the head dims, so that 4·G >= max(D, Dv))
// computes one query of one (b, h): lane l holds dims 4l .. 4l+3 of q (pre-multiplied by
// scale·log2 e: scores live in base 2) and of the output accumulator. A CTA of 256 threads holds
// 256/G groups, which take consecutive queries in q_order (or in position order), so that keys
// shared by neighbouring queries (sliding windows, LSH buckets sorted by q_order) are read from
// L1/L2 rather than from memory; consecutive CTAs take consecutive query blocks of one (b, h).
//
// Per segment s, an online softmax over the listed keys: the group reads G list entries at once
// (one per lane, coalesced), then walks them kChunk = 4 at a time, each broadcast from its lane:
// the rows k_j and v_j of the chunk's valid keys are loaded together (8 loads in flight per lane),
// the 4 partial dot products are summed over the group by one interleaved butterfly, and
//   m' = max(m, x_1..x_4),  l = l·2^(m-m') + Σ 2^(x_u-m'),  acc = acc·2^(m-m') + Σ 2^(x_u-m') v_u.
// Padding (-1) costs nothing when a whole chunk is padding. At the end of the segment
// lse_s = (m + log2 l)·ln 2 (-inf when l = 0: no keys) and out += w_s/l · acc.
//
// Launch: B·H·ceil(L / (256/G)) work items of 256 threads, one CTA each (with a tile plan, fewer
// CTAs looping over them: cuda::skip_grid), no shared memory. kVec kernels (D and
// Dv multiples of 4, rows aligned) read and write each lane's 4 elements as one vector.
#include "ops/attention/cuda/lanes.cuh"

namespace hax::ops {
namespace {

using namespace attn;

// Work item `item` (a CTA's kThreads / G queries of one (b, h)): the forward of this group's query.
// Beside the tile path, forward_kernel calls it only for the items of overflowing blocks.
template <class T, int G, bool kVec>
__device__ __forceinline__ void forward_item(const AttentionParams& p, const Layout& lay, int64_t nblk, int64_t item) {
  constexpr int kQueries = kThreads / G;  // queries per item
  const Group<G> g;
  const int64_t bh = item / nblk;
  const int64_t r = (int64_t)(item % nblk) * kQueries + threadIdx.x / G;  // rank in q_order
  if (r >= lay.L) return;  // a whole group leaves: no collective of another group waits on it
  const int64_t b = bh / lay.H, h = bh % lay.H;
  const int64_t i = p.q_order ? p.q_order[bh * lay.L + r] : r;
  if (i < 0 || i >= lay.L) return;  // not a permutation entry (checked only with check_device_values)
  const int d0 = 4 * g.lane, D = (int)lay.D, Dv = (int)lay.Dv;

  float q[4];
  load4<kVec>((const T*)p.q + lay.q(b, i, h), d0, D, q);
  const float qscale = (float)p.scale * kLog2e;
#pragma unroll
  for (int e = 0; e < 4; ++e) q[e] *= qscale;
  const T* kp = (const T*)p.k;
  const T* vp = (const T*)p.v;
  const T* bias = p.bias ? (const T*)p.bias + bh * lay.Lk : nullptr;

  float o[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t s = 0; s < lay.S; ++s) {
    const int32_t* list = p.idx + lay.list(bh, i) + s * lay.K;
    float m = -INFINITY, l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t t0 = 0; t0 < lay.K; t0 += G) {
      const int32_t jl = t0 + g.lane < lay.K ? listed_key(list[t0 + g.lane], lay.Lk) : -1;
      if (!g.any(jl >= 0)) continue;
      for (int c0 = 0; c0 < G; c0 += kChunk) {
        int32_t j[kChunk];
        bool any = false;
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          j[u] = g.from(jl, c0 + u);
          any |= j[u] >= 0;
        }
        if (!any) continue;  // the same for the whole group (broadcast values)
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
        float x[kChunk];
#pragma unroll
        for (int u = 0; u < kChunk; ++u) x[u] = dot4(q, kr[u]);
        g.sum(x);
        float mx = m;
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          x[u] = j[u] >= 0 ? x[u] + (bias ? to_f32(bias[j[u]]) * kLog2e : 0.f) : -INFINITY;
          mx = fmaxf(mx, x[u]);
        }
        // At least one key is valid, so mx is finite (finite scores); m = -inf gives corr = 0.
        const float corr = exp2f(m - mx);
        l *= corr;
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] *= corr;
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          const float pu = exp2f(x[u] - mx);  // 0 for padding (x = -inf)
          l += pu;
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[e] += pu * vr[u][e];
        }
        m = mx;
      }
    }
    const int64_t sg = lay.seg(bh, i) + s;
    if (g.lane == 0) ((float*)p.lse)[sg] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
    if (l > 0.f) {
      const float f = (p.seg_w ? to_f32(((const T*)p.seg_w)[sg]) : 1.f) / l;
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] += f * acc[e];
    }
  }
  store4<kVec>((T*)p.out + lay.o(b, i, h), d0, Dv, o);
}

// Items blockIdx.x, + gridDim.x, ...: one CTA an item, or beside the tile path fewer CTAs
// (cuda::skip_grid) that run only the items of overflowing blocks (for_each_overflow_item).
template <class T, int G, bool kVec>
__global__ void __launch_bounds__(kThreads) forward_kernel(AttentionParams p, Layout lay, int64_t nblk, int64_t items) {
  if (p.tile_count)
    for_each_overflow_item<kThreads / G>(p.tile_count, p.tile_overflow, lay.L, nblk, items,
                                         [&](int64_t w) { forward_item<T, G, kVec>(p, lay, nblk, w); });
  else
    for (int64_t w = blockIdx.x; w < items; w += gridDim.x) forward_item<T, G, kVec>(p, lay, nblk, w);
}

}  // namespace

void sparse_attention_forward_cuda(const AttentionParams& p, DType dtype, void* stream) {
  const Layout lay = layout_of(p);
  const int64_t BH = p.batch * p.nheads;
  if (BH * lay.L == 0) return;
  const auto s = (cudaStream_t)stream;
  const int G = attention_cuda_group(p.dim, p.vdim);
  const int64_t nblk = cuda::ceil_div(lay.L, kThreads / G), items = BH * nblk;
  const int64_t grid = p.tile_count ? cuda::skip_grid(items) : items;
  if (grid > 0x7fffffff) throw std::runtime_error("sparse_attention_forward_cuda: too many queries for one launch");
  HAX_DISPATCH_DTYPE(dtype, [&] {
    const int eb = (int)sizeof(scalar_t);
    const bool vec = rows_aligned(p.q, lay.D, eb) && rows_aligned(p.k, lay.D, eb) && rows_aligned(p.v, lay.Dv, eb) &&
                     rows_aligned(p.out, lay.Dv, eb);
    dispatch_group(G, [&](auto gc) {
      dispatch_bool(vec, [&](auto vc) {
        forward_kernel<scalar_t, decltype(gc)::value, decltype(vc)::value>
            <<<(unsigned)grid, kThreads, 0, s>>>(p, lay, nblk, items);
      });
    });
  });
  cuda::check_launch("sparse_attention_forward_cuda");
}

}  // namespace hax::ops
