// DMA and HSA against dense float64 references written from the seeds' formulas: every query's
// selection by brute force (a full sort), an L x L masked softmax, per-chunk softmaxes fused with
// the retrieval weights, and autograd through all of it, so that the gradients into q, k, v,
// DMA's Δ and A, and HSA's retrieval query and landmark encoder are checked too.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <numeric>

#include "cuda_harness.h"
#include "layers/dma.h"
#include "layers/hsa.h"
#include "op_harness.h"
#include "ops/check.h"
#include "patterns/pattern.h"

using hax::testing::rel_err;

namespace {

// Positions of the top w values of row[0..n) (ties: the earlier position), by a full sort.
std::vector<int64_t> brute_top(const double* row, int64_t n, int64_t w) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
  order.resize(std::min(n, w));
  return order;
}

// Gradients of Σ <out, cot> with respect to `leaves` (undefined where none).
std::vector<at::Tensor> grads_of(const at::Tensor& out, const at::Tensor& cot, const std::vector<at::Tensor>& leaves) {
  for (auto& t : leaves) t.mutable_grad() = at::Tensor();
  if (out.requires_grad()) (out * cot).sum().backward();  // else (nothing retrieved) every gradient is 0
  std::vector<at::Tensor> g;
  for (auto& t : leaves) g.push_back(t.grad().defined() ? t.grad().clone() : at::zeros_like(t));
  return g;
}

// ---------------------------------------------------------------------------------------------
// DMA: out_i = softmax_{j ∈ top_w(δ over j <= i)}(scale q_i·k_j + δ_j) v_j, δ = exp(A softplus(v Δ)).

at::Tensor dma_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& delta_w,
                         const at::Tensor& A, int64_t w, double scale) {
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2);
  const at::Tensor delta = at::exp(at::softplus(at::matmul(v.reshape({B, L, -1}), delta_w.t())) * A);  // (B, L, H)
  at::Tensor mask = at::zeros({B, H, L, L}, at::kBool);
  const at::Tensor d = delta.detach().contiguous();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> row(L);
      for (int64_t j = 0; j < L; ++j) row[j] = d[b][j][h].item<double>();
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j : brute_top(row.data(), i + 1, w)) mask[b][h][i][j] = true;
    }
  at::Tensor s = at::einsum("bihd,bjhd->bhij", {q, k}) * scale + delta.permute({0, 2, 1}).unsqueeze(2);
  at::Tensor p = at::softmax(s.masked_fill(mask.logical_not(), -INFINITY), -1);
  return at::einsum("bhij,bjhd->bihd", {p, v});
}

TEST(Dma, ForwardAndBackwardEqualDenseReferenceFloat64) {
  for (int64_t L : {1, 63, 64, 65, 1025})
    for (int64_t w : {1, 5, 16}) {
      if (L == 1025 && w != 16) continue;
      torch::manual_seed(100 + L + w);
      const int64_t B = 2, H = 2, D = 8;
      hax::DynamicMaskWeights dma(H * D, H);
      dma.to(at::kDouble);
      {
        torch::NoGradGuard ng;
        dma.A.uniform_(0.5, 2.0);
      }
      auto opt = at::TensorOptions().dtype(at::kDouble);
      at::Tensor q = at::randn({B, L, H, D}, opt).requires_grad_(), k = at::randn({B, L, H, D}, opt).requires_grad_();
      at::Tensor v = at::randn({B, L, H, D}, opt).requires_grad_();
      const double scale = 1 / std::sqrt((double)D);
      at::Tensor out = hax::dma_attention(q, k, v, dma.forward(v.reshape({B, L, H * D})), w, {}, scale);
      at::Tensor cot = at::randn_like(out);
      std::vector<at::Tensor> leaves = {q, k, v, dma.delta->weight, dma.A};
      auto g = grads_of(out, cot, leaves);
      at::Tensor dw = dma.delta->weight.detach().clone().requires_grad_(), A = dma.A.detach().clone().requires_grad_();
      std::vector<at::Tensor> ref_leaves = {q, k, v, dw, A};
      at::Tensor ref = dma_reference(q, k, v, dw, A, w, scale);
      auto rg = grads_of(ref, cot, ref_leaves);
      EXPECT_LE(rel_err(out, ref, 1e-11, 1e-9), 1.0) << "L=" << L << " w=" << w;
      const char* names[] = {"q", "k", "v", "Δ", "A"};
      for (size_t i = 0; i < g.size(); ++i)
        EXPECT_LE(rel_err(g[i], rg[i], 1e-10, 1e-8), 1.0) << "gradient of " << names[i] << " L=" << L << " w=" << w;
      if (L > 1 && w > 1) {
        EXPECT_GT(g[4].abs().sum().item<double>(), 0) << "A gets no gradient";
      }
    }
}

TEST(Dma, EachHeadHasItsOwnMask) {
  torch::manual_seed(7);
  const int64_t B = 1, L = 40, H = 3;
  at::Tensor delta = at::rand({B, L, H}, at::kDouble);
  at::Tensor idx = hax::patterns::top_k_prefix(delta, 4, {}).idx;  // (B, H, L, 4)
  EXPECT_FALSE(idx.select(1, 0).equal(idx.select(1, 1)));
  EXPECT_FALSE(idx.select(1, 1).equal(idx.select(1, 2)));
}

// ---------------------------------------------------------------------------------------------
// HSA: landmarks from each chunk by the formulas, top-k chunks before the query's own chunk by
// a full sort, w = softmax of the k retrieval scores, a softmax inside each chunk, summed with w.

at::Tensor rms(const at::Tensor& x, const at::Tensor& wt) {
  return x / at::sqrt(x.pow(2).mean(-1, true) + 1e-5) * wt;
}

// Landmarks (NC, d_ret) of one row x (L, d_in), chunk by chunk.
at::Tensor landmarks_reference(const hax::ChunkEncoder& enc, const at::Tensor& x, int64_t C, bool cls) {
  const int64_t NC = x.size(0) / C, d_ret = enc.in_proj->weight.size(0);
  std::vector<at::Tensor> out;
  for (int64_t c = 0; c < NC; ++c) {
    at::Tensor xc = x.narrow(0, c * C, C);  // (C, d_in)
    if (!cls) {
      out.push_back(at::matmul(enc.in_proj->weight, xc.mean(0)));
      continue;
    }
    at::Tensor seq = at::cat({enc.cls.view({1, d_ret}), at::matmul(xc, enc.in_proj->weight.t())}, 0);  // (C+1, d_ret)
    at::Tensor qkv = at::matmul(rms(seq, enc.norm1), enc.qkv->weight.t());
    at::Tensor qq = qkv.narrow(1, 0, d_ret), kk = qkv.narrow(1, d_ret, d_ret), vv = qkv.narrow(1, 2 * d_ret, d_ret);
    at::Tensor y = seq + at::matmul(at::matmul(at::softmax(at::matmul(qq, kk.t()) / std::sqrt((double)d_ret), -1), vv),
                                    enc.out->weight.t());
    out.push_back(rms(y[0], enc.norm2));
  }
  return out.empty() ? at::zeros({0, d_ret}, x.options()) : at::stack(out);
}

at::Tensor hsa_reference(hax::HierarchicalSparseAttention& hsa, const at::Tensor& x, const at::Tensor& q,
                         const at::Tensor& k, const at::Tensor& v, bool cls, double scale) {
  const int64_t B = x.size(0), L = x.size(1), H = q.size(2), C = hsa.chunk(), NC = L / C;
  const int64_t d_ret = hsa.ret_q->weight.size(0);
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < B; ++b) {
    at::Tensor lm = landmarks_reference(*hsa.encoder, x[b], C, cls);                   // (NC, d_ret)
    at::Tensor score = at::matmul(at::matmul(x[b], hsa.ret_q->weight.t()), lm.t()) / std::sqrt((double)d_ret);  // (L, NC)
    at::Tensor sel = at::zeros({L, NC}, at::kBool);
    at::Tensor sd = score.detach().contiguous();
    for (int64_t i = 0; i < L; ++i)
      for (int64_t c : brute_top(sd.data_ptr<double>() + i * NC, i / C, hsa.topk())) sel[i][c] = true;
    at::Tensor wgt = at::softmax(score.masked_fill(sel.logical_not(), -INFINITY), -1);
    wgt = at::where(sel, wgt, at::zeros_like(wgt));  // rows without chunks: 0 (not NaN)
    std::vector<at::Tensor> heads;
    for (int64_t h = 0; h < H; ++h) {
      if (NC == 0) {
        heads.push_back(at::zeros({L, v.size(3)}, x.options()));
        continue;
      }
      at::Tensor s = at::matmul(q[b].select(1, h), k[b].select(1, h).narrow(0, 0, NC * C).t()) * scale;  // (L, NC*C)
      at::Tensor a = at::softmax(s.view({L, NC, C}), -1);                                       // per chunk
      at::Tensor p = (a * wgt.unsqueeze(-1)).view({L, NC * C});
      heads.push_back(at::matmul(p, v[b].select(1, h).narrow(0, 0, NC * C)));
    }
    rows.push_back(at::stack(heads, 1));  // (L, H, Dv)
  }
  return at::stack(rows);
}

TEST(Hsa, ForwardAndBackwardEqualDenseReferenceFloat64) {
  for (const char* landmark : {"cls", "mean"})
    for (int64_t L : {1, 63, 64, 65, 1025}) {
      const bool cls = std::string(landmark) == "cls";
      const int64_t C = L == 1025 ? 64 : 16, topk = 3, B = 2, H = 2, N = 6, Dv = 5, d_in = 7, d_ret = 9;
      torch::manual_seed(200 + L);
      hax::HierarchicalSparseAttention hsa(d_in, d_ret, C, topk, landmark);
      hsa.to(at::kDouble);
      {
        torch::NoGradGuard ng;
        for (auto& p : hsa.parameters()) p.copy_(at::randn_like(p) * 0.5);
      }
      auto opt = at::TensorOptions().dtype(at::kDouble);
      at::Tensor x = at::randn({B, L, d_in}, opt).requires_grad_();
      at::Tensor q = at::randn({B, L, H, N}, opt).requires_grad_(), k = at::randn({B, L, H, N}, opt).requires_grad_();
      at::Tensor v = at::randn({B, L, H, Dv}, opt).requires_grad_();
      const double scale = 0.4;
      at::Tensor out = hsa.forward(x, q, k, v, {}, scale);
      at::Tensor cot = at::randn_like(out);
      std::vector<at::Tensor> leaves = {x, q, k, v};
      for (auto& p : hsa.parameters()) leaves.push_back(p);
      auto g = grads_of(out, cot, leaves);
      at::Tensor ref = hsa_reference(hsa, x, q, k, v, cls, scale);
      auto rg = grads_of(ref, cot, leaves);
      EXPECT_LE(rel_err(out, ref, 1e-11, 1e-9), 1.0) << landmark << " L=" << L;
      auto names = hsa.named_parameters();
      for (size_t i = 0; i < g.size(); ++i)
        EXPECT_LE(rel_err(g[i], rg[i], 1e-10, 1e-8), 1.0)
            << landmark << " L=" << L << ": gradient of " << (i < 4 ? "x,q,k,v" : names[i - 4].key()) << " #" << i;
      if (L >= 4 * C) {  // queries retrieving 2+ chunks train the retrieval through w
        EXPECT_GT(hsa.ret_q->weight.grad().abs().sum().item<double>(), 0) << landmark;
        EXPECT_GT(hsa.encoder->in_proj->weight.grad().abs().sum().item<double>(), 0) << landmark;
      }
    }
}

TEST(Hsa, NeverRetrievesTheCurrentOrAFutureChunkAndStaysInItsSequence) {
  torch::manual_seed(3);
  const int64_t B = 2, L = 300, C = 8, D = 5, k = 4;
  at::Tensor seq = hax::testing::random_packing(B, L, 0.02);
  auto lay = hax::patterns::chunk_layout(B, L, C, seq);
  const int64_t NC = lay.start.size(1);
  at::Tensor chunks = hax::patterns::top_k_chunks(at::randn({B, L, D}), at::randn({B, NC, D}), lay.lo, lay.hi, k);
  int64_t retrieved = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i) {
      // i's sequence start, and the first position of i's own chunk.
      int64_t s = i;
      while (s > 0 && seq[b][s - 1].item<int>() == seq[b][i].item<int>()) --s;
      const int64_t own = s + (i - s) / C * C;
      int64_t n = 0;
      for (int64_t t = 0; t < k; ++t) {
        const int64_t c = chunks[b][i][t].item<int>();
        if (c < 0) continue;
        ++n, ++retrieved;
        const int64_t first = lay.start[b][c].item<int>();
        EXPECT_GE(first, s) << "chunk from another sequence";
        EXPECT_LE(first + C, own) << "query " << i << " retrieved a chunk that is not complete before its own";
      }
      EXPECT_EQ(n, std::min<int64_t>(k, (own - s) / C)) << "query " << i << " must retrieve every chunk it may, up to k";
    }
  EXPECT_GT(retrieved, 0);
}

TEST(Hsa, TopKChunksEqualsBruteForce) {
  torch::manual_seed(4);
  const int64_t B = 2, L = 97, C = 5, D = 3;
  auto lay = hax::patterns::chunk_layout(B, L, C, {});
  const int64_t NC = lay.start.size(1);
  at::Tensor qr = at::randn({B, L, D}, at::kDouble), lm = at::randn({B, NC, D}, at::kDouble);
  lm.select(1, 3).copy_(lm.select(1, 1));  // a tie: the earlier chunk must win
  for (int64_t k : {1, 2, 7}) {
    at::Tensor got = hax::patterns::top_k_chunks(qr, lm, lay.lo, lay.hi, k);
    at::Tensor scores = at::matmul(qr, lm.transpose(1, 2)).contiguous();  // (B, L, NC)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < L; ++i) {
        auto top = brute_top(scores.data_ptr<double>() + (b * L + i) * NC, i / C, k);
        std::sort(top.begin(), top.end());
        for (int64_t t = 0; t < k; ++t)
          ASSERT_EQ(got[b][i][t].item<int>(), t < (int64_t)top.size() ? top[t] : -1) << "b " << b << " i " << i;
      }
  }
}

TEST(Hsa, BadInputsNameTheTensor) {
  auto lay = hax::patterns::chunk_layout(1, 10, 4, {});
  hax::testing::expect_usage_error(
      [&] { hax::patterns::top_k_chunks(at::randn({1, 10, 3}), at::randn({1, 2, 4}), lay.lo, lay.hi, 2); },
      "landmarks");
  hax::testing::expect_usage_error([&] { hax::patterns::chunk_layout(1, 10, 0, {}); }, "chunk");
  hax::testing::expect_usage_error(
      [&] { hax::patterns::top_k_chunks(at::randn({1, 10, 3}), at::randn({1, 2, 3}), lay.hi, lay.lo, 2); }, "chunk range");
}

// ---------------------------------------------------------------------------------------------
// The pattern functions of DMA and HSA on a CUDA device equal the CPU's exactly.

// `got` (on the GPU) equals the CPU's `want`, with its dtype.
void expect_cuda_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  EXPECT_TRUE(got.is_cuda()) << what << " is on " << got.device().str();
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << what;
  EXPECT_TRUE(at::equal(got.cpu(), want)) << what;
}

TEST(Dma, CudaSelectionEqualsCpu) {
  HAX_REQUIRE_CUDA();
  hax::ops::set_poison_outputs(true);
  const at::Device gpu(at::kCUDA, 0);
  for (int64_t L : {1, 63, 97, 1025})
    for (int64_t w : {1, 5, 16, 64, 2000})
      for (bool packed : {false, true}) {
        torch::manual_seed(300 + L + w);
        // δ = exp(·) > 0, and rounded to few values so that ties are common.
        const at::Tensor delta = at::exp(at::round(at::randn({2, L, 3}) * 2) / 2);
        const at::Tensor seq = packed ? hax::testing::random_packing(2, L, 0.05) : at::Tensor();
        const at::Tensor want = hax::patterns::top_k_prefix(delta, w, seq).idx;
        expect_cuda_equal(hax::patterns::top_k_prefix(delta.to(gpu), w, seq.defined() ? seq.to(gpu) : seq).idx, want,
                          "L=" + std::to_string(L) + " w=" + std::to_string(w) + " packed=" + std::to_string(packed));
      }
  hax::ops::set_poison_outputs(false);
}

TEST(Hsa, CudaChunkLayoutTopKChunksAndListsEqualCpu) {
  HAX_REQUIRE_CUDA();
  hax::ops::set_poison_outputs(true);
  const at::Device gpu(at::kCUDA, 0);
  for (int64_t L : {1, 63, 97, 1025})
    for (int64_t C : {1, 5, 16, 64})
      for (bool packed : {false, true}) {
        torch::manual_seed(400 + L + C);
        const std::string at_ =
            "L=" + std::to_string(L) + " C=" + std::to_string(C) + " packed=" + std::to_string(packed);
        const int64_t B = 2, H = 3;
        const int64_t D = packed ? 6 : 16;  // (16: the kernels' 16-byte row loads; 6: element by element)
        const at::Tensor seq = packed ? hax::testing::random_packing(B, L, 0.03) : at::Tensor();
        const auto lay = hax::patterns::chunk_layout(B, L, C, seq);
        // On seq_idx's device, or on the one asked for.
        const auto glay =
            packed ? hax::patterns::chunk_layout(B, L, C, seq.to(gpu)) : hax::patterns::chunk_layout(B, L, C, seq, gpu);
        expect_cuda_equal(glay.start, lay.start, "start " + at_);
        expect_cuda_equal(glay.lo, lay.lo, "lo " + at_);
        expect_cuda_equal(glay.hi, lay.hi, "hi " + at_);
        const int64_t NC = lay.start.size(1);
        for (int64_t k : {1, 2, 3, 7, 50}) {
          // Small integers: every score is exact in any summation order, and ties are common.
          const at::Tensor qr = at::randint(-3, 4, {B, L, D}).to(at::kFloat);
          const at::Tensor lm = at::randint(-3, 4, {B, NC, D}).to(at::kFloat);
          const at::Tensor chunks = hax::patterns::top_k_chunks(qr, lm, lay.lo, lay.hi, k);
          const at::Tensor gchunks = hax::patterns::top_k_chunks(qr.to(gpu), lm.to(gpu), glay.lo, glay.hi, k);
          expect_cuda_equal(gchunks, chunks, "top_k_chunks k=" + std::to_string(k) + " " + at_);
          expect_cuda_equal(
              hax::patterns::top_k_chunks(qr.to(gpu, at::kBFloat16), lm.to(gpu, at::kBFloat16), glay.lo, glay.hi, k),
              chunks, "bfloat16 top_k_chunks k=" + std::to_string(k) + " " + at_);
          expect_cuda_equal(hax::patterns::chunk_lists(gchunks, glay.start, C, H),
                            hax::patterns::chunk_lists(chunks, lay.start, C, H), "chunk_lists " + at_);
        }
      }
  // A range outside [0, NC] names the query, as on the CPU (device values are checked on request:
  // the check reads back from the device).
  const auto lay = hax::patterns::chunk_layout(1, 10, 4, {}, gpu);
  const bool checks = hax::ops::check_device_values();
  hax::ops::set_check_device_values(true);
  hax::testing::expect_usage_error(
      [&] {
        hax::patterns::top_k_chunks(at::randn({1, 10, 3}, gpu), at::randn({1, 2, 3}, gpu), lay.hi, lay.lo, 2);
      },
      "chunk range");
  hax::ops::set_check_device_values(checks);
  hax::ops::set_poison_outputs(false);
}

}  // namespace
