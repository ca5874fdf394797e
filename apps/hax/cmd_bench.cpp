// hax bench: performance measurements (JSON plus a readable table).
#include <fmt/format.h>

#include <algorithm>
#include <sstream>

#include "bench/attention_bench.h"
#include "bench/gpu_bench.h"
#include "bench/train_bench.h"
#include "bench/ssm_bench.h"
#include "commands.h"
#include "config_file.h"
#include "core/atomic_file.h"
#include "core/device.h"
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
    bench::GpuSsmBenchConfig gpu;
    std::string lengths = "", json = "bench-ssm.json", device = "cpu";
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
  ssm->add_option("--device", st->device,
                  "cpu, or cuda: the SSD scan alone at --gpu-heads heads x --headdim, d_state --d-state, bf16 by "
                  "default, lengths 4k..256k unless --lengths is given");
  ssm->add_option("--dtype", st->gpu.dtype, "GPU runs: bf16 or fp32");
  ssm->add_option("--gpu-heads", st->gpu.heads, "GPU runs: heads of the SSD scan");
  ssm->add_option("--calls", st->gpu.calls, "GPU runs: back-to-back calls per timed run (1..1000)")
      ->check(CLI::Range(1, 1000));
  ssm->add_option("--alone-ms", st->gpu.alone_ms,
                  "GPU runs: a call that takes longer than this many ms is timed alone (one call per timed run)")
      ->check(CLI::Range(0.0, 1e6));
  add_threads_option(ssm, &st->threads);
  auto* attn = sub->add_subcommand("attention",
                                   "every sparse pattern (pattern building included) beside full causal attention: "
                                   "forward, forward+backward and peak memory");
  struct AttnState {
    bench::AttentionBenchConfig cfg;
    bench::GpuAttentionBenchConfig gpu;
    std::string patterns = "", lengths = "", dims = "32,64";
    std::string json = "bench-attention.json", device = "cpu";
    int threads = 0;
  };
  auto at_st = std::make_shared<AttnState>();
  attn->add_option("--patterns", at_st->patterns, "comma-separated patterns");
  attn->add_option("--lengths", at_st->lengths, "sequence lengths, e.g. 1k,4k,16k,64k");
  attn->add_option("--dims", at_st->dims, "head dims");
  attn->add_option("--keys", at_st->cfg.keys, "k: keys per query");
  auto* heads_opt = attn->add_option("--heads", at_st->cfg.heads, "heads (CPU default 1, GPU default 16)");
  attn->add_option("--repeats", at_st->cfg.repeats, "timed runs per measurement");
  attn->add_option("--json", at_st->json, "JSON output file");
  attn->add_option("--device", at_st->device,
                   "cpu, or cuda: batch 1, --heads (16 on GPU unless given) x head dim --dims (64), bf16, lengths "
                   "4k..256k unless --lengths is given, beside LibTorch's dense causal SDPA");
  attn->add_option("--dtype", at_st->gpu.dtype, "GPU runs: bf16 or fp32");
  attn->add_option("--calls", at_st->gpu.calls, "GPU runs: back-to-back calls per timed run (1..1000)")
      ->check(CLI::Range(1, 1000));
  attn->add_option("--alone-ms", at_st->gpu.alone_ms,
                   "GPU runs: a call that takes longer than this many ms is timed alone (one call per timed run)")
      ->check(CLI::Range(0.0, 1e6));
  add_threads_option(attn, &at_st->threads);
  Command c;
  c.app = sub;
  auto* tr = sub->add_subcommand("train",
                                 "training steps/s of the paper's joint-recall models (batch 64, 1057 tokens): "
                                 "forward, ranking loss, backward, clipping, AdamW");
  struct TrainState {
    bench::TrainBenchConfig cfg;
    std::string variants = "mamba2+base,mamba2+hax", json = "bench-train.json";
    int threads = 0;
  };
  auto tr_st = std::make_shared<TrainState>();
  tr->add_option("--variants", tr_st->variants, "Table 1 variants, e.g. mamba2+base,mamba2+hax");
  tr->add_option("--device", tr_st->cfg.device, "cpu, cuda or auto");
  tr->add_option("--precision", tr_st->cfg.precision, "fp32 or bf16 (autocast, CUDA only)");
  tr->add_option("--batch", tr_st->cfg.batch, "samples per step");
  tr->add_option("--steps", tr_st->cfg.steps, "timed steps");
  tr->add_option("--warmup", tr_st->cfg.warmup, "untimed steps first");
  tr->add_option("--sparse-keys", tr_st->cfg.sparse_keys, "k of the sparse variants");
  tr->add_option("--seeds", tr_st->cfg.seeds,
                 "model initializations to time (seeds 1..N; a sparse variant's step cost depends on its "
                 "trajectory): one row each, and their median");
  tr->add_flag("--host-sync", tr_st->cfg.host_sync,
               "time the step as before: metrics read back every step, per-tensor AdamW and clipping, "
               "device-value argument checks (for comparison)");
  tr->add_option("--graphs", tr_st->cfg.graphs,
                 "both, on or off: time the steps eagerly and/or replayed from CUDA graphs (train/step_graph.h; "
                 "CUDA with the fused optimizer)");
  tr->add_flag("--deterministic", tr_st->cfg.deterministic,
               "time the steps as hax train --deterministic runs them (fixed-order backward sums, LibTorch's "
               "deterministic ops; eager steps only)");
  tr->add_option("--op-counts", tr_st->cfg.op_counts,
                 "after timing, count the LibTorch operator calls of two more steps and list the N most frequent "
                 "(where a GPU step's launches go)");
  tr->add_option("--json", tr_st->json, "JSON output file");
  add_threads_option(tr, &tr_st->threads);
  c.run = [st, at_st, attn, tr, tr_st, heads_opt]() {
    if (tr->parsed()) {
      auto& cfg = tr_st->cfg;
      cfg.variants = split_list(tr_st->variants);
      HAX_CHECK(!cfg.variants.empty(), "--variants is empty; name at least one Table 1 variant");
      HAX_CHECK(cfg.batch > 0, "--batch {} must be positive", cfg.batch);
      HAX_CHECK(cfg.steps > 0, "--steps {} must be positive", cfg.steps);
      HAX_CHECK(cfg.seeds >= 1 && cfg.seeds <= 100, "--seeds {} must be in 1..100", cfg.seeds);
      HAX_CHECK(cfg.warmup >= 0, "--warmup {} must be non-negative", cfg.warmup);
      HAX_CHECK(cfg.op_counts >= 0, "--op-counts {} must be non-negative", cfg.op_counts);
      HAX_CHECK(cfg.graphs == "both" || cfg.graphs == "on" || cfg.graphs == "off",
                "--graphs {} is unknown; choose both, on or off", cfg.graphs);
      set_threads(tr_st->threads);
      nlohmann::json report = bench::run_train_bench(cfg);
      write_file_atomic(tr_st->json, report.dump(2) + "\n");
      fmt::print("wrote {}\n", tr_st->json);
      return kExitOk;
    }
    if (attn->parsed()) {
      const at::Device dev = resolve_device(at_st->device);
      auto& cfg = at_st->cfg;
      std::vector<std::string> known = {"sw", "d", "sw+d", "a", "lsh", "ks", "hax", "dma", "hsa", "full"};
      if (dev.is_cuda()) known.push_back("sdpa");
      std::vector<std::string> patterns;
      for (const auto& p : split_list(at_st->patterns.empty() ? (dev.is_cuda() ? "sdpa,full,sw,d,sw+d,a,lsh,ks,hax,dma,hsa"
                                                                               : "sw,d,sw+d,a,lsh,ks,hax,dma,hsa,full")
                                                             : at_st->patterns)) {
        HAX_CHECK(std::find(known.begin(), known.end(), p) != known.end(),
                  "--patterns: `{}` is unknown; choose among sw, d, sw+d, a, lsh, ks, hax, dma, hsa, full{}", p,
                  dev.is_cuda() ? ", sdpa" : " (and sdpa with --device cuda)");
        patterns.push_back(p);
      }
      HAX_CHECK(cfg.keys > 0, "--keys {} must be positive", cfg.keys);
      HAX_CHECK(cfg.heads > 0, "--heads {} must be positive", cfg.heads);
      HAX_CHECK(cfg.repeats > 0, "--repeats {} must be positive", cfg.repeats);
      if (dev.is_cuda()) {
        auto& g = at_st->gpu;
        g.patterns = patterns;
        if (!at_st->lengths.empty()) g.lengths = parse_size_list(at_st->lengths, "--lengths");
        const auto dims = parse_size_list(at_st->dims == "32,64" ? "64" : at_st->dims, "--dims");
        HAX_CHECK(dims.size() == 1, "--dims {}: GPU runs take one head dim", at_st->dims);
        g.dim = dims[0], g.keys = cfg.keys, g.repeats = std::max(cfg.repeats, 20);
        if (heads_opt->count()) g.heads = cfg.heads;
        nlohmann::json report = bench::run_attention_bench_cuda(g);
        write_file_atomic(at_st->json, report.dump(2) + "\n");
        fmt::print("wrote {}\n", at_st->json);
        return kExitOk;
      }
      cfg.patterns = patterns;
      cfg.lengths = parse_size_list(at_st->lengths.empty() ? "1k,4k,16k,64k" : at_st->lengths, "--lengths");
      cfg.dims = parse_size_list(at_st->dims, "--dims");
      set_threads(at_st->threads);
      nlohmann::json report = bench::run_attention_bench(cfg);
      write_file_atomic(at_st->json, report.dump(2) + "\n");
      fmt::print("wrote {}\n", at_st->json);
      return kExitOk;
    }
    if (resolve_device(st->device).is_cuda()) {
      auto& g = st->gpu;
      if (!st->lengths.empty()) g.lengths = parse_size_list(st->lengths, "--lengths");
      g.batch = st->cfg.batch, g.headdim = st->cfg.headdim, g.chunk = st->cfg.chunk;
      g.d_state = st->cfg.d_state_mamba2 == bench::SsmBenchConfig{}.d_state_mamba2 ? 128 : st->cfg.d_state_mamba2;
      g.repeats = std::max(st->cfg.repeats, 20);
      nlohmann::json report = bench::run_ssm_bench_cuda(g);
      write_file_atomic(st->json, report.dump(2) + "\n");
      fmt::print("wrote {}\n", st->json);
      return kExitOk;
    }
    st->cfg.lengths = parse_size_list(st->lengths.empty() ? "1k,4k,16k" : st->lengths, "--lengths");
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
