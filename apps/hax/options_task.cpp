#include "core/error.h"
#include "options.h"
#include "tasks/registry.h"

namespace hax::cli {
namespace {

// "2,3,4" -> {2, 3, 4}; "" -> {}.
std::vector<int64_t> int_list(const std::string& s, const char* flag) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    try {
      size_t used = 0;
      out.push_back(std::stoll(item, &used));
      HAX_CHECK(used == item.size(), "{} {}: `{}` is not an integer", flag, s, item);
    } catch (const std::logic_error&) {
      fail("{} {}: `{}` is not an integer", flag, s, item);
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

}  // namespace

void add_task_options(CLI::App* app, TaskConfig* t) {
  const char* g = "Task";
  std::string names;
  for (auto& n : task_names()) names += (names.empty() ? "" : ", ") + n;
  app->add_option("--task", t->name, "task: " + names)->group(g);
  app->add_option("--levels", t->levels, "joint recall levels w (the last level is the key)")->group(g);
  app->add_option("--nc-min", t->nc_min, "fewest contexts n_c per sample")->group(g);
  app->add_option("--nc-max", t->nc_max, "most contexts n_c per sample")->group(g);
  app->add_option("--nk-min", t->nk_min, "fewest keys n_k per context")->group(g);
  app->add_option("--nk-max", t->nk_max, "most keys n_k per context")->group(g);
  auto list = [&](const char* flag, std::vector<int64_t>* v, const char* help) {
    app->add_option_function<std::string>(flag, [v, flag](const std::string& s) { *v = int_list(s, flag); }, help)
        ->group(g);
  };
  list("--level-min", &t->level_min, "multilevel: smallest size of each level, level 1 first (e.g. 2,3,4)");
  list("--level-max", &t->level_max, "multilevel: largest size of each level, level 1 first");
  list("--level-vocab", &t->level_vocab, "distinct ids of each level (default 16 each)");
  app->add_option("--num-values", t->num_values, "distinct value tokens (ids from 10)")->group(g);
  app->add_option("--mqar-vocab", t->vocab_size, "MQAR vocabulary V (keys < V/2 <= values)")->group(g);
  app->add_option("--seq-len", t->seq_len, "MQAR and NIAH input length (a sample has seq_len + 1 tokens)")->group(g);
  app->add_option("--kv-min", t->kv_min, "MQAR fewest key-value pairs")->group(g);
  app->add_option("--kv-max", t->kv_max, "MQAR most key-value pairs")->group(g);
  app->add_option("--power-a", t->power_a, "MQAR query-gap power law exponent")->group(g);
  app->add_option("--niah-variant", t->niah_variant, "NIAH variant: single, multikey, multivalue or multiquery")
      ->group(g);
  app->add_option("--niah-needles", t->niah_needles, "NIAH multikey/multiquery: needles (distinct keys)")->group(g);
  app->add_option("--niah-values", t->niah_values, "NIAH multivalue: passkeys of the one key")->group(g);
  app->add_option("--niah-key-len", t->niah_key_len, "NIAH key tokens per needle")->group(g);
  app->add_option("--niah-value-len", t->niah_value_len, "NIAH passkey digits per needle (the answer)")->group(g);
  app->add_option("--niah-key-vocab", t->niah_key_vocab, "NIAH distinct key tokens")->group(g);
  app->add_option("--niah-vocab", t->niah_vocab, "NIAH distinct filler tokens")->group(g);
  app->add_option("--niah-depth", t->niah_depth,
                  "NIAH depth of the queried needles in [0, 1] (0 = start), or negative for random per sample")
      ->group(g);
}

}  // namespace hax::cli
