// Binding layer of A-shaped attention: tensor checks, the CUDA fast path (the causal forward with
// its sink tile; the causal backward for the window and cuda/sink.cu for the sink keys outside it)
// with its autograd, and the lists path.
#include <torch/torch.h>

#include <cmath>

#include "core/error.h"
#include "ops/a_shaped_attention/a_shaped_attention.h"
#include "ops/a_shaped_attention/params.h"
#include "ops/attention/attention.h"
#include "ops/backend.h"
#include "ops/causal_attention/causal_attention.h"
#include "ops/check.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "a_shaped_attention";

using Dims = QkvDims;

Dims check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window, int64_t sink,
                  double scale) {
  const Dims d = check_qkv(kOp, q, k, v);
  HAX_CHECK(window >= 1, "{}: window {} must be >= 1 (the most recent keys each query sees, self included)", kOp,
            window);
  HAX_CHECK(sink >= 0, "{}: sink {} must be >= 0 (the first keys of the row every later query sees)", kOp, sink);
  HAX_CHECK(scale > 0 && std::isfinite(scale), "{}: scale {} must be positive and finite (e.g. 1/sqrt(D))", kOp,
            scale);
  return d;
}

ASinkParams sink_params(const Dims& d, int64_t window, int64_t sink, double scale, const at::Tensor& q,
                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse) {
  ASinkParams p;
  p.batch = d.B, p.seqlen = d.L, p.nheads = d.H, p.dim = d.D, p.vdim = d.Dv;
  p.window = window, p.sink = sink, p.scale = scale;
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.lse = lse.data_ptr<float>();
  return p;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The CUDA fast path (bfloat16): the causal forward over the window's key tiles and the sink's;
// the backward runs the window part's kernels with the union's out and lse, then adds the sink
// part's share (cuda/sink.cu).
struct AShapedFunction : public torch::autograd::Function<AShapedFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor q0, at::Tensor k0, at::Tensor v0, int64_t window,
                               int64_t sink, double scale) {
    ctx->set_materialize_grads(false);
    const Dims d{q0.size(0), q0.size(1), q0.size(2), q0.size(3), v0.size(3)};  // checked by a_shaped_attention
    const at::Tensor q = aligned_contiguous(q0), k = aligned_contiguous(k0), v = aligned_contiguous(v0);
    at::Tensor out = new_output({d.B, d.L, d.H, d.Dv}, q.options());
    at::Tensor lse = new_output({d.B, d.H, d.L}, q.options().dtype(at::kFloat));
    if (d.B * d.H * d.L > 0) {
      // The window's tiles and the sink's (one 64-key tile) in one pass of the causal forward.
      CausalAttentionParams wp = causal_attention_params(d, window, scale, q, k, v);
      wp.sink = sink;
      wp.out = out.data_ptr(), wp.lse = lse.data_ptr();
      HAX_CUDA_LAUNCH(kOp, q, causal_attention_forward_cuda(wp, DType::kBF16, cuda_stream(q)));
    }
    ctx->saved_data["window"] = window;
    ctx->saved_data["sink"] = sink;
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({q, k, v, out, lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3], &lse = s[4];
    const int64_t window = ctx->saved_data["window"].toInt(), sink = ctx->saved_data["sink"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const Dims d{q.size(0), q.size(1), q.size(2), q.size(3), v.size(3)};
    const at::Tensor dout =
        grads[0].defined() ? aligned_contiguous(grads[0].to(out.scalar_type())) : at::zeros_like(out);
    const at::Tensor dlse = grads[1].defined() ? grads[1].to(at::kFloat).contiguous() : at::Tensor();
    at::Tensor dq = new_output_like(q), dk = new_output_like(k), dv = new_output_like(v);
    if (d.B * d.H * d.L > 0) {
      CausalAttentionGradParams gp;
      gp.fwd = causal_attention_params(d, window, scale, q, k, v);
      gp.fwd.out = out.data_ptr(), gp.fwd.lse = lse.data_ptr();
      gp.dout = dout.data_ptr();
      gp.dlse = dlse.defined() ? dlse.data_ptr() : nullptr;
      gp.dq = dq.data_ptr(), gp.dk = dk.data_ptr(), gp.dv = dv.data_ptr();
      // Δ = dO·O - dlse of the union, written by the window part's backward, read by the sink's.
      at::Tensor delta = at::empty({causal_attention_cuda_workspace(gp.fwd)}, q.options().dtype(at::kFloat));
      gp.workspace = delta.data_ptr();
      ASinkGradParams sg;
      sg.fwd = sink_params(d, window, sink, scale, q, k, v, lse);
      sg.dout = dout.data_ptr();
      sg.delta = delta.data_ptr<float>();
      sg.dq = dq.data_ptr(), sg.dk = dk.data_ptr(), sg.dv = dv.data_ptr();
      at::Tensor part = at::empty({a_sink_cuda_workspace(sg.fwd)}, q.options().dtype(at::kFloat));
      sg.workspace = part.data_ptr<float>();
      HAX_CUDA_LAUNCH(kOp, q, {
        causal_attention_backward_cuda(gp, DType::kBF16, cuda_stream(q));
        a_sink_backward_cuda(sg, cuda_stream(q));
      });
    }
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool a_shaped_attention_native(const at::Tensor& q, const at::Tensor& v, int64_t window, int64_t sink) {
  if (!q.defined() || !v.defined() || !q.is_cuda() || q.dim() != 4 || v.dim() != 4) return false;
  const bool bf16 = q.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16;
  if (!bf16 && !(cuda_autocast_enabled() && at::isFloatingType(q.scalar_type()))) return false;
  const int64_t D = q.size(3), Dv = v.size(3);
  return causal_attention_tensor_cores() && window >= 1 && sink >= 1 && sink <= kASinkCudaMaxKeys && D % 8 == 0 &&
         Dv % 8 == 0 && D <= 128 && Dv <= 128 && q.size(1) < (int64_t(1) << 30);
}

at::Tensor a_shaped_lists(int64_t B, int64_t H, int64_t L, int64_t window, int64_t sink, const at::Device& device) {
  HAX_CHECK(window >= 1 && sink >= 0, "{}: window {} must be >= 1 and sink {} >= 0", kOp, window, sink);
  const int64_t K = std::max<int64_t>(1, std::min(L, sink + window));
  const auto o = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor i = at::arange(L, o).view({L, 1}), c = at::arange(K, o).view({1, K});
  const at::Tensor n1 = at::clamp_min(at::clamp_max(i - window, sink - 1) + 1, 0);  // sink keys [0, n1)
  const at::Tensor lo = at::clamp_min(i - window + 1, 0), n2 = i - lo + 1;         // window [lo, i]
  const at::Tensor idx = at::where(c < n1, c, at::where(c < n1 + n2, lo + c - n1, at::full_like(c, -1)));
  return idx.to(at::kInt).view({1, 1, L, K}).expand({B, H, L, K}).contiguous();
}

std::tuple<at::Tensor, at::Tensor> a_shaped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      int64_t window, int64_t sink, double scale) {
  if (autocast_cast_needed({q, k, v}))
    return a_shaped_attention(autocast_cast(q), autocast_cast(k), autocast_cast(v), window, sink, scale);
  const Dims d = check_inputs(q, k, v, window, sink, scale);
  if (sink == 0) return causal_attention(q, k, v, {}, window, scale);  // the window alone
  if (a_shaped_attention_native(q, v, window, sink) && q.scalar_type() == at::kBFloat16) {
    auto out = AShapedFunction::apply(q, k, v, window, sink, scale);
    return {out[0], out[1]};
  }
  const at::Tensor idx = a_shaped_lists(d.B, d.H, d.L, window, sink, q.device());
  auto [out, lse] = sparse_attention(q, k, v, idx, {}, {}, {}, scale);
  return {out, lse.squeeze(-1)};
}

}  // namespace hax::ops
