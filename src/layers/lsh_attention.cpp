#include "layers/lsh_attention.h"

#include "ops/causal_attention/causal_attention.h"
#include "ops/permute_rows/permute_rows.h"

namespace hax {

std::tuple<at::Tensor, at::Tensor> lsh_band_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const patterns::LshBand& band, double scale) {
  const at::Tensor qs = ops::permute_rows(q, band.q_order, false);  // (B, L, H, D), sorted queries
  const at::Tensor ks = ops::permute_rows(k, band.k_order, false);
  const at::Tensor vs = ops::permute_rows(v, band.k_order, false);
  auto [out_s, lse_s] = ops::causal_attention(qs, ks, vs, {}, 0, scale, band.band);
  at::Tensor out = ops::permute_rows(out_s, band.q_order, true);
  // lse (B, H, L) back to position order: rows of length 1, one (b·h) row each.
  const int64_t B = lse_s.size(0), H = lse_s.size(1), L = lse_s.size(2);
  at::Tensor lse = ops::permute_rows(lse_s.reshape({B * H, L, 1, 1}), band.q_order.reshape({B * H, 1, L}), true);
  return {out, lse.view({B, H, L})};
}

}  // namespace hax
