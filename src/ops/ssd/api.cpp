// Binding layer of the SSD scan: tensor checks, dispatch to the kernels, autograd.
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/check.h"
#include "ops/ssd/ssd.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "ssd";
std::atomic<bool> g_wgmma{true};  // SsdParams::wgmma of every call (set_ssd_wgmma)
std::atomic<bool> g_sweep{false};  // SsdParams::sweep of every call (set_ssd_sweep)
std::atomic<bool> g_joint{true};  // SsdParams::joint_dbdc of every call (set_ssd_joint_dbdc)

// An environment switch read once: 1 on, 0 off, whatever the setter says; unset: -1.
int env_choice(const char* name, const char* meaning) {
  const char* e = std::getenv(name);
  if (!e) return -1;
  const std::string v(e);
  HAX_CHECK(v == "0" || v == "1", "{} = '{}' must be 0 or 1 ({})", name, v, meaning);
  return v == "1" ? 1 : 0;
}
// SsdParams::sweep and joint_dbdc, resolved here so that the CUDA scratch holds the sweep's pieces
// only for calls that run it.
bool sweep_on() {
  static const int env = env_choice("HAX_SSD_SEGSCAN", "0: the SSD's local states and state pass as two kernels, 1: one sweep");
  return env < 0 ? g_sweep.load() : env == 1;
}
bool joint_on() {
  static const int env =
      env_choice("HAX_SSD_DBDC_JOINT", "0: the SSD backward's dB and dC blocks apart, 1: one block for both and <dS, S>");
  return env < 0 ? g_joint.load() : env == 1;
}

struct Dims {
  int64_t B, L, H, P, G, N;
};

Dims check_inputs(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& Bm,
                  const at::Tensor& Cm, const at::Tensor& init, int64_t chunk) {
  check_rank(kOp, "x", x, 4, "(B, L, H, P)");
  check_floating(kOp, "x", x);
  Dims d{x.size(0), x.size(1), x.size(2), x.size(3), 0, 0};
  check_rank(kOp, "B", Bm, 4, "(B, L, G, N)");
  d.G = Bm.size(2);
  d.N = Bm.size(3);
  HAX_CHECK(d.G > 0 && d.H % d.G == 0, "ssd: the group count G = {} (B's dim 2) must divide the head count H = {}",
            d.G, d.H);
  HAX_CHECK(chunk > 0, "ssd: chunk size {} must be positive", chunk);
  check_shape(kOp, "dt", dt, {d.B, d.L, d.H}, "(B, L, H)");
  check_shape(kOp, "A", A, {d.H}, "(H)");
  check_shape(kOp, "B", Bm, {d.B, d.L, d.G, d.N}, "(B, L, G, N)");
  check_shape(kOp, "C", Cm, {d.B, d.L, d.G, d.N}, "(B, L, G, N)");
  for (auto [name, t] : {std::pair{"dt", &dt}, {"A", &A}, {"B", &Bm}, {"C", &Cm}}) check_same(kOp, name, *t, x);
  if (init.defined()) {
    check_shape(kOp, "init_state", init, {d.B, d.H, d.P, d.N}, "(B, H, P, N)");
    check_same(kOp, "init_state", init, x);
  }
  return d;
}

SsdParams make_params(const Dims& d, int64_t chunk, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                      const at::Tensor& Bm, const at::Tensor& Cm, const at::Tensor& init, const at::Tensor& seq) {
  SsdParams p;
  p.batch = d.B, p.seqlen = d.L, p.nheads = d.H, p.headdim = d.P, p.ngroups = d.G, p.dstate = d.N;
  p.chunk = chunk;
  p.x = x.data_ptr(), p.dt = dt.data_ptr(), p.A = A.data_ptr(), p.Bm = Bm.data_ptr(), p.Cm = Cm.data_ptr();
  p.init_state = init.defined() ? init.data_ptr() : nullptr;
  p.seq_idx = seq.defined() ? seq.data_ptr<int32_t>() : nullptr;
  p.wgmma = g_wgmma.load();
  p.sweep = sweep_on();
  p.joint_dbdc = joint_on();
  return p;
}

}  // namespace

void set_ssd_wgmma(bool on) { g_wgmma.store(on); }
bool ssd_wgmma() { return g_wgmma.load(); }
void set_ssd_sweep(bool on) { g_sweep.store(on); }
bool ssd_sweep() { return g_sweep.load(); }
void set_ssd_joint_dbdc(bool on) { g_joint.store(on); }
bool ssd_joint_dbdc() { return g_joint.load(); }

namespace {

// ssd_forward; with `prep` (CUDA), also the forward's cs, decay and C B^T (SsdParams::prep) in a
// float32 tensor of their own, which the backward takes instead of computing them again.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_impl(const at::Tensor& x0, const at::Tensor& dt0,
                                                            const at::Tensor& A0, const at::Tensor& B0,
                                                            const at::Tensor& C0, const at::Tensor& init0,
                                                            const at::Tensor& seq_idx, int64_t chunk,
                                                            at::Tensor* prep) {
  Dims d = check_inputs(x0, dt0, A0, B0, C0, init0, chunk);
  at::Tensor x = x0.contiguous(), dt = dt0.contiguous(), A = A0.contiguous(), Bm = B0.contiguous(),
             Cm = C0.contiguous(), init = init0.defined() ? init0.contiguous() : init0;
  at::Tensor seq = check_seq_idx(kOp, seq_idx, d.B, d.L);
  HAX_CHECK(!seq.defined() || seq.device() == x.device(), "ssd: seq_idx is on {} but the input is on {}",
            seq.defined() ? seq.device().str() : "", x.device().str());
  SsdParams p = make_params(d, chunk, x, dt, A, Bm, Cm, init, seq);
  at::Tensor y = new_output({d.B, d.L, d.H, d.P}, x.options());
  at::Tensor fin = new_output({d.B, d.H, d.P, d.N}, x.options());
  // The saved states are in x's dtype (on CUDA the passes run in float32 and store rounded states,
  // as mamba_ssm's kernels do).
  at::Tensor cst = new_output({d.B, d.H, p.nchunks(), d.N, d.P}, x.options());
  p.y = y.data_ptr(), p.final_state = fin.data_ptr(), p.chunk_states = cst.data_ptr();
  if (d.B * d.L == 0) {
    if (init.defined()) fin.copy_(init);  // an empty sequence passes the state through
    else fin.zero_();
  } else if (x.is_cuda()) {
    const int64_t blocks = ssd_cuda_max_grid(p);
    HAX_CHECK(blocks < (int64_t{1} << 31),
              "ssd: batch {} x length {} x {} heads (groups {}, d_state {}) needs {} CUDA thread blocks in one grid; "
              "the CUDA kernels take fewer than 2^31: split the batch, or the sequence (passing the final state on)",
              d.B, d.L, d.H, d.G, d.N, blocks);
    if (prep) {
      *prep = at::empty({ssd_cuda_prep_entries(p)}, x.options().dtype(at::kFloat));
      p.prep = prep->data_ptr<float>();
    }
    at::Tensor work = at::empty({ssd_cuda_workspace(p, false, x.element_size())}, x.options().dtype(at::kFloat));
    p.workspace = work.data_ptr();
    HAX_CUDA_LAUNCH(kOp, x, ssd_forward_cuda(p, kernel_dtype(x), cuda_stream(x)));
  } else {
    ssd_forward_cpu(p, x.scalar_type());
  }
  return {y, fin, cst};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> ssd_forward(const at::Tensor& x0, const at::Tensor& dt0,
                                                           const at::Tensor& A0, const at::Tensor& B0,
                                                           const at::Tensor& C0, const at::Tensor& init0,
                                                           const at::Tensor& seq_idx, int64_t chunk) {
  return forward_impl(x0, dt0, A0, B0, C0, init0, seq_idx, chunk, nullptr);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SsdFunction : public torch::autograd::Function<SsdFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor dt, at::Tensor A, at::Tensor Bm,
                               at::Tensor Cm, at::Tensor init, at::Tensor seq_idx, int64_t chunk) {
    ctx->set_materialize_grads(false);  // an unused output (lse, final state) gets no tensor of zeros
    // Absent optional tensors arrive as empty tensors (LibTorch's autograd needs defined ones).
    if (init.numel() == 0) init = at::Tensor();
    if (seq_idx.numel() == 0) seq_idx = at::Tensor();
    // Contiguous once here: the forward and the saved copies share them (views of a split
    // projection would otherwise be copied twice).
    x = x.contiguous(), dt = dt.contiguous(), Bm = Bm.contiguous(), Cm = Cm.contiguous();
    at::Tensor prep;  // (CUDA: the forward's cs, decay and C B^T, for the backward)
    auto [y, fin, cst] = forward_impl(x, dt, A, Bm, Cm, init, seq_idx, chunk, &prep);
    at::Tensor seq = check_seq_idx(kOp, seq_idx, x.size(0), x.size(1));
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["has_init"] = init.defined();
    ctx->saved_data["has_seq"] = seq.defined();
    ctx->save_for_backward({x.contiguous(), dt.contiguous(), A.contiguous(), Bm.contiguous(), Cm.contiguous(),
                            init.defined() ? init.contiguous() : at::zeros({0}, x.options()),
                            seq.defined() ? seq : at::zeros({0}, x.options().dtype(at::kInt)), cst,
                            prep.defined() ? prep : at::zeros({0}, x.options().dtype(at::kFloat))});
    return {y, fin};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &dt = s[1], &A = s[2], &Bm = s[3], &Cm = s[4], &cst = s[7];
    const bool has_init = ctx->saved_data["has_init"].toBool();
    const bool has_seq = ctx->saved_data["has_seq"].toBool();
    at::Tensor init = has_init ? s[5] : at::Tensor();
    at::Tensor seq = has_seq ? s[6] : at::Tensor();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    Dims d{x.size(0), x.size(1), x.size(2), x.size(3), Bm.size(2), Bm.size(3)};
    at::Tensor dy = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(x);
    at::Tensor dfin = grads[1].defined() ? grads[1].contiguous() : at::Tensor();

    SsdGradParams gp;
    gp.fwd = make_params(d, chunk, x, dt, A, Bm, Cm, init, seq);
    gp.fwd.chunk_states = cst.data_ptr();
    gp.dy = dy.data_ptr();
    gp.dfinal = dfin.defined() ? dfin.data_ptr() : nullptr;
    at::Tensor dinit = has_init ? new_output_like(init) : at::Tensor();
    gp.dinit = has_init ? dinit.data_ptr() : nullptr;
    if (d.B * d.L == 0) {
      if (has_init) dinit.copy_(dfin.defined() ? dfin : at::zeros_like(init));
      return {at::zeros_like(x),  at::zeros_like(dt), at::zeros_like(A), at::zeros_like(Bm),
              at::zeros_like(Cm), dinit,              at::Tensor(),      at::Tensor()};
    }
    if (x.is_cuda()) {
      // dB and dC are summed over each group's heads in the kernels; dA_part is float32.
      at::Tensor dx = new_output_like(x), ddt = new_output_like(dt);
      at::Tensor dB = new_output_like(Bm), dC = new_output_like(Cm);
      at::Tensor dA_part = new_output({d.B, d.H}, x.options().dtype(at::kFloat));
      if (s[8].numel() > 0) gp.fwd.prep = s[8].data_ptr<float>(), gp.fwd.prepped = true;  // (before the size)
      at::Tensor work = at::empty({ssd_cuda_workspace(gp.fwd, true, x.element_size())}, x.options().dtype(at::kFloat));
      gp.fwd.workspace = work.data_ptr();
      gp.dx = dx.data_ptr(), gp.ddt = ddt.data_ptr(), gp.dA_part = dA_part.data_ptr();
      gp.dB = dB.data_ptr(), gp.dC = dC.data_ptr();
      HAX_CUDA_LAUNCH(kOp, x, ssd_backward_cuda(gp, kernel_dtype(x), cuda_stream(x)));
      if (d.H == 0) dB.zero_(), dC.zero_();  // no heads: the kernels have nothing to sum
      return {dx, ddt, dA_part.sum(0).to(A.scalar_type()), dB, dC, dinit, at::Tensor(), at::Tensor()};
    }
    at::Tensor dx = at::empty_like(x), ddt = at::empty_like(dt);
    at::Tensor dA_part = at::zeros({d.B, d.H}, x.options());
    at::Tensor dB_head = at::zeros({d.B, d.L, d.H, d.N}, x.options());
    at::Tensor dC_head = at::zeros({d.B, d.L, d.H, d.N}, x.options());
    gp.dx = dx.data_ptr(), gp.ddt = ddt.data_ptr(), gp.dA_part = dA_part.data_ptr();
    gp.dB_head = dB_head.data_ptr(), gp.dC_head = dC_head.data_ptr();
    ssd_backward_cpu(gp, x.scalar_type());
    // Sum the per-head B/C gradients over each group's heads, and dA over the batch.
    const int64_t hpg = d.H / d.G;
    at::Tensor dB = dB_head.view({d.B, d.L, d.G, hpg, d.N}).sum(3);
    at::Tensor dC = dC_head.view({d.B, d.L, d.G, hpg, d.N}).sum(3);
    at::Tensor dA = dA_part.sum(0);
    return {dx, ddt, dA, dB, dC, dinit, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> ssd(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                                       const at::Tensor& B, const at::Tensor& C, const at::Tensor& init_state,
                                       const at::Tensor& seq_idx, int64_t chunk) {
  if (autocast_cast_needed({x, dt, A, B, C, init_state}))
    return ssd(autocast_cast(x), autocast_cast(dt), autocast_cast(A), autocast_cast(B), autocast_cast(C),
               autocast_cast(init_state), seq_idx, chunk);
  auto absent = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, x.options()); };
  auto out = SsdFunction::apply(x, dt, A, B, C, absent(init_state), absent(seq_idx), chunk);
  return {out[0], out[1]};
}

}  // namespace hax::ops
