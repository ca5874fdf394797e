// How many query blocks add to each key's dK, dV in HAX's tile backward, for the inputs of
// `hax bench attention --device cuda --patterns hax` (B 1, 16 heads, head dim 64, k 64, the same
// seeds), computed on the CPU from the pattern's lists: a key's count is the number of blocks of
// 64 consecutive queries in LSH's bucket order that list it for LSH; keys that any query lists
// for Key Selection are counted apart (on the GPU those are the many-block keys, summed in
// float32). BENCHMARKS.md, thirty-third pass. Usage: hax_key_uses [L = 65536].
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

#include "layers/sparse_branch.h"
#include "models/model_config.h"

int main(int argc, char** argv) {
  using namespace hax;
  const int64_t B = 1, L = argc > 1 ? std::atoll(argv[1]) : 65536, H = 16, D = 64;
  torch::manual_seed(0);  // (bench/gpu_bench.cpp's draws, on the CPU in float32)
  const at::Tensor q = at::randn({B, L, H, D}), k = at::randn({B, L, H, D}) / std::sqrt((double)D);
  ModelConfig mc;
  mc.d_model = D, mc.d_state = D, mc.sparse = "hax", mc.sparse_keys = 64, mc.attn_heads = H, mc.qk_dim = D;
  torch::manual_seed(1);
  auto branch = std::make_shared<SparseAttentionBranch>(mc, D, D * H, 0);
  ForwardContext ctx;
  torch::NoGradGuard ng;
  at::Tensor scores;
  const auto parts = branch->part_lists(q, k, {}, &ctx, &scores);  // LSH's (with q_order), Key Selection's
  const auto li = parts[0].idx.accessor<int32_t, 4>();
  const auto ki = parts[1].idx.accessor<int32_t, 4>();
  const auto qo = parts[0].q_order.accessor<int32_t, 3>();
  std::map<int64_t, int64_t> hist;  // blocks (capped at 9) -> keys; -1: a Key Selection key
  int64_t ks_keys = 0;
  for (int64_t h = 0; h < H; ++h) {
    std::vector<int> uses(L, 0), last(L, -1);
    std::vector<char> ks(L, 0);
    for (int64_t t = 0; t < L; ++t) {
      const int64_t i = qo[0][h][t], blk = t / 64;
      for (int64_t e = 0; e < li.size(3); ++e) {
        const int j = li[0][h][i][e];
        if (j >= 0 && last[j] != blk) last[j] = (int)blk, ++uses[j];
      }
      for (int64_t e = 0; e < ki.size(3); ++e)
        if (ki[0][h][i][e] >= 0) ks[ki[0][h][i][e]] = 1;
    }
    for (int64_t j = 0; j < L; ++j) ++hist[ks[j] ? -1 : std::min(uses[j], 9)], ks_keys += ks[j];
  }
  for (const auto& [u, n] : hist)
    std::printf("%s: %lld keys (%.2f%%)\n", u < 0 ? "Key Selection keys" : ("LSH blocks " + std::to_string(u)).c_str(),
                (long long)n, 100.0 * n / (H * L));
  std::printf("Key Selection keys per head: %.1f\n", (double)ks_keys / H);

  // The interval form's work per block of 64 queries in LSH's order (patterns::hax_blocks): Key
  // Selection's candidates (interval keys up to the block's last position that leave after its
  // first) and the union, against the 64 x 32 list entries the hash plan inserts.
  const patterns::KeyIntervals iv = patterns::top_k_prefix_intervals(scores, 32, {});
  const patterns::LshBand band = branch->lsh_band(q, k, {}, &ctx);
  const ops::TileBlocks bl = patterns::hax_blocks(band, 32, iv, 32);
  const auto kc = iv.count.accessor<int32_t, 2>();
  const auto kk = iv.key.accessor<int32_t, 3>(), kl = iv.leave.accessor<int32_t, 3>();
  const auto qo2 = band.q_order.accessor<int32_t, 3>();
  const int64_t nblk = (L + 63) / 64;
  double cand = 0, uni = 0, over = 0;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t n = 0; n < nblk; ++n) {
      int64_t lo = L, hi = -1;
      for (int64_t t = 64 * n; t < std::min(L, 64 * n + 64); ++t)
        lo = std::min<int64_t>(lo, qo2[0][h][t]), hi = std::max<int64_t>(hi, qo2[0][h][t]);
      for (int64_t e = 0; e < kc[0][h] && kk[0][h][e] <= hi; ++e) cand += kl[0][h][e] > lo;
      const int32_t c = bl.count[0][h][n].item<int32_t>();
      if (c < 0) over += 1; else uni += c;
    }
  std::printf("interval form: %.1f Key Selection candidates and %.1f union keys a block (%.0f blocks overflow), "
              "against 2048 list entries a block hashed\n", cand / (H * nblk), uni / (H * nblk - over), over);
}
