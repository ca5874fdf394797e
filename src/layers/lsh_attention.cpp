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
  at::Tensor lse = at::scatter(at::empty_like(lse_s), 2, band.q_order.to(at::kLong), lse_s);  // (B, H, L)
  return {out, lse};
}

}  // namespace hax
