// Binding layer of the selective scan: tensor checks, dispatch to the kernels, autograd.
#include <torch/torch.h>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/check.h"
#include "ops/selective_scan/selective_scan.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "selective_scan";

// Σ over `dim` of partial sums, added one slice after another (a fixed order, whatever the
// thread count: each addition is elementwise).
at::Tensor sum_in_order(const at::Tensor& parts, int64_t dim) {
  if (parts.size(dim) == 0) return parts.sum(dim);
  at::Tensor acc = parts.select(dim, 0).clone();
  for (int64_t i = 1; i < parts.size(dim); ++i) acc.add_(parts.select(dim, i));
  return acc;
}

struct Dims {
  int64_t B, L, D, G, N;
};

Dims check_inputs(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& Bm,
                  const at::Tensor& Cm, const at::Tensor& init, int64_t checkpoint) {
  check_rank(kOp, "x", x, 3, "(B, L, D)");
  check_floating(kOp, "x", x);
  Dims d{x.size(0), x.size(1), x.size(2), 0, 0};
  check_rank(kOp, "B", Bm, 4, "(B, L, G, N)");
  d.G = Bm.size(2);
  d.N = Bm.size(3);
  HAX_CHECK(d.G > 0 && d.D % d.G == 0,
            "selective_scan: the group count G = {} (B's dim 2) must divide the channel count D = {}", d.G, d.D);
  HAX_CHECK(checkpoint > 0, "selective_scan: checkpoint interval {} must be positive", checkpoint);
  HAX_CHECK(!x.is_cuda() || d.N <= kSelectiveScanCudaMaxState,
            "selective_scan: the state size N = {} (B's dim 3) exceeds the CUDA kernels' maximum {}", d.N,
            kSelectiveScanCudaMaxState);
  check_shape(kOp, "delta", delta, {d.B, d.L, d.D}, "(B, L, D)");
  check_shape(kOp, "A", A, {d.D, d.N}, "(D, N)");
  check_shape(kOp, "B", Bm, {d.B, d.L, d.G, d.N}, "(B, L, G, N)");
  check_shape(kOp, "C", Cm, {d.B, d.L, d.G, d.N}, "(B, L, G, N)");
  for (auto [name, t] : {std::pair{"delta", &delta}, {"A", &A}, {"B", &Bm}, {"C", &Cm}}) check_same(kOp, name, *t, x);
  if (init.defined()) {
    check_shape(kOp, "init_state", init, {d.B, d.D, d.N}, "(B, D, N)");
    check_same(kOp, "init_state", init, x);
  }
  return d;
}

SelectiveScanParams make_params(const Dims& d, int64_t checkpoint, const at::Tensor& x, const at::Tensor& delta,
                                const at::Tensor& A, const at::Tensor& Bm, const at::Tensor& Cm,
                                const at::Tensor& init, const at::Tensor& seq) {
  SelectiveScanParams p;
  p.batch = d.B, p.seqlen = d.L, p.dim = d.D, p.ngroups = d.G, p.dstate = d.N;
  p.checkpoint = checkpoint;
  p.x = x.data_ptr(), p.delta = delta.data_ptr(), p.A = A.data_ptr(), p.Bm = Bm.data_ptr(), p.Cm = Cm.data_ptr();
  p.init_state = init.defined() ? init.data_ptr() : nullptr;
  p.seq_idx = seq.defined() ? seq.data_ptr<int32_t>() : nullptr;
  return p;
}

// seq_idx checked and converted to contiguous int32 on x's device (or undefined).
at::Tensor seq_on_device(const at::Tensor& seq_idx, const at::Tensor& x) {
  at::Tensor seq = check_seq_idx(kOp, seq_idx, x.size(0), x.size(1));
  return seq.defined() ? seq.to(x.device()).contiguous() : seq;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> selective_scan_forward(const at::Tensor& x0, const at::Tensor& delta0,
                                                                      const at::Tensor& A0, const at::Tensor& B0,
                                                                      const at::Tensor& C0, const at::Tensor& init0,
                                                                      const at::Tensor& seq_idx, int64_t checkpoint,
                                                                      bool save_checkpoints) {
  Dims d = check_inputs(x0, delta0, A0, B0, C0, init0, checkpoint);
  at::Tensor x = x0.contiguous(), delta = delta0.contiguous(), A = A0.contiguous(), Bm = B0.contiguous(),
             Cm = C0.contiguous(), init = init0.defined() ? init0.contiguous() : init0;
  at::Tensor seq = seq_on_device(seq_idx, x);
  SelectiveScanParams p = make_params(d, checkpoint, x, delta, A, Bm, Cm, init, seq);
  at::Tensor y = new_output({d.B, d.L, d.D}, x.options());
  at::Tensor fin = new_output({d.B, d.D, d.N}, x.options());
  // Checkpoints are float32 on CUDA (the kernels' math type), x's dtype on the CPU.
  at::Tensor ckpt = save_checkpoints ? new_output({d.B, p.nsegments(), d.D, d.N},
                                                  x.is_cuda() ? x.options().dtype(at::kFloat) : x.options())
                                     : at::Tensor();
  p.y = y.data_ptr(), p.final_state = fin.data_ptr();
  p.checkpoints = save_checkpoints ? ckpt.data_ptr() : nullptr;
  if (d.L > 0 && d.B * d.D * d.N > 0) {
    if (x.is_cuda()) {
      at::Tensor work = at::empty({selective_scan_cuda_forward_workspace(p)}, x.options().dtype(at::kFloat));
      p.workspace = work.data_ptr();
      HAX_CUDA_LAUNCH(kOp, x, selective_scan_forward_cuda(p, kernel_dtype(x), cuda_stream(x)));
    } else {
      selective_scan_forward_cpu(p, x.scalar_type());
    }
  } else {
    if (d.L > 0) y.zero_(), fin.zero_();                   // N = 0: no state, y = 0
    else init.defined() ? fin.copy_(init) : fin.zero_();  // L = 0: the state passes through
    if (save_checkpoints) ckpt.zero_();                    // (no entries to hold)
  }
  return {y, fin, ckpt};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SelectiveScanFunction : public torch::autograd::Function<SelectiveScanFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor delta, at::Tensor A, at::Tensor Bm,
                               at::Tensor Cm, at::Tensor init, at::Tensor seq_idx, int64_t checkpoint) {
    ctx->set_materialize_grads(false);  // an unused output (lse, final state) gets no tensor of zeros
    // Absent optional tensors arrive as empty tensors (LibTorch's autograd needs defined ones).
    if (init.numel() == 0 && init.dim() == 1) init = at::Tensor();
    if (seq_idx.numel() == 0 && seq_idx.dim() == 1) seq_idx = at::Tensor();
    // Contiguous once here: the forward and the saved copies share them.
    x = x.contiguous(), delta = delta.contiguous(), Bm = Bm.contiguous(), Cm = Cm.contiguous();
    auto [y, fin, ckpt] = selective_scan_forward(x, delta, A, Bm, Cm, init, seq_idx, checkpoint);
    at::Tensor seq = seq_on_device(seq_idx, x);
    ctx->saved_data["checkpoint"] = checkpoint;
    ctx->saved_data["has_init"] = init.defined();
    ctx->saved_data["has_seq"] = seq.defined();
    ctx->save_for_backward({x.contiguous(), delta.contiguous(), A.contiguous(), Bm.contiguous(), Cm.contiguous(),
                            init.defined() ? init.contiguous() : at::zeros({0}, x.options()),
                            seq.defined() ? seq : at::zeros({0}, x.options().dtype(at::kInt)), ckpt});
    return {y, fin};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &delta = s[1], &A = s[2], &Bm = s[3], &Cm = s[4], &ckpt = s[7];
    const bool has_init = ctx->saved_data["has_init"].toBool();
    const bool has_seq = ctx->saved_data["has_seq"].toBool();
    at::Tensor init = has_init ? s[5] : at::Tensor();
    at::Tensor seq = has_seq ? s[6] : at::Tensor();
    const int64_t checkpoint = ctx->saved_data["checkpoint"].toInt();
    Dims d{x.size(0), x.size(1), x.size(2), Bm.size(2), Bm.size(3)};
    at::Tensor dy = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(x);
    at::Tensor dfin = grads[1].defined() ? grads[1].contiguous() : at::Tensor();

    SelectiveScanGradParams gp;
    gp.fwd = make_params(d, checkpoint, x, delta, A, Bm, Cm, init, seq);
    gp.fwd.checkpoints = ckpt.data_ptr();
    gp.dy = dy.data_ptr();
    gp.dfinal = dfin.defined() ? dfin.data_ptr() : nullptr;
    if (x.is_cuda() && d.L > 0 && d.B * d.D * d.N > 0) {
      // Every gradient written by the kernels; dA, dB and dC reduced inside.
      at::Tensor dx = new_output_like(x), ddelta = new_output_like(delta), dA = new_output_like(A);
      at::Tensor dB = new_output_like(Bm), dC = new_output_like(Cm);
      at::Tensor dinit = has_init ? new_output_like(init) : at::Tensor();
      at::Tensor work = at::empty({selective_scan_cuda_backward_workspace(gp.fwd)}, x.options().dtype(at::kFloat));
      gp.dx = dx.data_ptr(), gp.ddelta = ddelta.data_ptr(), gp.dA = dA.data_ptr();
      gp.dB = dB.data_ptr(), gp.dC = dC.data_ptr();
      gp.dinit = has_init ? dinit.data_ptr() : nullptr;
      gp.workspace = work.data_ptr();
      HAX_CUDA_LAUNCH(kOp, x, selective_scan_backward_cuda(gp, kernel_dtype(x), cuda_stream(x)));
      return {dx, ddelta, dA, dB, dC, dinit, at::Tensor(), at::Tensor()};
    }
    const int64_t bpg = gp.fwd.blocks_per_group();
    at::Tensor dx = at::zeros_like(x), ddelta = at::zeros_like(delta);
    at::Tensor dA_part = at::zeros({d.B, d.D, d.N}, x.options());
    at::Tensor dB_part = at::zeros({d.B, d.L, d.G, bpg, d.N}, x.options());
    at::Tensor dC_part = at::zeros({d.B, d.L, d.G, bpg, d.N}, x.options());
    at::Tensor dinit = has_init ? at::zeros_like(init) : at::Tensor();
    gp.dx = dx.data_ptr(), gp.ddelta = ddelta.data_ptr(), gp.dA_part = dA_part.data_ptr();
    gp.dB_part = dB_part.data_ptr(), gp.dC_part = dC_part.data_ptr();
    gp.dinit = has_init ? dinit.data_ptr() : nullptr;
    if (d.L > 0 && d.B * d.D * d.N > 0) selective_scan_backward_cpu(gp, x.scalar_type());
    else if (d.L == 0 && has_init && dfin.defined()) dinit.copy_(dfin);
    // Sum the per-block B/C gradients over each group's blocks, and dA over the batch.
    at::Tensor dB = sum_in_order(dB_part, 3), dC = sum_in_order(dC_part, 3), dA = sum_in_order(dA_part, 0);
    return {dx, ddelta, dA, dB, dC, dinit, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> selective_scan(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& A,
                                                  const at::Tensor& B, const at::Tensor& C,
                                                  const at::Tensor& init_state, const at::Tensor& seq_idx,
                                                  int64_t checkpoint) {
  HAX_CHECK(x.defined(), "{}: tensor x is missing", kOp);
  if (autocast_cast_needed({x, delta, A, B, C, init_state}))
    return selective_scan(autocast_cast(x), autocast_cast(delta), autocast_cast(A), autocast_cast(B), autocast_cast(C),
                          autocast_cast(init_state), seq_idx, checkpoint);
  auto absent = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, x.options()); };
  auto out = SelectiveScanFunction::apply(x, delta, A, B, C, absent(init_state), absent(seq_idx), checkpoint);
  return {out[0], out[1]};
}

}  // namespace hax::ops
