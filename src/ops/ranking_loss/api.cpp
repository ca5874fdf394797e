// Binding layer of the fused ranking loss: tensor checks, dispatch (CUDA: the kernels; CPU: the
// reference), autograd.
#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/check.h"
#include "ops/ranking_loss/params.h"
#include "ops/ranking_loss/ranking_loss.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "ranking_loss";

struct Dims {
  int64_t B, L, H, N, C;
};

void check_device(const char* name, const at::Tensor& t, const at::Tensor& scores) {
  HAX_CHECK(t.device() == scores.device(), "{}: {} is on {} but scores is on {}; all tensors must be on one device",
            kOp, name, t.device().str(), scores.device().str());
}

// cand (B, C) on the CPU: every row holds C distinct positions in [0, L).
void check_cand_values(const at::Tensor& cand, const Dims& d) {
  const at::Tensor c = cand.cpu().contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  std::vector<int64_t> row(d.C);
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t i = 0; i < d.C; ++i) {
      const int64_t j = p[b * d.C + i];
      HAX_CHECK(j >= 0 && j < d.L, "{}: cand[{}, {}] = {} is not a position: entries must be in [0, L = {})", kOp, b,
                i, j, d.L);
      row[i] = j;
    }
    std::sort(row.begin(), row.end());
    const auto dup = std::adjacent_find(row.begin(), row.end());
    HAX_CHECK(dup == row.end(), "{}: cand row {} holds position {} twice; the candidates of a row must be distinct",
              kOp, b, dup == row.end() ? 0 : *dup);
  }
}

// Checks every argument; returns the sizes and seq_idx as contiguous int32 (or undefined) in *seq.
// seq_idx's order and cand's values are read on the CPU, and on a CUDA device only while
// check_device_values() is on (they would stall the host).
Dims check_inputs(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                  const at::Tensor& valid, const at::Tensor& cand, const at::Tensor& rows, at::Tensor* seq) {
  check_rank(kOp, "scores", scores, 3, "(B, L, H)");
  check_floating(kOp, "scores", scores);
  Dims d{scores.size(0), scores.size(1), scores.size(2), 0, 0};
  check_rank(kOp, "q", q, 4, "(B, L, H, N)");
  d.N = q.size(3);
  check_shape(kOp, "q", q, {d.B, d.L, d.H, d.N}, "(B, L, H, N)");
  check_shape(kOp, "k", k, {d.B, d.L, d.H, d.N}, "(B, L, H, N)");
  check_floating(kOp, "q", q);
  check_device("q", q, scores);
  check_same(kOp, "k", k, q);
  check_rank(kOp, "cand", cand, 2, "(B, C)");
  d.C = cand.size(1);
  check_shape(kOp, "cand", cand, {d.B, d.C}, "(B, C)");
  HAX_CHECK(cand.scalar_type() == at::kLong, "{}: cand has dtype {} but must be int64", kOp,
            c10::toString(cand.scalar_type()));
  check_device("cand", cand, scores);
  HAX_CHECK(d.B >= 1 && d.H >= 1 && d.C >= 1,
            "{}: B = {}, H = {}, C = {}: the loss is a mean over (B, C, C, H) and needs each >= 1", kOp, d.B, d.H,
            d.C);
  HAX_CHECK(d.C <= d.L, "{}: cand has C = {} candidates per row but a row has only L = {} positions", kOp, d.C, d.L);
  if (valid.defined()) {
    check_shape(kOp, "valid", valid, {d.B, d.L}, "(B, L)");
    HAX_CHECK(valid.scalar_type() == at::kBool, "{}: valid has dtype {} but must be bool", kOp,
              c10::toString(valid.scalar_type()));
    check_device("valid", valid, scores);
  }
  if (rows.defined()) {
    check_shape(kOp, "rows", rows, {d.B}, "(B)");
    HAX_CHECK(rows.scalar_type() == at::kBool,
              "{}: rows has dtype {} but must be bool (true: the row counts; false: a padding row, left out)", kOp,
              c10::toString(rows.scalar_type()));
    check_device("rows", rows, scores);
  }
  if (seq_idx.defined()) check_device("seq_idx", seq_idx, scores);
  *seq = check_seq_idx(kOp, seq_idx, d.B, d.L);
  if (!cand.is_cuda() || check_device_values()) check_cand_values(cand, d);
  return d;
}

// Checked inputs of the CUDA path: q and k keep their strides when their last dim is contiguous;
// seq, valid, cand, rows are contiguous (valid and rows may be undefined).
struct Inputs {
  Dims d;
  at::Tensor q, k, seq, valid, cand, rows;
};

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Differentiable in scores only; `in` (q, k, seq_idx, valid, cand, rows) reaches the forward as a plain
// argument, so autograd gives those tensors no gradient.
struct RankingLossFunction : public torch::autograd::Function<RankingLossFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor scores0, const Inputs& in) {
    ctx->set_materialize_grads(false);
    const Dims& d = in.d;
    const at::Tensor scores = scores0.contiguous();
    const int64_t bch = d.B * d.C * d.H, parts = d.B * d.H * ranking_loss_tiles(d.C);
    // One float32 buffer: dx (B, C, H) | y (B, C, H) | partial loss sums (parts); all written.
    at::Tensor work = new_output({2 * bch + parts}, scores.options().dtype(at::kFloat));
    at::Tensor loss = new_output({}, scores.options());
    RankingLossParams p;
    p.batch = d.B, p.seqlen = d.L, p.nheads = d.H, p.dim = d.N, p.ncand = d.C;
    for (int i = 0; i < 3; ++i) p.q_stride[i] = in.q.stride(i), p.k_stride[i] = in.k.stride(i);
    p.scores = scores.data_ptr(), p.q = in.q.data_ptr(), p.k = in.k.data_ptr();
    p.seq_idx = in.seq.defined() ? in.seq.data_ptr<int32_t>() : nullptr;
    p.valid = in.valid.defined() ? in.valid.data_ptr<bool>() : nullptr;
    p.cand = in.cand.data_ptr<int64_t>();
    p.rows = in.rows.defined() ? in.rows.data_ptr<bool>() : nullptr;
    float* w = work.data_ptr<float>();
    p.dx = w, p.y = w + bch, p.partial = w + 2 * bch;
    p.loss = loss.data_ptr();
    HAX_CUDA_LAUNCH(kOp, scores,
                    ranking_loss_forward_cuda(p, kernel_dtype(scores), kernel_dtype(in.q), cuda_stream(scores)));
    ctx->save_for_backward({scores0, in.cand, work.narrow(0, 0, bch)});
    return {loss};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};  // no gradient flows: zero
    auto s = ctx->get_saved_variables();
    const at::Tensor &scores = s[0], &cand = s[1], &dx = s[2];
    const at::Tensor g = grads[0].to(scores.scalar_type());  // 0-dim, read on the device
    at::Tensor dscores = at::zeros(scores.sizes(), scores.options());  // (B, L, H), contiguous
    RankingLossGradParams gp;
    gp.batch = scores.size(0), gp.seqlen = scores.size(1), gp.nheads = scores.size(2), gp.ncand = cand.size(1);
    gp.cand = cand.data_ptr<int64_t>(), gp.dx = dx.data_ptr<float>();
    gp.dloss = g.data_ptr(), gp.dscores = dscores.data_ptr();
    HAX_CUDA_LAUNCH(kOp, scores, ranking_loss_backward_cuda(gp, kernel_dtype(scores), cuda_stream(scores)));
    return {dscores, at::Tensor()};
  }
};

}  // namespace

at::Tensor ranking_loss_fused(const at::Tensor& scores, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& seq_idx, const at::Tensor& valid, const at::Tensor& cand,
                              const at::Tensor& rows) {
  at::Tensor seq;
  const Dims d = check_inputs(scores, q, k, seq_idx, valid, cand, rows, &seq);
  if (!scores.is_cuda()) return ranking_loss_reference(scores, q, k, seq_idx, valid, cand, rows);
  Inputs in{d,
            last_dim_contiguous(q.detach()),
            last_dim_contiguous(k.detach()),
            seq,
            valid.defined() ? valid.contiguous() : valid,
            cand.contiguous(),
            rows.defined() ? rows.contiguous() : rows};
  return RankingLossFunction::apply(scores, in)[0];
}

}  // namespace hax::ops
