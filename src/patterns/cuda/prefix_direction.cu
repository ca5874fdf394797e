// Key Selection's query direction on the GPU: out[b, i, h] = normalize(Σ_{p = start..i} q[b, p, h]),
// start the first position of i's packed sequence, summed in float32 (the CPU's reference, in
// key_scorer.cpp, sums in double). A segmented scan along positions per (b, h), over chunks of
// T = p.chunk positions (64; 32 or 16 for small inputs, so that there are warps enough), in at
// most three launches:
//   chunk_totals_kernel  warp per (b, chunk, h): the chunk's sum since its last sequence start
//                        (read from that start on), into `totals`; and whether a sequence starts
//                        in the chunk (`resets`).
//   carry_kernel         (rows of more than kLookBack chunks) block per (b, h, kCarryCols columns):
//                        an exclusive segmented scan of the chunk sums, a thread per (column, run
//                        of consecutive chunks), the runs' folds joined in shared memory; `totals`
//                        then holds the running sum before each chunk (its carry).
//   direction_kernel     warp per (b, chunk, h): the carry (read, or with at most kLookBack chunks
//                        per row summed from `totals` back to the last chunk where a sequence
//                        starts), then the running sum position by position, reset at sequence
//                        starts; its norm by a warp sum; each position's direction in q's dtype.
// A row of one chunk needs the last kernel only (every carry is 0): 1, 2 or 3 launches, none of
// which waits on the host. Lanes own columns V·lane + 32·V·j (V = 2, one vector load, where N and
// q's strides are even) and load a batch of rows at once, without branches, the next batch in
// flight while one is used (without this, bfloat16 loads were consumed one by one and pass 1
// ran at a third of the bandwidth). Sequence starts are where seq changes from the previous
// position (or position 0), as in the CPU's segments(): two ballots over a chunk's positions give
// them as a bit mask.
#include "patterns/cuda/list_utils.cuh"

namespace hax::patterns {
namespace {

using ops::cuda::from_f32;
using ops::cuda::to_f32;
using ops::cuda::warp_sum;

constexpr int kWarps = 8;            // warps (chunks) per block of the chunk kernels
constexpr int kBatch = 8;            // chunk sums a lane loads at once in carry_kernel
constexpr int kCarryThreads = 512;   // threads per carry_kernel block
constexpr int kCarryCols = 8;        // columns per carry_kernel block (a 32-byte sector of each chunk's sums)
constexpr int64_t kLookBack = 128;   // the most chunks per row for which direction_kernel sums its carries

// Warp-wide: bit k set where position t0 + k (k < np <= 64) of row b starts a sequence.
__device__ __forceinline__ uint64_t chunk_starts(const PrefixDirectionParams& p, int64_t b, int64_t t0, int64_t np,
                                                 int lane) {
  auto starts = [&](int64_t k) {
    if (k >= np) return false;
    const int64_t i = t0 + k;
    return i == 0 || (p.seq != nullptr && p.seq[b * p.L + i] != p.seq[b * p.L + i - 1]);
  };
  const uint32_t lo = __ballot_sync(dev::kFullMask, starts(lane));
  const uint32_t hi = __ballot_sync(dev::kFullMask, starts(lane + 32));
  return (uint64_t)hi << 32 | lo;
}

// The first of a lane's j-th V columns (V consecutive ones, one vector load): V·lane + 32·V·j.
template <int V>
__device__ __forceinline__ int64_t col_of(int lane, int j) {
  return (int64_t)V * lane + 32 * V * j;
}

// V elements of T as one load (Raw) and as floats.
template <class T, int V>
struct Raw;
template <>
struct Raw<float, 1> {
  using type = float;
};
template <>
struct Raw<float, 2> {
  using type = float2;
};
template <>
struct Raw<__nv_bfloat16, 1> {
  using type = __nv_bfloat16;
};
template <>
struct Raw<__nv_bfloat16, 2> {
  using type = __nv_bfloat162;
};
__device__ __forceinline__ void unpack(float x, float* v) { v[0] = x; }
__device__ __forceinline__ void unpack(float2 x, float* v) { v[0] = x.x, v[1] = x.y; }
__device__ __forceinline__ void unpack(__nv_bfloat16 x, float* v) { v[0] = to_f32(x); }
__device__ __forceinline__ void unpack(__nv_bfloat162 x, float* v) {
  const float2 f = __bfloat1622float2(x);
  v[0] = f.x, v[1] = f.y;
}
__device__ __forceinline__ void store_vec(float* p, const float (&v)[1]) { *p = v[0]; }
__device__ __forceinline__ void store_vec(__nv_bfloat16* p, const float (&v)[1]) { *p = from_f32<__nv_bfloat16>(v[0]); }
__device__ __forceinline__ void store_vec(float* p, const float (&v)[2]) { *(float2*)p = make_float2(v[0], v[1]); }
__device__ __forceinline__ void store_vec(__nv_bfloat16* p, const float (&v)[2]) {
  *(__nv_bfloat162*)p = __floats2bfloat162_rn(v[0], v[1]);
}

// The lane's columns of one row of q, raw: no branch (a lane past N reads column 0), so that a
// batch of rows is in flight at once; unpacked to floats (0 past N) only when used.
template <class T, int J, int V>
struct Row {
  using R = typename Raw<T, V>::type;
  R raw[J];
  __device__ __forceinline__ void load(const T* row, int64_t N, int lane) {
#pragma unroll
    for (int j = 0; j < J; ++j) raw[j] = *(const R*)(row + (col_of<V>(lane, j) < N ? col_of<V>(lane, j) : 0));
  }
  __device__ __forceinline__ void unpack_to(float (&v)[J * V], int64_t N, int lane) const {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      unpack(raw[j], v + j * V);
      if (col_of<V>(lane, j) >= N)
#pragma unroll
        for (int e = 0; e < V; ++e) v[j * V + e] = 0.f;
    }
  }
};

// Rows i0 .. i0 + kRows - 1 of a warp's rows (base + i·stride), clamped to those before `end`,
// loaded at once: 8 rows, fewer for wide ones (registers).
template <class T, int J, int V>
struct Batch {
  static constexpr int kRows = J * V >= 8 ? 2 : J * V >= 4 ? 4 : 8;
  Row<T, J, V> r[kRows];
  __device__ __forceinline__ void load(const T* base, int64_t stride, int64_t i0, int64_t end, int64_t N, int lane) {
#pragma unroll
    for (int u = 0; u < kRows; ++u) r[u].load(base + (i0 + u < end ? i0 + u : end - 1) * stride, N, lane);
  }
};

// Chunk (b, c, h) of the warp-per-chunk kernels, t = (b·nC + c)·H + h: neighbouring warps read
// neighbouring heads of the same positions.
struct Chunk {
  int64_t b, c, h, t0, np;
};
__device__ __forceinline__ Chunk chunk_of(const PrefixDirectionParams& p, int64_t t, int64_t nC) {
  Chunk k;
  k.h = t % p.H, k.c = (t / p.H) % nC, k.b = t / (p.H * nC);
  k.t0 = k.c * p.chunk;
  k.np = p.L - k.t0 < p.chunk ? p.L - k.t0 : p.chunk;
  return k;
}

template <class T, int J, int V>
__global__ void __launch_bounds__(kWarps * 32) chunk_totals_kernel(PrefixDirectionParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t nC = prefix_chunks(p.L, p.chunk), n = p.B * nC * p.H;
  for (int64_t t = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32; t < n; t += (int64_t)gridDim.x * kWarps) {
    const Chunk k = chunk_of(p, t, nC);
    const uint64_t starts = chunk_starts(p, k.b, k.t0, k.np, lane);
    // The sum runs from the chunk's last sequence start (or its first position) to its end.
    const int64_t from = starts ? 63 - __clzll((long long)starts) : 0;
    const T* row = (const T*)p.q + k.b * p.q_sb + k.h * p.q_sh;
    float run[J * V] = {};
    const int64_t end = k.t0 + k.np;
    using Rows = Batch<T, J, V>;
    Rows cur, next;  // the next batch is in flight while this one is summed
    cur.load(row, p.q_sl, k.t0 + from, end, p.N, lane);
    for (int64_t i0 = k.t0 + from; i0 < end; i0 += Rows::kRows, cur = next) {
      if (i0 + Rows::kRows < end) next.load(row, p.q_sl, i0 + Rows::kRows, end, p.N, lane);
#pragma unroll
      for (int u = 0; u < Rows::kRows; ++u)
        if (i0 + u < end) {
          float v[J * V];
          cur.r[u].unpack_to(v, p.N, lane);
#pragma unroll
          for (int e = 0; e < J * V; ++e) run[e] += v[e];
        }
    }
    float* tot = p.totals + ((k.b * p.H + k.h) * nC + k.c) * p.N;
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int e = 0; e < V; ++e)
        if (col_of<V>(lane, j) + e < p.N) tot[col_of<V>(lane, j) + e] = run[j * V + e];
    if (k.h == 0 && lane == 0) p.resets[k.b * nC + k.c] = starts != 0;
  }
}

// Block per (b, h, group of kCarryCols columns): thread (g, col) = (threadIdx / C, threadIdx % C)
// scans its column over chunks [g·per, (g + 1)·per).
__global__ void __launch_bounds__(kCarryThreads) carry_kernel(PrefixDirectionParams p) {
  __shared__ float fold[kCarryThreads];  // (g, col): the group's chunks folded (the sum since their last start)
  __shared__ int reset[kCarryThreads];   // (g): a sequence starts in the group's chunks
  const int64_t nC = prefix_chunks(p.L, p.chunk), N = p.N;
  const int64_t C = N < kCarryCols ? N : kCarryCols, CG = (N + C - 1) / C;  // columns per block, blocks per (b, h)
  const int64_t G = kCarryThreads / C, g = threadIdx.x / C, col = threadIdx.x % C;
  const int64_t per = (nC + G - 1) / G;
  const int64_t c0 = g * per < nC ? g * per : nC, c1 = c0 + per < nC ? c0 + per : nC;  // empty past the last group
  for (int64_t w = blockIdx.x; w < p.B * p.H * CG; w += gridDim.x) {  // w = (b·H + h)·CG + column group
    const int64_t bh = w / CG, n = (w % CG) * C + col;
    const bool mine = g < G && n < N;
    float* tot = p.totals + bh * nC * N + n;
    const int32_t* rs = p.resets + (bh / p.H) * nC;
    // Chunks c..c+kBatch-1 (those below c1): their totals and whether a sequence starts in them.
    auto load = [&](int64_t c, float (&x)[kBatch], bool (&r)[kBatch]) {
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (c + u < c1) x[u] = tot[(c + u) * N], r[u] = rs[c + u] != 0;
    };
    float v = 0.f;  // the sum since the last sequence start in chunks [c0, c1)
    bool f = false;
    if (mine)
      for (int64_t c = c0; c < c1; c += kBatch) {
        float x[kBatch];
        bool r[kBatch];
        load(c, x, r);
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          if (c + u < c1) v = r[u] ? x[u] : v + x[u], f = f || r[u];
      }
    if (g < G) {
      fold[threadIdx.x] = v;
      if (col == 0) reset[g] = f;
    }
    __syncthreads();
    if (mine) {
      float run = 0.f;  // the running sum before chunk c0
      for (int64_t u = 0; u < g; ++u) run = reset[u] ? fold[u * C + col] : run + fold[u * C + col];
      for (int64_t c = c0; c < c1; c += kBatch) {
        float x[kBatch];
        bool r[kBatch];
        load(c, x, r);
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          if (c + u < c1) {
            tot[(c + u) * N] = run;
            run = r[u] ? x[u] : run + x[u];
          }
      }
    }
    __syncthreads();
  }
}

// The running sum before chunk c of (b, h) into run (the lane's columns), from `totals` (B, H, nC, N)
// as chunk_totals_kernel left them: Σ totals[r..c-1], r the last chunk before c in which a sequence
// starts (there is one: chunk 0 starts at position 0).
// Warp-wide: the last chunk before c (c > 0) of row b in which a sequence starts (there is one:
// chunk 0 starts at position 0).
__device__ __forceinline__ int64_t last_start_chunk(const PrefixDirectionParams& p, int64_t b, int64_t c, int64_t nC,
                                                    int lane) {
  const int32_t* rs = p.resets + b * nC;
  int64_t r = -1;
  for (int64_t top = c - 1; r < 0; top -= 32) {  // chunks top, top - 1, ..., a lane each
    const int64_t x = top - lane;
    const uint32_t hit = __ballot_sync(dev::kFullMask, x == 0 || (x > 0 && rs[x] != 0));
    if (hit) r = top - (__ffs(hit) - 1);
  }
  return r;
}

template <int J, int V>
__device__ __forceinline__ void look_back(const PrefixDirectionParams& p, int64_t b, int64_t h, int64_t c, int64_t nC,
                                          int lane, float (&run)[J * V]) {
  const int64_t r = last_start_chunk(p, b, c, nC, lane);
  const float* tot = p.totals + (b * p.H + h) * nC * p.N;
  using Rows = Batch<float, J, V>;
  for (int64_t c0 = r; c0 < c; c0 += Rows::kRows) {
    Rows x;
    x.load(tot, p.N, c0, c, p.N, lane);
#pragma unroll
    for (int u = 0; u < Rows::kRows; ++u)
      if (c0 + u < c) {
        float v[J * V];
        x.r[u].unpack_to(v, p.N, lane);
#pragma unroll
        for (int e = 0; e < J * V; ++e) run[e] += v[e];
      }
  }
}

// summed: the carries are summed from the chunk totals (look_back), else carry_kernel left them.
template <class T, int J, int V>
__global__ void __launch_bounds__(kWarps * 32) direction_kernel(PrefixDirectionParams p, bool summed) {
  const int lane = threadIdx.x % 32;
  const int64_t nC = prefix_chunks(p.L, p.chunk), n = p.B * nC * p.H;
  const float eps2 = p.eps * p.eps;
  for (int64_t t = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32; t < n; t += (int64_t)gridDim.x * kWarps) {
    const Chunk k = chunk_of(p, t, nC);
    const uint64_t starts = chunk_starts(p, k.b, k.t0, k.np, lane);
    float run[J * V] = {};
    if (k.c > 0 && !(starts & 1)) {  // the carry (else the chunk starts a sequence)
      if (summed) {
        look_back<J, V>(p, k.b, k.h, k.c, nC, lane, run);
      } else {
        Row<float, J, V> carry;
        carry.load(p.totals + ((k.b * p.H + k.h) * nC + k.c) * p.N, p.N, lane);
        carry.unpack_to(run, p.N, lane);
      }
    }
    const T* row = (const T*)p.q + k.b * p.q_sb + k.t0 * p.q_sl + k.h * p.q_sh;
    T* out = (T*)p.out + ((k.b * p.L + k.t0) * p.H + k.h) * p.N;
    using Rows = Batch<T, J, V>;
    Rows cur, next;  // the next batch is in flight while this one is written
    cur.load(row, p.q_sl, 0, k.np, p.N, lane);
    for (int64_t i0 = 0; i0 < k.np; i0 += Rows::kRows, cur = next) {
      if (i0 + Rows::kRows < k.np) next.load(row, p.q_sl, i0 + Rows::kRows, k.np, p.N, lane);
#pragma unroll
      for (int u = 0; u < Rows::kRows; ++u) {
        if (i0 + u >= k.np) break;  // warp-uniform
        float v[J * V];
        cur.r[u].unpack_to(v, p.N, lane);
        const bool reset = (starts >> (i0 + u)) & 1;
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < J * V; ++e) {
          run[e] = reset ? v[e] : run[e] + v[e];
          ss += run[e] * run[e];
        }
        // 1 / max(|run|, eps)
        const float inv = rsqrtf(fmaxf(warp_sum(ss), eps2));
        T* o = out + (i0 + u) * p.H * p.N;
#pragma unroll
        for (int j = 0; j < J; ++j) {
          float y[V];
#pragma unroll
          for (int e = 0; e < V; ++e) y[e] = run[j * V + e] * inv;
          if (col_of<V>(lane, j) < p.N) store_vec(o + col_of<V>(lane, j), y);
        }
      }
    }
  }
}

// ---- The grouped forms (rows of 16-byte aligned columns) ----
// G lanes per head (a power of two with G·V >= N), each over V = 16 / sizeof(T) columns with one
// 16-byte load a row, so a warp walks the positions of 32 / G heads at once and a head's norm is a
// sum over its G lanes (log2 G shuffles). The forms above spend a 5-step warp sum and ~40
// instructions on each (position, head) for 2 columns a lane; these spread that over 32 / G heads.
// A warp per (b, chunk, group of heads); the chunk totals and carries are those above.
constexpr int kGroupWarps = 4;  // warps per block of the grouped kernels
constexpr int kGroupRows = 8;   // rows a lane loads at once (the next batch in flight while one is used)

template <class T>
__device__ __forceinline__ void unpack16(const uint4& raw, float (&v)[16 / sizeof(T)]) {
  if constexpr (sizeof(T) == 4) {
    v[0] = __uint_as_float(raw.x), v[1] = __uint_as_float(raw.y), v[2] = __uint_as_float(raw.z), v[3] = __uint_as_float(raw.w);
  } else {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
      v[2 * e] = f.x, v[2 * e + 1] = f.y;
    }
  }
}
template <class T>
__device__ __forceinline__ uint4 pack16(const float (&v)[16 / sizeof(T)]) {
  if constexpr (sizeof(T) == 4) {
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * e], v[2 * e + 1]);
      w[e] = *reinterpret_cast<const uint32_t*>(&b);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// The lane's task of t = (b·nC + c)·nG + group: head group·(32 / G) + lane / G (on: a head, and
// columns col .. col + V - 1 within N).
template <class T, int G>
struct GroupChunk {
  static constexpr int V = 16 / sizeof(T), HW = 32 / G;
  HAX_HOST_DEVICE static int64_t groups(int64_t H) { return (H + HW - 1) / HW; }  // head groups of a (b, chunk)
  int64_t b, c, h, t0, np;
  int col;
  bool on;
  __device__ GroupChunk(const PrefixDirectionParams& p, int64_t t, int64_t nC, int lane) {
    const int64_t nG = groups(p.H), g = t % nG;
    c = (t / nG) % nC, b = t / (nG * nC);
    h = g * HW + lane / G, col = (lane % G) * V;
    on = h < p.H && col < p.N;
    t0 = c * p.chunk;
    np = p.L - t0 < p.chunk ? p.L - t0 : p.chunk;
  }
  // Rows i0 .. i0 + kGroupRows - 1 (clamped to those before `end`) of the lane's columns; zeros when off.
  __device__ __forceinline__ void load(uint4 (&r)[kGroupRows], const T* row, int64_t stride, int64_t i0,
                                       int64_t end) const {
#pragma unroll
    for (int u = 0; u < kGroupRows; ++u)
      r[u] = on ? *reinterpret_cast<const uint4*>(row + (i0 + u < end ? i0 + u : end - 1) * stride) : make_uint4(0, 0, 0, 0);
  }
};

template <class T, int G>
__global__ void __launch_bounds__(kGroupWarps * 32) chunk_totals_grouped_kernel(PrefixDirectionParams p) {
  using K = GroupChunk<T, G>;
  constexpr int V = K::V;
  const int lane = threadIdx.x % 32;
  const int64_t nC = prefix_chunks(p.L, p.chunk), n = p.B * nC * K::groups(p.H);
  for (int64_t t = (int64_t)blockIdx.x * kGroupWarps + threadIdx.x / 32; t < n; t += (int64_t)gridDim.x * kGroupWarps) {
    const K k(p, t, nC, lane);
    const uint64_t starts = chunk_starts(p, k.b, k.t0, k.np, lane);
    const int64_t from = starts ? 63 - __clzll((long long)starts) : 0, end = k.t0 + k.np;
    const T* row = (const T*)p.q + k.b * p.q_sb + (k.on ? k.h * p.q_sh + k.col : 0);
    float run[V] = {};
    uint4 cur[kGroupRows], next[kGroupRows];
    k.load(cur, row, p.q_sl, k.t0 + from, end);
    for (int64_t i0 = k.t0 + from; i0 < end; i0 += kGroupRows) {
      if (i0 + kGroupRows < end) k.load(next, row, p.q_sl, i0 + kGroupRows, end);
#pragma unroll
      for (int u = 0; u < kGroupRows; ++u)
        if (i0 + u < end) {
          float v[V];
          unpack16<T>(cur[u], v);
#pragma unroll
          for (int e = 0; e < V; ++e) run[e] += v[e];
        }
#pragma unroll
      for (int u = 0; u < kGroupRows; ++u) cur[u] = next[u];
    }
    if (k.on) {
      float* tot = p.totals + ((k.b * p.H + k.h) * nC + k.c) * p.N + k.col;
#pragma unroll
      for (int e = 0; e < V; e += 4) *reinterpret_cast<float4*>(tot + e) = make_float4(run[e], run[e + 1], run[e + 2], run[e + 3]);
    }
    if (t % K::groups(p.H) == 0 && lane == 0) p.resets[k.b * nC + k.c] = starts != 0;
  }
}

template <class T, int G>
__global__ void __launch_bounds__(kGroupWarps * 32) direction_grouped_kernel(PrefixDirectionParams p, bool summed) {
  using K = GroupChunk<T, G>;
  constexpr int V = K::V;
  const int lane = threadIdx.x % 32;
  const int64_t nC = prefix_chunks(p.L, p.chunk), n = p.B * nC * K::groups(p.H);
  const float eps2 = p.eps * p.eps;
  for (int64_t t = (int64_t)blockIdx.x * kGroupWarps + threadIdx.x / 32; t < n; t += (int64_t)gridDim.x * kGroupWarps) {
    const K k(p, t, nC, lane);
    const uint64_t starts = chunk_starts(p, k.b, k.t0, k.np, lane);
    float run[V] = {};
    if (k.c > 0 && !(starts & 1)) {  // the carry (else the chunk starts a sequence)
      const float* tot = p.totals + (k.b * p.H + (k.on ? k.h : 0)) * nC * p.N + k.col;
      // summed: the totals since the last chunk in which a sequence starts; else chunk c's carry
      const int64_t r = summed ? last_start_chunk(p, k.b, k.c, nC, lane) : k.c;
      if (k.on)
#pragma unroll 4
        for (int64_t c0 = r; c0 < (summed ? k.c : k.c + 1); ++c0)
#pragma unroll
          for (int e = 0; e < V; e += 4) {
            const float4 x = *reinterpret_cast<const float4*>(tot + c0 * p.N + e);
            run[e] += x.x, run[e + 1] += x.y, run[e + 2] += x.z, run[e + 3] += x.w;
          }
    }
    const T* row = (const T*)p.q + k.b * p.q_sb + k.t0 * p.q_sl + (k.on ? k.h * p.q_sh + k.col : 0);
    T* out = (T*)p.out + ((k.b * p.L + k.t0) * p.H + (k.on ? k.h : 0)) * p.N + k.col;
    uint4 cur[kGroupRows], next[kGroupRows];
    k.load(cur, row, p.q_sl, 0, k.np);
    for (int64_t i0 = 0; i0 < k.np; i0 += kGroupRows) {
      if (i0 + kGroupRows < k.np) k.load(next, row, p.q_sl, i0 + kGroupRows, k.np);
#pragma unroll
      for (int u = 0; u < kGroupRows; ++u) {
        if (i0 + u >= k.np) break;  // warp-uniform
        float v[V];
        unpack16<T>(cur[u], v);
        const bool reset = (starts >> (i0 + u)) & 1;
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          run[e] = reset ? v[e] : run[e] + v[e];
          ss += run[e] * run[e];
        }
#pragma unroll
        for (int o = G / 2; o > 0; o /= 2) ss += __shfl_xor_sync(dev::kFullMask, ss, o);
        const float inv = rsqrtf(fmaxf(ss, eps2));  // 1 / max(|run|, eps)
        float y[V];
#pragma unroll
        for (int e = 0; e < V; ++e) y[e] = run[e] * inv;
        if (k.on) *reinterpret_cast<uint4*>(out + (i0 + u) * p.H * p.N) = pack16<T>(y);
      }
#pragma unroll
      for (int u = 0; u < kGroupRows; ++u) cur[u] = next[u];
    }
  }
}

// The launches of either form: totals(grid) where there is more than one chunk, the carries for
// rows of more than kLookBack chunks, then direction(grid, summed); `warps` warps a block over
// `tasks` warp tasks.
template <class Totals, class Direction>
void launch_passes(const PrefixDirectionParams& p, cudaStream_t stream, int64_t tasks, int warps, Totals&& totals,
                   Direction&& direction) {
  const int64_t nC = prefix_chunks(p.L, p.chunk);
  const unsigned grid = dev::grid_for(tasks, warps);
  const bool summed = nC <= kLookBack;
  if (nC > 1) {
    totals(grid);
    ops::cuda::check_launch("prefix_direction (chunk totals)");
  }
  if (!summed) {
    const int64_t C = p.N < kCarryCols ? p.N : kCarryCols;
    carry_kernel<<<dev::grid_for(p.B * p.H * ((p.N + C - 1) / C), 1), kCarryThreads, 0, stream>>>(p);
    ops::cuda::check_launch("prefix_direction (carries)");
  }
  direction(grid, summed);
  ops::cuda::check_launch("prefix_direction");
}

template <class T, int G>
void launch_grouped(const PrefixDirectionParams& p, cudaStream_t stream) {
  const int64_t tasks = p.B * prefix_chunks(p.L, p.chunk) * GroupChunk<T, G>::groups(p.H);
  launch_passes(
      p, stream, tasks, kGroupWarps,
      [&](unsigned grid) { chunk_totals_grouped_kernel<T, G><<<grid, kGroupWarps * 32, 0, stream>>>(p); },
      [&](unsigned grid, bool summed) {
        direction_grouped_kernel<T, G><<<grid, kGroupWarps * 32, 0, stream>>>(p, summed);
      });
}

// The grouped forms apply where every row's columns start 16-byte aligned: N and q's strides
// multiples of V, q, out and the totals 16-byte aligned, and N <= 32 V. HAX_PREFIX_GROUPS=0 keeps
// the forms above (for comparisons).
template <class T>
bool try_grouped(const PrefixDirectionParams& p, cudaStream_t s) {
  static const int on = ops::cuda::env_switch("HAX_PREFIX_GROUPS", 1, 1, "0 lane pairs over a head's row, 1 grouped heads");
  constexpr int64_t V = 16 / sizeof(T);
  const bool fits = on && p.N % V == 0 && p.N <= 32 * V && p.q_sb % V == 0 && p.q_sl % V == 0 && p.q_sh % V == 0 &&
                    (uintptr_t)p.q % 16 == 0 && (uintptr_t)p.out % 16 == 0 && (uintptr_t)p.totals % 16 == 0;
  if (!fits) return false;
  const int64_t lanes = p.N / V;  // G: the power of two >= lanes
  if (lanes <= 1) launch_grouped<T, 1>(p, s);
  else if (lanes <= 2) launch_grouped<T, 2>(p, s);
  else if (lanes <= 4) launch_grouped<T, 4>(p, s);
  else if (lanes <= 8) launch_grouped<T, 8>(p, s);
  else if (lanes <= 16) launch_grouped<T, 16>(p, s);
  else launch_grouped<T, 32>(p, s);
  return true;
}

template <class T, int J, int V>
void launch(const PrefixDirectionParams& p, cudaStream_t stream) {
  launch_passes(
      p, stream, p.B * prefix_chunks(p.L, p.chunk) * p.H, kWarps,
      [&](unsigned grid) { chunk_totals_kernel<T, J, V><<<grid, kWarps * 32, 0, stream>>>(p); },
      [&](unsigned grid, bool summed) { direction_kernel<T, J, V><<<grid, kWarps * 32, 0, stream>>>(p, summed); });
}

// Lanes own pairs of columns (one vector load) where N, q's strides and its address allow.
template <class T>
void dispatch(const PrefixDirectionParams& p, cudaStream_t s) {
  if (try_grouped<T>(p, s)) return;
  const bool pairs = p.N % 2 == 0 && p.q_sb % 2 == 0 && p.q_sl % 2 == 0 && p.q_sh % 2 == 0 &&
                     (uintptr_t)p.q % (2 * sizeof(T)) == 0 && (uintptr_t)p.out % (2 * sizeof(T)) == 0;
  if (pairs) {
    if (p.N <= 64) launch<T, 1, 2>(p, s);
    else if (p.N <= 128) launch<T, 2, 2>(p, s);
    else launch<T, 4, 2>(p, s);
  } else {
    if (p.N <= 32) launch<T, 1, 1>(p, s);
    else if (p.N <= 64) launch<T, 2, 1>(p, s);
    else if (p.N <= 128) launch<T, 4, 1>(p, s);
    else launch<T, 8, 1>(p, s);
  }
}

}  // namespace

void prefix_direction_cuda(const PrefixDirectionParams& p, DType dtype, void* stream) {
  if (p.B * p.L * p.H * p.N == 0) return;
  if (p.N > kPrefixMaxN)
    throw std::runtime_error("prefix_direction: N = " + std::to_string(p.N) + " is above the kernels' " +
                             std::to_string(kPrefixMaxN));
  if (p.chunk < 1 || p.chunk > 64)
    throw std::runtime_error("prefix_direction: chunk = " + std::to_string(p.chunk) + " is not within [1, 64]");
  const cudaStream_t s = (cudaStream_t)stream;
  HAX_DISPATCH_DTYPE(dtype, [&] { dispatch<scalar_t>(p, s); });
}

}  // namespace hax::patterns
