#include "layers/key_scorer.h"
#include "layers/project.h"

#include <algorithm>
#include <vector>
#include <cmath>

#include "core/rng.h"
#include "ops/ranking_loss/ranking_loss.h"
#include "ops/scorer_mlp/scorer_mlp.h"
#include "patterns/internal.h"

namespace hax {

KeyScorer::KeyScorer(int64_t n, int64_t hidden) {
  using torch::nn::Linear;
  l1 = register_module("l1", Linear(2 * n, hidden));
  l2 = register_module("l2", Linear(hidden, hidden));
  l3 = register_module("l3", Linear(hidden, 1));
}

namespace {

// Inclusive cumsum of x (B, L, ...) along dim 1 in float32, in blocks of 64 positions: a scan
// within each block, the blocks' totals scanned the same way (recursively), then added. On the
// GPU every scan then runs over a short dimension with the rest in parallel (LibTorch's scan along
// a long outer dimension used two thread blocks: 24.6 ms for (1, 65536, 1024) on an H100).
at::Tensor blocked_cumsum(const at::Tensor& x) {
  constexpr int64_t T = 64;
  const int64_t B = x.size(0), L = x.size(1);
  at::Tensor xf = x.to(at::kFloat).reshape({B, L, -1});
  if (L <= T) return xf.cumsum(1).reshape(x.sizes());
  const int64_t nb = (L + T - 1) / T, C = xf.size(2);
  if (nb * T != L) xf = at::constant_pad_nd(xf, {0, 0, 0, nb * T - L});
  at::Tensor cs = xf.view({B, nb, T, C}).cumsum(2);  // (B, nb, T, C) within each block
  at::Tensor tot = cs.select(2, T - 1);               // (B, nb, C) block totals
  at::Tensor carry = blocked_cumsum(tot) - tot;       // (B, nb, C) sum of the blocks before
  cs = (cs + carry.unsqueeze(2)).view({B, nb * T, C}).narrow(1, 0, L);
  return cs.reshape(x.sizes());
}

}  // namespace

at::Tensor segment_cumsum(const at::Tensor& x, const at::Tensor& seq_idx) {
  at::Tensor cs = x.is_cuda() ? blocked_cumsum(x) : x.cumsum(1);
  if (!seq_idx.defined()) return cs;
  const int64_t B = x.size(0), L = x.size(1);
  // Position of each sequence's first token: where seq_idx changes (or 0).
  at::Tensor s = seq_idx.to(at::kLong).to(x.device());
  at::Tensor is_start = at::ones({B, L}, s.options().dtype(at::kBool));
  if (L > 1) is_start.narrow(1, 1, L - 1).copy_(s.narrow(1, 1, L - 1) != s.narrow(1, 0, L - 1));
  at::Tensor pos = at::arange(L, s.options()).expand({B, L});
  at::Tensor start = std::get<0>(at::where(is_start, pos, at::zeros_like(pos)).cummax(1));  // (B, L)
  // cs at start - 1 (zero when start == 0), broadcast over the trailing dims.
  std::vector<int64_t> view = {B, L};
  for (int64_t d = 2; d < x.dim(); ++d) view.push_back(1);
  at::Tensor prev = (start - 1).clamp_min(0).view(view).expand(x.sizes());
  at::Tensor before = cs.gather(1, prev) * (start > 0).to(x.scalar_type()).view(view);
  return cs - before;
}

namespace {

// qs (B, L, H, N) = normalize(Σ_{p=start..j} q_p) on the CPU in one pass per (b, h) row, the sum
// accumulated in double; seq is the checked seq_idx or undefined.
template <class T>
void prefix_direction_cpu(const at::Tensor& q, const at::Tensor& seq, at::Tensor& out) {
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), N = q.size(3);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  patterns::detail::for_each_row(B, H, L, seq, L * N * 4, [&](int64_t b, int64_t hd, const auto& segs) {
    std::vector<double> sum(N);
    for (const auto& [s, e] : segs) {
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t i = s; i < e; ++i) {
        const int64_t at = ((b * L + i) * H + hd) * N;
        double nrm = 0;
        for (int64_t n = 0; n < N; ++n) sum[n] += (double)qp[at + n], nrm += sum[n] * sum[n];
        const double inv = 1.0 / std::max(std::sqrt(nrm), kDirectionEps);
        for (int64_t n = 0; n < N; ++n) op[at + n] = (T)(sum[n] * inv);
      }
    }
  });
}

}  // namespace

at::Tensor prefix_query_direction(const at::Tensor& q0, const at::Tensor& seq_idx) {
  constexpr const char* kOp = "prefix_query_direction";
  ops::check_rank(kOp, "q", q0, 4, "(B, L, H, N)");
  at::Tensor q = q0.detach();
  // CUDA: the chunked-scan kernels of patterns/cuda/prefix_direction.cu (at most 3 launches, no
  // wait on the host) for float32 and bfloat16; the tensor formula for other dtypes and N.
  if (q.is_cuda() && ops::cuda_backend_built() &&
      (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) && q.size(3) <= patterns::kPrefixMaxN) {
    const at::Tensor seq = ops::check_seq_idx(kOp, seq_idx, q.size(0), q.size(1));
    return patterns::detail::prefix_direction_device(q, seq, kDirectionEps);
  }
  if (!q.device().is_cpu() || !(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble)) {
    at::Tensor qs = segment_cumsum(q, seq_idx);
    return (qs / qs.norm(2, -1, true).clamp_min(kDirectionEps)).to(q.scalar_type());
  }
  q = q.contiguous();
  const at::Tensor seq = ops::check_seq_idx(kOp, seq_idx, q.size(0), q.size(1));
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kDouble)
    prefix_direction_cpu<double>(q, seq, out);
  else
    prefix_direction_cpu<float>(q, seq, out);
  return out;
}

at::Tensor KeyScorer::forward(const at::Tensor& k, const at::Tensor& q, const at::Tensor& seq_idx) {
  const at::Tensor kd = k.detach(), u = prefix_query_direction(q, seq_idx);  // (B, L, H, N) each
  // CUDA in bfloat16 (or under autocast): the whole MLP in one kernel (ops/scorer_mlp).
  if (ops::scorer_mlp_fused_applies(kd, u, l1->weight, l2->weight))
    return ops::scorer_mlp(kd, u, l1->weight, l1->bias, l2->weight, l2->bias, l3->weight, l3->bias);
  auto mlp = [&](int64_t t0, int64_t n) {
    at::Tensor h = at::cat({kd.narrow(1, t0, n), u.narrow(1, t0, n)}, -1);  // (B, n, H, 2N)
    h = project_relu(l1, h);
    h = project_relu(l2, h);
    return project(l3, h).squeeze(-1);  // (B, n, H)
  };
  // The MLP is per position: on the CPU it runs on slices of positions whose widest activation
  // stays below kSliceBytes. Whole-sequence activations at long L (64K x 128 floats = 33.5 MB)
  // pass glibc's largest mmap threshold and were page-faulted afresh at every call.
  constexpr int64_t kSliceBytes = int64_t(8) << 20;
  const int64_t L = k.size(1);
  const int64_t width = std::max<int64_t>(l1->weight.size(0), l1->weight.size(1));
  const int64_t per_pos = std::max<int64_t>(1, k.size(0) * k.size(2) * width * k.element_size());
  const int64_t slice = k.is_cpu() ? std::max<int64_t>(1, kSliceBytes / per_pos) : L;
  if (slice >= L) return mlp(0, L);
  std::vector<at::Tensor> parts;
  for (int64_t t0 = 0; t0 < L; t0 += slice) parts.push_back(mlp(t0, std::min(slice, L - t0)));
  return at::cat(parts, 1);
}

at::Tensor ranking_loss_at(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                           const at::Tensor& valid, const at::Tensor& cand) {
  // The fused kernels on CUDA, ops::ranking_loss_reference (LibTorch ops) on the CPU.
  return ops::ranking_loss_fused(scores, q, k, seq_idx, valid, cand);
}

at::Tensor ranking_candidates(const at::Tensor& valid_host, int64_t B, int64_t L, int64_t candidates, uint64_t seed) {
  at::Tensor ok = valid_host.defined() ? valid_host.to(at::kCPU).to(at::kBool).contiguous() : at::ones({B, L}, at::kBool);
  HAX_CHECK(ok.dim() == 2 && ok.size(0) == B && ok.size(1) == L,
            "ranking_candidates: the valid mask has shape {} but the scores have B = {}, L = {}",
            ops::shape_str(ok.sizes()), B, L);
  const bool* okp = ok.data_ptr<bool>();
  // Same candidate count for every row: the fewest valid positions of any row that has one (a row
  // with none is padding, left out of the loss), at most `candidates`.
  int64_t C = std::min(candidates, L);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = std::count(okp + b * L, okp + (b + 1) * L, true);
    if (n > 0) C = std::min(C, n);
  }
  at::Tensor cand = at::empty({B, C}, at::kLong);
  int64_t* cp = cand.data_ptr<int64_t>();
  std::vector<int64_t> pool(L);  // one row's valid positions, reused (no allocation per row)
  for (int64_t b = 0; b < B; ++b) {
    const bool* row = okp + b * L;
    int64_t n = 0;
    for (int64_t t = 0; t < L; ++t) pool[n] = t, n += row[t];  // compaction without a branch
    if (n == 0) {  // a padding row: any distinct positions (its loss is masked out)
      for (int64_t c = 0; c < C; ++c) cp[b * C + c] = c;
      continue;
    }
    Rng rng(derive_seed(seed, 0x4B53, (uint64_t)b));
    for (int64_t c = 0; c < C; ++c) {  // partial Fisher-Yates: C distinct positions
      const int64_t r = c + (int64_t)rng.below(n - c);
      std::swap(pool[c], pool[r]);
      cp[b * C + c] = pool[c];
    }
  }
  return cand;
}

at::Tensor ranking_loss_of(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                           const at::Tensor& valid, const at::Tensor& cand, const at::Tensor& rows) {
  if (cand.size(1) < 2) return scores.sum() * 0.0;  // no pair to rank
  return ops::ranking_loss_fused(scores, q, k, seq_idx, valid, cand, rows);
}

at::Tensor ranking_loss(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                        const at::Tensor& valid, int64_t candidates, uint64_t seed, const at::Tensor& valid_host) {
  const int64_t B = q.size(0), L = q.size(1);
  const at::Tensor& vh = valid_host.defined() ? valid_host : valid;
  const at::Tensor cand = ranking_candidates(vh, B, L, candidates, seed);
  // Not waiting for the copy: the source is staged at once (a blocking copy would wait for the GPU).
  return ranking_loss_of(scores, q, k, seq_idx, valid, cand.to(scores.device(), /*non_blocking=*/true),
                         ranking_rows(valid, valid_host, false));
}

at::Tensor ranking_rows(const at::Tensor& valid, const at::Tensor& valid_host, bool always) {
  if (!valid.defined()) return {};
  const at::Tensor& vh = valid_host.defined() ? valid_host : valid;
  if (!always && vh.to(at::kCPU).to(at::kBool).any(1).all().item<bool>()) return {};
  return valid.to(at::kBool).any(1);
}

}  // namespace hax
