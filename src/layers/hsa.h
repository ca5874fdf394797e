// Hierarchical sparse attention (HSA; seed 003, DESIGN.md section 2).
//
// The sequence is cut into chunks of C tokens (64 in the seed). Every complete past chunk has a
// landmark, a summary vector computed from the chunk's inputs: the CLS output of a small
// bidirectional encoder over [CLS; the chunk's tokens] (the seed's choice), or a projection of the
// chunk's mean (the cheap option). Query i projects its input to a retrieval query, scores the
// landmarks of the chunks before its own (q_ret · landmark / sqrt(d_ret)), keeps the top k,
// turns those k scores into weights w by a softmax, attends inside each retrieved chunk
// separately (one softmax per chunk), and sums the k results with w:
//
//   out_i = Σ_{s=1..k} w_{i,s} · softmax_{j ∈ chunk c_s}(scale · q_i·k_j) v_j,   w_i = softmax(scores of c_1..c_k)
//
// Retrieval is trained end to end through w (the choice of chunks itself is discrete). No
// positional encoding is applied here (NoPE): the caller passes q, k, v without rotation.
// Every chunk is retrieved whole; queries of the first chunk of a sequence retrieve nothing and
// output 0. Memory O(L·k·C).
#pragma once
#include <torch/torch.h>

#include <string>

#include "layers/mixer.h"
#include "patterns/pattern.h"

namespace hax {

// The landmark of every chunk of a layout from the inputs x (B, L, d_in): (B, NC, d_ret), rows of
// missing chunks (start -1) hold whatever the missing positions give and are never retrieved.
class ChunkEncoder : public torch::nn::Module {
 public:
  // kind: "cls" (bidirectional encoder with a CLS token) or "mean" (projection of the chunk mean).
  ChunkEncoder(int64_t d_in, int64_t d_ret, const std::string& kind);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& start, int64_t chunk);

  torch::nn::Linear in_proj{nullptr};   // cls: d_in -> d_ret; mean: d_in -> d_ret (the landmark)
  torch::nn::Linear qkv{nullptr}, out{nullptr};  // cls: the encoder's attention (d_ret -> 3 d_ret, d_ret -> d_ret)
  at::Tensor cls, norm1, norm2;         // cls: (d_ret) the CLS embedding and the encoder's RMSNorm weights

 private:
  std::string kind_;
  int64_t d_ret_;
};

class HierarchicalSparseAttention : public torch::nn::Module {
 public:
  // d_in: width of the retrieval input x; d_ret: retrieval width (landmarks and retrieval
  // queries); chunk: C; topk: chunks per query; landmark: "cls" | "mean".
  HierarchicalSparseAttention(int64_t d_in, int64_t d_ret, int64_t chunk, int64_t topk, const std::string& landmark);

  // x (B, L, d_in), q, k (B, L, H, N), v (B, L, H, Dv) -> (B, L, H, Dv). seq_idx: packed sequences
  // (chunks restart at each sequence's start).
  // With lists_out, the attention lists (B, H, L, k, C) go there (for inspection).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& seq_idx, double scale, at::Tensor* lists_out = nullptr);

  // One decoding step at position state.pos (not advanced here): x (B, d_in), q (B, 1, H, N), and
  // every key and value so far including this token's, (B, t+1, H, N / Dv). Keeps the landmarks of
  // complete chunks and the inputs of the current chunk in `state`. Gives what forward gives.
  at::Tensor step(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  MixerState& state, double scale);

  // The chunks each query retrieves (B, L, k) int32 and their weights w (B, L, k) for inputs x.
  std::pair<at::Tensor, at::Tensor> retrieve(const at::Tensor& x, const at::Tensor& seq_idx);

  torch::nn::Linear ret_q{nullptr};  // d_in -> d_ret: the retrieval query
  std::shared_ptr<ChunkEncoder> encoder;

  int64_t chunk() const { return chunk_; }
  int64_t topk() const { return topk_; }

 private:
  // Chunks and weights for retrieval queries qr (B, Lq, d_ret) against landmarks (B, NC, d_ret).
  std::pair<at::Tensor, at::Tensor> select(const at::Tensor& qr, const at::Tensor& lm, const at::Tensor& lo,
                                           const at::Tensor& hi);
  int64_t d_ret_, chunk_, topk_;
};

}  // namespace hax
