#include "layers/sparse_branch.h"
#include "layers/project.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "core/rng.h"
#include "core/error.h"
#include "layers/host_inputs.h"
#include "layers/lsh_attention.h"
#include "ops/a_shaped_attention/a_shaped_attention.h"
#include "ops/attention/attention.h"
#include "ops/attention/blocks.h"
#include "ops/causal_attention/causal_attention.h"
#include "ops/dilated_attention/dilated_attention.h"

namespace hax {

SparseAttentionBranch::SparseAttentionBranch(const ModelConfig& c, int64_t qk_in_dim, int64_t v_dim, int64_t layer)
    : kind_(c.sparse), parts_(c.sparse_parts()), H_(c.attn_heads), N_(c.qk_dim_resolved()), v_dim_(v_dim),
      keys_per_part_(c.keys_per_part()), stride_(std::max<int64_t>(1, c.dilated_span / c.keys_per_part())),
      bits_(c.lsh_bits), candidates_(c.ks_candidates_resolved()), layer_(layer),
      binning_(patterns::binning_from_string(c.lsh_binning)) {
  qk_proj = register_module("qk_proj", torch::nn::Linear(torch::nn::LinearOptions(qk_in_dim, 2 * H_ * N_).bias(false)));
  E = register_parameter("E", at::ones({v_dim}));
  for (auto& p : parts_)
    if (p == "ks") scorer = register_module("scorer", std::make_shared<KeyScorer>(N_, c.ks_hidden_resolved()));
  if (kind_ == "dma") dma = register_module("dma", std::make_shared<DynamicMaskWeights>(v_dim, H_));
  if (kind_ == "hsa")
    hsa = register_module("hsa", std::make_shared<HierarchicalSparseAttention>(
                                     qk_in_dim, c.hsa_dim_for(qk_in_dim), c.hsa_chunk, c.hsa_topk, c.hsa_landmark));
}

std::pair<at::Tensor, at::Tensor> SparseAttentionBranch::queries_keys(const at::Tensor& qk_in) {
  const int64_t B = qk_in.size(0), L = qk_in.size(1);
  const auto kq = split_last(project(qk_proj, qk_in), {H_ * N_, H_ * N_});
  at::Tensor k = kq[0].reshape({B, L, H_, N_}) / std::sqrt((double)N_);
  at::Tensor q = kq[1].reshape({B, L, H_, N_});
  return {q, k};
}

at::Tensor SparseAttentionBranch::lsh_projection(const ForwardContext* ctx) const {
  return patterns::lsh_projection(N_, bits_, derive_seed(ctx ? ctx->seed : 0, 0x15A, (uint64_t)layer_));
}

at::Tensor SparseAttentionBranch::lsh_projection_input(const at::Tensor& q, const ForwardContext* ctx) const {
  // Rounded to q's dtype and widened to float64 (the buckets' math) on the host, so the GPU gets
  // one upload and no conversions. Not waiting for the copy (the source is staged at once; a
  // blocking copy waits for the GPU).
  const at::ScalarType dt = q.scalar_type();
  const int64_t N = N_, bits = bits_, layer = layer_;
  const HostInputMaker make = [dt, N, bits, layer](const ForwardContext& c) {
    return patterns::lsh_projection(N, bits, derive_seed(c.seed, 0x15A, (uint64_t)layer)).to(dt).to(at::kDouble);
  };
  return host_input(ctx, make, q.device());
}

patterns::LshBand SparseAttentionBranch::lsh_band(const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                                                  const ForwardContext* ctx, bool key_side) const {
  RECORD_USER_SCOPE("hax::lsh_band");
  torch::NoGradGuard ng;
  return patterns::lsh_band(q.detach(), k.detach(), keys_per_part_, lsh_projection_input(q, ctx), binning_, seq_idx,
                            key_side);
}

std::vector<patterns::KeyLists> SparseAttentionBranch::part_lists(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& seq_idx, const ForwardContext* ctx,
                                                                 at::Tensor* ks_scores, bool skip_lsh) {
  const int64_t B = q.size(0), L = q.size(1);
  std::vector<patterns::KeyLists> lists;
  for (const auto& part : parts_) {
    if (skip_lsh && part == "lsh") continue;
    patterns::KeyLists p;
    if (part == "sw") p = patterns::sliding_window(B, H_, L, keys_per_part_, seq_idx, q.device());
    else if (part == "sink") p = patterns::sink(B, H_, L, keys_per_part_, seq_idx, q.device());
    else if (part == "d") p = patterns::dilated(B, H_, L, keys_per_part_, stride_, seq_idx, q.device());
    else if (part == "lsh") {
      RECORD_USER_SCOPE("hax::lsh_lists");
      torch::NoGradGuard ng;
      p = patterns::lsh(q.detach(), k.detach(), keys_per_part_, lsh_projection_input(q, ctx), binning_, seq_idx);
    } else if (part == "ks") {
      RECORD_USER_SCOPE("hax::ks_scores_and_lists");
      at::Tensor scores = ks_scores && ks_scores->defined() ? *ks_scores : scorer->forward(k, q, seq_idx);  // (B, L, H)
      if (ks_scores) *ks_scores = scores;
      torch::NoGradGuard ng;
      p = patterns::top_k_prefix(scores.detach(), keys_per_part_, seq_idx);
    }
    lists.push_back(p);
  }
  return lists;
}

namespace {

// HAX_LSH_BAND (lsh_band_mode: -1 unset, 0 or 1), and whether the GPU runs LSH as a band
// attention (layers/lsh_attention.h) for a pattern of `parts` parts (lsh_as_band):
// HAX_LSH_BAND unset: LSH alone only. HAX (LSH with Key Selection) measured faster through the
// merged lists on the H100 at 64K, k = 64, fwd+bwd: 5.98 ms, against 6.30 for the band beside Key
// Selection's blocks less the band's keys (BENCHMARKS.md, twelfth pass: the band's row permutes,
// the join and the summed gradients of two attentions cost more than the plan and the merge),
// and 7.3 against 6.1 with Key Selection's lists beside the band (eleventh pass).
// 1: always (HAX then takes Key Selection's blocks where the tile kernels run, else its lists);
// 0: never (LSH through its lists, for comparisons). Unset, HAX on the GPU plans LSH's band with
// Key Selection's intervals (ops::sparse_attention_union_band_intervals) or the other part's lists
// (ops::sparse_attention_union_band; see attend).
int lsh_band_mode() {
  static const int mode = [] {
    const char* e = std::getenv("HAX_LSH_BAND");
    if (!e) return -1;
    const std::string v(e);
    HAX_CHECK(v == "0" || v == "1", "HAX_LSH_BAND = '{}' must be 0 (LSH through lists) or 1 (the band)", v);
    return v == "1" ? 1 : 0;
  }();
  return mode;
}
bool lsh_as_band(size_t parts) { return lsh_band_mode() < 0 ? parts == 1 : lsh_band_mode() == 1; }

// A switch read from the environment at its first use: `name` unset is on; else it must be 0
// (off: `off`) or 1 (on: `on`).
bool env_switch(const char* name, const char* off, const char* on) {
  const char* e = std::getenv(name);
  if (!e) return true;
  const std::string v(e);
  HAX_CHECK(v == "0" || v == "1", "{} = '{}' must be 0 ({}) or 1 ({})", name, v, off, on);
  return v == "1";
}

// HAX_KS_INTERVALS=0 gives HAX's plan (LSH's band with Key Selection) Key Selection's lists, as
// before the interval form (for comparisons); unset or 1, the plan reads its intervals
// (ops::sparse_attention_union_band_intervals) where they apply.
bool ks_intervals() {
  static const bool on = env_switch("HAX_KS_INTERVALS", "Key Selection's lists", "its intervals");
  return on;
}

// HAX_A_SINK_KERNELS=0 runs A through its lists on the GPU too (for comparisons); unset or 1, A
// takes ops::a_shaped_attention's fast path where it applies.
bool a_sink_kernels() {
  static const bool on = env_switch("HAX_A_SINK_KERNELS", "A through lists", "the sink kernels");
  return on;
}

// The union of every part's lists (q_order: the first part's that has one).
patterns::KeyLists merge_parts(const std::vector<patterns::KeyLists>& parts) {
  patterns::KeyLists all = parts.at(0);
  for (size_t i = 1; i < parts.size(); ++i) all = patterns::merge(all, parts[i]);
  return all;
}

}  // namespace

patterns::KeyLists SparseAttentionBranch::key_lists(const at::Tensor& q, const at::Tensor& k, const at::Tensor& seq_idx,
                                                    const ForwardContext* ctx, at::Tensor* ks_scores) {
  return merge_parts(part_lists(q, k, seq_idx, ctx, ks_scores));
}

at::Tensor SparseAttentionBranch::attend(const at::Tensor& qk_in, const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& vh, const at::Tensor& seq_idx, ForwardContext* ctx,
                                         at::Tensor* scores_out) {
  const int64_t B = vh.size(0), L = vh.size(1);
  if (kind_ == "full") return std::get<0>(ops::causal_attention(q, k, vh, seq_idx, 0, 1.0));
  // A plain sliding window on the GPU is the causal kernel with a window of k keys (the same
  // definition: the k most recent keys of the packed sequence, self included), which visits only
  // the key tiles inside the window; no lists are built. The CPU, and recording, use the lists.
  if (kind_ == "sw" && vh.is_cuda() && !(ctx && ctx->record))
    return std::get<0>(ops::causal_attention(q, k, vh, seq_idx, keys_per_part_, 1.0));
  // A (the window plus the row's first keys) on the GPU without packing: the causal kernels for
  // the window and ops/a_shaped_attention's sink kernels for the first keys outside it; no lists.
  // Packed rows (a sink per sequence) and recording use the lists.
  if (kind_ == "a" && vh.is_cuda() && !(ctx && ctx->record) && !(seq_idx.defined() && seq_idx.numel() > 0) &&
      a_sink_kernels() && ops::a_shaped_attention_native(q, vh, keys_per_part_, keys_per_part_))
    return std::get<0>(ops::a_shaped_attention(q, k, vh, keys_per_part_, keys_per_part_, 1.0));
  // D and SW+D on the GPU without packing, at long lengths: the causal kernels over the window and,
  // as a band, over the compacted dilated keys (ops/dilated_attention), no lists. Packed rows (the
  // dilation's phase restarts per sequence) and recording use the lists.
  if ((kind_ == "d" || kind_ == "sw+d") && vh.is_cuda() && !(ctx && ctx->record) &&
      !(seq_idx.defined() && seq_idx.numel() > 0) && ops::dilated_attention_native(q, vh))
    return std::get<0>(
        ops::dilated_attention(q, k, vh, keys_per_part_, stride_, kind_ == "sw+d" ? keys_per_part_ : 0, 1.0));
  if (kind_ == "hsa") {
    at::Tensor lists;
    at::Tensor out = hsa->forward(qk_in, q, k, vh, seq_idx, 1.0, ctx && ctx->record ? &lists : nullptr);
    if (ctx && ctx->record) ctx->record->push_back({{lists.flatten(3), at::Tensor()}, {}, {}, {}});
    return out;
  }
  if (kind_ == "dma") {
    at::Tensor delta = dma->forward(vh.reshape({B, L, v_dim_}));  // δ (B, L, H)
    if (ctx && ctx->record) {
      torch::NoGradGuard ng;
      ctx->record->push_back({patterns::top_k_prefix(delta.detach(), keys_per_part_, seq_idx), {}, {}, delta.detach()});
    }
    if (scores_out) *scores_out = delta;
    return dma_attention(q, k, vh, delta, keys_per_part_, seq_idx, 1.0);
  }
  at::Tensor scores;
  // GPU: LSH in its band form (layers/lsh_attention.h), without lists. Alone ("lsh"), or (with
  // HAX_LSH_BAND=1, see lsh_as_band) beside the other parts of a union (HAX's Key Selection):
  // their lists then drop the keys LSH gives each query (so the two key sets are disjoint) and run
  // in position order, and the two attentions are joined by their log-sum-exps.
  const bool has_lsh = std::find(parts_.begin(), parts_.end(), "lsh") != parts_.end();
  const bool has_ks = std::find(parts_.begin(), parts_.end(), "ks") != parts_.end();
  // GPU: Key Selection in its block form (the prefix top-k plus each block's own keys) goes
  // straight to the tile kernels, without lists or a plan kernel; less a band's keys when given.
  const bool ks_blocks = has_ks && !(ctx && ctx->record) && keys_per_part_ <= patterns::kTopKBlocksMaxK &&
                         keys_per_part_ < L && ops::sparse_attention_blocks_native(q, vh);
  auto ks_blocks_attention = [&](const patterns::LshBand* exclude) {
    ops::TileBlocks blocks;
    {
      RECORD_USER_SCOPE("hax::ks_scores_and_blocks");
      scores = scorer->forward(k, q, seq_idx);  // (B, L, H)
      torch::NoGradGuard ng;
      blocks = patterns::top_k_prefix_blocks(scores.detach(), keys_per_part_, seq_idx, exclude);
    }
    if (scores_out) *scores_out = scores;
    RECORD_USER_SCOPE("hax::sparse_attention");
    return ops::sparse_attention_blocks(q, k, vh, blocks, {}, 1.0);
  };
  if (has_lsh && vh.is_cuda() && !(ctx && ctx->record) && lsh_as_band(parts_.size())) {
    const patterns::LshBand band = lsh_band(q, k, seq_idx, ctx);
    auto [o1, lse1] = lsh_band_attention(q, k, vh, band, 1.0);
    if (parts_.size() == 1) return o1;
    if (parts_.size() == 2 && ks_blocks) {  // HAX: Key Selection's blocks less the band's keys
      auto [o2, lse2] = ks_blocks_attention(&band);
      return ops::join_by_lse(o1, lse1.unsqueeze(-1), o2, lse2);
    }
    const std::vector<patterns::KeyLists> rest = part_lists(q, k, seq_idx, ctx, &scores, /*skip_lsh=*/true);
    if (scores_out) *scores_out = scores;
    const patterns::KeyLists others = patterns::exclude_band(merge_parts(rest), band);
    RECORD_USER_SCOPE("hax::sparse_attention");
    auto [o2, lse2] = ops::sparse_attention(q, k, vh, others.idx, {}, {}, others.q_order, 1.0);
    return ops::join_by_lse(o1, lse1.unsqueeze(-1), o2, lse2);
  }
  if (parts_.size() == 1 && ks_blocks) return std::get<0>(ks_blocks_attention(nullptr));  // Key Selection alone
  // GPU, LSH with one other part (HAX), HAX_LSH_BAND unset: LSH's band, without lists, and Key
  // Selection's intervals (or the other part's lists) in one tile plan (its blocks mark the band's
  // keys in a bitmap instead of hashing 32 list entries a query); the blocks whose union overflows
  // get merged lists.
  if (has_lsh && vh.is_cuda() && parts_.size() == 2 && !(ctx && ctx->record) && lsh_band_mode() < 0 &&
      keys_per_part_ <= 32 && ops::sparse_attention_union_native(q, vh, keys_per_part_, keys_per_part_)) {
    const patterns::LshBand band = lsh_band(q, k, seq_idx, ctx, /*key_side=*/false);
    // HAX: Key Selection as intervals (no lists; the plan tests each block's few candidate
    // intervals against its queries), where the GPU builds them (k < L).
    if (has_ks && ks_intervals() && keys_per_part_ < L) {
      patterns::KeyIntervals iv;
      {
        RECORD_USER_SCOPE("hax::ks_scores_and_intervals");
        scores = scorer->forward(k, q, seq_idx);  // (B, L, H)
        torch::NoGradGuard ng;
        iv = patterns::top_k_prefix_intervals(scores.detach(), keys_per_part_, seq_idx);
      }
      if (scores_out) *scores_out = scores;
      RECORD_USER_SCOPE("hax::sparse_attention");
      const auto merge_overflow = [&](const at::Tensor& count) {
        return patterns::merge_overflow_rows(band, keys_per_part_, iv, count);
      };
      return std::get<0>(ops::sparse_attention_union_band_intervals(q, k, vh, band.band, band.k_order, keys_per_part_,
                                                                    iv.count, iv.key, iv.leave, keys_per_part_,
                                                                    band.q_order, 1.0, merge_overflow));
    }
    const std::vector<patterns::KeyLists> rest = part_lists(q, k, seq_idx, ctx, &scores, /*skip_lsh=*/true);
    if (scores_out) *scores_out = scores;
    const patterns::KeyLists& other = rest.at(0);  // (keys_per_part_ slots, position order)
    RECORD_USER_SCOPE("hax::sparse_attention");
    const auto merge_overflow = [&](const at::Tensor& count) {
      return patterns::merge_overflow_rows(band, keys_per_part_, other, count);
    };
    return std::get<0>(ops::sparse_attention_union_band(q, k, vh, band.band, band.k_order, keys_per_part_, other.idx,
                                                        band.q_order, 1.0, merge_overflow));
  }
  std::vector<patterns::KeyLists> parts = part_lists(q, k, seq_idx, ctx, &scores);
  if (scores_out) *scores_out = scores;
  // CPU, HAX (a part computed in a query order of its own, LSH's buckets, beside one in position
  // order): two attentions, each with its own order, joined by their log-sum-exps. The merged
  // lists in LSH's order would put each block's Key Selection keys of far-apart positions into one
  // union (181 keys per 32 queries at L = 16K against 55 + 33 for the two parts), which the
  // CPU's dense tiles pay for. The second part drops the keys the first lists, so the two are the
  // union's disjoint halves. (The GPU's tile plan handles the merged lists better than two calls.)
  if (!vh.is_cuda() && parts.size() == 2 && parts[0].q_order.defined() != parts[1].q_order.defined() &&
      !(ctx && ctx->record)) {
    const patterns::KeyLists& ordered = parts[0].q_order.defined() ? parts[0] : parts[1];
    const patterns::KeyLists rest = patterns::exclude(parts[0].q_order.defined() ? parts[1] : parts[0], ordered);
    auto [o1, lse1] = ops::sparse_attention(q, k, vh, ordered.idx, {}, {}, ordered.q_order, 1.0);
    auto [o2, lse2] = ops::sparse_attention(q, k, vh, rest.idx, {}, {}, {}, 1.0);
    return ops::join_by_lse(o1, lse1, o2, lse2);
  }
  // GPU, two parts (HAX with HAX_LSH_BAND=0 or more than 32 keys a part, or two list parts): the
  // tile plan is built from both lists at once, and only the queries of the blocks whose union
  // overflows get merged lists (for the per-query kernels).
  if (vh.is_cuda() && parts.size() == 2 && !(ctx && ctx->record) &&
      ops::sparse_attention_union_native(q, vh, parts[0].idx.size(3), parts[1].idx.size(3))) {
    const patterns::KeyLists &a = parts[0], &b = parts[1];
    RECORD_USER_SCOPE("hax::sparse_attention");
    const auto merge_overflow = [&](const at::Tensor& count) { return patterns::merge_overflow_rows(a, b, count); };
    return std::get<0>(ops::sparse_attention_union(q, k, vh, a.idx, b.idx, a.q_order.defined() ? a.q_order : b.q_order,
                                                   1.0, merge_overflow));
  }
  patterns::KeyLists lists = [&] {
    RECORD_USER_SCOPE("hax::merge_lists");
    return merge_parts(parts);
  }();
  if (ctx && ctx->record) {
    PatternRecord rec{lists, {}, {}, scores.defined() ? scores.detach() : scores};
    if (std::find(parts_.begin(), parts_.end(), "lsh") != parts_.end()) {
      at::Tensor proj = lsh_projection(ctx).to(q.device(), q.scalar_type());
      rec.q_bucket = patterns::lsh_buckets(q.detach(), proj, binning_, seq_idx);
      rec.k_bucket = patterns::lsh_buckets(k.detach(), proj, binning_, seq_idx);
    }
    ctx->record->push_back(rec);
  }
  RECORD_USER_SCOPE("hax::sparse_attention");
  return std::get<0>(ops::sparse_attention(q, k, vh, lists.idx, {}, {}, lists.q_order, 1.0));
}

at::Tensor SparseAttentionBranch::forward(const at::Tensor& qk_in, const at::Tensor& v, const at::Tensor& seq_idx,
                                          ForwardContext* ctx) {
  RECORD_USER_SCOPE("hax::sparse_branch");
  const int64_t B = v.size(0), L = v.size(1);
  auto [q, k] = queries_keys(qk_in);
  at::Tensor scores;
  at::Tensor out = attend(qk_in, q, k, v.reshape({B, L, H_, v_dim_ / H_}), seq_idx, ctx, &scores);
  if (scorer && ctx && ctx->training) {
    RECORD_USER_SCOPE("hax::ranking_loss");
    // The candidates are drawn on the host from the step's seed and valid mask (host_inputs.h).
    const int64_t cands = candidates_, layer = layer_;
    const HostInputMaker make = [B, L, cands, layer](const ForwardContext& c) {
      at::Tensor vh = c.valid_host.defined() ? c.valid_host : c.valid;  // (a GPU valid is read back)
      return ranking_candidates(vh, B, L, cands, derive_seed(c.seed, 0x45, (uint64_t)layer));
    };
    const at::Tensor cand = host_input(ctx, make, scores.device());
    // Rows without a valid position (padding rows of a fixed-shape step) are left out of the mean;
    // while a step is captured the mask is always passed, so that the graph fits every batch.
    const at::Tensor rows = ranking_rows(ctx->valid, ctx->valid_host, ctx->host_inputs != nullptr);
    ctx->ranking_losses.push_back(ranking_loss_of(scores, q.detach(), k.detach(), seq_idx, ctx->valid, cand, rows));
  }
  return out.reshape({B, L, v_dim_}) * E;
}

at::Tensor SparseAttentionBranch::step(const at::Tensor& qk_in, const at::Tensor& v, MixerState& st,
                                       const ForwardContext* ctx) {
  const int64_t B = v.size(0), t = st.pos;
  auto [q, k] = queries_keys(qk_in.unsqueeze(1));  // (B, 1, H, N)
  at::Tensor vh = v.reshape({B, 1, H_, v_dim_ / H_});
  auto append = [](at::Tensor& cache, const at::Tensor& x) { cache = cache.defined() ? at::cat({cache, x}, 1) : x; };
  append(st.keys, k.detach());
  append(st.values, vh.detach());
  // q_sum holds Σ q of all tokens (Key Selection's query context); the queries themselves are
  // kept too for LSH, whose centering needs every past query.
  st.q_sum = st.q_sum.defined() ? st.q_sum + q.squeeze(1).detach() : q.squeeze(1).detach();
  if (kind_ == "hsa") return hsa->step(qk_in, q, st.keys, st.values, st, 1.0).reshape({B, v_dim_}) * E;
  at::Tensor idx, bias;  // (B, H, 1, K), (B, H, t + 1)
  if (kind_ == "dma") {
    append(st.key_scores, dma->forward(v.view({B, 1, v_dim_})).detach());  // δ of the new key
    idx = patterns::top_k_prefix(st.key_scores, keys_per_part_, {}).idx.narrow(2, t, 1);
    bias = st.key_scores.permute({0, 2, 1}).contiguous();
  } else if (kind_ == "full") {
    idx = at::arange(t + 1, at::TensorOptions().dtype(at::kInt).device(v.device())).view({1, 1, 1, t + 1}).expand({B, H_, 1, t + 1});
  } else {
    at::Tensor scores;
    if (scorer) {
      // The new key's score: the scorer on [k_t, normalize(Σ_{p<=t} q_p)].
      at::Tensor qs = st.q_sum / st.q_sum.norm(2, -1, true).clamp_min(1e-12);
      at::Tensor h = at::cat({k.squeeze(1).detach(), qs}, -1);
      h = project_relu(scorer->l1, h);
      h = project_relu(scorer->l2, h);
      append(st.key_scores, project(scorer->l3, h).view({B, 1, H_}));
      scores = st.key_scores;
    }
    at::Tensor qs_all;  // every past query, for LSH's causal centering
    if (std::find(parts_.begin(), parts_.end(), "lsh") != parts_.end()) {
      append(st.queries, q.detach());
      qs_all = st.queries;
    } else {
      qs_all = q.detach().expand({B, t + 1, H_, N_});  // unused by the other patterns
    }
    patterns::KeyLists lists = key_lists(qs_all, st.keys, {}, ctx, &scores);
    idx = lists.idx.narrow(2, t, 1);
  }
  at::Tensor out = std::get<0>(ops::sparse_attention(q, st.keys, st.values, idx.contiguous(), bias, {}, {}, 1.0));
  return out.reshape({B, v_dim_}) * E;
}

}  // namespace hax
