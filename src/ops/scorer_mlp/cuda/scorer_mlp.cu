// The fused scorer MLP (scorer_mlp.h) on tensor cores: one launch, bfloat16 storage, float32
// accumulation.
//
// A block of up to kMaxWarps warps (as many as shared memory holds) copies W1 and W2 into shared
// memory once (cp.async), then each warp takes tiles of 32 rows in turn (tile = global warp
// index, stride = all warps of the grid). A tile is two 16-row mma blocks (m tiles): every B
// fragment of W1 or W2 that ldmatrix reads feeds one mma for each of them, so the weights are
// read from shared memory once per 32 rows instead of once per 16 (those reads, 64 KB per pass
// at hidden 128 and 2N 128, bound the kernel, not the tensor cores). Per tile:
//   1. the tile's inputs [k_r ; u_r] (32 x 2N) come by cp.async into the warp's buffer, the next
//      tile's copy in flight while the current one is computed (two buffers per warp; where two
//      would leave fewer warps than one, at large 2N, the warp has one buffer and copies the next
//      tile after computing the current one);
//   2. layer 1: acc = X W1^T by mma.m16n8k16 (A from the buffer by ldmatrix, B the rows of W1 by
//      ldmatrix, as stored: W1 is (out, in) with `in` contiguous), for both m tiles and at most
//      64 output columns at a time (kCols): two m tiles of all 128 columns would not fit the
//      registers next to h1;
//   3. h1 = relu(acc + b1) rounded to bfloat16: the accumulator fragments of two neighbouring
//      8-column tiles are exactly the A fragment of a 16-wide k step (mma_bf16.cuh), so h1 goes to
//      layer 2 in registers (hidden / 2 registers per thread for the two m tiles);
//   4. layer 2 the same way with W2, again up to 64 output columns at a time; each group of
//      columns goes at once (h2 = relu(acc + b2) rounded to bfloat16) into layer 3, so h2 is
//      never held whole;
//   5. layer 3 in float32: each thread's share of h2 · w3 for its four rows (two per m tile,
//      summed in column order as with one group), summed over the 4 threads of a row
//      (shuffles), plus b3, rounded to bfloat16 and stored.
// Sizes: 2N a multiple of 16 up to 256, hidden 16..128 (a template parameter). Hidden 64 or 128
// with 2N a multiple of 64 go to scorer_mlp_wgmma.cu's warpgroup kernel instead where the device
// runs the sm_90a build (305 -> 211 us a call on the H100 at 1M rows, hidden 128, 2N 128).
#include <algorithm>

#include "ops/cuda/common.cuh"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/mma_bf16.cuh"
#include "ops/scorer_mlp/cuda/staging.cuh"
#include "ops/scorer_mlp/params.h"

namespace hax::ops {
namespace {

using bf16 = __nv_bfloat16;
using cuda::to_f32;
namespace mma = cuda::mma;

constexpr int kMaxWarps = 8;          // warps per block, fewer where their input tiles would not fit
constexpr int kThreads = 32 * kMaxWarps;
constexpr size_t kMaxSmem = 227 * 1024;  // an H100's shared memory per block
constexpr int kRows = 32;             // rows per warp tile: two mma row blocks of 16
constexpr int kCols = 64;             // output columns of a layer computed at a time (at most)

// Shared memory of a block, in bytes from the start: W1 [hidden][2N + 8], W2 [hidden][hidden + 8]
// (bfloat16, rows padded by 8 so that ldmatrix's 8 rows fall on distinct bank groups), b1, b2, w3
// (float32, hidden each), then `bufs` input tiles [32][2N + 8] per warp.
struct SmemLayout {
  int ldi, ldh;                  // row strides (entries) of W1 and the input tiles, of W2
  int bufs;                      // input tiles per warp (2: the next one is copied during the current)
  size_t w2, bias, tiles, bytes;  // offsets of W2, of b1 (b2, w3 follow), of the tiles; total
};
__host__ __device__ inline SmemLayout smem_layout(int64_t half, int hidden, int warps, int bufs) {
  SmemLayout s;
  s.ldi = (int)(2 * half) + 8;
  s.ldh = hidden + 8;
  s.bufs = bufs;
  s.w2 = (size_t)hidden * s.ldi * sizeof(bf16);
  s.bias = s.w2 + (size_t)hidden * s.ldh * sizeof(bf16);
  s.tiles = s.bias + 3 * (size_t)hidden * sizeof(float);
  s.bytes = s.tiles + (size_t)warps * bufs * kRows * s.ldi * sizeof(bf16);
  return s;
}
// The layout of a block of `warps` warps: two tiles per warp where they fit, else one.
__host__ __device__ inline SmemLayout smem_layout(int64_t half, int hidden, int warps) {
  const SmemLayout two = smem_layout(half, hidden, warps, 2);
  return two.bytes <= kMaxSmem ? two : smem_layout(half, hidden, warps, 1);
}

// Zeroes the accumulators of a column group's mma tiles (two m tiles, CT 8-column tiles).
template <int CT>
__device__ __forceinline__ void zero_tiles(float (&acc)[2][CT][4]) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < CT; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
}

template <int HID>
__global__ void __launch_bounds__(kThreads) scorer_mlp_kernel(ScorerMlpParams p) {
  constexpr int CT = (HID < kCols ? HID : kCols) / 8;  // 8-column accumulator tiles of a column group
  constexpr int NG = HID / (8 * CT);                    // column groups of a hidden layer
  extern __shared__ __align__(16) unsigned char smem[];
  const int warps = blockDim.x >> 5;
  const SmemLayout L = smem_layout(p.half, HID, warps);
  const int N = (int)p.half, IN = 2 * N, ldi = L.ldi;
  constexpr int ldh = HID + 8;
  bf16* sW1 = reinterpret_cast<bf16*>(smem);
  bf16* sW2 = reinterpret_cast<bf16*>(smem + L.w2);
  float* sB1 = reinterpret_cast<float*>(smem + L.bias);
  float* sB2 = sB1 + HID;
  float* sW3 = sB2 + HID;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool dbl = L.bufs == 2;
  bf16* buf0 = reinterpret_cast<bf16*>(smem + L.tiles) + warp * L.bufs * kRows * ldi;
  bf16* buf1 = dbl ? buf0 + kRows * ldi : buf0;

  // The weights, once per block (16-byte chunks; IN and HID are multiples of 8).
  const bf16 *W1 = (const bf16*)p.w1, *W2 = (const bf16*)p.w2;
  for (int c = threadIdx.x; c < HID * (IN / 8); c += blockDim.x) {
    const int r = c / (IN / 8), q = (c % (IN / 8)) * 8;
    cuda::cp_async16(sW1 + r * ldi + q, W1 + (int64_t)r * IN + q, true);
  }
  for (int c = threadIdx.x; c < HID * (HID / 8); c += blockDim.x) {
    const int r = c / (HID / 8), q = (c % (HID / 8)) * 8;
    cuda::cp_async16(sW2 + r * ldh + q, W2 + (int64_t)r * HID + q, true);
  }
  cuda::cp_async_commit();
  const float b3 = scorer_mlp_cuda::stage_biases(p, HID, sB1, sB2, sW3);

  // Copies the inputs of tile t (rows 32 t ..) into dst: chunk q of a row is k's while q < N / 8,
  // then u's; rows past R are zeros.
  auto issue = [&](int64_t t, bf16* dst) {
    const int cpr = IN / 8;
    for (int c = lane; c < kRows * cpr; c += 32) {
      const int r = c / cpr, q = (c % cpr) * 8;
      const int64_t row = t * kRows + r;
      const bool ok = row < p.rows;
      cuda::cp_async16(dst + r * ldi + q, scorer_mlp_cuda::input_chunk(p, ok ? row : 0, q), ok);
    }
  };
  const int64_t tiles = (p.rows + kRows - 1) / kRows, stride = (int64_t)gridDim.x * warps;
  int64_t tile = (int64_t)blockIdx.x * warps + warp;
  if (tile < tiles) issue(tile, buf0);
  cuda::cp_async_commit();
  cuda::cp_async_wait<0>();
  __syncthreads();  // the weights and biases are visible to every warp

  const int g = lane >> 2, t2 = (lane & 3) * 2;
  // ldmatrix addresses: an A fragment (rows lane % 16, columns 8 (lane / 16)); the B fragments of
  // two neighbouring 8-column tiles (rows 8 ((lane / 16) % 2) + lane % 8, columns 8 ((lane / 8) % 2)).
  const int a_row = lane & 15, a_col = (lane >> 4) * 8;
  const int b_row = ((lane >> 4) & 1) * 8 + (lane & 7), b_col = ((lane >> 3) & 1) * 8;
  for (int it = 0; tile < tiles; ++it, tile += stride) {
    const bf16* cur = it & 1 ? buf1 : buf0;
    // Two buffers: the next tile's copy goes into the other one now. One: after this tile (below);
    // the empty group committed here keeps the wait below the same.
    if (dbl && tile + stride < tiles) issue(tile + stride, it & 1 ? buf0 : buf1);
    cuda::cp_async_commit();
    cuda::cp_async_wait<1>();
    __syncwarp();  // every lane's copies of the current tile are visible

    // Layer 1: acc = X W1^T for the m tiles m = 0, 1 (rows 16 m ..), one column group at a time;
    // h1 = relu(acc + b1) in bfloat16, as the A fragments of layer 2's k steps.
    uint32_t h[2][HID / 16][4];
#pragma unroll
    for (int cg = 0; cg < NG; ++cg) {
      float acc[2][CT][4];
      zero_tiles(acc);
      // (unrolled twice, except at hidden 64: ptxas then caps itself at 128 registers and spills)
#pragma unroll (HID == 64 ? 1 : 2)
      for (int kk = 0; kk < IN; kk += 16) {
        uint32_t a[2][4];
        mma::ldsm_x4<false>(a[0], cur + a_row * ldi + kk + a_col);
        mma::ldsm_x4<false>(a[1], cur + (16 + a_row) * ldi + kk + a_col);
#pragma unroll
        for (int j = 0; j < CT; j += 2) {
          uint32_t b[4];
          mma::ldsm_x4<false>(b, sW1 + (cg * CT * 8 + j * 8 + b_row) * ldi + kk + b_col);
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            mma::mma(acc[m][j], a[m], b[0], b[1]);
            mma::mma(acc[m][j + 1], a[m], b[2], b[3]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < CT; ++j) {
        const int jt = cg * CT + j;  // 8-column tile of the layer
        const float c0 = sB1[jt * 8 + t2], c1 = sB1[jt * 8 + t2 + 1];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          h[m][jt / 2][(jt & 1) * 2] = mma::pack_bf16(fmaxf(acc[m][j][0] + c0, 0.f), fmaxf(acc[m][j][1] + c1, 0.f));
          h[m][jt / 2][(jt & 1) * 2 + 1] =
              mma::pack_bf16(fmaxf(acc[m][j][2] + c0, 0.f), fmaxf(acc[m][j][3] + c1, 0.f));
        }
      }
    }
    // Layers 2 and 3, one column group at a time: acc = h1 W2^T, then rows g and g + 8 of each m
    // tile take their share of w3 · h2, h2 rounded to bfloat16 first (s[m][0], s[m][1]).
    auto round = [](float x) { return __bfloat162float(__float2bfloat16(x)); };
    float s[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
    for (int cg = 0; cg < NG; ++cg) {
      float acc[2][CT][4];
      zero_tiles(acc);
#pragma unroll
      for (int ks = 0; ks < HID / 16; ++ks) {
#pragma unroll
        for (int j = 0; j < CT; j += 2) {
          uint32_t b[4];
          mma::ldsm_x4<false>(b, sW2 + (cg * CT * 8 + j * 8 + b_row) * ldh + ks * 16 + b_col);
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            mma::mma(acc[m][j], h[m][ks], b[0], b[1]);
            mma::mma(acc[m][j + 1], h[m][ks], b[2], b[3]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < CT; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = (cg * CT + j) * 8 + t2 + e;
          const float w = sW3[c], bias = sB2[c];
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            s[m][0] = fmaf(round(fmaxf(acc[m][j][e] + bias, 0.f)), w, s[m][0]);
            s[m][1] = fmaf(round(fmaxf(acc[m][j][2 + e] + bias, 0.f)), w, s[m][1]);
          }
        }
    }
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        s[m][i] += __shfl_xor_sync(0xffffffffu, s[m][i], 1);
        s[m][i] += __shfl_xor_sync(0xffffffffu, s[m][i], 2);
      }
    if ((lane & 3) == 0) {
      bf16* out = (bf16*)p.out;
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int64_t r0 = tile * kRows + 16 * m + g, r1 = r0 + 8;
        if (r0 < p.rows) out[r0] = __float2bfloat16(s[m][0] + b3);
        if (r1 < p.rows) out[r1] = __float2bfloat16(s[m][1] + b3);
      }
    }
    __syncwarp();  // every lane is done with `cur` before a copy refills it
    if (!dbl) {
      if (tile + stride < tiles) issue(tile + stride, buf0);
      cuda::cp_async_commit();
    }
  }
  cuda::cp_async_wait<0>();  // no copy outlives the block
}

// The launch shape of scorer_mlp_kernel<HID> for one 2N on one device: warps a block and blocks
// that fit the GPU at once (cached, with the kernel's shared-memory limit: cuda::LaunchShapeCache).
struct LaunchShape {
  int warps = 1;
  int64_t fit = 1;  // resident blocks: per SM x SMs
};

template <int HID>
LaunchShape launch_shape(int64_t half) {
  static cuda::LaunchShapeCache<LaunchShape> shapes;
  return shapes.get(half, [&](int /*dev*/) {
    LaunchShape sh;
    sh.warps = kMaxWarps;  // the most warps that fit (with two input tiles each where they fit, else one)
    while (sh.warps > 1 && smem_layout(half, HID, sh.warps).bytes > kMaxSmem) --sh.warps;
    const size_t bytes = smem_layout(half, HID, sh.warps).bytes;
    cuda::allow_smem(scorer_mlp_kernel<HID>, bytes, "scorer_mlp");
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, scorer_mlp_kernel<HID>, 32 * sh.warps, bytes);
    sh.fit = (int64_t)std::max(1, per_sm) * cuda::sm_count();
    return sh;
  });
}

template <int HID>
void launch(const ScorerMlpParams& p, cudaStream_t stream) {
  const LaunchShape sh = launch_shape<HID>(p.half);
  const int warps = sh.warps, threads = 32 * warps;
  const SmemLayout L = smem_layout(p.half, HID, warps);
  const int64_t tiles = (p.rows + kRows - 1) / kRows;
  const int64_t want = cuda::ceil_div(tiles, warps), fit = sh.fit;
  const unsigned blocks = (unsigned)std::min(want, fit);
  scorer_mlp_kernel<HID><<<blocks, threads, L.bytes, stream>>>(p);
  cuda::check_launch("scorer_mlp");
}

}  // namespace

void scorer_mlp_forward_cuda(const ScorerMlpParams& p, void* stream) {
  if (p.rows == 0 || scorer_mlp_wgmma_forward_cuda(p, stream)) return;
  const cudaStream_t s = (cudaStream_t)stream;
  switch (p.hidden) {
    case 16: return launch<16>(p, s);
    case 32: return launch<32>(p, s);
    case 64: return launch<64>(p, s);
    case 128: return launch<128>(p, s);
    default: throw std::runtime_error("scorer_mlp: hidden = " + std::to_string(p.hidden) + " is not 16, 32, 64 or 128");
  }
}

}  // namespace hax::ops
