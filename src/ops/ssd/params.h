// Plain parameters of the SSD scan kernels and the CUDA launchers (no LibTorch: the .cu files
// include this). See ssd.h for the definition and cpu.cpp for the chunked algorithm.
#pragma once
#include <cstdint>

#include "ops/kernel_dtype.h"

namespace hax::ops {

// The CUDA kernels work on sub-chunks of at most kSsdSubChunk steps (one tile of a thread block):
// a chunk of Q <= 64 steps is one sub-chunk, a longer chunk is split into ceil(Q / 64) sub-chunks
// counted from its start (the last one shorter when 64 does not divide Q). The result does not
// depend on the chunking; only the saved chunk_states follow the requested chunk.
constexpr int64_t kSsdSubChunk = 64;

// a / b for a >= 0, b > 0. On the GPU a power-of-two b is a shift: a 64-bit division costs about 35
// instructions there (its 32-bit path included), and the kernels' block coordinates and sub-chunk
// geometry took a dozen of them per thread block (about a fifth of dx_kernel's instructions at
// L = 64K, ncu, H200, 2026-11-29). The sizes that divide are powers of two by default (chunk 64,
// heads and groups), so the other path is rare.
HAX_HOST_DEVICE inline int64_t ssd_div(int64_t a, int64_t b) {
#ifdef __CUDA_ARCH__
  if ((b & (b - 1)) == 0) return a >> (__ffsll(b) - 1);
#endif
  return a / b;
}
HAX_HOST_DEVICE inline int64_t ssd_mod(int64_t a, int64_t b) { return a - ssd_div(a, b) * b; }

// Raw-pointer parameters of the SSD kernels (all tensors contiguous, one dtype).
struct SsdParams {
  int64_t batch = 0, seqlen = 0, nheads = 0, headdim = 0, ngroups = 0, dstate = 0;
  int64_t chunk = 64;           // chunk length Q of the chunked algorithm
  const void* x = nullptr;      // (B, L, H, P)
  const void* dt = nullptr;     // (B, L, H), positive step sizes (softplus already applied)
  const void* A = nullptr;      // (H), negative decay rates
  const void* Bm = nullptr;     // (B, L, G, N)
  const void* Cm = nullptr;     // (B, L, G, N)
  const void* init_state = nullptr;  // (B, H, P, N) or null (zeros)
  const int32_t* seq_idx = nullptr;  // (B, L) non-decreasing sequence numbers, or null
  void* y = nullptr;            // out (B, L, H, P)
  void* final_state = nullptr;  // out (B, H, P, N)
  void* chunk_states = nullptr; // out (B, H, nchunks, N, P): state entering each chunk (for backward), x's dtype
  void* workspace = nullptr;    // CUDA only: scratch of ssd_cuda_workspace(*this, backward, ...) float32 entries
  float* prep = nullptr;        // CUDA only: ssd_cuda_prep_entries(*this) float32 entries for cs, decay and
                                // C B^T (SsdScratch), kept from the forward for the backward; null: in workspace
  bool prepped = false;         // CUDA backward: `prep` holds the forward's values (same inputs), so the
                                // backward does not compute them again
  bool wgmma = true;            // CUDA bfloat16 on sm_90a builds: chunk_scan, the local states and dB/dC
                                // on warpgroup products where their sizes allow (cuda/*_wgmma.cuh);
                                // false: mma.sync
  bool sweep = false;           // CUDA, where wgmma applies: the states by one sweep of local states and
                                // pass (cuda/segment_scan_wgmma.cuh); false: two kernels
  bool joint_dbdc = true;       // CUDA backward, where wgmma's dB/dC applies: one block for dB, dC and
                                // <dS, S> (cuda/dbdc_joint_wgmma.cuh), so that dx reads no S; false: dB
                                // and dC blocks apart, <dS, S> in dx

  HAX_HOST_DEVICE int64_t nchunks() const { return ssd_div(seqlen + chunk - 1, chunk); }
  // CUDA sub-chunks (see kSsdSubChunk): steps per full sub-chunk, sub-chunks per chunk, how many
  // there are in a row (only non-empty ones), and where sub-chunk s starts and how long it is.
  // A chunk of at most 64 steps is one sub-chunk (no division past nchunks).
  HAX_HOST_DEVICE int64_t sub_len() const { return chunk < kSsdSubChunk ? chunk : kSsdSubChunk; }
  HAX_HOST_DEVICE int64_t subs_per_chunk() const {
    return chunk <= kSsdSubChunk ? 1 : ssd_div(chunk + kSsdSubChunk - 1, kSsdSubChunk);
  }
  HAX_HOST_DEVICE int64_t nsubs() const {
    const int64_t nc = nchunks();
    if (nc == 0 || chunk <= kSsdSubChunk) return nc;
    const int64_t tail = seqlen - (nc - 1) * chunk;  // steps of the last chunk, 1..chunk
    return (nc - 1) * subs_per_chunk() + ssd_div(tail + kSsdSubChunk - 1, kSsdSubChunk);
  }
  HAX_HOST_DEVICE int64_t sub_start(int64_t s) const {
    if (chunk <= kSsdSubChunk) return s * chunk;
    const int64_t spc = subs_per_chunk(), c = ssd_div(s, spc);
    return c * chunk + (s - c * spc) * kSsdSubChunk;
  }
  HAX_HOST_DEVICE int64_t sub_size(int64_t s) const {
    const int64_t t0 = sub_start(s), left = seqlen - t0;
    const int64_t in_chunk = chunk <= kSsdSubChunk ? chunk : chunk - ssd_mod(s, subs_per_chunk()) * kSsdSubChunk;
    const int64_t n = in_chunk < left ? in_chunk : left;
    return n < sub_len() ? n : sub_len();
  }
};

// Gradient parameters: inputs of SsdParams plus the saved chunk states, dy and dfinal.
struct SsdGradParams {
  SsdParams fwd;                      // the forward's inputs and chunk_states (and, on CUDA, workspace)
  const void* dy = nullptr;           // (B, L, H, P)
  const void* dfinal = nullptr;       // (B, H, P, N) or null
  void* dx = nullptr;                 // out (B, L, H, P)
  void* ddt = nullptr;                // out (B, L, H)
  void* dA_part = nullptr;            // out (B, H): per-row partial dA, summed over B by the caller
                                      // (x's dtype on the CPU, float32 on CUDA)
  void* dB_head = nullptr;            // CPU out (B, L, H, N): per-head dB, summed over a group's heads by the caller
  void* dC_head = nullptr;            // CPU out (B, L, H, N)
  void* dB = nullptr;                 // CUDA out (B, L, G, N): dB summed over each group's heads in the kernel
  void* dC = nullptr;                 // CUDA out (B, L, G, N)
  void* dinit = nullptr;              // out (B, H, P, N) or null
};

// The CUDA kernels' scratch, carved from one workspace buffer, float32 except the states, which
// are stored in x's dtype (as chunk_states; the passes and products still run in float32). Per
// sub-chunk s of row b, head h (or group g):
struct SsdScratch {
  float* cs = nullptr;       // (B, H, S, 64): inclusive cumsum of dt A within the sub-chunk
  float* decay = nullptr;    // (B, H, S): the factor of the entering state in the leaving one
  float* cb = nullptr;       // (B, G, S, 64, 64): C_i . B_j
  void* states = nullptr;    // (B, H, S, N, P), x's dtype: state entering each sub-chunk; null where
                             // chunk_states holds them (one sub-chunk per chunk)
  void* dstates = nullptr;   // backward (B, H, S, N, P), x's dtype: gradient of the state leaving each sub-chunk
  float* dcb = nullptr;      // backward (B, G, S, 64, 64): d(C_i . B_j) summed over the group's heads
  float* rows = nullptr;     // backward (5, B, H, S, 64): per-step terms of d(cs): intra, v, u, x.dXd,
                             // and u's second part where it comes in two (cuda/grad_rows.cuh)
  float* dg = nullptr;       // backward (B, H, S): d(cs_last) from the entering state's decay
  float* dg2 = nullptr;      // backward (B, H, S): its part from columns 64..127 of N (the joint dB/dC)
  float* dA_sub = nullptr;   // backward (B, H, S): dA of each sub-chunk
  float* coef = nullptr;     // sweep (B, H, S, 64): the steps' factors in the local states (w dt or re)
  float* seg_agg = nullptr;  // sweep (B, H, P / 64, K, N, 64): each segment's run from zeros (thread order)
  float* seg_decay = nullptr;  // sweep (B, H, P / 64, K): the product of each segment's decays
  int64_t total = 0;         // float32 entries in all
};

// Lays the pieces cs, decay and cb out from `base` (null: only counts them) into s; returns their
// float32 entries. Pieces are 256-byte aligned, as in ssd_cuda_scratch.
inline int64_t ssd_cuda_prep_layout(const SsdParams& p, float* base, SsdScratch& s) {
  const int64_t S = p.nsubs(), BH = p.batch * p.nheads, BG = p.batch * p.ngroups, T = kSsdSubChunk;
  int64_t n = 0;
  auto take = [&](int64_t k) {
    float* at = base ? base + n : nullptr;
    n += (k + 63) / 64 * 64;
    return at;
  };
  s.cs = take(BH * S * T);
  s.decay = take(BH * S);
  s.cb = take(BG * S * T * T);
  return n;
}

// Segments K of a row in the CUDA sweep of states (cuda/segment_scan_wgmma.cuh), 1..S: about 256
// blocks (two an SM on an H100) over (row, head, 64 columns of P) and segments. Shapes only, so
// that results do not depend on the device.
inline int64_t ssd_segments(const SsdParams& p) {
  const int64_t per = p.batch * p.nheads * ((p.headdim + kSsdSubChunk - 1) / kSsdSubChunk), S = p.nsubs();
  if (per <= 0 || S <= 0) return 1;
  const int64_t k = 256 / per;
  return k < 1 ? 1 : k > S ? S : k;
}

// Float32 entries of cs, decay and cb (the size of p.prep).
inline int64_t ssd_cuda_prep_entries(const SsdParams& p) {
  SsdScratch s;
  return ssd_cuda_prep_layout(p, nullptr, s);
}

// Lays the scratch out from `base` (null: only counts the entries); state_bytes: the size of one
// entry of x's dtype (2 for bfloat16, 4 for float32). cs, decay and cb lie in p.prep when it is
// set (then not counted here), else at the start of `base`.
inline SsdScratch ssd_cuda_scratch(const SsdParams& p, bool backward, int64_t state_bytes, float* base) {
  SsdScratch s;
  const int64_t S = p.nsubs(), BH = p.batch * p.nheads, BG = p.batch * p.ngroups;
  const int64_t T = kSsdSubChunk, NP = p.dstate * p.headdim;
  auto take = [&](int64_t n) {
    float* at = base ? base + s.total : nullptr;
    s.total += (n + 63) / 64 * 64;  // 256-byte aligned pieces
    return at;
  };
  if (p.prep) ssd_cuda_prep_layout(p, p.prep, s);
  else s.total = ssd_cuda_prep_layout(p, base, s);  // (at the start of base: s.total was 0)
  const int64_t state_entries = (BH * S * NP * state_bytes + 3) / 4;  // in float32 entries
  if (p.subs_per_chunk() > 1) s.states = take(state_entries);
  if (backward) {
    s.dstates = take(state_entries);
    s.dcb = take(BG * S * T * T);
    s.rows = take(5 * BH * S * T);
    s.dg = take(BH * S);
    s.dg2 = take(BH * S);
    s.dA_sub = take(BH * S);
  }
  // The sweep's pieces where it is on and its sizes may apply (bfloat16, P and N multiples of 64,
  // N <= 128): about 8 MB at L = 64K, H = 16, P = 64, N = 128.
  if (p.sweep && state_bytes == 2 && p.headdim % T == 0 && p.dstate % T == 0 && p.dstate <= 2 * T) {
    const int64_t K = ssd_segments(p);
    s.coef = take(BH * S * T);
    s.seg_agg = take(BH * K * NP);
    s.seg_decay = take(BH * (p.headdim / T) * K);
  }
  return s;
}

// Float32 entries of workspace the CUDA forward (backward = false) or backward needs.
inline int64_t ssd_cuda_workspace(const SsdParams& p, bool backward, int64_t state_bytes) {
  return ssd_cuda_scratch(p, backward, state_bytes, nullptr).total;
}

// Thread blocks in the largest grid of the CUDA kernels: B S H (one a row, head and sub-chunk) or
// dB/dC's B S G tiles_n 2. Grids and the kernels' block coordinates (head_sub_of_block) are 32-bit,
// so the binding refuses a call where this reaches 2^31.
inline int64_t ssd_cuda_max_grid(const SsdParams& p) {
  const int64_t tiles_n = (p.dstate + kSsdSubChunk - 1) / kSsdSubChunk;
  const int64_t per_sub = p.nheads > 2 * p.ngroups * tiles_n ? p.nheads : 2 * p.ngroups * tiles_n;
  return p.batch * p.nsubs() * per_sub;
}

// CUDA kernels (float32 or bfloat16 storage, float32 math; bfloat16 runs its matrix products on
// tensor cores); `stream` is a cudaStream_t. dA_part is float32. No atomics: the backward is
// deterministic.
void ssd_forward_cuda(const SsdParams& p, DType dtype, void* stream);
void ssd_backward_cuda(const SsdGradParams& p, DType dtype, void* stream);

}  // namespace hax::ops
