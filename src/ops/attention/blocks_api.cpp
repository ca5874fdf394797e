// Binding layer of sparse attention over query blocks (blocks.h): the conversions to and from
// lists, and the op (the tile kernels of cuda/tiles.cu with a plan given by the caller; elsewhere
// the lists and sparse_attention).
#include <torch/torch.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/attention/blocks.h"
#include "ops/backend.h"
#include "ops/check.h"

namespace hax::ops {
namespace {

constexpr const char* kOp = "sparse_attention_blocks";

void check_blocks(const char* op, const TileBlocks& bl, int64_t B, int64_t H, int64_t L, const at::Device& dev) {
  const int64_t nblk = tile_blocks_count(L);
  check_shape(op, "blocks.count", bl.count, {B, H, nblk}, "(B, H, ceil(L / 64))");
  check_shape(op, "blocks.keys", bl.keys, {B, H, nblk, kAttentionTileMaxKeys}, "(B, H, ceil(L / 64), 512)");
  check_shape(op, "blocks.mask", bl.mask, {B, H, nblk, kAttentionTilesPerBlock, kAttentionTileQueries},
              "(B, H, ceil(L / 64), 8, 64)");
  const std::pair<const char*, const at::Tensor*> parts[] = {
      {"blocks.count", &bl.count}, {"blocks.keys", &bl.keys}, {"blocks.mask", &bl.mask}};
  for (const auto& [name, t] : parts)
    HAX_CHECK(t->device() == dev, "{}: {} is on {} but must be on {}", op, name, t->device().str(), dev.str());
  HAX_CHECK(bl.count.scalar_type() == at::kInt && bl.keys.scalar_type() == at::kInt,
            "{}: blocks.count and blocks.keys must be int32 (they are {} and {})", op,
            c10::toString(bl.count.scalar_type()), c10::toString(bl.keys.scalar_type()));
  HAX_CHECK(bl.mask.scalar_type() == at::kLong, "{}: blocks.mask must be int64 (it is {})", op,
            c10::toString(bl.mask.scalar_type()));
  HAX_CHECK(bl.max_keys >= 0, "{}: blocks.max_keys = {} must be >= 0", op, bl.max_keys);
}

// Every block's key count (non-empty count) must be in [0, kAttentionTileMaxKeys]: one copy of its
// range to the host. Returns the largest.
int32_t check_counts(const char* op, const at::Tensor& count) {
  const at::Tensor range = at::stack({count.min(), count.max()}).cpu();
  const int32_t lo = range[0].item<int32_t>(), hi = range[1].item<int32_t>();
  HAX_CHECK(lo >= 0 && hi <= kAttentionTileMaxKeys,
            "{}: a block's key count is {} but must be in [0, {}] (a block whose union did not fit has no keys here)",
            op, lo < 0 ? lo : hi, kAttentionTileMaxKeys);
  return hi;
}

// The plan view of contiguous blocks.
AttentionTilePlan plan_view(const at::Tensor& count, const at::Tensor& keys, const at::Tensor& mask) {
  AttentionTilePlan v;
  v.count = count.data_ptr<int32_t>(), v.keys = keys.data_ptr<int32_t>();
  v.mask = reinterpret_cast<uint64_t*>(mask.data_ptr<int64_t>());
  return v;
}

// The definition: per (b, h, block), the valid keys of its queries' lists, sorted and unique, and
// each listed key's bit.
TileBlocks from_lists_cpu(const at::Tensor& idx, int64_t Lk) {
  const int64_t B = idx.size(0), H = idx.size(1), L = idx.size(2), K = idx.size(3), nblk = tile_blocks_count(L);
  constexpr int64_t Q = kAttentionTileQueries, U = kAttentionTileMaxKeys, T = kAttentionTilesPerBlock;
  TileBlocks bl;
  bl.count = at::empty({B, H, nblk}, at::kInt);
  bl.keys = at::full({B, H, nblk, U}, -1, at::kInt);
  bl.mask = at::zeros({B, H, nblk, T, Q}, at::kLong);
  bl.max_keys = K;
  const int32_t* x = idx.data_ptr<int32_t>();
  int32_t* cnt = bl.count.data_ptr<int32_t>();
  int32_t* keys = bl.keys.data_ptr<int32_t>();
  uint64_t* mask = reinterpret_cast<uint64_t*>(bl.mask.data_ptr<int64_t>());
  at::parallel_for(0, B * H * nblk, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> u;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / nblk, r0 = item % nblk * Q, nq = std::min(Q, L - r0);
      const int32_t* rows = x + (bh * L + r0) * K;  // the block's lists, (nq, K)
      const auto each_key = [&](int64_t r, auto&& f) {
        for (int64_t t = 0; t < K; ++t)
          if (rows[r * K + t] >= 0 && rows[r * K + t] < Lk) f(rows[r * K + t]);
      };
      fill_tile_block(item, nq, each_key, cnt, keys, mask, u);
    }
  });
  return bl;
}

TileBlocks from_lists_cuda(const at::Tensor& idx, int64_t Lk) {
  const int64_t B = idx.size(0), H = idx.size(1), L = idx.size(2), K = idx.size(3), nblk = tile_blocks_count(L);
  TileBlocks bl;
  bl.count = new_output({B, H, nblk}, idx.options());
  bl.keys = new_output({B, H, nblk, kAttentionTileMaxKeys}, idx.options());
  bl.mask = new_output({B, H, nblk, kAttentionTilesPerBlock, kAttentionTileQueries}, idx.options().dtype(at::kLong));
  bl.max_keys = K;
  if (B * H * L == 0) return bl;
  AttentionParams p;
  p.batch = B, p.seqlen = L, p.keylen = Lk, p.nheads = H, p.nseg = 1, p.maxkeys = K;
  p.idx = idx.data_ptr<int32_t>();
  if (K == 0) {  // no keys anywhere
    bl.count.zero_(), bl.keys.fill_(-1), bl.mask.zero_();
    return bl;
  }
  HAX_CUDA_LAUNCH("tile_blocks_from_lists", idx,
                  sparse_attention_tile_plan_cuda(p, plan_view(bl.count, bl.keys, bl.mask), cuda_stream(idx)));
  return bl;
}

// The tile kernels over the caller's blocks; saves what the backward needs.
struct BlocksAttentionFunction : public torch::autograd::Function<BlocksAttentionFunction> {
  static AttentionParams params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& bias, int64_t max_keys, double scale) {
    AttentionParams p;
    p.batch = q.size(0), p.seqlen = q.size(1), p.keylen = k.size(1), p.nheads = q.size(2);
    p.dim = q.size(3), p.vdim = v.size(3), p.nseg = 1, p.maxkeys = std::max<int64_t>(1, max_keys);
    p.scale = scale;
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
    p.bias = bias.defined() ? bias.data_ptr() : nullptr;
    p.wgmma_products = sparse_attention_wgmma_products();
    return p;
  }

  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::Tensor q, at::Tensor k,
                                                at::Tensor v, at::Tensor bias, at::Tensor count, at::Tensor keys,
                                                at::Tensor mask, int64_t max_keys, double scale) {
    ctx->set_materialize_grads(false);
    q = q.contiguous(), k = k.contiguous(), v = v.contiguous();
    const bool has_bias = bias.numel() > 0;
    bias = has_bias ? bias.contiguous() : at::Tensor();
    count = count.contiguous(), keys = keys.contiguous(), mask = mask.contiguous();
    const int64_t B = q.size(0), L = q.size(1), H = q.size(2), Dv = v.size(3);
    at::Tensor out = new_output({B, L, H, Dv}, q.options());
    at::Tensor lse = new_output({B, H, L, 1}, q.options().dtype(at::kFloat));
    if (B * H * L > 0) {
      AttentionParams p = params(q, k, v, bias, max_keys, scale);
      p.out = out.data_ptr(), p.lse = lse.data_ptr();
      p.tile_count = count.data_ptr<int32_t>();
      HAX_CUDA_LAUNCH(kOp, q, sparse_attention_tile_forward_cuda(p, plan_view(count, keys, mask), cuda_stream(q)));
    }
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["max_keys"] = max_keys;
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({q, k, v, has_bias ? bias : at::empty({0}, q.options()), count, keys, mask, out, lse});
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &count = s[4], &keys = s[5], &mask = s[6], &out = s[7];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const at::Tensor bias = has_bias ? s[3] : at::Tensor();
    const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3), Lk = k.size(1), Dv = v.size(3);
    const at::Tensor dout = grads[0].defined() ? grads[0].to(q.scalar_type()).contiguous()
                                               : at::zeros({B, L, H, Dv}, q.options());
    const at::Tensor dlse = grads[1].defined() ? grads[1].to(at::kFloat).contiguous() : at::Tensor();
    const auto f32 = q.options().dtype(at::kFloat);
    at::Tensor dq = new_output_like(q);
    at::Tensor dk = at::zeros({B, Lk, H, D}, f32), dv = at::zeros({B, Lk, H, Dv}, f32);
    at::Tensor dbias = has_bias ? at::zeros({B, H, Lk}, f32) : at::Tensor();
    if (B * H * L > 0) {
      AttentionGradParams gp;
      gp.fwd = params(q, k, v, bias, ctx->saved_data["max_keys"].toInt(), ctx->saved_data["scale"].toDouble());
      gp.fwd.lse = s[8].data_ptr(), gp.fwd.out = out.data_ptr();
      gp.fwd.tile_count = count.data_ptr<int32_t>();
      gp.dout = dout.data_ptr(), gp.dlse = dlse.defined() ? dlse.data_ptr() : nullptr;
      gp.dq = dq.data_ptr(), gp.dk = dk.data_ptr(), gp.dv = dv.data_ptr();
      gp.dbias = has_bias ? dbias.data_ptr() : nullptr;
      HAX_CUDA_LAUNCH(kOp, q, sparse_attention_tile_backward_cuda(gp, plan_view(count, keys, mask), cuda_stream(q)));
    }
    const auto dt = q.scalar_type();
    return {dq, dk.to(dt), dv.to(dt), has_bias ? dbias.to(dt) : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TileBlocks tile_blocks_from_lists(const at::Tensor& idx0, int64_t Lk) {
  constexpr const char* op = "tile_blocks_from_lists";
  check_rank(op, "idx", idx0, 4, "(B, H, L, K)");
  HAX_CHECK(idx0.scalar_type() == at::kInt, "{}: idx has dtype {} but must be int32", op,
            c10::toString(idx0.scalar_type()));
  HAX_CHECK(Lk >= 0, "{}: Lk = {} must be >= 0", op, Lk);
  check_backend(op, "idx", idx0);
  const at::Tensor idx = idx0.contiguous();
  return idx.is_cuda() ? from_lists_cuda(idx, Lk) : from_lists_cpu(idx, Lk);
}

at::Tensor tile_blocks_to_lists(const TileBlocks& bl, int64_t L) {
  constexpr const char* op = "tile_blocks_to_lists";
  check_rank(op, "blocks.count", bl.count, 3, "(B, H, nblk)");
  const int64_t B = bl.count.size(0), H = bl.count.size(1), K = bl.max_keys;
  HAX_CHECK(L >= 0, "{}: L = {} must be >= 0", op, L);
  check_blocks(op, bl, B, H, L, bl.count.device());
  const auto i32 = bl.keys.options();
  if (B * H * L == 0 || K == 0) return at::full({B, H, L, K}, -1, i32);
  const int32_t hi = check_counts(op, bl.count);
  const int64_t nt = std::max<int64_t>(1, (hi + 63) / 64), nblk = tile_blocks_count(L), Q = kAttentionTileQueries;
  // bits (B, H, nblk, 64 queries, nt * 64 union slots): whether each query sees each slot.
  const at::Tensor shifts = at::arange(64, bl.mask.options());
  at::Tensor bits = bl.mask.narrow(3, 0, nt).unsqueeze(-1).__rshift__(shifts).bitwise_and(1).to(at::kBool);
  bits = bits.permute({0, 1, 2, 4, 3, 5}).reshape({B, H, nblk, Q, nt * 64});
  const at::Tensor slot = at::arange(nt * 64, i32).view({1, 1, 1, 1, nt * 64});
  bits = bits.logical_and(slot < bl.count.view({B, H, nblk, 1, 1}));
  const int64_t most = bits.sum(-1).max().item<int64_t>();
  HAX_CHECK(most <= K, "{}: a query sees {} keys, more than blocks.max_keys = {}", op, most, K);
  const at::Tensor keys = bl.keys.narrow(3, 0, nt * 64).view({B, H, nblk, 1, nt * 64}).expand({B, H, nblk, Q, nt * 64});
  at::Tensor vals = at::where(bits, keys, at::full({}, INT_MAX, i32));
  vals = std::get<0>(vals.sort(-1));  // the seen keys ascending, then INT_MAX
  if (nt * 64 < K) vals = at::cat({vals, at::full({B, H, nblk, Q, K - nt * 64}, INT_MAX, i32)}, -1);
  vals = vals.narrow(-1, 0, K);
  vals = at::where(vals == INT_MAX, at::full({}, -1, i32), vals);
  return vals.reshape({B, H, nblk * Q, K}).narrow(2, 0, L).contiguous();
}

bool sparse_attention_blocks_native(const at::Tensor& q, const at::Tensor& v) {
  if (!q.is_cuda() || !cuda_backend_built()) return false;
  const bool bf16 = q.scalar_type() == at::kBFloat16 || (cuda_autocast_enabled() && q.scalar_type() == at::kFloat);
  return bf16 && !deterministic() && sparse_attention_path() != AttentionPath::kPerQuery && q.dim() == 4 &&
         v.dim() == 4 && q.size(3) <= 128 && v.size(3) <= 128;
}

std::tuple<at::Tensor, at::Tensor> sparse_attention_blocks(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, const TileBlocks& blocks,
                                                           const at::Tensor& bias, double scale) {
  if (autocast_cast_needed({q, k, v, bias}))
    return sparse_attention_blocks(autocast_cast(q), autocast_cast(k), autocast_cast(v), blocks, autocast_cast(bias),
                                   scale);
  check_rank(kOp, "q", q, 4, "(B, L, H, D)");
  check_floating(kOp, "q", q);
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3);
  check_rank(kOp, "k", k, 4, "(B, Lk, H, D)");
  const int64_t Lk = k.size(1);
  check_shape(kOp, "k", k, {B, Lk, H, D}, "(B, Lk, H, D)");
  check_rank(kOp, "v", v, 4, "(B, Lk, H, Dv)");
  check_shape(kOp, "v", v, {B, Lk, H, v.size(3)}, "(B, Lk, H, Dv)");
  check_same(kOp, "k", k, q);
  check_same(kOp, "v", v, q);
  if (bias.defined()) {
    check_shape(kOp, "bias", bias, {B, H, Lk}, "(B, H, Lk)");
    check_same(kOp, "bias", bias, q);
  }
  HAX_CHECK(scale > 0 && std::isfinite(scale), "{}: scale {} must be positive and finite (e.g. 1/sqrt(D))", kOp, scale);
  check_blocks(kOp, blocks, B, H, L, q.device());
  if (!sparse_attention_blocks_native(q, v)) {
    const at::Tensor idx = tile_blocks_to_lists(blocks, L);
    return sparse_attention(q, k, v, idx, bias, {}, {}, scale);
  }
  if (check_device_values() && blocks.count.numel() > 0) check_counts(kOp, blocks.count);
  auto out = BlocksAttentionFunction::apply(q, k, v, bias.defined() ? bias : at::empty({0}, q.options()),
                                            blocks.count, blocks.keys, blocks.mask, blocks.max_keys, scale);
  return {out[0], out[1]};
}

}  // namespace hax::ops
