// Binding layer of causal attention: tensor checks, dispatch to the kernels, autograd.
#include <torch/torch.h>

#include <atomic>
#include <cmath>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/causal_attention/causal_attention.h"
#include "ops/check.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "causal_attention";

std::atomic<bool> g_tensor_cores{true};
std::atomic<bool> g_wgmma_products{true};

using Dims = QkvDims;

Dims check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window, double scale) {
  const Dims d = check_qkv(kOp, q, k, v);
  HAX_CHECK(window >= 0, "{}: window {} must be >= 0 (0 = every earlier key)", kOp, window);
  HAX_CHECK(scale > 0 && std::isfinite(scale), "{}: scale {} must be positive and finite (e.g. 1/sqrt(D))", kOp,
            scale);
  if (q.is_cuda()) {
    HAX_CHECK(d.D <= kCausalAttentionCudaMaxDim && d.Dv <= kCausalAttentionCudaMaxDim,
              "{}: head dims D = {} and Dv = {} must be at most {} on CUDA", kOp, d.D, d.Dv,
              kCausalAttentionCudaMaxDim);
    HAX_CHECK(d.L < (int64_t(1) << 30), "{}: L = {} must be below 2^30 on CUDA", kOp, d.L);
  }
  return d;
}

// The band (params.h), if given: int32 (4, B, H, L) on q's device; then no window and no seq_idx.
at::Tensor check_band(const at::Tensor& band, const Dims& d, const at::Tensor& q, int64_t window,
                      const at::Tensor& seq_idx) {
  if (!band.defined() || (band.numel() == 0 && band.dim() == 1)) return at::Tensor();
  check_shape(kOp, "band", band, {4, d.B, d.H, d.L}, "(4, B, H, L): first/last key of each query, first/last query of each key");
  HAX_CHECK(band.scalar_type() == at::kInt, "{}: band must be int32, got {}", kOp, c10::toString(band.scalar_type()));
  HAX_CHECK(band.device() == q.device(), "{}: band is on {} but q is on {}; band must be on q's device", kOp,
            band.device().str(), q.device().str());
  HAX_CHECK(window == 0, "{}: window {} must be 0 with a band (the band alone says who sees whom)", kOp, window);
  HAX_CHECK(!seq_idx.defined() || seq_idx.numel() == 0,
            "{}: seq_idx must be absent with a band (the band alone says who sees whom)", kOp);
  return band.contiguous();
}

CausalAttentionParams make_params(const Dims& d, int64_t window, double scale, const at::Tensor& q,
                                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& seq,
                                  const at::Tensor& band) {
  CausalAttentionParams p = causal_attention_params(d, window, scale, q, k, v, band);
  p.seq_idx = seq.defined() ? seq.data_ptr<int32_t>() : nullptr;
  p.tensor_cores = g_tensor_cores.load();
  return p;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CausalAttentionFunction : public torch::autograd::Function<CausalAttentionFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor q0, at::Tensor k0, at::Tensor v0, at::Tensor seq_idx,
                               int64_t window, double scale, at::Tensor band0, int64_t key_rows, int64_t dkdv_splits) {
    ctx->set_materialize_grads(false);  // an unused output (lse, final state) gets no tensor of zeros
    // An absent seq_idx arrives as an empty tensor (LibTorch's autograd needs defined ones).
    if (seq_idx.numel() == 0) seq_idx = at::Tensor();
    Dims d = check_inputs(q0, k0, v0, window, scale);
    at::Tensor seq = check_seq_idx(kOp, seq_idx, d.B, d.L);
    if (seq.defined())
      HAX_CHECK(seq.device() == q0.device(), "{}: seq_idx is on {} but q is on {}; seq_idx must be on q's device",
                kOp, seq.device().str(), q0.device().str());
    const at::Tensor band = check_band(band0, d, q0, window, seq);
    at::Tensor q = q0.contiguous(), k = k0.contiguous(), v = v0.contiguous();
    CausalAttentionParams p = make_params(d, window, scale, q, k, v, seq, band);
    at::Tensor out = new_output({d.B, d.L, d.H, d.Dv}, q.options());
    // lse is float32 on CUDA (the kernels' math type), q's dtype on the CPU.
    at::Tensor lse = new_output({d.B, d.H, d.L}, q.is_cuda() ? q.options().dtype(at::kFloat) : q.options());
    p.out = out.data_ptr(), p.lse = lse.data_ptr();
    if (d.B * d.H * d.L > 0) {
      if (q.is_cuda())
        HAX_CUDA_LAUNCH(kOp, q, causal_attention_forward_cuda(p, kernel_dtype(q), cuda_stream(q)));
      else
        causal_attention_forward_cpu(p, q.scalar_type());
    }
    ctx->saved_data["window"] = window;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_seq"] = seq.defined();
    ctx->saved_data["has_band"] = band.defined();
    ctx->saved_data["tensor_cores"] = p.tensor_cores;
    ctx->saved_data["key_rows"] = key_rows;
    ctx->saved_data["dkdv_splits"] = dkdv_splits;
    ctx->save_for_backward({q, k, v, seq.defined() ? seq : at::empty({0}, at::kInt), out, lse,
                            band.defined() ? band : at::empty({0}, at::kInt)});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[4], &lse = s[5];
    at::Tensor seq = ctx->saved_data["has_seq"].toBool() ? s[3] : at::Tensor();
    at::Tensor band = ctx->saved_data["has_band"].toBool() ? s[6] : at::Tensor();
    const int64_t window = ctx->saved_data["window"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    Dims d{q.size(0), q.size(1), q.size(2), q.size(3), v.size(3)};
    at::Tensor dout = grads[0].defined() ? grads[0].to(out.scalar_type()).contiguous() : at::zeros_like(out);
    at::Tensor dlse = grads[1].defined() ? grads[1].to(lse.scalar_type()).contiguous() : at::Tensor();
    CausalAttentionGradParams gp;
    gp.fwd = make_params(d, window, scale, q, k, v, seq, band);
    gp.fwd.out = out.data_ptr(), gp.fwd.lse = lse.data_ptr();
    at::Tensor dq = new_output_like(q), dk = new_output_like(k), dv = new_output_like(v);
    gp.dout = dout.data_ptr();
    gp.dlse = dlse.defined() ? dlse.data_ptr() : nullptr;
    gp.dq = dq.data_ptr(), gp.dk = dk.data_ptr(), gp.dv = dv.data_ptr();
    if (d.B * d.H * d.L > 0) {
      if (q.is_cuda()) {
        // The tile family the forward used (the switch may have changed since).
        gp.fwd.tensor_cores = ctx->saved_data["tensor_cores"].toBool();
        at::Tensor delta = at::empty({causal_attention_cuda_workspace(gp.fwd)}, q.options().dtype(at::kFloat));
        gp.workspace = delta.data_ptr();
        gp.key_rows = ctx->saved_data["key_rows"].toInt();
        gp.dkdv_splits = ctx->saved_data["dkdv_splits"].toInt();
        at::Tensor partial = at::empty({causal_attention_partial_entries(gp)}, q.options().dtype(at::kFloat));
        gp.partial = gp.dkdv_splits > 1 ? partial.data_ptr<float>() : nullptr;
        HAX_CUDA_LAUNCH(kOp, q, causal_attention_backward_cuda(gp, kernel_dtype(q), cuda_stream(q)));
      } else {
        causal_attention_backward_cpu(gp, q.scalar_type());
      }
    }
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

CausalAttentionParams causal_attention_params(const QkvDims& d, int64_t window, double scale, const at::Tensor& q,
                                              const at::Tensor& k, const at::Tensor& v, const at::Tensor& band) {
  CausalAttentionParams p;
  p.batch = d.B, p.seqlen = d.L, p.nheads = d.H, p.dim = d.D, p.vdim = d.Dv;
  p.window = window;
  p.scale = scale;
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.band = band.defined() ? band.data_ptr<int32_t>() : nullptr;
  p.tensor_cores = true;
  p.wgmma_products = g_wgmma_products.load();
  return p;
}

void set_causal_attention_tensor_cores(bool on) { g_tensor_cores.store(on); }
bool causal_attention_tensor_cores() { return g_tensor_cores.load(); }
void set_causal_attention_wgmma_products(bool on) { g_wgmma_products.store(on); }
bool causal_attention_wgmma_products() { return g_wgmma_products.load(); }

std::tuple<at::Tensor, at::Tensor> causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& seq_idx, int64_t window, double scale,
                                                    const at::Tensor& band, int64_t key_rows, int64_t dkdv_splits) {
  if (autocast_cast_needed({q, k, v}))
    return causal_attention(autocast_cast(q), autocast_cast(k), autocast_cast(v), seq_idx, window, scale, band,
                            key_rows, dkdv_splits);
  const Dims d = check_inputs(q, k, v, window, scale);  // before apply, which needs defined tensors
  const at::Tensor b = check_band(band, d, q, window, seq_idx);
  HAX_CHECK(key_rows >= 0 && dkdv_splits >= 1 && dkdv_splits <= 65535,
            "{}: key_rows {} must be >= 0 and dkdv_splits {} in [1, 65535]", kOp, key_rows, dkdv_splits);
  HAX_CHECK(b.defined() || (key_rows == 0 && dkdv_splits == 1),
            "{}: key_rows {} and dkdv_splits {} need a band (they describe its keys)", kOp, key_rows, dkdv_splits);
  auto out = CausalAttentionFunction::apply(q, k, v, seq_idx.defined() ? seq_idx : at::empty({0}, at::kInt), window,
                                            scale, band.defined() ? band : at::empty({0}, at::kInt), key_rows,
                                            dkdv_splits);
  return {out[0], out[1]};
}

}  // namespace hax::ops
