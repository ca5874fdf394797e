// The CUDA paths of the pattern builders (see cuda_paths.h): outputs and workspace on the device,
// LibTorch's sort for LSH and LibTorch ops for HSA's chunk layout, and the launchers of
// patterns/cuda/. Outputs come from ops::new_output, so tests that poison outputs see any slot a
// kernel leaves unwritten.
#include "patterns/cuda_paths.h"

#if defined(HAX_CUDA_KERNELS)
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "ops/backend.h"
#include "patterns/internal.h"

namespace hax::patterns::detail {
namespace {

at::TensorOptions int32_on(const at::Device& d) { return at::TensorOptions().dtype(at::kInt).device(d); }

}  // namespace

void* stream_of(const at::Tensor& t) { return t.is_cuda() ? ops::cuda_stream(t) : nullptr; }

SequenceBounds sequence_bounds_device(const at::Tensor& seq, int64_t B, int64_t L, const at::Device& device) {
  SequenceBounds r{at::empty({B, L}, int32_on(device)), at::empty({B, L}, int32_on(device))};
  const at::Tensor s = seq.defined() ? seq.to(device, at::kInt).contiguous() : seq;
  SequenceBoundsParams p;
  p.B = B, p.L = L;
  p.seq = s.defined() ? s.data_ptr<int32_t>() : nullptr;
  p.start = r.start.data_ptr<int32_t>(), p.end = r.end.data_ptr<int32_t>();
  sequence_bounds_cuda(p, stream_of(r.start));
  return r;
}

at::Tensor progression_lists_device(ProgressionKind kind, int64_t B, int64_t H, int64_t L, int64_t k, int64_t stride,
                                    const at::Tensor& seq, const at::Device& device) {
  const SequenceBounds bounds = sequence_bounds_device(seq, B, L, device);
  at::Tensor idx = ops::new_output({B, H, L, k}, int32_on(device));
  ProgressionParams p;
  p.B = B, p.H = H, p.L = L, p.k = k, p.stride = stride, p.kind = kind;
  p.start = bounds.start.data_ptr<int32_t>();
  p.out = idx.data_ptr<int32_t>();
  progression_lists_cuda(p, stream_of(idx));
  return idx;
}

at::Tensor lsh_buckets_device(const at::Tensor& x0, const at::Tensor& proj, Binning binning, const at::Tensor& start) {
  // Any strides of (b, position, head) (a view of a wider projection, say): no copy of x unless n is strided.
  const at::Tensor x = x0.stride(3) == 1 || x0.size(3) == 1 ? x0.detach() : x0.detach().contiguous();
  const at::Device dev = x.device();
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2), N = x.size(3), h = proj.size(1);
  const at::Tensor P = proj.detach().to(dev, at::kDouble).contiguous();
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(dev);
  const at::Tensor values = at::empty({B, L, H, h}, f64), tiles = at::empty({B, H * h, lsh_bucket_tiles(L)}, f64);
  at::Tensor out = ops::new_output({B, L, H}, int32_on(dev));
  if (out.numel() == 0) return out;
  LshBucketsParams p;
  p.B = B, p.L = L, p.H = H, p.N = N, p.h = h, p.argmax = binning == Binning::kArgmax;
  p.x = x.data_ptr(), p.x_sb = x.stride(0), p.x_sl = x.stride(1), p.x_sh = x.stride(2);
  p.proj = P.data_ptr<double>(), p.start = start.data_ptr<int32_t>();
  p.values = values.data_ptr<double>(), p.tiles = tiles.data_ptr<double>(), p.out = out.data_ptr<int32_t>();
  lsh_buckets_cuda(p, ops::kernel_dtype(x), stream_of(out));
  return out;
}

namespace {

std::atomic<bool> g_wide_sort_keys{false};  // set_lsh_wide_sort_keys

// Buckets of q and k, and every (b, h) row's keys and queries sorted by (sequence, bucket,
// position): what the lists and the band are read off.
struct LshSorted {
  SequenceBounds bounds;
  at::Tensor bq;           // (B, L, H) query buckets
  at::Tensor key_sorted;   // (B, H, L) the key sort keys, ascending per row
  at::Tensor key_pos;      // (B, H, L) their positions
  at::Tensor query_order;  // (B, H, L) the queries' positions in their sorted order
  int64_t nb = 0;          // buckets
  bool keys64 = false;
  uint64_t row_stride = 0;
};

LshSorted lsh_sorted(const at::Tensor& q, const at::Tensor& k, const at::Tensor& proj, Binning binning,
                     const at::Tensor& seq) {
  const at::Device dev = q.device();
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), h = proj.size(1);
  LshSorted out;
  out.bounds = sequence_bounds_device(seq, B, L, dev);
  out.bq = lsh_buckets_device(q, proj, binning, out.bounds.start);
  const at::Tensor bk = lsh_buckets_device(k.to(dev), proj, binning, out.bounds.start);
  const int64_t nb = binning == Binning::kSign ? (int64_t)1 << h : h;
  // Every row's keys are < span = nb·L. One radix sort of all rows when the row fits above them
  // in 64 bits (r·span + key), over the bits that r·span + key can have; else a sort per row.
  const uint64_t span = (uint64_t)nb * (uint64_t)L, rows = (uint64_t)(B * H);
  const bool joint = rows <= UINT64_MAX / span;
  const uint64_t top = joint ? rows * span - 1 : 0;  // the largest joint key
  const bool keys64 = !joint || top > UINT32_MAX || g_wide_sort_keys.load();
  // Rows of one sequence each sort their short keys r·nb + bucket (LshSortKeysParams::short_keys).
  const bool short_keys = joint && !seq.defined() && rows * (uint64_t)nb <= UINT32_MAX;
  const uint64_t sort_top = short_keys ? rows * (uint64_t)nb - 1 : top;  // the largest key sorted
  int bits = 1;
  while (bits < 64 && (sort_top >> bits) != 0) ++bits;
  const bool sort64 = keys64 && !short_keys;
  const auto key_opts = at::TensorOptions().dtype(keys64 ? at::kLong : at::kInt).device(dev);
  const auto sort_opts = at::TensorOptions().dtype(sort64 ? at::kLong : at::kInt).device(dev);
  // Short keys of at most kBucketSortMaxBuckets buckets: a counting sort (lsh_bucket_sort.cu)
  // instead of the keys, the radix sort and the full keys.
  const bool counting = short_keys && nb <= kBucketSortMaxBuckets;
  const size_t temp_bytes = joint && !counting ? lsh_sort_temp_bytes(B * H * L, sort64, bits) : 0;
  const at::Tensor temp = joint && !counting ? at::empty({(int64_t)std::max<size_t>(temp_bytes, 1)},
                                                         at::TensorOptions().dtype(at::kByte).device(dev))
                                             : at::Tensor();
  // Every (b, h) row's sort keys of (sequence, bucket, position), sorted (with_keys: the counting
  // sort leaves them out otherwise), and their positions (int32).
  auto sorted = [&](const at::Tensor& bucket, bool with_keys) {
    if (counting) {
      at::Tensor full = with_keys ? at::empty({B, H, L}, key_opts) : at::Tensor();
      at::Tensor pos = at::empty({B, H, L}, int32_on(dev));
      const int64_t tiles = (L + kBucketSortTile - 1) / kBucketSortTile;
      at::Tensor counts = at::empty({B * H * nb * (2 * tiles + 1)}, int32_on(dev));
      LshBucketSortParams p;
      p.B = B, p.L = L, p.H = H, p.num_buckets = nb, p.keys64 = keys64;
      p.bucket = bucket.data_ptr<int32_t>(), p.counts = counts.data_ptr<int32_t>();
      p.keys = with_keys ? full.data_ptr() : nullptr, p.pos = pos.data_ptr<int32_t>();
      lsh_bucket_sort_cuda(p, stream_of(pos));
      return std::make_pair(full, pos);
    }
    at::Tensor key = at::empty({B, H, L}, sort_opts);
    at::Tensor pos = joint ? at::empty({B, H, L}, int32_on(dev)) : at::Tensor();
    LshSortKeysParams p;
    p.B = B, p.L = L, p.H = H, p.num_buckets = nb, p.keys64 = sort64, p.row_stride = joint ? span : 0;
    p.bucket = bucket.data_ptr<int32_t>(), p.start = out.bounds.start.data_ptr<int32_t>();
    p.end = out.bounds.end.data_ptr<int32_t>(), p.keys = key.data_ptr();
    p.pos = joint ? pos.data_ptr<int32_t>() : nullptr;
    p.short_keys = short_keys;
    lsh_sort_keys_cuda(p, stream_of(key));
    if (!joint) {
      auto [values, positions] = at::sort(key, -1);
      return std::make_pair(values.contiguous(), positions.to(at::kInt).contiguous());
    }
    at::Tensor key_out = at::empty_like(key), pos_out = at::empty_like(pos);
    LshSortParams sp;
    sp.n = B * H * L, sp.bits = bits, sp.keys64 = sort64;
    sp.keys_in = key.data_ptr(), sp.keys_out = key_out.data_ptr();
    sp.pos_in = pos.data_ptr<int32_t>(), sp.pos_out = pos_out.data_ptr<int32_t>();
    sp.temp = temp.data_ptr(), sp.temp_bytes = temp_bytes;
    lsh_sort_cuda(sp, stream_of(key));
    if (!short_keys) return std::make_pair(key_out, pos_out);
    at::Tensor full = at::empty({B, H, L}, key_opts);
    LshFullKeysParams fp;
    fp.n = B * H * L, fp.L = L, fp.keys64 = keys64;
    fp.short_keys = reinterpret_cast<const uint32_t*>(key_out.data_ptr<int32_t>());
    fp.pos = pos_out.data_ptr<int32_t>(), fp.keys = full.data_ptr();
    lsh_full_keys_cuda(fp, stream_of(full));
    return std::make_pair(full, pos_out);
  };
  std::tie(out.key_sorted, out.key_pos) = sorted(bk, true);
  out.query_order = sorted(out.bq, false).second;  // queries by (sequence, bucket, position)
  out.nb = nb, out.keys64 = keys64, out.row_stride = joint ? span : 0;
  return out;
}

LshListsParams lists_params(const LshSorted& st, int64_t B, int64_t L, int64_t H, int64_t keys) {
  LshListsParams p;
  p.B = B, p.L = L, p.H = H, p.K = keys, p.num_buckets = st.nb, p.keys64 = st.keys64, p.row_stride = st.row_stride;
  p.q_bucket = st.bq.data_ptr<int32_t>(), p.start = st.bounds.start.data_ptr<int32_t>();
  p.end = st.bounds.end.data_ptr<int32_t>(), p.sorted_keys = st.key_sorted.data_ptr();
  p.sorted_pos = st.key_pos.data_ptr<int32_t>();
  return p;
}

}  // namespace

void set_lsh_wide_sort_keys(bool on) { g_wide_sort_keys.store(on); }

KeyLists lsh_device(const at::Tensor& q, const at::Tensor& k, int64_t keys, const at::Tensor& proj, Binning binning,
                    const at::Tensor& seq) {
  const at::Device dev = q.device();
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2);
  at::Tensor idx = ops::new_output({B, H, L, keys}, int32_on(dev));
  if (B * H * L == 0) return {idx, at::empty({B, H, L}, int32_on(dev))};
  const LshSorted st = lsh_sorted(q, k, proj, binning, seq);
  LshListsParams p = lists_params(st, B, L, H, keys);
  p.out = idx.data_ptr<int32_t>();
  lsh_lists_cuda(p, stream_of(idx));
  return {idx, st.query_order};
}

LshBand lsh_band_device(const at::Tensor& q, const at::Tensor& k, int64_t keys, const at::Tensor& proj,
                        Binning binning, const at::Tensor& seq, bool key_side) {
  const at::Device dev = q.device();
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2);
  at::Tensor band = ops::new_output({4, B, H, L}, int32_on(dev));
  if (B * H * L == 0) return {at::empty({B, H, L}, int32_on(dev)), at::empty({B, H, L}, int32_on(dev)), band};
  const LshSorted st = lsh_sorted(q, k, proj, binning, seq);
  LshBandParams p;
  p.lists = lists_params(st, B, L, H, keys);
  p.q_order = st.query_order.data_ptr<int32_t>();
  p.band = band.data_ptr<int32_t>();
  p.key_side = key_side;
  lsh_band_cuda(p, stream_of(band));
  return {st.query_order, st.key_pos, band};
}

at::Tensor exclude_band_device(const at::Tensor& idx0, const LshBand& band) {
  const at::Tensor idx = idx0.contiguous(), q_order = band.q_order.contiguous(), k_order = band.k_order.contiguous();
  const at::Tensor bd = band.band.contiguous();
  at::Tensor out = ops::new_output(idx.sizes(), idx.options());
  at::Tensor ranks = at::empty({2, idx.size(0), idx.size(1), idx.size(2)}, idx.options());
  ExcludeBandParams p;
  p.B = idx.size(0), p.H = idx.size(1), p.L = idx.size(2), p.K = idx.size(3);
  p.idx = idx.data_ptr<int32_t>(), p.q_order = q_order.data_ptr<int32_t>(), p.k_order = k_order.data_ptr<int32_t>();
  p.band = bd.data_ptr<int32_t>(), p.q_rank = ranks[0].data_ptr<int32_t>(), p.k_rank = ranks[1].data_ptr<int32_t>();
  p.out = out.data_ptr<int32_t>();
  exclude_band_cuda(p, stream_of(out));
  return out;
}

namespace {

// Runs the top_k_prefix kernels (k < L) with p's outputs set by the caller; the workspace lives
// until the kernels are queued.
void run_top_k_prefix(TopKPrefixParams& p, const at::Tensor& scores, const at::Tensor& seq) {
  const at::Device dev = scores.device();
  const SequenceBounds bounds = sequence_bounds_device(seq, p.B, p.L, dev);
  const int64_t lists_blk = p.B * p.H * top_k_blocks(p.L) * p.k, lists_sup = p.B * p.H * top_k_supers(p.L) * p.k;
  const at::Tensor work = at::empty({2 * lists_blk + 2 * lists_sup}, at::TensorOptions().dtype(at::kLong).device(dev));
  uint64_t* w = (uint64_t*)work.data_ptr<int64_t>();
  p.scores = scores.data_ptr(), p.start = bounds.start.data_ptr<int32_t>();
  p.block_top = w, p.block_prefix = w + lists_blk;
  p.super_top = w + 2 * lists_blk, p.super_prefix = w + 2 * lists_blk + lists_sup;
  top_k_prefix_cuda(p, ops::kernel_dtype(scores), stream_of(scores));
}

}  // namespace

at::Tensor top_k_prefix_device(const at::Tensor& scores0, int64_t k, const at::Tensor& seq) {
  const at::Tensor scores = scores0.detach().contiguous();
  const at::Device dev = scores.device();
  const int64_t B = scores.size(0), L = scores.size(1), H = scores.size(2);
  // With k >= L every key of the prefix is kept: the sliding window of k.
  if (k >= L) return progression_lists_device(ProgressionKind::kSlidingWindow, B, H, L, k, 1, seq, dev);
  HAX_CHECK(k <= kTopKMaxK, "top_k_prefix: k = {} is above the CUDA kernels' {}", k, kTopKMaxK);
  at::Tensor idx = ops::new_output({B, H, L, k}, int32_on(dev));
  if (B * H == 0) return idx;
  TopKPrefixParams p;
  p.B = B, p.L = L, p.H = H, p.k = k;
  p.out = idx.data_ptr<int32_t>();
  run_top_k_prefix(p, scores, seq);
  return idx;
}

KeyIntervals top_k_prefix_intervals_device(const at::Tensor& scores0, int64_t k, const at::Tensor& seq) {
  const at::Tensor scores = scores0.detach().contiguous();
  const at::Device dev = scores.device();
  const int64_t B = scores.size(0), L = scores.size(1), H = scores.size(2);
  const int64_t nblk = top_k_blocks(L), nsup = top_k_supers(L);
  HAX_CHECK(k >= 1 && k < L && k <= kTopKMaxK, "top_k_prefix_intervals: k = {} must be in [1, L - 1 = {}] and at most {}",
            k, L - 1, kTopKMaxK);
  const SequenceBounds bounds = sequence_bounds_device(seq, B, L, dev);
  KeyIntervals iv;
  iv.k = k;
  iv.count = ops::new_output({B, H}, int32_on(dev));
  iv.key = ops::new_output({B, H, L}, int32_on(dev));
  iv.leave = ops::new_output({B, H, L}, int32_on(dev));
  iv.leave_at = ops::new_output({B, H, L}, int32_on(dev));
  iv.prefix = ops::new_output({B, H, nblk, k}, at::TensorOptions().dtype(at::kLong).device(dev));
  iv.start = bounds.start;
  if (B * H == 0) return iv;
  // Workspace: block_top (B·H·nblk·k), super_top and super_prefix (B·H·nsup·k each), then the
  // blocks' counts (B·H·nblk int32 in int64 words).
  const int64_t lists_blk = B * H * nblk * k, lists_sup = B * H * nsup * k;
  const at::Tensor work =
      at::empty({lists_blk + 2 * lists_sup + (B * H * nblk + 1) / 2}, at::TensorOptions().dtype(at::kLong).device(dev));
  uint64_t* w = (uint64_t*)work.data_ptr<int64_t>();
  TopKIntervalsParams p;
  p.scan.B = B, p.scan.L = L, p.scan.H = H, p.scan.k = k;
  p.scan.scores = scores.data_ptr(), p.scan.start = bounds.start.data_ptr<int32_t>();
  p.scan.block_top = w, p.scan.super_top = w + lists_blk, p.scan.super_prefix = w + lists_blk + lists_sup;
  p.scan.block_prefix = (uint64_t*)iv.prefix.data_ptr<int64_t>();
  p.end = bounds.end.data_ptr<int32_t>();
  p.block_count = (int32_t*)(w + lists_blk + 2 * lists_sup);
  p.leave_at = iv.leave_at.data_ptr<int32_t>();
  p.count = iv.count.data_ptr<int32_t>(), p.key = iv.key.data_ptr<int32_t>(), p.leave = iv.leave.data_ptr<int32_t>();
  top_k_intervals_cuda(p, ops::kernel_dtype(scores), stream_of(scores));
  return iv;
}

ops::TileBlocks top_k_prefix_blocks_device(const at::Tensor& scores0, int64_t k, const at::Tensor& seq,
                                           const LshBand* exclude) {
  const at::Tensor scores = scores0.detach().contiguous();
  const at::Device dev = scores.device();
  const int64_t B = scores.size(0), L = scores.size(1), H = scores.size(2), nblk = top_k_blocks(L);
  HAX_CHECK(k < L && k <= kTopKPlanMaxK, "top_k_prefix_blocks: k = {} must be below L = {} and at most {}", k, L,
            kTopKPlanMaxK);
  ops::TileBlocks bl;
  bl.count = ops::new_output({B, H, nblk}, int32_on(dev));
  bl.keys = ops::new_output({B, H, nblk, ops::kAttentionTileMaxKeys}, int32_on(dev));
  bl.mask = ops::new_output({B, H, nblk, ops::kAttentionTilesPerBlock, ops::kAttentionTileQueries},
                            at::TensorOptions().dtype(at::kLong).device(dev));
  bl.max_keys = k;
  if (B * H * L == 0) return bl;
  TopKPrefixParams p;
  p.B = B, p.L = L, p.H = H, p.k = k;
  p.plan_count = bl.count.data_ptr<int32_t>(), p.plan_keys = bl.keys.data_ptr<int32_t>();
  p.plan_mask = reinterpret_cast<uint64_t*>(bl.mask.data_ptr<int64_t>());
  at::Tensor ex_lo, ex_hi, ex_rank;  // by position: each query's band, each key's sorted rank
  if (exclude) {
    const at::Tensor qo = exclude->q_order.to(at::kLong), ko = exclude->k_order.to(at::kLong);
    const at::Tensor ranks = at::arange(L, int32_on(dev)).view({1, 1, L}).expand({B, H, L}).contiguous();
    ex_rank = at::empty({B, H, L}, int32_on(dev)).scatter_(2, ko, ranks);
    ex_lo = at::empty({B, H, L}, int32_on(dev)).scatter_(2, qo, exclude->band[0].contiguous());
    ex_hi = at::empty({B, H, L}, int32_on(dev)).scatter_(2, qo, exclude->band[1].contiguous());
    p.ex_lo = ex_lo.data_ptr<int32_t>(), p.ex_hi = ex_hi.data_ptr<int32_t>(), p.ex_rank = ex_rank.data_ptr<int32_t>();
  }
  run_top_k_prefix(p, scores, seq);
  return bl;
}

at::Tensor merge_device(const at::Tensor& a0, const at::Tensor& b0) {
  const at::Tensor a = a0.contiguous(), b = b0.to(a0.device()).contiguous();
  const int64_t B = a.size(0), H = a.size(1), L = a.size(2), Ka = a.size(3), Kb = b.size(3);
  at::Tensor out = ops::new_output({B, H, L, Ka + Kb}, int32_on(a.device()));
  MergeListsParams p;
  p.rows = B * H * L, p.Ka = Ka, p.Kb = Kb;
  p.a = a.data_ptr<int32_t>(), p.b = b.data_ptr<int32_t>(), p.out = out.data_ptr<int32_t>();
  merge_lists_cuda(p, stream_of(out));
  return out;
}

namespace {

// The overflow merge's output, (B, H, L, Ka + Kb) (rows the merge leaves out are read by nothing
// but the op's value check, which needs them valid), and the params every form of it shares; the
// caller sets the inputs (a or the band, b) and runs merge_lists_cuda.
std::pair<at::Tensor, MergeListsParams> overflow_merge_setup(int64_t B, int64_t H, int64_t L, int64_t Ka, int64_t Kb,
                                                             const at::Tensor& q_order, const at::Tensor& block_count,
                                                             const at::Device& dev) {
  at::Tensor out = ops::check_device_values() ? at::full({B, H, L, Ka + Kb}, -1, int32_on(dev))
                                              : at::empty({B, H, L, Ka + Kb}, int32_on(dev));
  MergeListsParams p;
  p.rows = B * H * L, p.Ka = Ka, p.Kb = Kb;
  p.out = out.data_ptr<int32_t>();
  p.block_count = block_count.data_ptr<int32_t>();
  p.q_order = q_order.defined() ? q_order.data_ptr<int32_t>() : nullptr;
  p.L = L, p.block = ops::kAttentionTileQueries;
  return {out, p};
}

}  // namespace

at::Tensor merge_overflow_device(const at::Tensor& a0, const at::Tensor& b0, const at::Tensor& q_order0,
                                 const at::Tensor& block_count0) {
  const at::Tensor a = a0.contiguous(), b = b0.to(a0.device()).contiguous();
  const int64_t B = a.size(0), H = a.size(1), L = a.size(2), Ka = a.size(3), Kb = b.size(3);
  if (Ka > 32 || Kb > 32) return merge_device(a, b);  // (only the small kernel skips rows)
  const at::Tensor q_order = q_order0.defined() ? q_order0.contiguous() : q_order0;
  const at::Tensor block_count = block_count0.contiguous();
  auto [out, p] = overflow_merge_setup(B, H, L, Ka, Kb, q_order, block_count, a.device());
  p.a = a.data_ptr<int32_t>(), p.b = b.data_ptr<int32_t>();
  merge_lists_cuda(p, stream_of(out));
  return out;
}

at::Tensor merge_overflow_band_device(const at::Tensor& band0, const at::Tensor& band_pos0, int64_t Ka,
                                      const at::Tensor& b0, const at::Tensor& q_order0,
                                      const at::Tensor& block_count0) {
  const at::Tensor b = b0.contiguous(), band = band0.narrow(0, 0, 2).contiguous(), band_pos = band_pos0.contiguous();
  const at::Tensor q_order = q_order0.contiguous(), block_count = block_count0.contiguous();
  const int64_t B = b.size(0), H = b.size(1), L = b.size(2), Kb = b.size(3);
  auto [out, p] = overflow_merge_setup(B, H, L, Ka, Kb, q_order, block_count, b.device());
  p.b = b.data_ptr<int32_t>();
  p.band = band.data_ptr<int32_t>(), p.band_pos = band_pos.data_ptr<int32_t>();
  merge_lists_cuda(p, stream_of(out));
  return out;
}

at::Tensor merge_overflow_intervals_device(const at::Tensor& band0, const at::Tensor& band_pos0, int64_t Ka,
                                           const KeyIntervals& b, const at::Tensor& q_order0,
                                           const at::Tensor& block_count0) {
  const at::Tensor band = band0.narrow(0, 0, 2).contiguous(), band_pos = band_pos0.contiguous();
  const at::Tensor q_order = q_order0.contiguous(), block_count = block_count0.contiguous();
  const at::Tensor leave_at = b.leave_at.contiguous(), prefix = b.prefix.contiguous(), start = b.start.contiguous();
  const int64_t B = leave_at.size(0), H = leave_at.size(1), L = leave_at.size(2);
  auto [out, p] = overflow_merge_setup(B, H, L, Ka, b.k, q_order, block_count, leave_at.device());
  p.band = band.data_ptr<int32_t>(), p.band_pos = band_pos.data_ptr<int32_t>();
  p.iv_leave_at = leave_at.data_ptr<int32_t>(), p.iv_prefix = (const uint64_t*)prefix.data_ptr<int64_t>();
  p.iv_start = start.data_ptr<int32_t>(), p.H = H;
  merge_lists_cuda(p, stream_of(out));
  return out;
}

ChunkLayout chunk_layout_device(int64_t B, int64_t L, int64_t chunk, const at::Tensor& seq, const at::Device& device) {
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(device);
  if (B * L == 0)
    return {chunk, at::full({B, 0}, -1, int32_on(device)), at::zeros({B, L}, int32_on(device)),
            at::zeros({B, L}, int32_on(device))};
  const SequenceBounds bounds = sequence_bounds_device(seq, B, L, device);
  const at::Tensor s = bounds.start.to(at::kLong), e = bounds.end.to(at::kLong);
  const at::Tensor pos = at::arange(L, i64).view({1, L}).expand({B, L});
  const at::Tensor rel = pos - s;                           // position within the sequence
  const at::Tensor n_seq = at::div(e - s, chunk, "trunc");  // complete chunks of the sequence
  const at::Tensor m = at::div(rel, chunk, "trunc");        // chunk of the position in its sequence
  // The row's chunks before the sequence: an inclusive cumsum of n_seq over sequence starts, less its own.
  const at::Tensor at_start = at::where(rel.eq(0), n_seq, at::zeros_like(n_seq));
  const at::Tensor cum = at_start.cumsum(1);
  const at::Tensor first = cum - n_seq;
  // The most complete chunks a row can hold (packed rows hold fewer; the rest of start is -1): a
  // shape known on the host, so nothing waits on the device.
  const int64_t NC = L / chunk;
  // start[b, first + m] = the position where chunk m of a sequence begins; the rest goes to column NC.
  const at::Tensor begins = rel.remainder(chunk).eq(0) & m.lt(n_seq);
  const at::Tensor column = at::where(begins, first + m, at::full({}, NC, i64));
  at::Tensor start = at::full({B, NC + 1}, -1, i64);
  start.scatter_(1, column, pos.contiguous());
  return {chunk, start.narrow(1, 0, NC).to(at::kInt).contiguous(), first.to(at::kInt).contiguous(),
          (first + m).to(at::kInt).contiguous()};
}

at::Tensor top_k_chunks_device(const at::Tensor& q_ret, const at::Tensor& landmarks, const at::Tensor& lo0,
                               const at::Tensor& hi0, int64_t k) {
  constexpr const char* kOp = "top_k_chunks";
  const at::Tensor q = q_ret.detach().contiguous();
  const at::Device dev = q.device();
  const at::Tensor lm = landmarks.detach().to(dev).contiguous();
  const at::Tensor lo = lo0.to(dev).contiguous(), hi = hi0.to(dev).contiguous();
  const int64_t B = q.size(0), L = q.size(1), D = q.size(2), NC = lm.size(1);
  if (B * L > 0 && ops::check_device_values()) {  // a read-back: only with device-value checks on
    const at::Tensor bad = (lo.lt(0) | lo.gt(hi) | hi.gt(NC)).flatten();
    if (bad.any().item<bool>()) {
      const int64_t i = bad.nonzero().select(1, 0)[0].item<int64_t>();
      fail("{}: the chunk range [lo, hi) = [{}, {}) of query {} is not within [0, NC = {}]", kOp,
           lo.flatten()[i].item<int32_t>(), hi.flatten()[i].item<int32_t>(), i, NC);
    }
  }
  at::Tensor out = ops::new_output({B, L, k}, int32_on(dev));
  const at::Tensor best = at::empty({B, L, k}, at::TensorOptions().dtype(at::kFloat).device(dev));
  TopKChunksParams p;
  p.B = B, p.L = L, p.D = D, p.NC = NC, p.k = k;
  p.q = q.data_ptr(), p.landmarks = lm.data_ptr(), p.lo = lo.data_ptr<int32_t>(), p.hi = hi.data_ptr<int32_t>();
  p.best = best.data_ptr<float>(), p.out = out.data_ptr<int32_t>();
  top_k_chunks_cuda(p, ops::kernel_dtype(q), stream_of(out));
  return out;
}

at::Tensor prefix_direction_device(const at::Tensor& q0, const at::Tensor& seq, double eps) {
  // Any strides of (b, position, head) (q is a view of the joint q/k projection): no copy unless n is strided.
  const at::Tensor q = q0.stride(3) == 1 || q0.size(3) == 1 ? q0.detach() : q0.detach().contiguous();
  const at::Device dev = q.device();
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), N = q.size(3);
  const int64_t chunk = prefix_chunk(B, H, L), nC = prefix_chunks(L, chunk);
  HAX_CHECK(N <= kPrefixMaxN, "prefix_query_direction: N = {} is above the CUDA kernel's {}", N, kPrefixMaxN);
  at::Tensor out = ops::new_output(q.sizes(), q.options());
  if (out.numel() == 0) return out;
  const at::Tensor s = seq.defined() ? seq.to(dev, at::kInt).contiguous() : seq;
  // Rows of one chunk need no carries (the direction kernel alone).
  const at::Tensor totals = nC > 1 ? at::empty({B, H, nC, N}, q.options().dtype(at::kFloat)) : at::Tensor();
  const at::Tensor resets = nC > 1 ? at::empty({B, nC}, int32_on(dev)) : at::Tensor();
  PrefixDirectionParams p;
  p.B = B, p.L = L, p.H = H, p.N = N, p.chunk = chunk, p.eps = (float)eps;
  p.q = q.data_ptr(), p.q_sb = q.stride(0), p.q_sl = q.stride(1), p.q_sh = q.stride(2);
  p.seq = s.defined() ? s.data_ptr<int32_t>() : nullptr;
  p.totals = nC > 1 ? totals.data_ptr<float>() : nullptr;
  p.resets = nC > 1 ? resets.data_ptr<int32_t>() : nullptr;
  p.out = out.data_ptr();
  prefix_direction_cuda(p, ops::kernel_dtype(q), stream_of(out));
  return out;
}

}  // namespace hax::patterns::detail

#else  // no CUDA kernels: the builders reject CUDA tensors and devices before reaching these

#include "core/error.h"

namespace hax::patterns::detail {
namespace {
[[noreturn]] void no_kernels() {
  fail("the pattern builders' CUDA paths are not in this build of hax (no CUDA kernels)");
}
}  // namespace
void* stream_of(const at::Tensor&) { return nullptr; }
void set_lsh_wide_sort_keys(bool) {}  // (no CUDA paths to widen)
SequenceBounds sequence_bounds_device(const at::Tensor&, int64_t, int64_t, const at::Device&) { no_kernels(); }
at::Tensor progression_lists_device(ProgressionKind, int64_t, int64_t, int64_t, int64_t, int64_t, const at::Tensor&,
                                    const at::Device&) {
  no_kernels();
}
at::Tensor lsh_buckets_device(const at::Tensor&, const at::Tensor&, Binning, const at::Tensor&) { no_kernels(); }
KeyLists lsh_device(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, Binning, const at::Tensor&) {
  no_kernels();
}
LshBand lsh_band_device(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, Binning, const at::Tensor&,
                        bool) {
  no_kernels();
}
at::Tensor exclude_band_device(const at::Tensor&, const LshBand&) { no_kernels(); }
at::Tensor top_k_prefix_device(const at::Tensor&, int64_t, const at::Tensor&) { no_kernels(); }
ops::TileBlocks top_k_prefix_blocks_device(const at::Tensor&, int64_t, const at::Tensor&, const LshBand*) {
  no_kernels();
}
at::Tensor merge_device(const at::Tensor&, const at::Tensor&) { no_kernels(); }
at::Tensor merge_overflow_device(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  no_kernels();
}
at::Tensor merge_overflow_band_device(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&) {
  no_kernels();
}
at::Tensor merge_overflow_intervals_device(const at::Tensor&, const at::Tensor&, int64_t, const KeyIntervals&,
                                           const at::Tensor&, const at::Tensor&) {
  no_kernels();
}
KeyIntervals top_k_prefix_intervals_device(const at::Tensor&, int64_t, const at::Tensor&) { no_kernels(); }
ChunkLayout chunk_layout_device(int64_t, int64_t, int64_t, const at::Tensor&, const at::Device&) { no_kernels(); }
at::Tensor top_k_chunks_device(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  no_kernels();
}
at::Tensor prefix_direction_device(const at::Tensor&, const at::Tensor&, double) { no_kernels(); }
}  // namespace hax::patterns::detail

#endif  // HAX_CUDA_KERNELS
