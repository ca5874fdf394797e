// The fused scorer MLP (scorer_mlp.h) on warpgroup products (wgmma, sm_90a builds), for hidden 64
// or 128 and 2N a multiple of 64: the same three layers as scorer_mlp.cu's kernel, which serves
// every other size and non-Hopper builds.
//
// Why: scorer_mlp.cu's warps read every B fragment of W1 and W2 from shared memory by ldmatrix
// into registers for each 32 rows (64 KB a tile at hidden 128 and 2N 128), and those reads bound
// it (H100, L = 64K x 16 heads: 304 us a call). wgmma reads its shared operand straight into the
// tensor cores, for 64 rows at once.
//
// A block of up to kMaxGroups warpgroups (as many as shared memory holds) copies W1 and W2 into
// shared memory once, each as 64-column k blocks of 128-byte rows in the 128-byte swizzle that
// wgmma's descriptors read (ops/cuda/wgmma.cuh; 1024-byte aligned). Each warpgroup then takes
// tiles of 64 rows in turn (tile = global group index, stride = all groups of the grid):
//   1. the tile's inputs [k_r ; u_r] (64 x 2N) come by cp.async into the group's buffer, in the
//      same swizzled k blocks, the next tile's copy in flight while the current one is computed
//      (two buffers a group); a barrier of the group's 128 threads publishes them;
//   2. layer 1: acc = X W1^T by wgmma m64nHk16, both operands from shared memory;
//   3. h1 = relu(acc + b1) rounded to bfloat16, kept in registers: warp w's accumulator rows
//      16w..16w+15 are exactly the A fragments of layer 2's k steps (mma_bf16.cuh's c_to_a);
//   4. layer 2: acc = h1 W2^T by wgmma with A from registers, W2 from shared memory;
//   5. layer 3 in float32 as scorer_mlp.cu's: each thread's share of round(relu(acc + b2)) · w3
//      for its two rows, summed over the row's 4 threads, plus b3, rounded to bfloat16.
#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "ops/cuda/common.cuh"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/mma_bf16.cuh"
#include "ops/cuda/smem_align.cuh"
#include "ops/cuda/wgmma.cuh"
#include "ops/scorer_mlp/cuda/staging.cuh"
#include "ops/scorer_mlp/params.h"

namespace hax::ops {
namespace {

using bf16 = __nv_bfloat16;
using cuda::to_f32;

constexpr int kGroupThreads = 128;  // a warpgroup
constexpr int kMaxGroups = 4;       // warpgroups per block, fewer where their input tiles would not fit
constexpr int kRows = 64;           // rows per tile: wgmma's M
constexpr int kKBlock = 64;         // columns of a swizzled k block (128-byte rows)
constexpr size_t kMaxSmem = 227 * 1024;
constexpr size_t kAlign = 1024;     // swizzled tiles start 1024-byte aligned

// Shared memory of a block, in bytes from its 1024-aligned start: W1 as kb k blocks of hidden
// rows, W2 as hidden / 64 k blocks of hidden rows, then per group two input tiles of kb k blocks
// of 64 rows, then b1, b2, w3 (float32, hidden each). `bytes` includes the alignment slack.
struct WgLayout {
  int kb;                          // k blocks of an input row (2N / 64)
  size_t w2, x, bias, bytes;       // offsets of W2, of the input tiles, of b1; total
};
__host__ __device__ inline WgLayout wg_layout(int64_t half, int hidden, int groups) {
  WgLayout s;
  s.kb = (int)(2 * half / kKBlock);
  const size_t row = kKBlock * sizeof(bf16);  // 128 bytes
  s.w2 = (size_t)s.kb * hidden * row;
  s.x = s.w2 + (size_t)(hidden / kKBlock) * hidden * row;
  s.bias = s.x + (size_t)groups * 2 * s.kb * kRows * row;
  s.bytes = s.bias + 3 * (size_t)hidden * sizeof(float) + kAlign;
  return s;
}

// Element (r, c) of a matrix of `rows` rows stored as swizzled k blocks from `base`: k block
// c / 64, row r at 128 bytes a row, 16-byte chunk (c % 64) / 8 at chunk ((c % 64) / 8) ^ (r % 8).
__device__ __forceinline__ bf16* swizzled(bf16* base, int rows, int r, int c) {
  const int kb = c / kKBlock, ch = (c % kKBlock) / 8;
  return base + ((size_t)kb * rows + r) * kKBlock + ((ch ^ (r % 8)) * 8) + c % 8;
}

// A barrier of one warpgroup's 128 threads (named barrier 1 + group; 0 is __syncthreads').
__device__ __forceinline__ void group_barrier(int group) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group), "n"(kGroupThreads) : "memory");
}

// A tile's input chunks as one thread copies them: chunk i (< kIters) of thread tid is row
// row(i), columns col(i) .. + 7 of the tile's [k ; u]. With the row's chunk count CPR dividing
// the group's 128 threads, a thread keeps one column and steps by 128 / CPR rows.
template <int IN>
struct TileChunks {
  static constexpr int CPR = IN / 8;                           // 16-byte chunks of an input row
  static constexpr int kIters = kRows * CPR / kGroupThreads;  // chunks a thread copies a tile
  static_assert(kRows * CPR % kGroupThreads == 0, "a tile's chunks spread evenly over the group");
  static __device__ __forceinline__ int row(int tid, int i) {
    if constexpr (kGroupThreads % CPR == 0) return tid / CPR + i * (kGroupThreads / CPR);
    else return (tid + i * kGroupThreads) / CPR;
  }
  static __device__ __forceinline__ int col(int tid, int i) {
    if constexpr (kGroupThreads % CPR == 0) return (tid % CPR) * 8;
    else return ((tid + i * kGroupThreads) % CPR) * 8;
  }
};

// HID: the hidden width; IN = 2N: the input width (both known at compile time, so the copies'
// and the epilogues' indices are shifts and constants: the first form divided by a runtime 2N,
// 26 integer divisions in its loop, and issued 1330 warp instructions a tile; H100 ncu, pass 36).
template <int HID, int IN>
__global__ void __launch_bounds__(kGroupThreads * kMaxGroups, 1) scorer_mlp_wgmma_kernel(ScorerMlpParams p) {
  if constexpr (!cuda::kHaveWgmma) {
    __trap();  // (never launched: the host checks wgmma_built)
  } else {
    static_assert(HID == 64 || HID == 128, "wgmma's N is the hidden width: 64 or 128");
    static_assert(IN % kKBlock == 0 && IN <= kScorerMlpMaxIn, "2N: whole k blocks of 64");
    constexpr int NT = HID / 8, KS2 = HID / 16, KS1 = IN / 16, N = IN / 2;
    using Chunks = TileChunks<IN>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* smem = cuda::align_up<unsigned char>(smem_raw, 0, kAlign);  // (still known as shared memory)
    const int groups = blockDim.x / kGroupThreads;
    const WgLayout Ly = wg_layout(N, HID, groups);
    bf16* sW1 = reinterpret_cast<bf16*>(smem);
    bf16* sW2 = reinterpret_cast<bf16*>(smem + Ly.w2);
    float* sB1 = reinterpret_cast<float*>(smem + Ly.bias);
    float* sB2 = sB1 + HID;
    float* sW3 = sB2 + HID;
    const int group = threadIdx.x / kGroupThreads, tid = threadIdx.x % kGroupThreads;
    bf16* xbuf0 = reinterpret_cast<bf16*>(smem + Ly.x) + (size_t)group * 2 * (IN / kKBlock) * kRows * kKBlock;
    bf16* xbuf1 = xbuf0 + (size_t)(IN / kKBlock) * kRows * kKBlock;

    // The weights, once per block (16-byte chunks).
    const bf16 *W1 = (const bf16*)p.w1, *W2 = (const bf16*)p.w2;
    for (int c = threadIdx.x; c < HID * (IN / 8); c += blockDim.x) {
      const int r = c / (IN / 8), q = (c % (IN / 8)) * 8;
      cuda::cp_async16(swizzled(sW1, HID, r, q), W1 + (int64_t)r * IN + q, true);
    }
    for (int c = threadIdx.x; c < HID * (HID / 8); c += blockDim.x) {
      const int r = c / (HID / 8), q = (c % (HID / 8)) * 8;
      cuda::cp_async16(swizzled(sW2, HID, r, q), W2 + (int64_t)r * HID + q, true);
    }
    cuda::cp_async_commit();
    const float b3 = scorer_mlp_cuda::stage_biases(p, HID, sB1, sB2, sW3);

    // Copies the inputs of tile t (rows 64 t ..) into dst: column c of a row is k's while c < N,
    // then u's; rows past R are zeros.
    const bf16 *K = (const bf16*)p.k, *U = (const bf16*)p.u;
    auto issue = [&](int64_t t, bf16* dst) {
      const int64_t left = p.rows - t * kRows;  // rows of the tile that exist (>= 1)
      const bf16* k0 = K + t * kRows * N;
      const bf16* u0 = U + t * kRows * N;
#pragma unroll 2
      for (int i = 0; i < Chunks::kIters; ++i) {
        const int r = Chunks::row(tid, i), q = Chunks::col(tid, i);
        const bool ok = r < left;
        const bf16* src = q < N ? k0 + r * N + q : u0 + r * N + (q - N);
        cuda::cp_async16(swizzled(dst, kRows, r, q), ok ? src : K, ok);
      }
    };
    const int64_t tiles = (p.rows + kRows - 1) / kRows, stride = (int64_t)gridDim.x * groups;
    int64_t tile = (int64_t)blockIdx.x * groups + group;
    if (tile < tiles) issue(tile, xbuf0);
    cuda::cp_async_commit();
    cuda::cp_async_wait<0>();
    cuda::fence_proxy_async_shared();  // (the copies are generic-proxy writes; wgmma reads async)
    __syncthreads();                   // the weights, biases and first tiles are visible

    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, t2 = (lane & 3) * 2;
    const uint64_t dW1 = cuda::wgmma_desc_sw128(sW1), dW2 = cuda::wgmma_desc_sw128(sW2);
    // Descriptor k step ks of a matrix of `rows` rows in k blocks: block ks / 4 is rows · 128 bytes
    // further, and the step 32 bytes (2 in the descriptor's 16-byte units) into it.
    auto step = [](uint64_t d, int rows, int ks) {
      return d + (uint64_t)((ks / 4) * rows * kKBlock * (int)sizeof(bf16) / 16 + 2 * (ks % 4));
    };
    for (int it = 0; tile < tiles; ++it, tile += stride) {
      const bf16* cur = it & 1 ? xbuf1 : xbuf0;
      if (it > 0) {  // this tile's copy has landed, and the group is done with the previous tile
        cuda::cp_async_wait<0>();
        cuda::fence_proxy_async_shared();
        group_barrier(group);
      }
      if (tile + stride < tiles) issue(tile + stride, it & 1 ? xbuf0 : xbuf1);
      cuda::cp_async_commit();

      // Layer 1: acc = X W1^T over 2N.
      float acc[NT][4];
      const uint64_t dX = cuda::wgmma_desc_sw128(cur);
      cuda::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < KS1; ++ks) cuda::wgmma_k16<NT>(acc, step(dX, kRows, ks), step(dW1, HID, ks), ks > 0);
      cuda::wgmma_commit();
      cuda::wgmma_wait<0>();
      // h1 = relu(acc + b1) in bfloat16, as layer 2's A fragments (columns j*8 + t2, + 1).
      uint32_t h[KS2][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float2 c = *reinterpret_cast<const float2*>(sB1 + j * 8 + t2);
        h[j / 2][(j & 1) * 2] = cuda::mma::pack_bf16(fmaxf(acc[j][0] + c.x, 0.f), fmaxf(acc[j][1] + c.y, 0.f));
        h[j / 2][(j & 1) * 2 + 1] = cuda::mma::pack_bf16(fmaxf(acc[j][2] + c.x, 0.f), fmaxf(acc[j][3] + c.y, 0.f));
      }
      // Layer 2: acc = h1 W2^T.
      cuda::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < KS2; ++ks) cuda::wgmma_k16_rs<NT>(acc, h[ks], step(dW2, HID, ks), ks > 0);
      cuda::wgmma_commit();
      cuda::wgmma_wait<0>();
      // Layer 3: rows g and g + 8 of the warp's 16, h2 rounded to bfloat16 first (two columns a
      // conversion; a bfloat16 is a float's high half), summed in column order.
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float2 w = *reinterpret_cast<const float2*>(sW3 + j * 8 + t2);
        const float2 bias = *reinterpret_cast<const float2*>(sB2 + j * 8 + t2);
        const uint32_t r0 = cuda::mma::pack_bf16(fmaxf(acc[j][0] + bias.x, 0.f), fmaxf(acc[j][1] + bias.y, 0.f));
        const uint32_t r1 = cuda::mma::pack_bf16(fmaxf(acc[j][2] + bias.x, 0.f), fmaxf(acc[j][3] + bias.y, 0.f));
        s0 = fmaf(__uint_as_float(r0 << 16), w.x, s0);
        s0 = fmaf(__uint_as_float(r0 & 0xffff0000u), w.y, s0);
        s1 = fmaf(__uint_as_float(r1 << 16), w.x, s1);
        s1 = fmaf(__uint_as_float(r1 & 0xffff0000u), w.y, s1);
      }
      s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
      s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
      s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
      s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
      if ((lane & 3) == 0) {
        bf16* out = (bf16*)p.out;
        const int64_t r0 = tile * kRows + warp * 16 + g, r1 = r0 + 8;
        if (r0 < p.rows) out[r0] = __float2bfloat16(s0 + b3);
        if (r1 < p.rows) out[r1] = __float2bfloat16(s1 + b3);
      }
    }
    cuda::cp_async_wait<0>();  // no copy outlives the block
  }
}

// Whether this device runs kernels of this file built with wgmma (an sm_90a binary): the probe's
// static shared memory is kProbeWgmma bytes in such a binary and a quarter of it otherwise, and
// the runtime reports the size in the binary it picked for the device (no launch, nothing on a
// stream).
constexpr int kProbeWgmma = 1024;
__global__ void wgmma_probe_kernel(int* out) {
  constexpr int n = (cuda::kHaveWgmma ? kProbeWgmma : kProbeWgmma / 4) / (int)sizeof(int);
  __shared__ int s[n];
  s[threadIdx.x % n] = (int)threadIdx.x;
  __syncthreads();
  if (out) *out = s[(threadIdx.x + 1) % n];
}

// HAX_SCORER_WGMMA: unset or 1, this kernel where it applies; 0 keeps scorer_mlp.cu's (for comparisons).
bool wgmma_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("HAX_SCORER_WGMMA");
    if (!e) return true;
    const std::string v(e);
    if (v != "0" && v != "1")
      throw std::runtime_error("HAX_SCORER_WGMMA = '" + v + "' must be 0 (the mma.sync kernel) or 1 (wgmma where it applies)");
    return v == "1";
  }();
  return on;
}

// The launch shape for one 2N on one device (cached, with the kernel's shared-memory limit:
// cuda::LaunchShapeCache), with whether the device runs the wgmma binary.
struct WgShape {
  bool built = false;
  int groups = 1;
  int64_t fit = 1;  // resident blocks: per SM x SMs
};

// (One kernel per (HID, IN), so each has its own cache and shared-memory limit.)
template <int HID, int IN>
WgShape wg_shape() {
  constexpr int64_t half = IN / 2;
  static cuda::LaunchShapeCache<WgShape> shapes;
  return shapes.get(half, [&](int /*dev*/) {
    WgShape sh;
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, wgmma_probe_kernel) != cudaSuccess) (void)cudaGetLastError();
    else sh.built = attr.sharedSizeBytes >= (size_t)kProbeWgmma;
    if (!sh.built) return sh;
    sh.groups = kMaxGroups;
    while (sh.groups > 1 && wg_layout(half, HID, sh.groups).bytes > kMaxSmem) --sh.groups;
    const size_t bytes = wg_layout(half, HID, sh.groups).bytes;
    cuda::allow_smem(scorer_mlp_wgmma_kernel<HID, IN>, bytes, "scorer_mlp (wgmma)");
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, scorer_mlp_wgmma_kernel<HID, IN>, kGroupThreads * sh.groups, bytes);
    sh.fit = (int64_t)std::max(1, per_sm) * cuda::sm_count();
    return sh;
  });
}

template <int HID, int IN>
bool launch_wgmma(const ScorerMlpParams& p, cudaStream_t stream) {
  const WgShape sh = wg_shape<HID, IN>();
  if (!sh.built) return false;
  const int64_t tiles = (p.rows + kRows - 1) / kRows;
  const unsigned blocks = (unsigned)std::min(cuda::ceil_div(tiles, (int64_t)sh.groups), sh.fit);
  const size_t bytes = wg_layout(IN / 2, HID, sh.groups).bytes;
  scorer_mlp_wgmma_kernel<HID, IN><<<blocks, kGroupThreads * sh.groups, bytes, stream>>>(p);
  cuda::check_launch("scorer_mlp (wgmma)");
  return true;
}

// The kernel for 2N = IN of the hidden width HID.
template <int HID>
bool launch_for_width(const ScorerMlpParams& p, cudaStream_t s) {
  switch (2 * p.half) {
    case 64: return launch_wgmma<HID, 64>(p, s);
    case 128: return launch_wgmma<HID, 128>(p, s);
    case 192: return launch_wgmma<HID, 192>(p, s);
    case 256: return launch_wgmma<HID, 256>(p, s);
    default: return false;
  }
}
static_assert(kScorerMlpMaxIn == 256, "launch_for_width covers every 2N the kernel takes");

}  // namespace

bool scorer_mlp_wgmma_forward_cuda(const ScorerMlpParams& p, void* stream) {
  if (p.rows == 0 || (2 * p.half) % kKBlock != 0 || 2 * p.half > kScorerMlpMaxIn || !wgmma_enabled()) return false;
  const cudaStream_t s = (cudaStream_t)stream;
  if (p.hidden == 128) return launch_for_width<128>(p, s);
  if (p.hidden == 64) return launch_for_width<64>(p, s);
  return false;
}

}  // namespace hax::ops
