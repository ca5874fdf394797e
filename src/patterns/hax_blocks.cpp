// HAX's union in the tile path's block form, from LSH's band and Key Selection's intervals: the
// CPU definition of a plan that reads a few hundred key intervals a head instead of hashing
// 32 list entries a query (pattern.h, hax_blocks). Per (b, h) and block of 64 ranks of q_order:
//   1. the block's queries i_r = q_order[t] and their range [lo, hi] of positions;
//   2. the candidates of Key Selection: the interval keys with key <= hi (a prefix of the keys,
//      which ascend: a binary search) and leave > lo;
//   3. the union: each query's band keys (k_order over its run of sorted keys) and the candidates
//      whose interval holds it (key <= i_r < leave), sorted and deduplicated; more than
//      kAttentionTileMaxKeys keys: the block overflows (count -1, no keys, no mask);
//   4. each query's bits at its keys' ranks in the union.
#include <algorithm>
#include <vector>

#include "patterns/internal.h"
#include "patterns/pattern.h"

namespace hax::patterns {

ops::TileBlocks hax_blocks(const LshBand& band, int64_t band_keys, const KeyIntervals& ks, int64_t ks_keys) {
  constexpr const char* kOp = "hax_blocks";
  ops::check_rank(kOp, "band.q_order", band.q_order, 3, "(B, H, L)");
  const int64_t B = band.q_order.size(0), H = band.q_order.size(1), L = band.q_order.size(2);
  ops::check_shape(kOp, "band.k_order", band.k_order, {B, H, L}, "(B, H, L)");
  ops::check_rank(kOp, "band.band", band.band, 4, "(2 or more, B, H, L)");
  HAX_CHECK(band.band.size(0) >= 2 && band.band.size(1) == B && band.band.size(2) == H && band.band.size(3) == L,
            "{}: band.band has shape {}, expected (2 or more, B, H, L) = (2+, {}, {}, {})", kOp,
            ops::shape_str(band.band.sizes()), B, H, L);
  ops::check_shape(kOp, "ks.count", ks.count, {B, H}, "(B, H)");
  ops::check_rank(kOp, "ks.key", ks.key, 3, "(B, H, M)");
  ops::check_shape(kOp, "ks.leave", ks.leave, ks.key.sizes().vec(), "ks.key's (B, H, M)");
  HAX_CHECK(ks.key.size(0) == B && ks.key.size(1) == H, "{}: ks.key has shape {}, expected (B, H, M) = ({}, {}, M)",
            kOp, ops::shape_str(ks.key.sizes()), B, H);
  detail::check_positive(kOp, "band_keys", band_keys);
  detail::check_positive(kOp, "ks_keys", ks_keys);
  auto cpu = [](const at::Tensor& t) { return t.to(at::kCPU, at::kInt).contiguous(); };
  const at::Tensor qo_t = cpu(band.q_order), ko_t = cpu(band.k_order), bd_t = cpu(band.band.narrow(0, 0, 2));
  const at::Tensor kc_t = cpu(ks.count), kk_t = cpu(ks.key), kl_t = cpu(ks.leave);
  {  // entries inside the row (a listed band run, the intervals' keys and leaves), clear errors
    const at::Tensor first = bd_t[0], last = bd_t[1], listed = last >= first;
    HAX_CHECK(!(listed & ((first < 0) | (last >= L) | (last - first >= band_keys))).any().item<bool>(),
              "{}: a band run lists sorted keys outside [0, L = {}) or more than band_keys = {} of them", kOp, L,
              band_keys);
    const int64_t M = kk_t.size(2);
    HAX_CHECK(!((kc_t < 0) | (kc_t > M)).any().item<bool>(), "{}: ks.count holds a count outside [0, M = {}]", kOp, M);
    const at::Tensor used = at::arange(M, at::kInt).view({1, 1, M}) < kc_t.unsqueeze(-1);
    HAX_CHECK(!(used & ((kk_t < 0) | (kl_t <= kk_t) | (kl_t > L))).any().item<bool>(),
              "{}: an interval has key outside [0, L = {}) or leave outside (key, L]", kOp, L);
  }
  const auto qo = qo_t.accessor<int32_t, 3>(), ko = ko_t.accessor<int32_t, 3>();
  const auto bd = bd_t.accessor<int32_t, 4>();
  const auto kc = kc_t.accessor<int32_t, 2>();
  const auto kk = kk_t.accessor<int32_t, 3>(), kl = kl_t.accessor<int32_t, 3>();
  constexpr int64_t Q = ops::kAttentionTileQueries, U = ops::kAttentionTileMaxKeys, T = ops::kAttentionTilesPerBlock;
  const int64_t nblk = ops::tile_blocks_count(L);
  ops::TileBlocks bl;
  bl.count = at::empty({B, H, nblk}, at::kInt);
  bl.keys = at::full({B, H, nblk, U}, -1, at::kInt);
  bl.mask = at::zeros({B, H, nblk, T, Q}, at::kLong);
  bl.max_keys = band_keys + ks_keys;
  int32_t* cnt = bl.count.data_ptr<int32_t>();
  int32_t* keys = bl.keys.data_ptr<int32_t>();
  uint64_t* mask = reinterpret_cast<uint64_t*>(bl.mask.data_ptr<int64_t>());
  at::parallel_for(0, B * H * nblk, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> u, cand;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / nblk, b = bh / H, h = bh % H, t0 = item % nblk * Q, nq = std::min(Q, L - t0);
      int64_t lo = L, hi = -1;
      for (int64_t r = 0; r < nq; ++r) lo = std::min<int64_t>(lo, qo[b][h][t0 + r]), hi = std::max<int64_t>(hi, qo[b][h][t0 + r]);
      // 2. candidates: keys <= hi (binary search over the ascending keys), leaving after lo.
      const int32_t* kb = &kk[b][h][0];
      const int64_t n = std::upper_bound(kb, kb + kc[b][h], (int32_t)hi) - kb;
      cand.clear();
      for (int64_t e = 0; e < n; ++e)
        if (kl[b][h][e] > lo) cand.push_back((int32_t)e);
      // 3, 4. each query's band keys and held candidates; the union and the bits.
      const auto each_key = [&](int64_t r, auto&& f) {
        const int64_t i = qo[b][h][t0 + r];
        for (int64_t p = bd[0][b][h][t0 + r]; p <= bd[1][b][h][t0 + r]; ++p) f(ko[b][h][p]);
        for (const int32_t e : cand)
          if (kk[b][h][e] <= i && i < kl[b][h][e]) f(kk[b][h][e]);
      };
      ops::fill_tile_block(item, nq, each_key, cnt, keys, mask, u);
    }
  });
  const at::Device dev = band.q_order.device();
  return {detail::on(bl.count, dev), detail::on(bl.keys, dev), detail::on(bl.mask, dev), bl.max_keys};
}

}  // namespace hax::patterns
