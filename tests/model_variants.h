// Every model variant hax trains, as small test configurations (shared by the CPU and GPU model tests).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "models/model_config.h"

namespace hax::testing {

// Every variant: (mixer, sparse).
inline std::vector<std::pair<std::string, std::string>> all_variants() {
  std::vector<std::pair<std::string, std::string>> v;
  for (const char* m : {"mamba", "mamba2"})
    for (const char* s : {"sw", "d", "sw+d", "a", "lsh", "ks", "hax", "dma", "hsa", "full"}) v.push_back({m, s});
  v.push_back({"samba", "none"});
  for (const char* a : {"full", "swa", "swa+hsa", "dma"}) v.push_back({"transformer", a});  // (mixer, attention)
  return v;
}

inline ModelConfig hybrid_config(const std::string& mixer, const std::string& sparse) {
  ModelConfig c;
  c.mixer = mixer;
  c.sparse = mixer == "transformer" ? "none" : sparse;
  if (mixer == "transformer") c.attention = sparse;
  c.vocab_size = 29;
  c.d_model = 16;
  c.n_layers = mixer == "samba" ? 4 : 2;
  c.d_state = 6;
  c.headdim = 8;
  c.chunk_size = 16;
  c.sparse_keys = 8;       // 4 per part in unions
  c.lsh_bits = 2;          // few buckets, so same-bucket keys exist at short lengths
  c.dilated_span = 12;     // dilated stride 12 / 4 = 3 in unions, 12 / 8 alone
  c.swa_window = 5;
  c.swa_heads = 2;
  c.hsa_chunk = 6;         // several chunks at the tests' lengths
  c.hsa_topk = 3;
  c.hsa_dim = 7;
  return c;
}

inline std::string name_of(const std::pair<std::string, std::string>& v) { return v.first + "+" + v.second; }

}  // namespace hax::testing
