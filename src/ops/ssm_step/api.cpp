// Binding layer of the decoding steps: tensor checks, dispatch to the CPU or CUDA kernels.
#include <torch/torch.h>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/check.h"
#include "ops/ssm_step/ssm_step.h"

namespace hax::ops {
namespace {

constexpr const char* kConvOp = "conv1d_step";
constexpr const char* kSsdOp = "ssd_step";
constexpr const char* kScanOp = "selective_scan_step";

// t itself when its dims after the first are contiguous (any stride between rows), else a
// contiguous copy.
at::Tensor rows_contiguous(const at::Tensor& t) {
  int64_t expect = 1;
  for (int64_t i = t.dim() - 1; i >= 1; --i) {
    if (t.size(i) != 1 && t.stride(i) != expect) return t.contiguous();
    expect *= t.size(i);
  }
  return t;
}

// An optional per-head / per-channel vector: undefined, or shape `shape` in x's dtype and device.
at::Tensor optional_vector(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x,
                           std::vector<int64_t> shape, const char* dims) {
  if (!t.defined()) return t;
  check_shape(op, name, t, shape, dims);
  check_same(op, name, t, x);
  return t.contiguous();
}

// The SSM state: `shape`, on x's device, x's dtype or float32, contiguous (updated in place).
void check_state(const char* op, const at::Tensor& state, const at::Tensor& x, std::vector<int64_t> shape,
                 const char* dims) {
  check_shape(op, "state", state, shape, dims);
  HAX_CHECK(state.scalar_type() == x.scalar_type() || state.scalar_type() == at::kFloat,
            "{}: state has dtype {} but must have x's dtype {} or be float32", op, c10::toString(state.scalar_type()),
            c10::toString(x.scalar_type()));
  HAX_CHECK(state.device() == x.device(), "{}: state is on {} but x is on {}", op, state.device().str(),
            x.device().str());
  HAX_CHECK(state.is_contiguous(), "{}: state (shape {}) must be contiguous: it is updated in place", op,
            shape_str(state.sizes()));
}

// B or C of a step: (B, G, N), G dividing `units` (heads or channels).
void check_bc(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x, int64_t batch,
              int64_t units, const char* unit_name, int64_t G, int64_t N) {
  check_shape(op, name, t, {batch, G, N}, "(B, G, N)");
  check_same(op, name, t, x);
  HAX_CHECK(G > 0 && units % G == 0, "{}: the group count G = {} ({}'s dim 1) must divide the {} count {}", op, G,
            name, unit_name, units);
}

}  // namespace

at::Tensor conv1d_step(const at::Tensor& x0, const at::Tensor& conv_state, const at::Tensor& weight0,
                       const at::Tensor& bias0, bool silu) {
  check_rank(kConvOp, "x", x0, 2, "(B, C)");
  check_floating(kConvOp, "x", x0);
  const int64_t Bsz = x0.size(0), C = x0.size(1);
  check_rank(kConvOp, "weight", weight0, 2, "(C, W)");
  const int64_t W = weight0.size(1);
  HAX_CHECK(W >= 1, "{}: the kernel width W = {} (weight's dim 1) must be at least 1", kConvOp, W);
  check_shape(kConvOp, "weight", weight0, {C, W}, "(C, W)");
  check_same(kConvOp, "weight", weight0, x0);
  at::Tensor bias = optional_vector(kConvOp, "bias", bias0, x0, {C}, "(C)");
  check_shape(kConvOp, "conv_state", conv_state, {Bsz, W - 1, C}, "(B, W-1, C)");
  check_same(kConvOp, "conv_state", conv_state, x0);
  HAX_CHECK(conv_state.is_contiguous(), "{}: conv_state (shape {}) must be contiguous: it is updated in place",
            kConvOp, shape_str(conv_state.sizes()));
  at::Tensor x = rows_contiguous(x0), weight = weight0.contiguous();
  at::Tensor out = new_output({Bsz, C}, x.options());
  if (Bsz * C == 0) return out;
  Conv1dStepParams p;
  p.batch = Bsz, p.channels = C, p.width = W, p.silu = silu;
  p.x = x.data_ptr(), p.x_stride = x.stride(0);
  p.weight = weight.data_ptr(), p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.state = conv_state.data_ptr(), p.out = out.data_ptr();
  if (x.is_cuda())
    HAX_CUDA_LAUNCH(kConvOp, x, conv1d_step_cuda(p, kernel_dtype(x), cuda_stream(x)));
  else
    conv1d_step_cpu(p, x.scalar_type());
  return out;
}

at::Tensor ssd_step(const at::Tensor& x0, const at::Tensor& dt0, const at::Tensor& A0, const at::Tensor& B0,
                    const at::Tensor& C0, const at::Tensor& D0, const at::Tensor& dt_bias0, bool dt_softplus,
                    const at::Tensor& state) {
  check_rank(kSsdOp, "x", x0, 3, "(B, H, P)");
  check_floating(kSsdOp, "x", x0);
  const int64_t Bsz = x0.size(0), H = x0.size(1), P = x0.size(2);
  check_shape(kSsdOp, "dt", dt0, {Bsz, H}, "(B, H)");
  check_same(kSsdOp, "dt", dt0, x0);
  check_shape(kSsdOp, "A", A0, {H}, "(H)");
  check_same(kSsdOp, "A", A0, x0);
  check_rank(kSsdOp, "B", B0, 3, "(B, G, N)");
  const int64_t G = B0.size(1), N = B0.size(2);
  check_bc(kSsdOp, "B", B0, x0, Bsz, H, "head", G, N);
  check_bc(kSsdOp, "C", C0, x0, Bsz, H, "head", G, N);
  at::Tensor D = optional_vector(kSsdOp, "D", D0, x0, {H}, "(H)");
  at::Tensor dt_bias = optional_vector(kSsdOp, "dt_bias", dt_bias0, x0, {H}, "(H)");
  check_state(kSsdOp, state, x0, {Bsz, H, P, N}, "(B, H, P, N)");
  at::Tensor x = rows_contiguous(x0), dt = rows_contiguous(dt0), A = A0.contiguous();
  at::Tensor Bm = rows_contiguous(B0), Cm = rows_contiguous(C0);
  at::Tensor y = new_output({Bsz, H, P}, x.options());
  if (y.numel() == 0) return y;
  SsdStepParams p;
  p.batch = Bsz, p.nheads = H, p.headdim = P, p.ngroups = G, p.dstate = N, p.dt_softplus = dt_softplus;
  p.x = x.data_ptr(), p.x_stride = x.stride(0);
  p.dt = dt.data_ptr(), p.dt_stride = dt.stride(0);
  p.dt_bias = dt_bias.defined() ? dt_bias.data_ptr() : nullptr;
  p.A = A.data_ptr();
  p.Bm = Bm.data_ptr(), p.B_stride = Bm.stride(0);
  p.Cm = Cm.data_ptr(), p.C_stride = Cm.stride(0);
  p.skip = D.defined() ? D.data_ptr() : nullptr;
  p.state = state.data_ptr(), p.y = y.data_ptr();
  if (x.is_cuda())
    HAX_CUDA_LAUNCH(kSsdOp, x, ssd_step_cuda(p, kernel_dtype(x), kernel_dtype(state), cuda_stream(x)));
  else
    ssd_step_cpu(p, x.scalar_type(), state.scalar_type());
  return y;
}

at::Tensor selective_scan_step(const at::Tensor& x0, const at::Tensor& delta0, const at::Tensor& A0,
                               const at::Tensor& B0, const at::Tensor& C0, const at::Tensor& D0,
                               const at::Tensor& delta_bias0, bool delta_softplus, const at::Tensor& state) {
  check_rank(kScanOp, "x", x0, 2, "(B, D)");
  check_floating(kScanOp, "x", x0);
  const int64_t Bsz = x0.size(0), Dm = x0.size(1);
  check_shape(kScanOp, "delta", delta0, {Bsz, Dm}, "(B, D)");
  check_same(kScanOp, "delta", delta0, x0);
  check_rank(kScanOp, "B", B0, 3, "(B, G, N)");
  const int64_t G = B0.size(1), N = B0.size(2);
  check_bc(kScanOp, "B", B0, x0, Bsz, Dm, "channel", G, N);
  check_bc(kScanOp, "C", C0, x0, Bsz, Dm, "channel", G, N);
  check_shape(kScanOp, "A", A0, {Dm, N}, "(D, N)");
  check_same(kScanOp, "A", A0, x0);
  at::Tensor D = optional_vector(kScanOp, "D", D0, x0, {Dm}, "(D)");
  at::Tensor delta_bias = optional_vector(kScanOp, "delta_bias", delta_bias0, x0, {Dm}, "(D)");
  check_state(kScanOp, state, x0, {Bsz, Dm, N}, "(B, D, N)");
  at::Tensor x = rows_contiguous(x0), delta = rows_contiguous(delta0), A = A0.contiguous();
  at::Tensor Bm = rows_contiguous(B0), Cm = rows_contiguous(C0);
  at::Tensor y = new_output({Bsz, Dm}, x.options());
  if (y.numel() == 0) return y;
  SelectiveScanStepParams p;
  p.batch = Bsz, p.dim = Dm, p.ngroups = G, p.dstate = N, p.delta_softplus = delta_softplus;
  p.x = x.data_ptr(), p.x_stride = x.stride(0);
  p.delta = delta.data_ptr(), p.delta_stride = delta.stride(0);
  p.delta_bias = delta_bias.defined() ? delta_bias.data_ptr() : nullptr;
  p.A = A.data_ptr();
  p.Bm = Bm.data_ptr(), p.B_stride = Bm.stride(0);
  p.Cm = Cm.data_ptr(), p.C_stride = Cm.stride(0);
  p.skip = D.defined() ? D.data_ptr() : nullptr;
  p.state = state.data_ptr(), p.y = y.data_ptr();
  if (x.is_cuda())
    HAX_CUDA_LAUNCH(kScanOp, x, selective_scan_step_cuda(p, kernel_dtype(x), kernel_dtype(state), cuda_stream(x)));
  else
    selective_scan_step_cpu(p, x.scalar_type(), state.scalar_type());
  return y;
}

}  // namespace hax::ops
