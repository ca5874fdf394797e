// hax bench: performance measurements (JSON plus a readable table).
#include <fmt/format.h>

#include <algorithm>
#include <sstream>

#include "bench/attention_bench.h"
#include "bench/ssm_bench.h"
#include "commands.h"
#include "config_file.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "core/threads.h"
#include "options.h"

namespace hax::cli {

Command add_bench_command(CLI::App& app) {
  auto* sub = app.add_subcommand("bench", "benchmarks (JSON and a table)");
  sub->require_subcommand(1);
  auto* ssm = sub->add_subcommand("ssm", "Mamba / Mamba-2 mixers and the SSD scan: forward and forward+backward");
  struct State {
    bench::SsmBenchConfig cfg;
    std::string lengths = "1k,4k,16k", json = "bench-ssm.json", device = "cpu";
    int threads = 0;
  };
  auto st = std::make_shared<State>();
  ssm->add_option("--lengths", st->lengths, "sequence lengths, e.g. 1k,4k,16k");
  ssm->add_option("--batch", st->cfg.batch, "batch size");
  ssm->add_option("--d-model", st->cfg.d_model, "mixer width (d_inner = 2 d_model)");
  ssm->add_option("--headdim", st->cfg.headdim, "Mamba-2 head dim");
  ssm->add_option("--d-state", st->cfg.d_state_mamba2, "Mamba-2 state size");
  ssm->add_option("--mamba-d-state", st->cfg.d_state_mamba, "Mamba state size");
  ssm->add_option("--chunk", st->cfg.chunk, "SSD chunk length");
  ssm->add_option("--naive-max-len", st->cfg.naive_max_len, "longest L for the naive recurrence");
  ssm->add_option("--repeats", st->cfg.repeats, "timed runs per measurement");
  ssm->add_option("--json", st->json, "JSON output file");
  ssm->add_option("--device", st->device, "cpu");
  add_threads_option(ssm, &st->threads);
  auto* attn = sub->add_subcommand("attention",
                                   "every sparse pattern (pattern building included) beside full causal attention: "
                                   "forward, forward+backward and peak memory");
  struct AttnState {
    bench::AttentionBenchConfig cfg;
    std::string patterns = "sw,d,sw+d,a,lsh,ks,hax,dma,hsa,full", lengths = "1k,4k,16k,64k", dims = "32,64";
    std::string json = "bench-attention.json", device = "cpu";
    int threads = 0;
  };
  auto at_st = std::make_shared<AttnState>();
  attn->add_option("--patterns", at_st->patterns, "comma-separated patterns");
  attn->add_option("--lengths", at_st->lengths, "sequence lengths, e.g. 1k,4k,16k,64k");
  attn->add_option("--dims", at_st->dims, "head dims");
  attn->add_option("--keys", at_st->cfg.keys, "k: keys per query");
  attn->add_option("--heads", at_st->cfg.heads, "heads");
  attn->add_option("--repeats", at_st->cfg.repeats, "timed runs per measurement");
  attn->add_option("--json", at_st->json, "JSON output file");
  attn->add_option("--device", at_st->device, "cpu");
  add_threads_option(attn, &at_st->threads);
  Command c;
  c.app = sub;
  c.run = [st, at_st, attn]() {
    if (attn->parsed()) {
      HAX_CHECK(at_st->device == "cpu", "--device {}: this build of hax benchmarks the CPU only", at_st->device);
      auto& cfg = at_st->cfg;
      cfg.lengths = parse_size_list(at_st->lengths, "--lengths");
      cfg.dims = parse_size_list(at_st->dims, "--dims");
      cfg.patterns.clear();
      std::stringstream ss(at_st->patterns);
      std::string p;
      const std::vector<std::string> known = {"sw", "d", "sw+d", "a", "lsh", "ks", "hax", "dma", "hsa", "full"};
      while (std::getline(ss, p, ',')) {
        HAX_CHECK(std::find(known.begin(), known.end(), p) != known.end(),
                  "--patterns: `{}` is unknown; choose among sw, d, sw+d, a, lsh, ks, hax, dma, hsa, full", p);
        cfg.patterns.push_back(p);
      }
      HAX_CHECK(cfg.keys > 0, "--keys {} must be positive", cfg.keys);
      HAX_CHECK(cfg.heads > 0, "--heads {} must be positive", cfg.heads);
      HAX_CHECK(cfg.repeats > 0, "--repeats {} must be positive", cfg.repeats);
      set_threads(at_st->threads);
      nlohmann::json report = bench::run_attention_bench(cfg);
      write_file_atomic(at_st->json, report.dump(2) + "\n");
      fmt::print("wrote {}\n", at_st->json);
      return kExitOk;
    }
    HAX_CHECK(st->device == "cpu", "--device {}: this build of hax benchmarks the CPU only", st->device);
    st->cfg.lengths = parse_size_list(st->lengths, "--lengths");
    HAX_CHECK(st->cfg.batch > 0, "--batch {} must be positive", st->cfg.batch);
    HAX_CHECK(st->cfg.repeats > 0, "--repeats {} must be positive", st->cfg.repeats);
    set_threads(st->threads);
    nlohmann::json report = bench::run_ssm_bench(st->cfg);
    write_file_atomic(st->json, report.dump(2) + "\n");
    fmt::print("wrote {}\n", st->json);
    return kExitOk;
  };
  return c;
}

}  // namespace hax::cli
