// Binding layer of sparse attention: tensor checks, dispatch to the kernels, autograd.
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/check.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "sparse_attention";

std::atomic<AttentionPath> g_path{AttentionPath::kAuto};

struct Dims {
  int64_t B, L, Lk, H, D, Dv, S, K;
};

void check_cpu(const char* name, const at::Tensor& t) {
  HAX_CHECK(t.device().is_cpu(), "{}: {} is on {}, but this build runs {} on the CPU only", kOp, name,
            t.device().str(), kOp);
}

void check_int32(const char* name, const at::Tensor& t) {
  HAX_CHECK(t.scalar_type() == at::kInt, "{}: {} has dtype {} but must be int32", kOp, name,
            c10::toString(t.scalar_type()));
}

Dims check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx,
                  const at::Tensor& bias, const at::Tensor& seg_w, const at::Tensor& q_order, double scale) {
  check_rank(kOp, "q", q, 4, "(B, L, H, D)");
  check_floating(kOp, "q", q);
  check_cpu("q", q);
  Dims d{q.size(0), q.size(1), 0, q.size(2), q.size(3), 0, 1, 0};
  check_rank(kOp, "k", k, 4, "(B, Lk, H, D)");
  d.Lk = k.size(1);
  check_shape(kOp, "k", k, {d.B, d.Lk, d.H, d.D}, "(B, Lk, H, D)");
  check_rank(kOp, "v", v, 4, "(B, Lk, H, Dv)");
  d.Dv = v.size(3);
  check_shape(kOp, "v", v, {d.B, d.Lk, d.H, d.Dv}, "(B, Lk, H, Dv)");
  check_same(kOp, "k", k, q);
  check_same(kOp, "v", v, q);
  HAX_CHECK(idx.defined(), "{}: tensor idx is missing; it must be (B, H, L, S, K) or (B, H, L, K)", kOp);
  HAX_CHECK(idx.dim() == 4 || idx.dim() == 5, "{}: idx has shape {} but must be (B, H, L, S, K) or (B, H, L, K)", kOp,
            shape_str(idx.sizes()));
  if (idx.dim() == 4) {
    d.K = idx.size(3);
    check_shape(kOp, "idx", idx, {d.B, d.H, d.L, d.K}, "(B, H, L, K)");
  } else {
    d.S = idx.size(3), d.K = idx.size(4);
    check_shape(kOp, "idx", idx, {d.B, d.H, d.L, d.S, d.K}, "(B, H, L, S, K)");
  }
  check_int32("idx", idx);
  check_cpu("idx", idx);
  if (bias.defined()) {
    check_shape(kOp, "bias", bias, {d.B, d.H, d.Lk}, "(B, H, Lk)");
    check_same(kOp, "bias", bias, q);
  }
  if (seg_w.defined()) {
    check_shape(kOp, "seg_w", seg_w, {d.B, d.H, d.L, d.S}, "(B, H, L, S)");
    check_same(kOp, "seg_w", seg_w, q);
  }
  if (q_order.defined()) {
    check_shape(kOp, "q_order", q_order, {d.B, d.H, d.L}, "(B, H, L)");
    check_int32("q_order", q_order);
    check_cpu("q_order", q_order);
  }
  HAX_CHECK(scale > 0 && std::isfinite(scale), "{}: scale {} must be positive and finite (e.g. 1/sqrt(D))", kOp,
            scale);
  HAX_CHECK(d.L * d.S * d.K < (int64_t(1) << 31),
            "{}: L * S * K = {} * {} * {} list entries per (b, h) must be below 2^31", kOp, d.L, d.S, d.K);
  return d;
}

// idx (contiguous int32, (B, H, L, S, K)) must hold only -1 and key positions in [0, Lk).
void check_idx_values(const at::Tensor& idx, const Dims& d) {
  const int64_t n = idx.numel();
  if (n == 0) return;
  const int32_t* p = idx.data_ptr<int32_t>();
  const int64_t nchunks = (n + 65535) / 65536;
  std::vector<char> bad(nchunks, 0);
  at::parallel_for(0, nchunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t e0 = c * 65536, e1 = std::min(n, e0 + 65536);
      int32_t lo = 0, hi = -1;
#pragma omp simd reduction(min : lo) reduction(max : hi)
      for (int64_t e = e0; e < e1; ++e) lo = std::min(lo, p[e]), hi = std::max(hi, p[e]);
      bad[c] = lo < -1 || hi >= d.Lk;
    }
  });
  for (int64_t c = 0; c < nchunks; ++c) {
    if (!bad[c]) continue;
    for (int64_t e = c * 65536; e < n; ++e) {
      if (p[e] >= -1 && p[e] < d.Lk) continue;
      const int64_t t = e % d.K, s = e / d.K % d.S, i = e / (d.K * d.S) % d.L, bh = e / (d.K * d.S * d.L);
      fail("{}: idx[b={}, h={}, i={}, s={}, k={}] = {} is not a key position: entries must be in [0, Lk = {}) or -1",
           kOp, bh / d.H, bh % d.H, i, s, t, p[e], d.Lk);
    }
  }
}

// q_order (contiguous int32 (B, H, L)) must be a permutation of 0..L-1 in every (b, h).
void check_permutation(const at::Tensor& q_order, const Dims& d) {
  const int32_t* p = q_order.data_ptr<int32_t>();
  const int64_t BH = d.B * d.H;
  std::vector<int64_t> bad(BH, -1);
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> seen(d.L);
    for (int64_t bh = begin; bh < end; ++bh) {
      std::fill(seen.begin(), seen.end(), 0);
      for (int64_t i = 0; i < d.L; ++i) {
        const int32_t j = p[bh * d.L + i];
        if (j < 0 || j >= d.L || seen[j]) {
          bad[bh] = i;
          break;
        }
        seen[j] = 1;
      }
    }
  });
  for (int64_t bh = 0; bh < BH; ++bh)
    HAX_CHECK(bad[bh] < 0,
              "{}: q_order must be a permutation of 0..L-1 (L = {}) for every (b, h), but q_order[b={}, h={}, {}] = {} "
              "is out of range or repeated",
              kOp, d.L, bh / d.H, bh % d.H, bad[bh], p[bh * d.L + bad[bh]]);
}

// Checked, contiguous inputs; idx as (B, H, L, S, K).
struct Inputs {
  Dims d;
  at::Tensor q, k, v, idx, bias, seg_w, q_order;
};

Inputs prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx,
               const at::Tensor& bias, const at::Tensor& seg_w, const at::Tensor& q_order, double scale) {
  Inputs in;
  in.d = check_inputs(q, k, v, idx, bias, seg_w, q_order, scale);
  const Dims& d = in.d;
  in.q = q.contiguous(), in.k = k.contiguous(), in.v = v.contiguous();
  in.idx = idx.reshape({d.B, d.H, d.L, d.S, d.K}).contiguous();
  check_idx_values(in.idx, d);
  if (bias.defined()) in.bias = bias.contiguous();
  if (seg_w.defined()) in.seg_w = seg_w.contiguous();
  if (q_order.defined()) {
    in.q_order = q_order.contiguous();
    check_permutation(in.q_order, d);
  }
  return in;
}

AttentionParams make_params(const Inputs& in, double scale) {
  const Dims& d = in.d;
  AttentionParams p;
  p.batch = d.B, p.seqlen = d.L, p.keylen = d.Lk, p.nheads = d.H, p.dim = d.D, p.vdim = d.Dv;
  p.nseg = d.S, p.maxkeys = d.K;
  p.scale = scale;
  p.q = in.q.data_ptr(), p.k = in.k.data_ptr(), p.v = in.v.data_ptr();
  p.idx = in.idx.data_ptr<int32_t>();
  p.bias = in.bias.defined() ? in.bias.data_ptr() : nullptr;
  p.seg_w = in.seg_w.defined() ? in.seg_w.data_ptr() : nullptr;
  p.q_order = in.q_order.defined() ? in.q_order.data_ptr<int32_t>() : nullptr;
  p.path = g_path.load();
  return p;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SparseAttentionFunction : public torch::autograd::Function<SparseAttentionFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor idx,
                               at::Tensor bias, at::Tensor seg_w, at::Tensor q_order, double scale) {
    // Absent optional tensors arrive as empty tensors (LibTorch's autograd needs defined ones).
    auto present = [](const at::Tensor& t) { return t.numel() > 0 ? t : at::Tensor(); };
    Inputs in = prepare(q, k, v, idx, present(bias), present(seg_w), present(q_order), scale);
    const Dims& d = in.d;
    AttentionParams p = make_params(in, scale);
    at::Tensor out = at::empty({d.B, d.L, d.H, d.Dv}, in.q.options());
    at::Tensor lse = at::empty({d.B, d.H, d.L, d.S}, in.q.options());
    p.out = out.data_ptr(), p.lse = lse.data_ptr();
    if (d.B * d.H * d.L > 0) sparse_attention_forward_cpu(p, in.q.scalar_type());
    auto or_empty = [&](const at::Tensor& t, at::ScalarType dt) { return t.defined() ? t : at::empty({0}, dt); };
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_bias"] = in.bias.defined();
    ctx->saved_data["has_seg_w"] = in.seg_w.defined();
    ctx->saved_data["has_q_order"] = in.q_order.defined();
    ctx->saved_data["path"] = int64_t(p.path);
    ctx->save_for_backward({in.q, in.k, in.v, in.idx, or_empty(in.bias, q.scalar_type()),
                            or_empty(in.seg_w, q.scalar_type()), or_empty(in.q_order, at::kInt), lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    Inputs in;
    in.q = s[0], in.k = s[1], in.v = s[2], in.idx = s[3];
    if (ctx->saved_data["has_bias"].toBool()) in.bias = s[4];
    if (ctx->saved_data["has_seg_w"].toBool()) in.seg_w = s[5];
    if (ctx->saved_data["has_q_order"].toBool()) in.q_order = s[6];
    const at::Tensor& lse = s[7];
    Dims& d = in.d;
    d = {in.q.size(0), in.q.size(1), in.k.size(1), in.q.size(2), in.q.size(3), in.v.size(3), in.idx.size(3),
         in.idx.size(4)};
    const double scale = ctx->saved_data["scale"].toDouble();
    at::Tensor dout = grads[0].defined() ? grads[0].contiguous() : at::zeros({d.B, d.L, d.H, d.Dv}, in.q.options());
    at::Tensor dlse = grads[1].defined() ? grads[1].contiguous() : at::Tensor();

    AttentionGradParams gp;
    gp.fwd = make_params(in, scale);
    gp.fwd.path = AttentionPath(ctx->saved_data["path"].toInt());
    gp.fwd.lse = lse.data_ptr();
    at::Tensor dq = at::empty_like(in.q), dk = at::empty_like(in.k), dv = at::empty_like(in.v);
    at::Tensor dbias = in.bias.defined() ? at::empty_like(in.bias) : at::Tensor();
    at::Tensor dseg_w = in.seg_w.defined() ? at::empty_like(in.seg_w) : at::Tensor();
    gp.dout = dout.data_ptr();
    gp.dlse = dlse.defined() ? dlse.data_ptr() : nullptr;
    gp.dq = dq.data_ptr(), gp.dk = dk.data_ptr(), gp.dv = dv.data_ptr();
    gp.dbias = dbias.defined() ? dbias.data_ptr() : nullptr;
    gp.dseg_w = dseg_w.defined() ? dseg_w.data_ptr() : nullptr;
    if (d.B * d.H * d.L > 0) {
      sparse_attention_backward_cpu(gp, in.q.scalar_type());
    } else {
      dk.zero_(), dv.zero_();
      if (dbias.defined()) dbias.zero_();
    }
    return {dq, dk, dv, at::Tensor(), dbias, dseg_w, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

void set_sparse_attention_path(AttentionPath path) { g_path.store(path); }
AttentionPath sparse_attention_path() { return g_path.load(); }

std::tuple<at::Tensor, at::Tensor> sparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& idx, const at::Tensor& bias,
                                                    const at::Tensor& seg_w, const at::Tensor& q_order, double scale) {
  check_inputs(q, k, v, idx, bias, seg_w, q_order, scale);  // before apply, which needs defined tensors
  auto absent = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, q.options()); };
  auto out = SparseAttentionFunction::apply(q, k, v, idx, absent(bias), absent(seg_w),
                                            q_order.defined() ? q_order : at::empty({0}, at::kInt), scale);
  return {out[0], out[1]};
}

}  // namespace hax::ops
