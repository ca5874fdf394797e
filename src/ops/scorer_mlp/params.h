// Plain parameters of the fused scorer MLP kernel (no LibTorch: the .cu file includes this). See
// scorer_mlp.h for the definition.
#pragma once
#include <cstdint>

namespace hax::ops {

// bfloat16 tensors, all contiguous; k and u 16-byte aligned.
struct ScorerMlpParams {
  int64_t rows = 0;             // R: rows of k and u
  int64_t half = 0;             // N: entries of k_r (and of u_r); the MLP's input [k_r ; u_r] has 2N
  int64_t hidden = 0;           // width of both hidden layers
  const void* k = nullptr;      // (R, N)
  const void* u = nullptr;      // (R, N)
  const void* w1 = nullptr;     // (hidden, 2N)
  const void* b1 = nullptr;     // (hidden) or null (zeros)
  const void* w2 = nullptr;     // (hidden, hidden)
  const void* b2 = nullptr;     // (hidden) or null
  const void* w3 = nullptr;     // (hidden)
  const void* b3 = nullptr;     // (1) or null
  void* out = nullptr;          // out (R)
};

// The sizes the kernel takes: 2N a multiple of 16 and at most kScorerMlpMaxIn; hidden 16, 32, 64
// or 128.
constexpr int64_t kScorerMlpMaxIn = 256;
inline bool scorer_mlp_cuda_supports(int64_t half, int64_t hidden) {
  return half > 0 && (2 * half) % 16 == 0 && 2 * half <= kScorerMlpMaxIn &&
         (hidden == 16 || hidden == 32 || hidden == 64 || hidden == 128);
}

// The CUDA kernel; `stream` is a cudaStream_t.
void scorer_mlp_forward_cuda(const ScorerMlpParams& p, void* stream);
// Its warpgroup form (cuda/scorer_mlp_wgmma.cu), which scorer_mlp_forward_cuda takes first: hidden
// 64 or 128 and 2N a multiple of 64, on a device that runs the build's sm_90a binary, unless
// HAX_SCORER_WGMMA=0. Returns false (launching nothing) where it does not apply.
bool scorer_mlp_wgmma_forward_cuda(const ScorerMlpParams& p, void* stream);

}  // namespace hax::ops
