// Binding layer of sparse attention: tensor checks, dispatch to the kernels, autograd.
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/attention/blocks.h"
#include "ops/backend.h"
#include "ops/check.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "sparse_attention";

std::atomic<AttentionPath> g_path{AttentionPath::kAuto};
std::atomic<bool> g_wgmma_products{true};

struct Dims {
  int64_t B, L, Lk, H, D, Dv, S, K;
};

// An index tensor must live on q's device.
void check_device(const char* name, const at::Tensor& t, const at::Tensor& q) {
  HAX_CHECK(t.device() == q.device(), "{}: {} is on {} but q is on {}; the index tensors must be on q's device", kOp,
            name, t.device().str(), q.device().str());
}

void check_int32(const char* name, const at::Tensor& t) {
  HAX_CHECK(t.scalar_type() == at::kInt, "{}: {} has dtype {} but must be int32", kOp, name,
            c10::toString(t.scalar_type()));
}

Dims check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx,
                  const at::Tensor& bias, const at::Tensor& seg_w, const at::Tensor& q_order, double scale) {
  check_rank(kOp, "q", q, 4, "(B, L, H, D)");
  check_floating(kOp, "q", q);
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
  check_device("idx", idx, q);
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
    check_device("q_order", q_order, q);
  }
  HAX_CHECK(scale > 0 && std::isfinite(scale), "{}: scale {} must be positive and finite (e.g. 1/sqrt(D))", kOp,
            scale);
  if (q.is_cuda())
    HAX_CHECK(d.D <= kAttentionCudaMaxDim && d.Dv <= kAttentionCudaMaxDim,
              "{}: head dims D = {} and Dv = {} must be at most {} for the CUDA kernels", kOp, d.D, d.Dv,
              kAttentionCudaMaxDim);
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

// The checks above for tensors on a CUDA device: one min/max reduction (idx) or one sort (q_order)
// on the device and a single copy of the verdict to the host; only a failing tensor is copied whole
// to the host, where the checks above name the offending entry.
void check_idx_values_cuda(const at::Tensor& idx, const Dims& d) {
  if (idx.numel() == 0) return;
  const auto [lo, hi] = at::aminmax(idx);
  const at::Tensor range = at::stack({lo, hi}).cpu();
  const int32_t* r = range.data_ptr<int32_t>();
  if (r[0] >= -1 && r[1] < d.Lk) return;
  check_idx_values(idx.cpu(), d);
  fail("{}: idx holds {} .. {} but its entries must be in [0, Lk = {}) or -1", kOp, r[0], r[1], d.Lk);
}

void check_permutation_cuda(const at::Tensor& q_order, const Dims& d) {
  if (q_order.numel() == 0) return;
  const at::Tensor sorted = std::get<0>(at::sort(q_order.view({d.B * d.H, d.L}), 1));
  if (sorted.eq(at::arange(d.L, sorted.options()).unsqueeze(0)).all().item<bool>()) return;
  check_permutation(q_order.cpu(), d);
  fail("{}: q_order must be a permutation of 0..L-1 (L = {}) for every (b, h)", kOp, d.L);
}

// Checked, contiguous inputs; idx as (B, H, L, S, K).
struct Inputs {
  Dims d;
  at::Tensor q, k, v, idx, bias, seg_w, q_order;
};

// in.q_order, contiguous and checked to be a permutation per (b, h) (on a CUDA device only while
// check_device_values() is on: a read-back).
void set_q_order(Inputs& in, const at::Tensor& q_order) {
  in.q_order = q_order.contiguous();
  if (!in.q_order.is_cuda()) check_permutation(in.q_order, in.d);
  else if (check_device_values()) check_permutation_cuda(in.q_order, in.d);
}

Inputs prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx,
               const at::Tensor& bias, const at::Tensor& seg_w, const at::Tensor& q_order, double scale) {
  Inputs in;
  in.d = check_inputs(q, k, v, idx, bias, seg_w, q_order, scale);
  const Dims& d = in.d;
  in.q = q.contiguous(), in.k = k.contiguous(), in.v = v.contiguous();
  in.idx = idx.reshape({d.B, d.H, d.L, d.S, d.K}).contiguous();
  // On a CUDA device the value checks read the tensors back (a host synchronization), so they run
  // only while check_device_values() is on; the kernels ignore out-of-range entries either way.
  // On the CPU the forward kernel checks idx as it reads it (AttentionParams::invalid).
  if (in.idx.is_cuda() && check_device_values()) check_idx_values_cuda(in.idx, d);
  if (bias.defined()) in.bias = bias.contiguous();
  if (seg_w.defined()) in.seg_w = seg_w.contiguous();
  if (q_order.defined()) set_q_order(in, q_order);
  return in;
}

AttentionParams make_params(const Inputs& in, double scale) {
  const Dims& d = in.d;
  AttentionParams p;
  p.batch = d.B, p.seqlen = d.L, p.keylen = d.Lk, p.nheads = d.H, p.dim = d.D, p.vdim = d.Dv;
  p.nseg = d.S, p.maxkeys = d.K;
  p.scale = scale;
  p.q = in.q.data_ptr(), p.k = in.k.data_ptr(), p.v = in.v.data_ptr();
  p.idx = in.idx.defined() ? in.idx.data_ptr<int32_t>() : nullptr;  // (undefined: a plan of intervals)
  p.bias = in.bias.defined() ? in.bias.data_ptr() : nullptr;
  p.seg_w = in.seg_w.defined() ? in.seg_w.data_ptr() : nullptr;
  p.q_order = in.q_order.defined() ? in.q_order.data_ptr<int32_t>() : nullptr;
  p.path = g_path.load();
  p.wgmma_products = g_wgmma_products.load();
  return p;
}

// The CUDA tile path's plan (params.h, AttentionTilePlan), built on the device. Its unions stay in
// the plan kernel's hash-slot order: the sort they would need to be ascending cost a quarter of
// the kernel (H100, HAX at 64K: 1.07 -> 0.82 ms without it), and nothing here reads the order.
struct TilePlan {
  at::Tensor count, keys, mask;  // count: (blocks), or (blocks + 1) with the overflow counter last (build_tile_plan)
  at::Tensor uses;  // (B*H, Lk) int32 key_uses of a band's plan with few-key sums on, or undefined
  AttentionTilePlan view() const {
    AttentionTilePlan v;
    v.count = count.data_ptr<int32_t>(), v.keys = keys.data_ptr<int32_t>();
    v.mask = reinterpret_cast<uint64_t*>(mask.data_ptr<int64_t>());
    v.key_uses = uses.defined() ? uses.data_ptr<int32_t>() : nullptr;
    v.overflow = overflow();
    return v;
  }
  // The plan's count of overflowing blocks (AttentionTilePlan::overflow), where it has one.
  int32_t* overflow() const {
    const int64_t blocks = keys.size(0);
    return count.numel() > blocks ? count.data_ptr<int32_t>() + blocks : nullptr;
  }
};

// backward: a backward may follow (the key counts serve only it).
TilePlan build_tile_plan(const Inputs& in, const AttentionParams& p, bool backward) {
  const int64_t blocks = in.d.B * in.d.H * attention_tile_blocks(in.d.L);
  const auto i32 = in.q.options().dtype(at::kInt);
  TilePlan plan;
  plan.count = at::empty({blocks + 1}, i32);  // (the last entry counts the blocks that overflow)
  plan.count.narrow(0, blocks, 1).zero_();
  plan.keys = at::empty({blocks, kAttentionTileMaxKeys}, i32);
  plan.mask = at::empty({blocks, kAttentionTilesPerBlock, kAttentionTileQueries}, i32.dtype(at::kLong));
  // A band's plan (HAX's union) without a bias, a backward to come: count each key's blocks, for
  // the backward's bfloat16 sums of the keys of few blocks.
  if (backward && p.band && !p.bias && sparse_attention_few_key_sums()) plan.uses = at::zeros({in.d.B * in.d.H * in.d.Lk}, i32);
  HAX_CUDA_LAUNCH(kOp, in.q, sparse_attention_tile_plan_cuda(p, plan.view(), cuda_stream(in.q), /*sorted=*/false));
  return plan;
}

struct CudaGrads {
  at::Tensor dq, dk, dv, dbias, dseg_w;  // in q's dtype; dbias, dseg_w undefined when absent
};

// The CUDA backward. dk, dv and dbias are summed in float32 accumulators and cast to q's dtype:
// zeroed and summed with atomics by default; in deterministic mode, every key's sums are written
// by a key pass over the list entries sorted by key (a stable sort of idx per (b, h) and a search
// for each key's first entry, both on the device), in work chunks of at most kAttentionKeyChunk
// entries of one key.
// With a tile plan (the forward used the tile path), the planned query blocks go to the tile
// kernels, which need the forward's output `out`, and the per-query kernels take the rest.
CudaGrads backward_cuda(const Inputs& in, const at::Tensor& lse, const at::Tensor& dout, const at::Tensor& dlse,
                        double scale, AttentionPath path, const TilePlan* tiles, const at::Tensor& out) {
  const Dims& d = in.d;
  const bool det = deterministic();
  const auto f32 = in.q.options().dtype(at::kFloat);
  // With the plan's key_uses, only the float32 rows of keys of many blocks are used (zeroed and cast
  // by sparse_attention_many_use_rows_cuda); the other keys' sums go to g.dk, g.dv directly.
  const bool few = tiles && tiles->uses.defined() && !in.bias.defined();
  auto accumulator = [&](std::vector<int64_t> sizes) {
    return (det && !tiles) || few ? new_output(sizes, f32) : at::zeros(sizes, f32);
  };
  CudaGrads g;
  g.dq = new_output_like(in.q);
  at::Tensor dk = accumulator({d.B, d.Lk, d.H, d.D}), dv = accumulator({d.B, d.Lk, d.H, d.Dv});
  at::Tensor dbias = in.bias.defined() ? accumulator({d.B, d.H, d.Lk}) : at::Tensor();
  g.dseg_w = in.seg_w.defined() ? new_output_like(in.seg_w) : at::Tensor();
  if (d.B * d.H * d.L == 0) {
    dk.zero_(), dv.zero_();
    if (dbias.defined()) dbias.zero_();
  } else {
    AttentionGradParams gp;
    gp.fwd = make_params(in, scale);
    gp.fwd.path = path;
    gp.fwd.lse = lse.data_ptr();
    gp.dout = dout.data_ptr();
    gp.dlse = dlse.defined() ? dlse.data_ptr() : nullptr;
    gp.dq = g.dq.data_ptr(), gp.dk = dk.data_ptr(), gp.dv = dv.data_ptr();
    gp.dbias = dbias.defined() ? dbias.data_ptr() : nullptr;
    gp.dseg_w = g.dseg_w.defined() ? g.dseg_w.data_ptr() : nullptr;
    gp.deterministic = det && !tiles;
    if (tiles) gp.fwd.tile_count = tiles->count.data_ptr<int32_t>(), gp.fwd.tile_overflow = tiles->overflow();
    if (few) {
      // (every row is written: stored by its one block, or zeroed by many_use_rows first)
      g.dk = new_output({d.B, d.Lk, d.H, d.D}, in.q.options());
      g.dv = new_output({d.B, d.Lk, d.H, d.Dv}, in.q.options());
      gp.key_uses = tiles->uses.data_ptr<int32_t>();
      gp.dk_bf16 = g.dk.data_ptr(), gp.dv_bf16 = g.dv.data_ptr();
      HAX_CUDA_LAUNCH(kOp, in.q, sparse_attention_many_use_rows_cuda(gp, /*finish=*/false, cuda_stream(in.q)));
    }
    at::Tensor key_entries, key_start, chunk_start, partial_start, partials;
    if (gp.deterministic) {
      const int64_t BH = d.B * d.H, N = d.L * d.S * d.K;
      if (N > 0) {
        // Entries e = (i*S + s)*K + t of each (b, h) sorted by key, stable: ascending e within a
        // key, the padding (-1) first; key j's entries start at the first position holding >= j.
        auto sorted = at::sort(in.idx.view({BH, N}), /*stable=*/true, /*dim=*/1, /*descending=*/false);
        key_entries = std::get<1>(sorted).to(at::kInt).contiguous();
        const at::Tensor keys = at::arange(d.Lk + 1, in.idx.options()).unsqueeze(0).expand({BH, d.Lk + 1}).contiguous();
        key_start = at::searchsorted(std::get<0>(sorted), keys, /*out_int32=*/true, /*right=*/false).contiguous();
        gp.key_entries = key_entries.data_ptr<int32_t>();
      } else {
        key_start = at::zeros({BH, d.Lk + 1}, in.idx.options());
      }
      gp.key_start = key_start.data_ptr<int32_t>();
      // Work chunks of the key pass: max(1, ceil(entries / kAttentionKeyChunk)) per key, and
      // partial rows for the keys of several chunks (one copy of the two totals to the host).
      const at::Tensor counts =
          (key_start.narrow(1, 1, d.Lk) - key_start.narrow(1, 0, d.Lk)).to(at::kLong).reshape({BH * d.Lk});
      const at::Tensor chunks = at::div(counts + (kAttentionKeyChunk - 1), kAttentionKeyChunk, "trunc").clamp_min(1);
      const at::Tensor zero = at::zeros({1}, counts.options());
      chunk_start = at::cat({zero, chunks.cumsum(0)});
      partial_start = at::cat({zero, at::where(chunks > 1, chunks, at::zeros_like(chunks)).cumsum(0)});
      const at::Tensor totals = at::stack({chunk_start[BH * d.Lk], partial_start[BH * d.Lk]}).cpu();
      gp.key_chunks = totals[0].item<int64_t>();
      partials = at::empty({std::max<int64_t>(1, totals[1].item<int64_t>() * (d.D + d.Dv + 1))}, f32);
      gp.key_chunk_start = chunk_start.data_ptr<int64_t>();
      gp.key_partial_start = partial_start.data_ptr<int64_t>();
      gp.key_partials = partials.data_ptr<float>();
    }
    const int64_t ws = sparse_attention_cuda_workspace(gp);
    at::Tensor work = ws > 0 ? at::empty({ws}, f32) : at::Tensor();
    gp.workspace = ws > 0 ? work.data_ptr<float>() : nullptr;
    HAX_CUDA_LAUNCH(kOp, in.q, sparse_attention_backward_cuda(gp, kernel_dtype(in.q), cuda_stream(in.q)));
    if (tiles) {
      gp.fwd.out = out.data_ptr();
      HAX_CUDA_LAUNCH(kOp, in.q, sparse_attention_tile_backward_cuda(gp, tiles->view(), cuda_stream(in.q)));
    }
    if (few) HAX_CUDA_LAUNCH(kOp, in.q, sparse_attention_many_use_rows_cuda(gp, /*finish=*/true, cuda_stream(in.q)));
  }
  const auto dt = in.q.scalar_type();
  if (few) return g;
  g.dk = dk.to(dt), g.dv = dv.to(dt);
  if (dbias.defined()) g.dbias = dbias.to(dt);
  return g;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SparseAttentionFunction : public torch::autograd::Function<SparseAttentionFunction> {
  // plan_count, plan_keys, plan_mask, plan_uses: a tile plan built by the caller (sparse_attention_union; plan_uses
  // empty unless it counted its keys' blocks),
  // or empty tensors (the forward builds it from idx when the tile path applies).
  static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor idx,
                               at::Tensor bias, at::Tensor seg_w, at::Tensor q_order, double scale,
                               bool record, at::Tensor plan_count, at::Tensor plan_keys, at::Tensor plan_mask,
                               at::Tensor plan_uses) {
    ctx->set_materialize_grads(false);  // an unused output (lse, final state) gets no tensor of zeros
    // Absent optional tensors arrive as empty tensors (LibTorch's autograd needs defined ones).
    auto present = [](const at::Tensor& t) { return t.numel() > 0 ? t : at::Tensor(); };
    Inputs in = prepare(q, k, v, idx, present(bias), present(seg_w), present(q_order), scale);
    const Dims& d = in.d;
    AttentionParams p = make_params(in, scale);
    const bool cuda = in.q.is_cuda();
    // lse is float32 on CUDA (the kernels' math type), q's dtype on the CPU.
    at::Tensor out = cuda ? new_output({d.B, d.L, d.H, d.Dv}, in.q.options())
                          : at::empty({d.B, d.L, d.H, d.Dv}, in.q.options());
    at::Tensor lse = cuda ? new_output({d.B, d.H, d.L, d.S}, in.q.options().dtype(at::kFloat))
                          : at::empty({d.B, d.H, d.L, d.S}, in.q.options());
    p.out = out.data_ptr(), p.lse = lse.data_ptr();
    // CUDA: the tile path takes the query blocks whose key union fits (params.h), the per-query
    // kernels the rest.
    const bool tiles = cuda && d.B * d.H * d.L > 0 && attention_tiles_apply(p, kernel_dtype(in.q), deterministic());
    TilePlan plan;
    const bool given = plan_count.numel() > 0;
    HAX_CHECK(!given || tiles, "{}: a tile plan was given but the tile path does not apply to these inputs", kOp);
    if (tiles) {
      plan = given ? TilePlan{plan_count, plan_keys, plan_mask, present(plan_uses)} : build_tile_plan(in, p, record);
      p.tile_count = plan.count.data_ptr<int32_t>(), p.tile_overflow = plan.overflow();
    }
    // CPU, one segment, a backward to come: the forward records its key unions for it.
    at::Tensor union_count, union_keys, union_mult;
    if (!cuda && record && d.S == 1 && d.B * d.H * d.L > 0) {
      const CpuUnionShape u = sparse_attention_cpu_unions(p);
      if (u.limit > 0) {
        union_count = at::empty({u.items}, at::kInt);
        union_keys = at::empty({u.items, u.limit}, at::kInt);  // pages beyond each union stay untouched
        union_mult = at::empty({u.items, u.limit, u.lanes}, at::kByte);
        p.union_count = union_count.data_ptr<int32_t>();
        p.union_keys = union_keys.data_ptr<int32_t>();
        p.union_mult = union_mult.data_ptr<uint8_t>();
      }
    }
    ctx->saved_data["unions"] = union_count.defined();
    if (union_count.defined()) {
      ctx->saved_data["union_count"] = union_count;
      ctx->saved_data["union_keys"] = union_keys;
      ctx->saved_data["union_mult"] = union_mult;
    }
    if (d.B * d.H * d.L > 0) {
      if (cuda)
        HAX_CUDA_LAUNCH(kOp, in.q, sparse_attention_forward_cuda(p, kernel_dtype(in.q), cuda_stream(in.q)));
      else {
        int32_t invalid = 0;
        p.invalid = &invalid;
        sparse_attention_forward_cpu(p, in.q.scalar_type());
        if (invalid) check_idx_values(in.idx, d);  // names the first bad entry and throws
      }
      if (tiles) HAX_CUDA_LAUNCH(kOp, in.q, sparse_attention_tile_forward_cuda(p, plan.view(), cuda_stream(in.q)));
    }
    ctx->saved_data["tiles"] = tiles;
    if (tiles) {
      ctx->saved_data["plan_count"] = plan.count;
      ctx->saved_data["plan_keys"] = plan.keys;
      ctx->saved_data["plan_mask"] = plan.mask;
      ctx->saved_data["plan_uses"] = plan.uses.defined() ? plan.uses : at::empty({0}, at::kInt);
    }
    auto or_empty = [&](const at::Tensor& t, at::ScalarType dt) { return t.defined() ? t : at::empty({0}, dt); };
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_bias"] = in.bias.defined();
    ctx->saved_data["has_seg_w"] = in.seg_w.defined();
    ctx->saved_data["has_q_order"] = in.q_order.defined();
    ctx->saved_data["path"] = int64_t(p.path);
    ctx->save_for_backward({in.q, in.k, in.v, in.idx, or_empty(in.bias, q.scalar_type()),
                            or_empty(in.seg_w, q.scalar_type()), or_empty(in.q_order, at::kInt), lse,
                            tiles ? out : at::empty({0}, q.options())});
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
    const AttentionPath path = AttentionPath(ctx->saved_data["path"].toInt());
    if (in.q.is_cuda()) {
      const at::Tensor dout = grads[0].defined() ? grads[0].to(in.q.scalar_type()).contiguous()
                                                 : at::zeros({d.B, d.L, d.H, d.Dv}, in.q.options());
      const at::Tensor dlse = grads[1].defined() ? grads[1].to(at::kFloat).contiguous() : at::Tensor();
      TilePlan plan;
      const bool tiles = ctx->saved_data["tiles"].toBool();
      if (tiles) {
        plan.count = ctx->saved_data["plan_count"].toTensor();
        plan.keys = ctx->saved_data["plan_keys"].toTensor();
        plan.mask = ctx->saved_data["plan_mask"].toTensor();
        const at::Tensor uses = ctx->saved_data["plan_uses"].toTensor();
        if (uses.numel() > 0) plan.uses = uses;
      }
      const CudaGrads g = backward_cuda(in, lse, dout, dlse, scale, path, tiles ? &plan : nullptr, s[8]);
      const at::Tensor none;  // (idx, q_order, scale, record and the plan have no gradient)
      return {g.dq, g.dk, g.dv, none, g.dbias, g.dseg_w, none, none, none, none, none, none, none};
    }
    at::Tensor dout = grads[0].defined() ? grads[0].contiguous() : at::zeros({d.B, d.L, d.H, d.Dv}, in.q.options());
    at::Tensor dlse = grads[1].defined() ? grads[1].contiguous() : at::Tensor();

    AttentionGradParams gp;
    gp.fwd = make_params(in, scale);
    gp.fwd.path = path;
    gp.fwd.lse = lse.data_ptr();
    at::Tensor union_count, union_keys, union_mult;
    if (ctx->saved_data["unions"].toBool()) {
      union_count = ctx->saved_data["union_count"].toTensor();
      union_keys = ctx->saved_data["union_keys"].toTensor();
      union_mult = ctx->saved_data["union_mult"].toTensor();
      gp.fwd.union_count = union_count.data_ptr<int32_t>();
      gp.fwd.union_keys = union_keys.data_ptr<int32_t>();
      gp.fwd.union_mult = union_mult.data_ptr<uint8_t>();
    }
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
    const at::Tensor none;
    return {dq, dk, dv, none, dbias, dseg_w, none, none, none, none, none, none, none};
  }
};

}  // namespace

void set_sparse_attention_path(AttentionPath path) { g_path.store(path); }
AttentionPath sparse_attention_path() { return g_path.load(); }
void set_sparse_attention_wgmma_products(bool on) { g_wgmma_products.store(on); }
bool sparse_attention_wgmma_products() { return g_wgmma_products.load(); }
// Whether band plans count their keys' blocks (AttentionTilePlan::key_uses) so that the backward
// sums the keys of few blocks in bfloat16: HAX_TILE_KEY_SUMS at the first use (default 1), as
// check.cpp's device-value switch.
namespace {
std::atomic<bool>& few_key_sums() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("HAX_TILE_KEY_SUMS");
    const std::string s = e ? e : "1";
    HAX_CHECK(s == "0" || s == "1",
              "HAX_TILE_KEY_SUMS = '{}' must be 0 (every key's gradient summed in float32) or 1 (the keys of few "
              "blocks in bfloat16)", s);
    return s == "1";
  }()};
  return on;
}
}  // namespace
void set_sparse_attention_few_key_sums(bool on) { few_key_sums() = on; }
bool sparse_attention_few_key_sums() { return few_key_sums(); }

std::tuple<at::Tensor, at::Tensor> sparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& idx, const at::Tensor& bias,
                                                    const at::Tensor& seg_w, const at::Tensor& q_order, double scale) {
  if (autocast_cast_needed({q, k, v, bias, seg_w}))
    return sparse_attention(autocast_cast(q), autocast_cast(k), autocast_cast(v), idx, autocast_cast(bias),
                            autocast_cast(seg_w), q_order, scale);
  check_inputs(q, k, v, idx, bias, seg_w, q_order, scale);  // before apply, which needs defined tensors
  auto absent = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, q.options()); };
  const bool record = at::GradMode::is_enabled() &&
                      (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                       (bias.defined() && bias.requires_grad()) || (seg_w.defined() && seg_w.requires_grad()));
  const at::Tensor none = at::empty({0}, at::kInt);
  auto out = SparseAttentionFunction::apply(q, k, v, idx, absent(bias), absent(seg_w),
                                            q_order.defined() ? q_order : none, scale, record, none, none, none, none);
  return {out[0], out[1]};
}

namespace {

// The end both union ops share: the tile plan of p (its lists set up by the caller), the merged
// rows of the blocks whose union overflows (merge_overflow, (B, H, L, K) with K = Ka + Kb), and
// the op over them with the plan.
std::tuple<at::Tensor, at::Tensor> planned_union(const char* op, const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, const Inputs& in, const AttentionParams& p,
                                                 int64_t K, const at::Tensor& q_order, double scale,
                                                 const MergeOverflow& merge_overflow) {
  const Dims& d = in.d;
  const bool record = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  const TilePlan plan = build_tile_plan(in, p, record);
  const int64_t nblk = attention_tile_blocks(d.L);
  const at::Tensor idx = merge_overflow(plan.count.narrow(0, 0, d.B * d.H * nblk).view({d.B, d.H, nblk}));
  check_shape(op, "merge_overflow(count)", idx, {d.B, d.H, d.L, K}, "(B, H, L, Ka + Kb)");
  const at::Tensor none = at::empty({0}, q.options()), no_int = at::empty({0}, at::kInt);
  auto out = SparseAttentionFunction::apply(q, k, v, idx, none, none, q_order.defined() ? q_order : no_int, scale,
                                            record, plan.count, plan.keys, plan.mask,
                                            plan.uses.defined() ? plan.uses : no_int);
  return {out[0], out[1]};
}

}  // namespace

bool sparse_attention_union_native(const at::Tensor& q, const at::Tensor& v, int64_t Ka, int64_t Kb) {
  return sparse_attention_blocks_native(q, v) && Ka > 0 && Kb > 0 && Ka + Kb <= kAttentionPlanMaxStagedKeys;
}

std::tuple<at::Tensor, at::Tensor> sparse_attention_union(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, const at::Tensor& idx_a,
                                                          const at::Tensor& idx_b, const at::Tensor& q_order,
                                                          double scale, const MergeOverflow& merge_overflow) {
  if (autocast_cast_needed({q, k, v}))
    return sparse_attention_union(autocast_cast(q), autocast_cast(k), autocast_cast(v), idx_a, idx_b, q_order, scale,
                                  merge_overflow);
  constexpr const char* kUnion = "sparse_attention_union";
  check_rank(kUnion, "idx_a", idx_a, 4, "(B, H, L, Ka)");
  check_rank(kUnion, "idx_b", idx_b, 4, "(B, H, L, Kb)");
  const int64_t Ka = idx_a.size(3), Kb = idx_b.size(3);
  HAX_CHECK(sparse_attention_union_native(q, v, Ka, Kb),
            "{}: needs the CUDA tile path (bfloat16 or autocast on CUDA, head dims <= 128, not deterministic) and "
            "0 < Ka, Kb with Ka + Kb = {} <= {}; use sparse_attention on merged lists otherwise",
            kUnion, Ka + Kb, kAttentionPlanMaxStagedKeys);
  check_inputs(q, k, v, idx_b, {}, {}, q_order, scale);  // b's shape, dtype and device (a's: prepare)
  Inputs in = prepare(q, k, v, idx_a, {}, {}, q_order, scale);
  AttentionParams p = make_params(in, scale);
  const at::Tensor b = idx_b.contiguous();  // (alive until the plan is built)
  p.idx_b = b.data_ptr<int32_t>(), p.maxkeys_b = Kb;
  return planned_union(kUnion, q, k, v, in, p, Ka + Kb, q_order, scale, merge_overflow);
}

namespace {

// The band's checks of both band unions (band (2+, B, H, L), band_pos (B, H, Lk) int32 on q's
// device; with the value checks on, their entries) and p's band fields; returns the contiguous
// tensors p points into.
// What both band unions need before anything else: the tile path for parts of Ka and Kb keys, and
// q_order (the band's rows are its ranks).
void check_band_union(const char* op, const at::Tensor& q, const at::Tensor& v, int64_t Ka, int64_t Kb,
                      const at::Tensor& q_order) {
  HAX_CHECK(sparse_attention_union_native(q, v, Ka, Kb),
            "{}: needs the CUDA tile path (bfloat16 or autocast on CUDA, head dims <= 128, not deterministic) and "
            "0 < Ka, Kb with Ka + Kb = {} <= {} (Ka = {}, Kb = {})",
            op, Ka + Kb, kAttentionPlanMaxStagedKeys, Ka, Kb);
  HAX_CHECK(q_order.defined(), "{}: q_order is needed (band rows are ranks in q_order)", op);
}

std::pair<at::Tensor, at::Tensor> set_band(const char* op, AttentionParams& p, const Dims& d, const at::Tensor& q,
                                           const at::Tensor& band, const at::Tensor& band_pos, int64_t Ka) {
  check_rank(op, "band", band, 4, "(2 or more, B, H, L)");
  HAX_CHECK(band.size(0) >= 2 && band.size(1) == d.B && band.size(2) == d.H && band.size(3) == d.L,
            "{}: band has shape {}, expected (2 or more, B, H, L) = (2+, {}, {}, {})", op, shape_str(band.sizes()), d.B,
            d.H, d.L);
  check_shape(op, "band_pos", band_pos, {d.B, d.H, d.Lk}, "(B, H, Lk)");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"band", band}, {"band_pos", band_pos}})
    HAX_CHECK(t.scalar_type() == at::kInt && t.device() == q.device(), "{}: {} must be int32 on {} (got {} on {})",
              op, name, q.device().str(), c10::toString(t.scalar_type()), t.device().str());
  const at::Tensor bnd = band.narrow(0, 0, 2).contiguous(), pos = band_pos.contiguous();
  if (check_device_values()) {  // (reads device values: only while the checks are on)
    const at::Tensor first = bnd[0], last = bnd[1], listed = last >= first;
    const bool bad_band = (listed & ((first < 0) | (last >= d.Lk) | (last - first >= Ka))).any().item<bool>();
    HAX_CHECK(!bad_band, "{}: a band row lists sorted keys outside [0, Lk = {}) or more than Ka = {} of them", op,
              d.Lk, Ka);
    HAX_CHECK(!((pos < 0) | (pos >= d.Lk)).any().item<bool>(), "{}: band_pos holds a position outside [0, Lk = {})",
              op, d.Lk);
  }
  p.band = bnd.data_ptr<int32_t>(), p.band_pos = pos.data_ptr<int32_t>(), p.band_keys = Ka;
  return {bnd, pos};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sparse_attention_union_band(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& band,
                                                               const at::Tensor& band_pos, int64_t Ka,
                                                               const at::Tensor& idx_b, const at::Tensor& q_order,
                                                               double scale, const MergeOverflow& merge_overflow) {
  if (autocast_cast_needed({q, k, v}))
    return sparse_attention_union_band(autocast_cast(q), autocast_cast(k), autocast_cast(v), band, band_pos, Ka, idx_b,
                                       q_order, scale, merge_overflow);
  constexpr const char* kUnion = "sparse_attention_union_band";
  check_rank(kUnion, "idx_b", idx_b, 4, "(B, H, L, Kb)");
  const int64_t Kb = idx_b.size(3);
  check_band_union(kUnion, q, v, Ka, Kb, q_order);
  Inputs in = prepare(q, k, v, idx_b, {}, {}, q_order, scale);  // (checks q, k, v, idx_b, q_order)
  AttentionParams p = make_params(in, scale);
  const auto kept = set_band(kUnion, p, in.d, q, band, band_pos, Ka);
  return planned_union(kUnion, q, k, v, in, p, Ka + Kb, q_order, scale, merge_overflow);
}

std::tuple<at::Tensor, at::Tensor> sparse_attention_union_band_intervals(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& band, const at::Tensor& band_pos,
    int64_t Ka, const at::Tensor& iv_count, const at::Tensor& iv_key, const at::Tensor& iv_leave, int64_t Kb,
    const at::Tensor& q_order, double scale, const MergeOverflow& merge_overflow) {
  if (autocast_cast_needed({q, k, v}))
    return sparse_attention_union_band_intervals(autocast_cast(q), autocast_cast(k), autocast_cast(v), band, band_pos,
                                                 Ka, iv_count, iv_key, iv_leave, Kb, q_order, scale, merge_overflow);
  constexpr const char* kUnion = "sparse_attention_union_band_intervals";
  check_band_union(kUnion, q, v, Ka, Kb, q_order);
  // The plan's inputs without lists: the shapes as for lists of Kb keys (a stand-in of no storage
  // for check_inputs), q, k, v and q_order as prepare makes them.
  check_rank(kUnion, "q", q, 4, "(B, L, H, D)");
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2);
  const at::Tensor shape_only = at::empty({1}, q.options().dtype(at::kInt)).expand({B, H, L, Kb});
  Inputs in;
  in.d = check_inputs(q, k, v, shape_only, {}, {}, q_order, scale);
  in.q = q.contiguous(), in.k = k.contiguous(), in.v = v.contiguous();
  set_q_order(in, q_order);
  check_shape(kUnion, "iv_count", iv_count, {B, H}, "(B, H)");
  check_rank(kUnion, "iv_key", iv_key, 3, "(B, H, M)");
  HAX_CHECK(iv_key.size(0) == B && iv_key.size(1) == H, "{}: iv_key has shape {}, expected (B, H, M) = ({}, {}, M)",
            kUnion, shape_str(iv_key.sizes()), B, H);
  check_shape(kUnion, "iv_leave", iv_leave, iv_key.sizes().vec(), "iv_key's (B, H, M)");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"iv_count", iv_count}, {"iv_key", iv_key},
                                {"iv_leave", iv_leave}})
    HAX_CHECK(t.scalar_type() == at::kInt && t.device() == q.device(), "{}: {} must be int32 on {} (got {} on {})",
              kUnion, name, q.device().str(), c10::toString(t.scalar_type()), t.device().str());
  const at::Tensor ic = iv_count.contiguous(), ik = iv_key.contiguous(), il = iv_leave.contiguous();
  const int64_t M = ik.size(2);
  if (check_device_values())  // (reads device values)
    HAX_CHECK(!((ic < 0) | (ic > M)).any().item<bool>(), "{}: iv_count holds a count outside [0, M = {}]", kUnion, M);
  AttentionParams p = make_params(in, scale);  // (maxkeys = Kb, from the stand-in's shape)
  const auto kept = set_band(kUnion, p, in.d, q, band, band_pos, Ka);
  p.iv_count = ic.data_ptr<int32_t>(), p.iv_key = ik.data_ptr<int32_t>(), p.iv_leave = il.data_ptr<int32_t>();
  p.iv_stride = M;
  return planned_union(kUnion, q, k, v, in, p, Ka + Kb, q_order, scale, merge_overflow);
}

}  // namespace hax::ops
