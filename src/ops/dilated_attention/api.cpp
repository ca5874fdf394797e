// Binding layer of dilated attention (D, SW+D): tensor checks, the CUDA fast path (the causal
// kernels over the window and, as a band, over the compacted dilated keys, joined by lse) and the
// lists path. dilated_attention.h has the definition and the band's formulas.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/backend.h"
#include "ops/causal_attention/causal_attention.h"
#include "ops/check.h"
#include "ops/dilated_attention/dilated_attention.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "dilated_attention";

QkvDims check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t keys, int64_t stride,
                     int64_t window, double scale) {
  const QkvDims d = check_qkv(kOp, q, k, v);
  HAX_CHECK(keys >= 1, "{}: keys {} must be >= 1 (the most recent dilated keys each query sees)", kOp, keys);
  HAX_CHECK(stride >= 1, "{}: stride {} must be >= 1 (the dilation r: keys j with j mod r = r - 1)", kOp, stride);
  HAX_CHECK(window >= 0, "{}: window {} must be >= 0 (the sliding window beside the dilated keys; 0 = none)", kOp,
            window);
  HAX_CHECK(scale > 0 && std::isfinite(scale), "{}: scale {} must be positive and finite (e.g. 1/sqrt(D))", kOp,
            scale);
  return d;
}

// Checks the sizes and clamps keys, stride and window to L + 1, which changes no set (more than L
// keys or a window past L is all keys; a stride past L has no dilated key) and keeps the bounds'
// products in range.
void clamp_sizes(int64_t L, int64_t& keys, int64_t& stride, int64_t& window) {
  HAX_CHECK(keys >= 1 && stride >= 1 && window >= 0, "{}: keys {} and stride {} must be >= 1 and window {} >= 0",
            kOp, keys, stride, window);
  HAX_CHECK(L >= 0 && L < (int64_t(1) << 30), "{}: L = {} must be in [0, 2^30)", kOp, L);
  keys = std::min(keys, L + 1), stride = std::min(stride, L + 1), window = std::min(window, L + 1);
}

// The per-query bounds of the dilated part outside the window, over compacted key indices m
// (row m r + r - 1): [first, last], empty when first > last. i is a (L) int64 arange.
std::pair<at::Tensor, at::Tensor> dilated_bounds(const at::Tensor& i, int64_t keys, int64_t stride, int64_t window) {
  const at::Tensor c = at::floor_divide(i + 1, stride);                                  // c(i)
  const at::Tensor cw = at::floor_divide(at::clamp_min(i - window + 1, 0), stride);       // c(i - window)
  return {at::clamp_min(c - keys, 0), cw - 1};
}

// Whether some query sees a dilated key outside its window (otherwise the window alone is the set).
bool dilated_part_nonempty(int64_t L, int64_t keys, int64_t stride, int64_t window) {
  // Key m = 0 is the first seen, by queries [r + window - 1, (keys + 1) r - 2].
  return stride + window - 1 <= std::min(L - 1, (keys + 1) * stride - 2);
}

// HAX_D_KERNELS: 0 the lists everywhere, 1 (unset) the block tiles where they measured faster,
// 2 the block tiles wherever they run (for comparisons).
int dilated_tiles_mode() {
  static const int mode = [] {
    const char* e = std::getenv("HAX_D_KERNELS");
    if (!e) return 1;
    const std::string v(e);
    HAX_CHECK(v == "0" || v == "1" || v == "2",
              "HAX_D_KERNELS = '{}' must be 0 (the lists), 1 (the block tiles where they are faster) or 2 (the block "
              "tiles wherever they run)",
              v);
    return std::stoi(v);
  }();
  return mode;
}

}  // namespace

bool dilated_attention_native(const at::Tensor& q, const at::Tensor& v) {
  if (!q.defined() || !v.defined() || !q.is_cuda() || q.dim() != 4 || v.dim() != 4) return false;
  const bool bf16 = q.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16;
  if (!bf16 && !(cuda_autocast_enabled() && at::isFloatingType(q.scalar_type()))) return false;
  const int mode = dilated_tiles_mode();
  const bool fits = causal_attention_tensor_cores() && q.size(3) <= kCausalAttentionCudaMaxDim &&
                    v.size(3) <= kCausalAttentionCudaMaxDim && q.size(1) < (int64_t(1) << 30);
  return mode == 2 ? fits : mode == 1 && fits && q.size(1) >= kDilatedTilesMinLength;
}

at::Tensor dilated_lists(int64_t B, int64_t H, int64_t L, int64_t keys, int64_t stride, int64_t window,
                         const at::Device& device) {
  clamp_sizes(L, keys, stride, window);
  const int64_t K = std::max<int64_t>(1, std::min(L, keys + window));
  const auto o = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor i = at::arange(L, o).view({L, 1}), c = at::arange(K, o).view({1, K});
  auto [first, last] = dilated_bounds(i, keys, stride, window);
  const at::Tensor nd = at::clamp_min(last - first + 1, 0);                               // dilated keys
  const at::Tensor lo = window > 0 ? at::clamp_min(i - window + 1, 0) : i + 1, nw = i - lo + 1;  // window [lo, i]
  const at::Tensor idx = at::where(c < nd, (first + c) * stride + stride - 1,
                                   at::where(c < nd + nw, lo + c - nd, at::full_like(c, -1)));
  return idx.to(at::kInt).view({1, 1, L, K}).expand({B, H, L, K}).contiguous();
}

at::Tensor dilated_band(int64_t B, int64_t H, int64_t L, int64_t keys, int64_t stride, int64_t window,
                        const at::Device& device) {
  clamp_sizes(L, keys, stride, window);
  const auto o = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor i = at::arange(L, o);
  auto [first, last] = dilated_bounds(i, keys, stride, window);
  // Compacted key m (any m: the padding rows m >= L / r get first query L, so nobody sees them).
  const at::Tensor fq = at::clamp_max((i + 1) * stride + window - 1, L);
  const at::Tensor lq = at::clamp_max((i + keys + 1) * stride - 2, L - 1);
  return at::stack({first, last, fq, lq}).to(at::kInt).view({4, 1, 1, L}).expand({4, B, H, L}).contiguous();
}

namespace {

// The compacted dilated keys of t, k[:, r-1::r] (L / r rows), padded with zero rows to L: the band
// never lets a query see a padding row, but the tile holding the last real key loads some.
at::Tensor compact_keys(const at::Tensor& t, int64_t L, int64_t stride) {
  return at::constant_pad_nd(t.slice(1, stride - 1, L, stride), {0, 0, 0, 0, 0, L - L / stride});
}

// dkdv_splits for the band over L / r compacted keys: a tile of 64 of them is seen by about
// (64 + keys) r queries, whose tiles are split over blocks of about 16 tiles each (the float32
// partial sums cost splits x L / r rows, so at most 2 L rows).
int64_t band_splits(int64_t L, int64_t keys, int64_t stride, int64_t window) {
  const int64_t tiles = std::min(L, (kCausalKeyTile + keys) * stride + window) / kCausalKeyTile + 2;
  const int64_t most = std::clamp<int64_t>(2 * L / std::max<int64_t>(L / stride, kCausalKeyTile), 1, 4096);
  return std::clamp<int64_t>((tiles + 15) / 16, 1, most);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// SW+D on CUDA in bfloat16: the two parts' forwards joined by lse, and a backward that runs each
// part's causal backward with the union's out and lse (the same softmax as one attention, as
// ops/a_shaped_attention does), adding the dilated part's dq and its compacted keys' dk, dv into
// the window part's. Against autograd through the join this saves the join's backward, the
// gradient's scatter into a zeroed (B, L, H, D) and two full-size adds.
struct WindowDilatedFunction : public torch::autograd::Function<WindowDilatedFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor q0, at::Tensor k0, at::Tensor v0, int64_t keys,
                               int64_t stride, int64_t window, double scale) {
    ctx->set_materialize_grads(false);
    const QkvDims d{q0.size(0), q0.size(1), q0.size(2), q0.size(3), v0.size(3)};
    const at::Tensor q = aligned_contiguous(q0), k = aligned_contiguous(k0), v = aligned_contiguous(v0);
    const at::Tensor kc = compact_keys(k, d.L, stride), vc = compact_keys(v, d.L, stride);
    const at::Tensor band = dilated_band(d.B, d.H, d.L, keys, stride, window, q.device());
    at::Tensor o1 = new_output({d.B, d.L, d.H, d.Dv}, q.options()), o2 = new_output({d.B, d.L, d.H, d.Dv}, q.options());
    at::Tensor lse1 = new_output({d.B, d.H, d.L}, q.options().dtype(at::kFloat)), lse2 = new_output_like(lse1);
    CausalAttentionParams wp = causal_attention_params(d, window, scale, q, k, v);
    CausalAttentionParams dp = causal_attention_params(d, 0, scale, q, kc, vc, band);
    wp.out = o1.data_ptr(), wp.lse = lse1.data_ptr(), dp.out = o2.data_ptr(), dp.lse = lse2.data_ptr();
    HAX_CUDA_LAUNCH(kOp, q, {
      causal_attention_forward_cuda(wp, DType::kBF16, cuda_stream(q));
      causal_attention_forward_cuda(dp, DType::kBF16, cuda_stream(q));
    });
    const at::Tensor out = join_by_lse(o1, lse1.unsqueeze(-1), o2, lse2.unsqueeze(-1));
    const at::Tensor lse = at::logaddexp(lse1, lse2);
    ctx->saved_data["keys"] = keys;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["window"] = window;
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({q, k, v, kc, vc, band, out, lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &kc = s[3], &vc = s[4], &band = s[5], &out = s[6], &lse = s[7];
    const int64_t keys = ctx->saved_data["keys"].toInt(), stride = ctx->saved_data["stride"].toInt();
    const int64_t window = ctx->saved_data["window"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const QkvDims d{q.size(0), q.size(1), q.size(2), q.size(3), v.size(3)};
    const int64_t Lk = d.L / stride;
    const at::Tensor dout =
        grads[0].defined() ? aligned_contiguous(grads[0].to(out.scalar_type())) : at::zeros_like(out);
    const at::Tensor dlse = grads[1].defined() ? grads[1].to(at::kFloat).contiguous() : at::Tensor();
    at::Tensor dq = new_output_like(q), dk = new_output_like(k), dv = new_output_like(v);
    at::Tensor dq2 = new_output_like(q), dkc = new_output_like(kc), dvc = new_output_like(vc);
    // Each part's backward with the union's out and lse (Δ = dO·O - dlse of the union).
    auto grad_params = [&](const CausalAttentionParams& fwd, at::Tensor& gq, at::Tensor& gk, at::Tensor& gv) {
      CausalAttentionGradParams gp;
      gp.fwd = fwd;
      gp.fwd.out = out.data_ptr(), gp.fwd.lse = lse.data_ptr();
      gp.dout = dout.data_ptr();
      gp.dlse = dlse.defined() ? dlse.data_ptr() : nullptr;
      gp.dq = gq.data_ptr(), gp.dk = gk.data_ptr(), gp.dv = gv.data_ptr();
      return gp;
    };
    CausalAttentionGradParams wg = grad_params(causal_attention_params(d, window, scale, q, k, v), dq, dk, dv);
    CausalAttentionGradParams dg = grad_params(causal_attention_params(d, 0, scale, q, kc, vc, band), dq2, dkc, dvc);
    dg.key_rows = Lk, dg.dkdv_splits = band_splits(d.L, keys, stride, window);
    const auto f32 = q.options().dtype(at::kFloat);
    at::Tensor delta1 = at::empty({causal_attention_cuda_workspace(wg.fwd)}, f32), delta2 = at::empty_like(delta1);
    at::Tensor partial = at::empty({causal_attention_partial_entries(dg)}, f32);
    wg.workspace = delta1.data_ptr(), dg.workspace = delta2.data_ptr();
    dg.partial = dg.dkdv_splits > 1 ? partial.data_ptr<float>() : nullptr;
    HAX_CUDA_LAUNCH(kOp, q, {
      causal_attention_backward_cuda(wg, DType::kBF16, cuda_stream(q));
      causal_attention_backward_cuda(dg, DType::kBF16, cuda_stream(q));
    });
    dq.add_(dq2);
    dk.slice(1, stride - 1, d.L, stride).add_(dkc.narrow(1, 0, Lk));
    dv.slice(1, stride - 1, d.L, stride).add_(dvc.narrow(1, 0, Lk));
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The dilated keys outside the window: the causal kernels over the compacted keys padded to L
// rows, with dilated_band's visibility.
std::tuple<at::Tensor, at::Tensor> dilated_part(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const QkvDims& d, int64_t keys, int64_t stride, int64_t window,
                                                double scale) {
  const at::Tensor band = dilated_band(d.B, d.H, d.L, keys, stride, window, q.device());
  return causal_attention(q, compact_keys(k, d.L, stride), compact_keys(v, d.L, stride), {}, 0, scale, band,
                          d.L / stride, band_splits(d.L, keys, stride, window));
}

// The block-tile form on checked inputs of sizes d.
std::tuple<at::Tensor, at::Tensor> tiles_form(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const QkvDims& d, int64_t keys, int64_t stride, int64_t window,
                                              double scale) {
  clamp_sizes(d.L, keys, stride, window);
  if (window > 0 && !dilated_part_nonempty(d.L, keys, stride, window))
    return causal_attention(q, k, v, {}, window, scale);  // the window covers every D(i)
  if (window > 0 && q.is_cuda() && q.scalar_type() == at::kBFloat16 && causal_attention_tensor_cores()) {
    auto r = WindowDilatedFunction::apply(q, k, v, keys, stride, window, scale);
    return {r[0], r[1]};
  }
  auto [o2, lse2] = dilated_part(q, k, v, d, keys, stride, window, scale);
  if (window == 0) return {o2, lse2};
  auto [o1, lse1] = causal_attention(q, k, v, {}, window, scale);
  return {join_by_lse(o1, lse1.unsqueeze(-1), o2, lse2.unsqueeze(-1)), at::logaddexp(lse1, lse2)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> dilated_attention_tiles(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, int64_t keys, int64_t stride,
                                                           int64_t window, double scale) {
  return tiles_form(q, k, v, check_inputs(q, k, v, keys, stride, window, scale), keys, stride, window, scale);
}

std::tuple<at::Tensor, at::Tensor> dilated_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     int64_t keys, int64_t stride, int64_t window, double scale) {
  if (autocast_cast_needed({q, k, v}))
    return dilated_attention(autocast_cast(q), autocast_cast(k), autocast_cast(v), keys, stride, window, scale);
  const QkvDims d = check_inputs(q, k, v, keys, stride, window, scale);
  if (dilated_attention_native(q, v) && q.scalar_type() == at::kBFloat16)
    return tiles_form(q, k, v, d, keys, stride, window, scale);
  const at::Tensor idx = dilated_lists(d.B, d.H, d.L, keys, stride, window, q.device());
  auto [out, lse] = sparse_attention(q, k, v, idx, {}, {}, {}, scale);
  return {out, lse.squeeze(-1)};
}

}  // namespace hax::ops
