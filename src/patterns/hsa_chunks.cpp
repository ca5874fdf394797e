// HSA's chunk retrieval: the chunk layout of packed rows, each query's top-k past chunks by
// retrieval score, and the attention lists of the retrieved chunks.
//
// top_k_chunks takes the queries that may retrieve the same chunks (those of one chunk of one
// sequence) as a block: their scores against those chunks' landmarks are one small matrix
// product (block x chunks), and each query keeps its k best. Memory per block, never L x NC.
// On CUDA: chunk_layout by LibTorch ops and top_k_chunks by cuda/top_k_chunks.cu (cuda_paths.cpp);
// chunk_lists is LibTorch ops on any device.
#include <cmath>
#include <limits>
#include <numeric>

#include "core/small_gemm.h"
#include "patterns/internal.h"
#include "patterns/pattern.h"

namespace hax::patterns {
namespace {

constexpr int64_t kMaxBlock = 64;  // queries per block of top_k_chunks

template <class T>
void top_k_chunks_kernel(const at::Tensor& q, const at::Tensor& lm, const int32_t* lo, const int32_t* hi, int64_t k,
                         int32_t* out) {
  const int64_t B = q.size(0), L = q.size(1), D = q.size(2), NC = lm.size(1);
  // Landmarks transposed per row, (B, D, NC), so that a block's scores are Q_blk · LM^T[:, lo:hi].
  const at::Tensor lmT = lm.transpose(1, 2).contiguous();
  struct Blk {
    int64_t b, i0, i1;
  };
  std::vector<Blk> blocks;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t *l = lo + b * L, *h = hi + b * L;
    for (int64_t i = 0; i < L;) {
      int64_t j = i + 1;
      while (j < L && j - i < kMaxBlock && l[j] == l[i] && h[j] == h[i]) ++j;
      blocks.push_back({b, i, j});
      i = j;
    }
  }
  const T* qp = q.data_ptr<T>();
  const T* lp = lmT.data_ptr<T>();
  at::parallel_for(0, (int64_t)blocks.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scores;
    std::vector<int32_t> order;
    for (int64_t bi = begin; bi < end; ++bi) {
      const Blk& blk = blocks[bi];
      const int64_t nq = blk.i1 - blk.i0, c0 = lo[blk.b * L + blk.i0], n = hi[blk.b * L + blk.i0] - c0;
      int32_t* o = out + (blk.b * L + blk.i0) * k;
      std::fill(o, o + nq * k, -1);
      if (n <= 0) continue;
      scores.resize(nq * n);
      small_gemm<T>(nq, n, D, qp + (blk.b * L + blk.i0) * D, D, lp + blk.b * D * NC + c0, NC, scores.data(), n,
                    false);
      const int64_t m = std::min<int64_t>(k, n);
      for (int64_t r = 0; r < nq; ++r) {
        const T* s = &scores[r * n];
        auto key = [&](int32_t c) { return std::isnan(s[c]) ? -std::numeric_limits<T>::infinity() : s[c]; };
        order.resize(n);
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + m, order.end(), [&](int32_t a, int32_t b) {
          const T ka = key(a), kb = key(b);
          return ka > kb || (ka == kb && a < b);
        });
        std::sort(order.begin(), order.begin() + m);
        for (int64_t t = 0; t < m; ++t) o[r * k + t] = int32_t(c0 + order[t]);
      }
    }
  });
}

}  // namespace

ChunkLayout chunk_layout(int64_t B, int64_t L, int64_t chunk, const at::Tensor& seq_idx,
                         std::optional<at::Device> device) {
  constexpr const char* kOp = "chunk_layout";
  detail::check_sizes(kOp, B, 1, L);
  detail::check_positive(kOp, "chunk", chunk);
  const at::Device dev = detail::list_device(seq_idx, device);
  detail::check_list_device(kOp, dev);
  if (dev.is_cuda())
    return detail::chunk_layout_device(B, L, chunk, ops::check_seq_idx(kOp, detail::on(seq_idx, dev), B, L), dev);
  const at::Tensor seq = detail::on(ops::check_seq_idx(kOp, seq_idx, B, L), at::kCPU);
  std::vector<std::vector<int32_t>> starts(B);
  at::Tensor lo = at::empty({B, L}, at::TensorOptions().dtype(at::kInt));
  at::Tensor hi = at::empty({B, L}, at::TensorOptions().dtype(at::kInt));
  const int64_t NC = L / chunk;  // the most complete chunks a row can hold (a shape fixed by B and L)
  for (int64_t b = 0; b < B; ++b) {
    int32_t *l = lo.data_ptr<int32_t>() + b * L, *h = hi.data_ptr<int32_t>() + b * L;
    for (const auto& [s, e] : detail::segments(seq, b, L)) {
      const int32_t first = (int32_t)starts[b].size();
      for (int64_t c = s; c + chunk <= e; c += chunk) starts[b].push_back((int32_t)c);
      for (int64_t i = s; i < e; ++i) l[i] = first, h[i] = first + int32_t((i - s) / chunk);
    }
  }
  at::Tensor start = at::full({B, NC}, -1, at::TensorOptions().dtype(at::kInt));
  for (int64_t b = 0; b < B; ++b)
    std::copy(starts[b].begin(), starts[b].end(), start.data_ptr<int32_t>() + b * NC);
  return {chunk, start, lo, hi};
}

at::Tensor top_k_chunks(const at::Tensor& q_ret0, const at::Tensor& landmarks0, const at::Tensor& lo0,
                        const at::Tensor& hi0, int64_t k) {
  constexpr const char* kOp = "top_k_chunks";
  ops::check_rank(kOp, "q_ret", q_ret0, 3, "(B, L, D)");
  ops::check_rank(kOp, "landmarks", landmarks0, 3, "(B, NC, D)");
  ops::check_floating(kOp, "q_ret", q_ret0);
  detail::check_positive(kOp, "k", k);
  const int64_t B = q_ret0.size(0), L = q_ret0.size(1), D = q_ret0.size(2), NC = landmarks0.size(1);
  HAX_CHECK(landmarks0.size(0) == B && landmarks0.size(2) == D,
            "{}: landmarks has shape {}, expected (B, NC, D) = ({}, NC, {}) to match q_ret", kOp,
            ops::shape_str(landmarks0.sizes()), B, D);
  HAX_CHECK(landmarks0.scalar_type() == q_ret0.scalar_type(), "{}: landmarks has dtype {}, q_ret {}; they must match",
            kOp, c10::toString(landmarks0.scalar_type()), c10::toString(q_ret0.scalar_type()));
  for (const auto* t : {&lo0, &hi0}) {
    const char* name = t == &lo0 ? "lo" : "hi";
    HAX_CHECK(t->defined() && t->dim() == 2 && t->size(0) == B && t->size(1) == L && t->scalar_type() == at::kInt,
              "{}: {} must be an int32 (B, L) = ({}, {}) tensor, got {}", kOp, name, B, L,
              t->defined() ? fmt::format("{} {}", c10::toString(t->scalar_type()), ops::shape_str(t->sizes())) : std::string("undefined"));
  }
  if (q_ret0.is_cuda()) return detail::top_k_chunks_device(q_ret0, landmarks0, lo0, hi0, k);
  const at::Tensor q = q_ret0.detach().to(at::kCPU).contiguous();
  const at::Tensor lm = landmarks0.detach().to(at::kCPU).contiguous();
  const at::Tensor lo = lo0.to(at::kCPU).contiguous(), hi = hi0.to(at::kCPU).contiguous();
  const int32_t *l = lo.data_ptr<int32_t>(), *h = hi.data_ptr<int32_t>();
  for (int64_t i = 0; i < B * L; ++i)
    HAX_CHECK(0 <= l[i] && l[i] <= h[i] && h[i] <= NC, "{}: the chunk range [lo, hi) = [{}, {}) of query {} is not within [0, NC = {}]",
              kOp, l[i], h[i], i, NC);
  at::Tensor out = at::empty({B, L, k}, at::TensorOptions().dtype(at::kInt));
  if (q.scalar_type() == at::kDouble)
    top_k_chunks_kernel<double>(q, lm, l, h, k, out.data_ptr<int32_t>());
  else
    top_k_chunks_kernel<float>(q, lm, l, h, k, out.data_ptr<int32_t>());
  return detail::on(out, q_ret0.device());
}

at::Tensor chunk_lists(const at::Tensor& chunks, const at::Tensor& start, int64_t chunk, int64_t H) {
  constexpr const char* kOp = "chunk_lists";
  ops::check_rank(kOp, "chunks", chunks, 3, "(B, L, k)");
  detail::check_positive(kOp, "chunk", chunk);
  detail::check_positive(kOp, "H", H);
  const int64_t B = chunks.size(0), L = chunks.size(1), k = chunks.size(2);
  HAX_CHECK(start.dim() == 2 && start.size(0) == B, "chunk_lists: start has shape {}, expected (B = {}, NC)",
            ops::shape_str(start.sizes()), B);
  // position = start[chunk] + t, or -1 for a missing chunk.
  const at::Tensor c = chunks.to(at::kLong);
  if (start.size(1) == 0) return at::full({B, H, L, k, chunk}, -1, chunks.options().dtype(at::kInt));
  const at::Tensor first =
      at::gather(start.to(c.device(), at::kLong), 1, c.clamp_min(0).view({B, L * k})).view({B, L, k, 1});
  const at::Tensor t = at::arange(chunk, c.options()).view({1, 1, 1, chunk});
  at::Tensor pos = at::where(c.unsqueeze(-1) >= 0, first + t, at::full({}, -1, c.options()));
  return pos.to(at::kInt).unsqueeze(1).expand({B, H, L, k, chunk}).contiguous();
}

}  // namespace hax::patterns
