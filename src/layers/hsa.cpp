#include "layers/hsa.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "layers/project.h"
#include "ops/attention/attention.h"
#include "ops/hsa_attention/hsa_attention.h"
#include "ops/rmsnorm/rmsnorm.h"

namespace hax {
namespace {

// A permutation of each row's queries (B, H, L) int32 that puts queries retrieving the same chunks
// next to each other (sorted by their chunk lists), so that the attention op computes them as
// tiles over shared keys. Speed only. chunks: (B, L, k) int32.
at::Tensor retrieval_order(const at::Tensor& chunks0, int64_t H) {
  if (chunks0.is_cuda()) {
    // On the device (nothing waits for it): stable sorts by each chunk column from the last to
    // the first give the lexicographic order, ties by position, as std::stable_sort does below.
    const int64_t B = chunks0.size(0), L = chunks0.size(1), k = chunks0.size(2);
    at::Tensor order = at::arange(L, chunks0.options().dtype(at::kLong)).unsqueeze(0).expand({B, L}).contiguous();
    for (int64_t j = k - 1; j >= 0; --j) {
      const at::Tensor key = chunks0.select(2, j).gather(1, order);
      order = order.gather(1, std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/1, /*descending=*/false)));
    }
    return order.to(at::kInt).unsqueeze(1).expand({B, H, L}).contiguous();
  }
  const at::Tensor chunks = chunks0.contiguous();
  const int64_t B = chunks.size(0), L = chunks.size(1), k = chunks.size(2);
  at::Tensor order = at::empty({B, L}, at::TensorOptions().dtype(at::kInt));
  const int32_t* c = chunks.data_ptr<int32_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int32_t* o = order.data_ptr<int32_t>() + b * L;
      std::iota(o, o + L, 0);
      const int32_t* cb = c + b * L * k;
      std::stable_sort(o, o + L, [&](int32_t x, int32_t y) {
        return std::lexicographical_compare(cb + x * k, cb + (x + 1) * k, cb + y * k, cb + (y + 1) * k);
      });
    }
  });
  return order.unsqueeze(1).expand({B, H, L}).contiguous();
}

}  // namespace

ChunkEncoder::ChunkEncoder(int64_t d_in, int64_t d_ret, const std::string& kind) : kind_(kind), d_ret_(d_ret) {
  HAX_CHECK(kind == "cls" || kind == "mean", "--hsa-landmark {} is unknown; choose cls or mean", kind);
  using torch::nn::Linear;
  using torch::nn::LinearOptions;
  in_proj = register_module("in_proj", Linear(LinearOptions(d_in, d_ret).bias(false)));
  if (kind == "cls") {
    qkv = register_module("qkv", Linear(LinearOptions(d_ret, 3 * d_ret).bias(false)));
    out = register_module("out", Linear(LinearOptions(d_ret, d_ret).bias(false)));
    cls = register_parameter("cls", at::randn({d_ret}) * 0.02);
    norm1 = register_parameter("norm1", at::ones({d_ret}));
    norm2 = register_parameter("norm2", at::ones({d_ret}));
  }
}

at::Tensor ChunkEncoder::forward(const at::Tensor& x, const at::Tensor& start, int64_t chunk) {
  const int64_t B = x.size(0), L = x.size(1), d = x.size(2), NC = start.size(1);
  if (NC == 0 || L == 0) return at::zeros({B, NC, d_ret_}, x.options());
  // The chunks' tokens (B, NC, C, d_in); missing chunks read clamped positions (never retrieved).
  const at::Tensor pos = (start.to(at::kLong).clamp_min(0).unsqueeze(-1) +
                          at::arange(chunk, at::TensorOptions().dtype(at::kLong).device(x.device())))
                             .clamp_max(L - 1);
  const at::Tensor xc = at::gather(x, 1, pos.view({B, NC * chunk, 1}).expand({B, NC * chunk, d})).view({B, NC, chunk, d});
  if (kind_ == "mean") return project(in_proj, xc.mean(2));
  // [CLS; tokens] through one pre-norm bidirectional attention layer; the landmark is CLS's output.
  const at::Tensor h = project(in_proj, xc);                                          // (B, NC, C, d_ret)
  const at::Tensor seq = at::cat({cls.view({1, 1, 1, d_ret_}).expand({B, NC, 1, d_ret_}), h}, 2);  // (B, NC, C+1, d_ret)
  const at::Tensor u = ops::rmsnorm(seq, at::Tensor(), norm1, 1e-5, 0);
  const auto parts = project(qkv, u).chunk(3, -1);
  const at::Tensor att = at::softmax(at::matmul(parts[0], parts[1].transpose(-1, -2)) / std::sqrt((double)d_ret_), -1);
  const at::Tensor y = seq + project(out, at::matmul(att, parts[2]));
  return ops::rmsnorm(y.select(2, 0).contiguous(), at::Tensor(), norm2, 1e-5, 0);
}

HierarchicalSparseAttention::HierarchicalSparseAttention(int64_t d_in, int64_t d_ret, int64_t chunk, int64_t topk,
                                                         const std::string& landmark)
    : d_ret_(d_ret), chunk_(chunk), topk_(topk) {
  ret_q = register_module("ret_q", torch::nn::Linear(torch::nn::LinearOptions(d_in, d_ret).bias(false)));
  encoder = register_module("encoder", std::make_shared<ChunkEncoder>(d_in, d_ret, landmark));
}

std::pair<at::Tensor, at::Tensor> HierarchicalSparseAttention::select(const at::Tensor& qr, const at::Tensor& lm,
                                                                      const at::Tensor& lo, const at::Tensor& hi) {
  const int64_t B = qr.size(0), Lq = qr.size(1), NC = lm.size(1);
  const at::Tensor chunks = patterns::top_k_chunks(qr, lm, lo, hi, topk_).to(qr.device());  // (B, Lq, k)
  if (NC == 0) return {chunks, at::zeros({B, Lq, topk_}, qr.options())};
  const at::Tensor valid = chunks >= 0;
  const at::Tensor c = chunks.to(at::kLong).clamp_min(0).view({B, Lq * topk_, 1}).expand({B, Lq * topk_, d_ret_});
  const at::Tensor sel = at::gather(lm, 1, c).view({B, Lq, topk_, d_ret_});
  at::Tensor s = (qr.unsqueeze(2) * sel).sum(-1) / std::sqrt((double)d_ret_);
  // Missing chunks get a finite, very low score (a row with none stays finite) and weight 0.
  s = s.masked_fill(valid.logical_not(), -1e30);
  return {chunks, at::softmax(s, -1) * valid.to(s.scalar_type())};
}

std::pair<at::Tensor, at::Tensor> HierarchicalSparseAttention::retrieve(const at::Tensor& x, const at::Tensor& seq_idx) {
  const patterns::ChunkLayout lay = patterns::chunk_layout(x.size(0), x.size(1), chunk_, seq_idx, x.device());
  return select(project(ret_q, x), encoder->forward(x, lay.start, chunk_), lay.lo, lay.hi);
}

at::Tensor HierarchicalSparseAttention::forward(const at::Tensor& x, const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const at::Tensor& seq_idx, double scale,
                                                at::Tensor* lists_out) {
  const int64_t B = x.size(0), L = x.size(1), H = q.size(2);
  const patterns::ChunkLayout lay = patterns::chunk_layout(B, L, chunk_, seq_idx, x.device());
  auto [chunks, w] = select(project(ret_q, x), encoder->forward(x, lay.start, chunk_), lay.lo, lay.hi);
  // CUDA in bfloat16 (or autocast): per-chunk tiles without lists (ops/hsa_attention).
  if (!lists_out && ops::hsa_attention_native(q, v, chunk_))
    return ops::hsa_attention(q, k, v, chunks, lay.start, w, chunk_, scale);
  const at::Tensor idx = patterns::chunk_lists(chunks, lay.start, chunk_, H);  // (B, H, L, k, C)
  const at::Tensor seg_w = w.unsqueeze(1).expand({B, H, L, topk_}).contiguous();
  if (lists_out) *lists_out = idx;
  return std::get<0>(ops::sparse_attention(q, k, v, idx, {}, seg_w, retrieval_order(chunks, H), scale));
}

at::Tensor HierarchicalSparseAttention::step(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys,
                                             const at::Tensor& values, MixerState& st, double scale) {
  const int64_t B = x.size(0), H = q.size(2), t = st.pos;
  const auto i32 = at::TensorOptions().dtype(at::kInt).device(x.device());
  // The chunks complete before this token's own chunk: exactly t / C of them are cached.
  const at::Tensor lm = st.landmarks.defined() ? st.landmarks : at::zeros({B, 0, d_ret_}, x.options());
  const int64_t NC = lm.size(1);
  const at::Tensor start = (at::arange(NC, i32) * chunk_).view({1, NC}).expand({B, NC}).contiguous();
  auto [chunks, w] = select(project(ret_q, x).unsqueeze(1), lm, at::zeros({B, 1}, i32), at::full({B, 1}, t / chunk_, i32));
  const at::Tensor idx = patterns::chunk_lists(chunks, start, chunk_, H);  // (B, H, 1, k, C)
  const at::Tensor seg_w = w.unsqueeze(1).expand({B, H, 1, topk_}).contiguous();
  at::Tensor out = std::get<0>(ops::sparse_attention(q, keys, values, idx, {}, seg_w, {}, scale));
  // This token's input joins its chunk; a completed chunk gets its landmark.
  const at::Tensor xi = x.detach().unsqueeze(1);
  st.chunk_inputs = st.chunk_inputs.defined() ? at::cat({st.chunk_inputs, xi}, 1) : xi;
  if (st.chunk_inputs.size(1) == chunk_) {
    const at::Tensor l = encoder->forward(st.chunk_inputs, at::zeros({B, 1}, i32), chunk_).detach();
    st.landmarks = st.landmarks.defined() ? at::cat({st.landmarks, l}, 1) : l;
    st.chunk_inputs = at::Tensor();
  }
  return out;
}

}  // namespace hax
