// Binding layer of HSA attention: tensor checks, the CUDA fast path (the pair plan built with
// LibTorch ops on the device, the kernels of cuda/hsa.cu) with its autograd, and the lists path.
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/backend.h"
#include "ops/check.h"
#include "ops/hsa_attention/hsa_attention.h"
#include "ops/hsa_attention/params.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "hsa_attention";

struct Dims {
  QkvDims qkv;
  int64_t S = 0, NC = 0;  // slots a query, chunks a row
};

Dims check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& chunks,
                  const at::Tensor& start, const at::Tensor& w, int64_t chunk, double scale) {
  Dims d;
  d.qkv = check_qkv(kOp, q, k, v);
  const int64_t B = d.qkv.B, L = d.qkv.L;
  check_rank(kOp, "chunks", chunks, 3, "(B, L, S)");
  d.S = chunks.size(2);
  check_shape(kOp, "chunks", chunks, {B, L, d.S}, "(B, L, S)");
  HAX_CHECK(chunks.scalar_type() == at::kInt, "{}: chunks must be int32 chunk numbers, got {}", kOp,
            c10::toString(chunks.scalar_type()));
  check_rank(kOp, "start", start, 2, "(B, NC)");
  d.NC = start.size(1);
  check_shape(kOp, "start", start, {B, d.NC}, "(B, NC)");
  HAX_CHECK(start.scalar_type() == at::kInt, "{}: start must be int32 key positions, got {}", kOp,
            c10::toString(start.scalar_type()));
  check_shape(kOp, "w", w, {B, L, d.S}, "(B, L, S)");
  HAX_CHECK(at::isFloatingType(w.scalar_type()), "{}: w must be floating weights, got {}", kOp, c10::toString(w.scalar_type()));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"chunks", chunks}, {"start", start}, {"w", w}})
    HAX_CHECK(t.device() == q.device(), "{}: {} is on {} but q is on {}", kOp, name, t.device().str(),
              q.device().str());
  HAX_CHECK(chunk >= 1, "{}: chunk {} must be >= 1 (keys per chunk)", kOp, chunk);
  HAX_CHECK(scale > 0 && std::isfinite(scale), "{}: scale {} must be positive and finite (e.g. 1/sqrt(D))", kOp,
            scale);
  // Value ranges (read on the host: always for CPU tensors, on CUDA only while check_device_values()).
  if ((!q.is_cuda() || check_device_values()) && chunks.numel() > 0) {
    const int64_t lo = chunks.min().item<int64_t>(), hi = chunks.max().item<int64_t>();
    HAX_CHECK(lo >= -1 && hi < d.NC, "{}: chunks holds values in [{}, {}]; they must be chunk numbers in [0, NC = {}) "
              "or -1", kOp, lo, hi, d.NC);
  }
  if ((!q.is_cuda() || check_device_values()) && start.numel() > 0) {
    const at::Tensor bad = (start != -1) & ((start < 0) | (start.to(at::kLong) + chunk > L));
    HAX_CHECK(!bad.any().item<bool>(), "{}: start must hold -1 or chunk starts in [0, L - chunk] = [0, {}]", kOp,
              L - chunk);
  }
  return d;
}

// The sizes of inputs that passed check_inputs.
Dims dims_of(const at::Tensor& q, const at::Tensor& v, const at::Tensor& chunks, const at::Tensor& start) {
  Dims d;
  d.qkv = {q.size(0), q.size(1), q.size(2), q.size(3), v.size(3)};
  d.S = chunks.size(2), d.NC = start.size(1);
  return d;
}

// Each slot's chunk (clamped into [0, NC)), its chunk's first key and whether the slot is valid
// (0 <= chunk < NC and start >= 0), all (B, L, S) int64 / bool. Needs NC >= 1.
struct Slots {
  at::Tensor chunk, first, valid;
};
Slots slots_of(const at::Tensor& chunks, const at::Tensor& start) {
  const int64_t B = chunks.size(0), L = chunks.size(1), S = chunks.size(2), NC = start.size(1);
  const at::Tensor c = chunks.to(at::kLong);
  Slots sl;
  sl.chunk = c.clamp(0, NC - 1);
  sl.first = start.to(at::kLong).gather(1, sl.chunk.view({B, L * S})).view({B, L, S});
  sl.valid = (c >= 0) & (c < NC) & (sl.first >= 0);
  return sl;
}

// The pair plan (params.h, HsaPlan) on the device, with LibTorch ops and no host synchronization.
struct PlanTensors {
  at::Tensor order, pair_key, first, count, tile_end, group_end, slot_end;
  int64_t P = 0, U = 0;

  HsaPlan view() const {
    HsaPlan p;
    p.order = order.data_ptr<int32_t>(), p.pair_key = pair_key.data_ptr<int32_t>();
    p.first = first.data_ptr<int32_t>(), p.count = count.data_ptr<int32_t>();
    p.tile_end = tile_end.data_ptr<int32_t>(), p.group_end = group_end.data_ptr<int32_t>();
    p.slot_end = slot_end.data_ptr<int32_t>();
    p.max_tiles = hsa_max_tiles(P, U), p.max_groups = hsa_max_groups(P, U), p.max_slots = hsa_max_slots(P, U);
    return p;
  }
};

PlanTensors build_plan(const at::Tensor& chunks, const at::Tensor& start) {
  const int64_t B = chunks.size(0), L = chunks.size(1), S = chunks.size(2), NC = start.size(1);
  PlanTensors pl;
  pl.P = B * L * S, pl.U = B * NC;
  const auto i64 = chunks.options().dtype(at::kLong);
  at::Tensor key;
  if (NC == 0) {
    key = at::zeros({pl.P}, i64);  // (U = 0: every pair invalid)
  } else {
    const Slots sl = slots_of(chunks, start);
    const at::Tensor row = at::arange(B, i64).view({B, 1, 1}) * NC;
    key = at::where(sl.valid, row + sl.chunk, at::full_like(sl.chunk, pl.U)).view({pl.P});
  }
  auto sorted = at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor& skey = std::get<0>(sorted);
  const at::Tensor us = at::arange(pl.U, i64);
  const at::Tensor first = at::searchsorted(skey, us);
  const at::Tensor count = at::searchsorted(skey, us, /*out_int32=*/false, /*right=*/true) - first;
  const at::Tensor tiles = at::floor_divide(count + (kHsaTilePairs - 1), kHsaTilePairs);
  const at::Tensor groups = at::floor_divide(tiles + (kHsaGroupTiles - 1), kHsaGroupTiles);
  auto i32 = [](const at::Tensor& t) { return t.to(at::kInt).contiguous(); };
  pl.order = i32(std::get<1>(sorted));
  pl.pair_key = i32(key);
  pl.first = i32(first), pl.count = i32(count);
  pl.tile_end = i32(tiles.cumsum(0)), pl.group_end = i32(groups.cumsum(0));
  pl.slot_end = i32(at::where(groups > 1, groups, at::zeros_like(groups)).cumsum(0));
  return pl;
}

HsaParams params_of(const Dims& d, int64_t chunk, double scale, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& start, const at::Tensor& w, const at::Tensor& o_pair,
                    const at::Tensor& lse_pair) {
  HsaParams p;
  p.batch = d.qkv.B, p.seqlen = d.qkv.L, p.nheads = d.qkv.H, p.dim = d.qkv.D, p.vdim = d.qkv.Dv;
  p.nslots = d.S, p.nchunks = d.NC, p.chunk = chunk, p.scale = scale;
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.start = start.data_ptr<int32_t>();
  p.w = w.data_ptr<float>();
  p.o_pair = o_pair.data_ptr(), p.lse_pair = lse_pair.data_ptr<float>();
  return p;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The CUDA fast path (bfloat16 q, k, v; any floating w, used in float32). Its inputs passed
// check_inputs in hsa_attention.
struct HsaFunction : public torch::autograd::Function<HsaFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor q0, at::Tensor k0, at::Tensor v0, at::Tensor w0,
                               at::Tensor chunks0, at::Tensor start0, int64_t chunk, double scale) {
    ctx->set_materialize_grads(false);
    const Dims d = dims_of(q0, v0, chunks0, start0);
    const at::Tensor q = aligned_contiguous(q0), k = aligned_contiguous(k0), v = aligned_contiguous(v0);
    const at::Tensor w = w0.to(at::kFloat).contiguous(), chunks = chunks0.contiguous(), start = start0.contiguous();
    const PlanTensors pl = build_plan(chunks, start);
    const int64_t H = d.qkv.H;
    at::Tensor o_pair = at::empty({pl.P, H, d.qkv.Dv}, q.options());
    at::Tensor lse_pair = at::empty({pl.P, H}, q.options().dtype(at::kFloat));
    at::Tensor out = new_output({d.qkv.B, d.qkv.L, H, d.qkv.Dv}, q.options());
    const HsaParams p = params_of(d, chunk, scale, q, k, v, start, w, o_pair, lse_pair);
    HAX_CUDA_LAUNCH(kOp, q, hsa_forward_cuda(p, pl.view(), out.data_ptr(), cuda_stream(q)));
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["w_dtype"] = (int64_t)w0.scalar_type();
    ctx->save_for_backward({q, k, v, w, chunks, start, o_pair, lse_pair, pl.order, pl.pair_key, pl.first, pl.count,
                            pl.tile_end, pl.group_end, pl.slot_end});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &w = s[3], &chunks = s[4], &start = s[5];
    const at::Tensor &o_pair = s[6], &lse_pair = s[7];
    PlanTensors pl;
    pl.order = s[8], pl.pair_key = s[9], pl.first = s[10], pl.count = s[11];
    pl.tile_end = s[12], pl.group_end = s[13], pl.slot_end = s[14];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto w_dtype = (at::ScalarType)ctx->saved_data["w_dtype"].toInt();
    const Dims d = dims_of(q, v, chunks, start);
    pl.P = d.qkv.B * d.qkv.L * d.S, pl.U = d.qkv.B * d.NC;
    const at::Tensor dout = grads[0].defined() ? aligned_contiguous(grads[0].to(q.scalar_type()))
                                               : at::zeros({d.qkv.B, d.qkv.L, d.qkv.H, d.qkv.Dv}, q.options());
    at::Tensor dq = new_output_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
    at::Tensor dw = new_output({d.qkv.B, d.qkv.L, d.S}, w.options());
    at::Tensor delta = at::empty({pl.P, d.qkv.H}, w.options());
    at::Tensor dq_pair = at::empty({pl.P, d.qkv.H, d.qkv.D}, q.options());
    HsaGradParams gp;
    gp.fwd = params_of(d, chunk, scale, q, k, v, start, w, o_pair, lse_pair);
    const HsaPlan plan = pl.view();
    at::Tensor part = at::empty({hsa_cuda_workspace(gp.fwd, plan)}, w.options());
    gp.dout = dout.data_ptr();
    gp.delta = delta.data_ptr<float>(), gp.dw = dw.data_ptr<float>();
    gp.dq_pair = dq_pair.data_ptr();
    gp.dq = dq.data_ptr(), gp.dk = dk.data_ptr(), gp.dv = dv.data_ptr();
    gp.workspace = part.data_ptr<float>();
    HAX_CUDA_LAUNCH(kOp, q, hsa_backward_cuda(gp, plan, cuda_stream(q)));
    return {dq, dk, dv, dw.to(w_dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// HAX_HSA_KERNELS=0 turns the fast path off (the lists path then runs everywhere), for comparisons.
bool hsa_kernels_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("HAX_HSA_KERNELS");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

}  // namespace

bool hsa_attention_native(const at::Tensor& q, const at::Tensor& v, int64_t chunk) {
  if (!hsa_kernels_enabled() || !cuda_backend_built() || !q.defined() || !v.defined() || !q.is_cuda() || q.dim() != 4 || v.dim() != 4)
    return false;
  const bool bf16 = q.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16;
  if (!bf16 && !(cuda_autocast_enabled() && at::isFloatingType(q.scalar_type()))) return false;
  const int64_t D = q.size(3), Dv = v.size(3);
  return chunk >= 1 && chunk <= kHsaCudaMaxChunk && D % 8 == 0 && Dv % 8 == 0 && D >= 8 && Dv >= 8 && D <= 128 &&
         Dv <= 128;
}

at::Tensor hsa_lists(const at::Tensor& chunks, const at::Tensor& start, int64_t chunk, int64_t H) {
  const int64_t B = chunks.size(0), L = chunks.size(1), S = chunks.size(2), NC = start.size(1);
  const auto o = chunks.options().dtype(at::kLong);
  if (NC == 0 || S == 0) return at::full({B, H, L, S, chunk}, -1, chunks.options().dtype(at::kInt));
  const Slots sl = slots_of(chunks, start);
  const at::Tensor keys = sl.first.unsqueeze(-1) + at::arange(chunk, o).view({1, 1, 1, chunk});  // (B, L, S, C)
  const at::Tensor valid = sl.valid.unsqueeze(-1) & (keys < L);
  const at::Tensor idx = at::where(valid, keys, at::full_like(keys, -1)).to(at::kInt);
  return idx.unsqueeze(1).expand({B, H, L, S, chunk}).contiguous();
}

at::Tensor hsa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& chunks,
                         const at::Tensor& start, const at::Tensor& w, int64_t chunk, double scale) {
  if (autocast_cast_needed({q, k, v}))
    return hsa_attention(autocast_cast(q), autocast_cast(k), autocast_cast(v), chunks, start, w, chunk, scale);
  const Dims d = check_inputs(q, k, v, chunks, start, w, chunk, scale);
  if (hsa_attention_native(q, v, chunk) && q.scalar_type() == at::kBFloat16)
    return HsaFunction::apply(q, k, v, w, chunks, start, chunk, scale)[0];
  // The definition: sparse_attention over the (query, slot) lists, w the segments' weights.
  const int64_t B = d.qkv.B, L = d.qkv.L, H = d.qkv.H;
  if (d.S == 0) return (v.sum() * 0).expand({B, L, H, d.qkv.Dv}).contiguous();  // no slots: 0, with gradients
  const at::Tensor idx = hsa_lists(chunks, start, chunk, H);  // (B, H, L, S, C)
  const at::Tensor seg_w = w.to(q.scalar_type()).unsqueeze(1).expand({B, H, L, d.S}).contiguous();
  return std::get<0>(sparse_attention(q, k, v, idx, {}, seg_w, {}, scale));
}

}  // namespace hax::ops
