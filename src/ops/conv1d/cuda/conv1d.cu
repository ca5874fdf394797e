// CUDA kernels of the depthwise causal conv1d (channels-last (B, L, C)); cpu.cpp is the reference
// and conv1d.h the definition.
//
// Tiling: a block is 32 channels (threadIdx.x: a warp reads 32 consecutive channels of one
// position, coalesced) x kConv1dCudaRunsPerBlock runs (threadIdx.y); a thread owns one channel c
// of one batch row b and a run of kConv1dCudaRun consecutive positions [t0, t1). It walks its run
// with the last kW inputs in a register window (slot kW-1 the newest, slot kW-1-j the input j
// positions back) beside their sequence numbers, so each input is read once, plus the W-1 before
// the run. A tap counts only when its sequence number equals the output position's; positions
// before the row start read the initial state (zeros without one) and carry seq[0], so the
// initial state feeds only the row's first sequence. kW is a compile-time bound on the width
// (4, 8 or 16); the W taps in use are the slots kW-W .. kW-1.
//
// Forward: out_t = act(bias + Σ_k w_k in_{t-(W-1)+k}), the taps added oldest first as on the
// CPU. The final state (B, W-1, C): one thread per entry.
//
// Backward, with dpre_u = dout_u act'(pre_u) (pre_u recomputed): the thread walks u from t0 to
// t1+W-2, its run plus W-1 positions of look-ahead whose dpre it recomputes, keeping the last kW
// dpre values in registers beside the inputs. When dpre_{s+W-1} is known, position s = u-(W-1)
// is complete:
//   dx_s            = Σ_{j<W} w_{W-1-j} dpre_{s+j} [same sequence as s]   (s in the run)
//   dinit_{W-1+s}   = the same sum for s < 0                                (the run at t0 = 0)
// and for u in the run dweight_k += dpre_u in_{u-(W-1)+k}, dbias += dpre_u. Each block adds its
// runs' dweight/dbias in order (shared memory) into one (W+1, C) float32 partial per (row, block
// of positions) in the workspace; a fixed tree of 32-way sums adds the partials and a last
// kernel casts them into dweight and dbias (deterministic, no atomics).
#include <climits>
#include <stdexcept>
#include <string>

#include "ops/conv1d/params.h"
#include "ops/cuda/common.cuh"

namespace hax::ops {
namespace {

using cuda::from_f32;
using cuda::to_f32;

constexpr int kRun = (int)kConv1dCudaRun;
constexpr int kRuns = (int)kConv1dCudaRunsPerBlock;
constexpr int64_t kPos = kConv1dCudaPositionsPerBlock;
constexpr int kChannels = 32;      // channels per block (threadIdx.x)
constexpr int kNoSeq = INT_MIN;    // sequence number of the look-ahead past the row's end
constexpr int kFan = 32;           // partials added per thread and level of the fixed tree

__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

// Channel c of batch row b: where its inputs come from.
template <class T>
struct Column {
  const T* x;          // &x[b, 0, c], position stride C
  const T* init;       // &init_state[b, 0, c] or null, position stride C
  const int32_t* seq;  // &seq_idx[b, 0] or null
  int64_t C, W;
  // The input at position s (-(W-1) <= s < L) and its sequence number.
  __device__ __forceinline__ void load(int64_t s, float& v, int& q) const {
    if (s >= 0) {
      v = to_f32(x[s * C]);
      q = seq ? seq[s] : 0;
    } else {
      v = init ? to_f32(init[(W - 1 + s) * C]) : 0.f;
      q = seq ? seq[0] : 0;
    }
  }
};

template <class T>
__device__ __forceinline__ Column<T> column_of(const Conv1dParams& p, int64_t b, int64_t c) {
  const int64_t L = p.seqlen, C = p.channels, W = p.width;
  Column<T> col;
  col.x = (const T*)p.x + b * L * C + c;
  col.init = p.init_state ? (const T*)p.init_state + b * (W - 1) * C + c : nullptr;
  col.seq = p.seq_idx ? p.seq_idx + b * L : nullptr;
  col.C = C, col.W = W;
  return col;
}

// The window before position t0: slot kW-1-j holds position t0-1-j (j < W-1); unused slots are 0.
template <class T, int kW>
__device__ __forceinline__ void fill_window(const Column<T>& col, int64_t t0, int64_t W, float (&win)[kW],
                                            int (&sq)[kW]) {
#pragma unroll
  for (int j = 0; j < kW; ++j) {
    win[kW - 1 - j] = 0.f;
    sq[kW - 1 - j] = kNoSeq;
    if (j < W - 1) col.load(t0 - 1 - j, win[kW - 1 - j], sq[kW - 1 - j]);
  }
}

template <int kW, class V>
__device__ __forceinline__ void shift(V (&a)[kW]) {
#pragma unroll
  for (int i = 0; i + 1 < kW; ++i) a[i] = a[i + 1];
}

// Forward-tap weights by window slot: wf[i] = weight[c, i-(kW-W)] for the W slots in use, else 0.
// Backward-tap weights: wb[i] = weight[c, kW-1-i] (slot i is i-(kW-W) positions after the slot
// kW-W that dx_s is computed for).
template <class T, int kW>
__device__ __forceinline__ void load_weights(const Conv1dParams& p, int64_t c, float (&wf)[kW], float (&wb)[kW]) {
  const T* w = (const T*)p.weight + c * p.width;
  const int64_t W = p.width;
#pragma unroll
  for (int i = 0; i < kW; ++i) {
    const bool used = i >= kW - W;
    wf[i] = used ? to_f32(w[i - (kW - W)]) : 0.f;
    wb[i] = used ? to_f32(w[kW - 1 - i]) : 0.f;
  }
}

// bias + Σ of the taps in the newest position's sequence, oldest first (the CPU's order).
template <int kW>
__device__ __forceinline__ float pre_activation(const float (&wf)[kW], const float (&win)[kW], const int (&sq)[kW],
                                                int64_t W, float bias) {
  float acc = bias;
  const int q = sq[kW - 1];
#pragma unroll
  for (int i = 0; i < kW; ++i)
    if (i >= kW - W && sq[i] == q) acc += wf[i] * win[i];
  return acc;
}

template <class T, int kW>
__global__ void __launch_bounds__(kChannels* kRuns) forward_kernel(Conv1dParams p, int64_t pos_blocks) {
  const int64_t L = p.seqlen, C = p.channels, W = p.width;
  const int64_t b = blockIdx.x / pos_blocks, pb = blockIdx.x % pos_blocks;
  const int64_t c = (int64_t)blockIdx.y * kChannels + threadIdx.x;
  const int64_t t0 = pb * kPos + (int64_t)threadIdx.y * kRun;
  if (c >= C || t0 >= L) return;
  const int64_t t1 = min(L, t0 + (int64_t)kRun);
  const Column<T> col = column_of<T>(p, b, c);
  float wf[kW], wb[kW], win[kW];
  int sq[kW];
  load_weights<T, kW>(p, c, wf, wb);
  const float bias = p.bias ? to_f32(((const T*)p.bias)[c]) : 0.f;
  fill_window<T, kW>(col, t0, W, win, sq);
  T* out = (T*)p.out + b * L * C + c;
  for (int64_t t = t0; t < t1; ++t) {
    shift(win), shift(sq);
    col.load(t, win[kW - 1], sq[kW - 1]);
    const float pre = pre_activation<kW>(wf, win, sq, W, bias);
    out[t * C] = from_f32<T>(p.silu ? pre * sigmoid(pre) : pre);
  }
}

// final_state[b, j, c] = input at s = L-(W-1)+j when it belongs to the row's last sequence, else 0.
template <class T>
__global__ void final_state_kernel(Conv1dParams p) {
  const int64_t L = p.seqlen, C = p.channels, W = p.width;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.batch * (W - 1) * C) return;
  const int64_t c = idx % C, j = (idx / C) % (W - 1), b = idx / ((W - 1) * C);
  const int64_t s = L - (W - 1) + j;
  const int32_t* seq = p.seq_idx ? p.seq_idx + b * L : nullptr;
  float v = 0.f;
  if (s >= 0) {
    if (!seq || seq[s] == seq[L - 1]) v = to_f32(((const T*)p.x)[(b * L + s) * C + c]);
  } else if (p.init_state && (!seq || L == 0 || seq[0] == seq[L - 1])) {
    v = to_f32(((const T*)p.init_state)[(b * (W - 1) + (W - 1) + s) * C + c]);
  }
  ((T*)p.final_state)[idx] = from_f32<T>(v);
}

template <class T, int kW>
__global__ void __launch_bounds__(kChannels* kRuns)
    backward_kernel(Conv1dGradParams gp, int64_t pos_blocks, float* partial) {
  const Conv1dParams& p = gp.fwd;
  const int64_t L = p.seqlen, C = p.channels, W = p.width;
  const int64_t b = blockIdx.x / pos_blocks, pb = blockIdx.x % pos_blocks;
  const int64_t c = (int64_t)blockIdx.y * kChannels + threadIdx.x;
  const int64_t t0 = pb * kPos + (int64_t)threadIdx.y * kRun;
  // dweight / dbias of this thread's run, by window slot (slot kW-W+k is tap k).
  float dws[kW], db = 0.f;
#pragma unroll
  for (int i = 0; i < kW; ++i) dws[i] = 0.f;

  if (c < C && t0 < L) {  // no early return: the whole block meets at the reduction below
    const int64_t t1 = min(L, t0 + (int64_t)kRun);
    const Column<T> col = column_of<T>(p, b, c);
    float wf[kW], wb[kW], win[kW], dp[kW];
    int sq[kW];
    load_weights<T, kW>(p, c, wf, wb);
    const float bias = p.bias ? to_f32(((const T*)p.bias)[c]) : 0.f;
    fill_window<T, kW>(col, t0, W, win, sq);
#pragma unroll
    for (int i = 0; i < kW; ++i) dp[i] = 0.f;  // dpre of positions before the run: never read
    const T* dout = (const T*)gp.dout + b * L * C + c;
    T* dx = (T*)gp.dx + b * L * C + c;
    T* dinit = (t0 == 0 && gp.dinit) ? (T*)gp.dinit + b * (W - 1) * C + c : nullptr;
    for (int64_t u = t0; u < t1 + W - 1; ++u) {
      shift(win), shift(sq), shift(dp);
      if (u < L) {
        col.load(u, win[kW - 1], sq[kW - 1]);
        const float pre = pre_activation<kW>(wf, win, sq, W, bias);
        float g = to_f32(dout[u * C]);
        if (p.silu) {
          const float sg = sigmoid(pre);
          g *= sg * (1.f + pre * (1.f - sg));
        }
        dp[kW - 1] = g;
        if (u < t1) {
          db += g;
#pragma unroll
          for (int i = 0; i < kW; ++i)
            if (i >= kW - W && sq[i] == sq[kW - 1]) dws[i] += g * win[i];
        }
      } else {  // past the row's end: no output, so no gradient
        win[kW - 1] = 0.f, sq[kW - 1] = kNoSeq, dp[kW - 1] = 0.f;
      }
      // Position s = u-(W-1) (window slot kW-W) now has every dpre it feeds.
      const int64_t s = u - (W - 1);
      if (s >= t0 || (dinit && s < 0)) {
        int qs = sq[0];
#pragma unroll
        for (int i = 1; i < kW; ++i)
          if (i == kW - W) qs = sq[i];
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < kW; ++i)
          if (i >= kW - W && sq[i] == qs) acc += wb[i] * dp[i];
        if (s >= t0)
          dx[s * C] = from_f32<T>(acc);
        else
          dinit[(W - 1 + s) * C] = from_f32<T>(acc);
      }
    }
  }

  // The block's partial: Σ over its runs (threadIdx.y in order) per channel, for each tap k (slot
  // kW-W+k) and then the bias (k = W).
  __shared__ float red[kRuns][kChannels];
  float* part = partial + (b * pos_blocks + pb) * (W + 1) * C;
#pragma unroll
  for (int i = 0; i <= kW; ++i) {
    if (i < kW && i < kW - W) continue;  // unused slot (the condition is the same for the whole block)
    red[threadIdx.y][threadIdx.x] = i < kW ? dws[i] : db;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
      float acc = 0.f;
#pragma unroll
      for (int y = 0; y < kRuns; ++y) acc += red[y][threadIdx.x];
      const int64_t k = i < kW ? i - (kW - W) : W;
      part[k * C + c] = acc;
    }
    __syncthreads();
  }
}

// One level of the fixed summation tree over K partials of I floats each (parts (K, I)): for every
// group of kFan partials `step` apart, starting at k0 = group * step * kFan, parts[k0] = Σ of the
// group in order.
__global__ void sum_level_kernel(float* parts, int64_t K, int64_t I, int64_t step) {
  const int64_t groups = (K + step * kFan - 1) / (step * kFan);
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= groups * I) return;
  const int64_t i = idx % I, k0 = (idx / I) * step * kFan;
  float acc = 0.f;
  for (int q = 0; q < kFan; ++q) {
    const int64_t k = k0 + q * step;
    if (k >= K) break;
    acc += parts[k * I + i];
  }
  parts[k0 * I + i] = acc;
}

// dweight[c, k] = total[k, c], dbias[c] = total[W, c] (total: the summed (W+1, C) partial).
template <class T>
__global__ void finish_kernel(const float* total, int64_t C, int64_t W, T* dweight, T* dbias) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (W + 1) * C) return;
  const int64_t k = idx / C, c = idx % C;
  if (k < W)
    dweight[c * W + k] = from_f32<T>(total[idx]);
  else if (dbias)
    dbias[c] = from_f32<T>(total[idx]);
}

// Grid of the run kernels: (batch rows x position blocks, channel tiles).
dim3 run_grid(const Conv1dParams& p, int64_t pos_blocks, const char* what) {
  const int64_t x = p.batch * pos_blocks, y = cuda::ceil_div(p.channels, kChannels);
  if (x > INT_MAX || y > 65535)
    throw std::runtime_error(std::string(what) + ": the tensors are too large for one launch (B " +
                             std::to_string(p.batch) + ", L " + std::to_string(p.seqlen) + ", C " +
                             std::to_string(p.channels) + ")");
  return dim3((unsigned)x, (unsigned)y);
}

// Calls f(std::integral_constant<int, kW>) with the smallest supported kW >= W.
template <class F>
void dispatch_width(int64_t W, F&& f) {
  if (W <= 4) return f(std::integral_constant<int, 4>{});
  if (W <= 8) return f(std::integral_constant<int, 8>{});
  if (W <= kConv1dCudaMaxWidth) return f(std::integral_constant<int, 16>{});
  throw std::invalid_argument("conv1d: kernel width W = " + std::to_string(W) + " exceeds the CUDA kernels' maximum " +
                              std::to_string(kConv1dCudaMaxWidth));
}

}  // namespace

void conv1d_forward_cuda(const Conv1dParams& p, DType dtype, void* stream) {
  const auto s = (cudaStream_t)stream;
  const int64_t pos_blocks = cuda::ceil_div(p.seqlen, kPos);
  if (p.batch * p.seqlen * p.channels > 0) {
    const dim3 grid = run_grid(p, pos_blocks, "conv1d_forward_cuda");
    dispatch_width(p.width, [&](auto kw) {
      constexpr int kW = decltype(kw)::value;
      HAX_DISPATCH_DTYPE(dtype, [&] {
        forward_kernel<scalar_t, kW><<<grid, dim3(kChannels, kRuns), 0, s>>>(p, pos_blocks);
      });
    });
    cuda::check_launch("conv1d_forward_cuda");
  }
  const int64_t nfinal = p.batch * (p.width - 1) * p.channels;
  if (p.final_state && nfinal > 0) {
    HAX_DISPATCH_DTYPE(dtype, [&] {
      final_state_kernel<scalar_t><<<(unsigned)cuda::ceil_div(nfinal, 256), 256, 0, s>>>(p);
    });
    cuda::check_launch("conv1d_forward_cuda (final state)");
  }
}

void conv1d_backward_cuda(const Conv1dGradParams& gp, DType dtype, void* stream) {
  const Conv1dParams& p = gp.fwd;
  if (p.batch * p.seqlen * p.channels == 0) return;  // the binding fills the empty case
  const auto s = (cudaStream_t)stream;
  const int64_t pos_blocks = cuda::ceil_div(p.seqlen, kPos);
  float* partial = (float*)gp.workspace;  // (B * pos_blocks, W+1, C), see conv1d_cuda_workspace
  const dim3 grid = run_grid(p, pos_blocks, "conv1d_backward_cuda");
  dispatch_width(p.width, [&](auto kw) {
    constexpr int kW = decltype(kw)::value;
    HAX_DISPATCH_DTYPE(dtype, [&] {
      backward_kernel<scalar_t, kW><<<grid, dim3(kChannels, kRuns), 0, s>>>(gp, pos_blocks, partial);
    });
  });
  cuda::check_launch("conv1d_backward_cuda (dx)");
  const int64_t K = p.batch * pos_blocks, I = (p.width + 1) * p.channels;
  for (int64_t step = 1; step < K; step *= kFan) {
    const int64_t groups = cuda::ceil_div(K, step * kFan);
    sum_level_kernel<<<(unsigned)cuda::ceil_div(groups * I, 256), 256, 0, s>>>(partial, K, I, step);
  }
  HAX_DISPATCH_DTYPE(dtype, [&] {
    finish_kernel<scalar_t><<<(unsigned)cuda::ceil_div(I, 256), 256, 0, s>>>(partial, p.channels, p.width,
                                                                             (scalar_t*)gp.dweight,
                                                                             (scalar_t*)gp.dbias);
  });
  cuda::check_launch("conv1d_backward_cuda (dweight)");
}

}  // namespace hax::ops
