#include "bench/train_bench.h"
#include "bench/op_counts.h"
#include "bench/timing.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <ATen/record_function.h>

#include <chrono>

#include "core/cuda_util.h"
#include "core/device.h"
#include "core/error.h"
#include "eval/table1.h"
#include "models/lm.h"
#include "ops/backend.h"
#include "ops/check.h"
#include "tasks/batch.h"
#include "tasks/registry.h"
#include "tasks/splits.h"
#include "train/adamw.h"
#include "train/loss.h"
#include "train/precision.h"
#include "train/step_graph.h"
#include "train/train_step.h"

namespace hax::bench {

nlohmann::json run_train_bench(const TrainBenchConfig& cfg) {
  const at::Device dev = resolve_device(cfg.device);
  const bool gpu = dev.is_cuda();
  Table1Config t1;
  t1.sparse_keys = cfg.sparse_keys, t1.chunk_size = cfg.chunk_size;
  auto task = make_task(t1.task);  // the paper's joint recall instance
  const int64_t len = task->max_length() - 1;
  nlohmann::json report;
  report["device"] = gpu ? cuda_device_name() : std::string("cpu");
  report["threads"] = at::get_num_threads();
  report["config"] = {{"batch", cfg.batch}, {"length", len}, {"steps", cfg.steps}, {"warmup", cfg.warmup},
                      {"sparse_keys", cfg.sparse_keys}, {"chunk_size", cfg.chunk_size}, {"precision", cfg.precision},
                      {"host_sync", cfg.host_sync}, {"graphs", cfg.graphs}, {"seeds", cfg.seeds},
                      {"deterministic", cfg.deterministic},
                      {"fused_optimizer", gpu && !cfg.host_sync && fused_optimizer_built()}};
  fmt::print("hax bench train: {}, joint recall, batch {} x {} tokens (packed rows), {}; {} timed steps after {} "
             "warm-up steps (data prepared beforehand); {}\n",
             gpu ? cuda_device_name() : fmt::format("CPU, {} threads", at::get_num_threads()), cfg.batch, len,
             cfg.precision, cfg.steps, cfg.warmup,
             cfg.host_sync ? "host reads the metrics every step, per-tensor optimizer"
                           : "metrics read at the end, fused optimizer on CUDA");
  if (cfg.deterministic) fmt::print("deterministic mode, as hax train --deterministic: eager steps only\n");
  const bool checks_were = ops::check_device_values();
  ops::set_check_device_values(cfg.host_sync || checks_were);
  // The step kinds timed: eager, and (CUDA, fused optimizer, not deterministic) replayed from CUDA graphs.
  std::vector<bool> graph_modes;
  if (cfg.graphs != "on") graph_modes.push_back(false);
  if (cfg.graphs != "off" && gpu && !cfg.host_sync && !cfg.deterministic && fused_optimizer_built())
    graph_modes.push_back(true);
  HAX_CHECK(!graph_modes.empty(), "--graphs on: CUDA graphs need --device cuda, the fused optimizer (LibTorch >= 2.4), "
            "no --host-sync and no --deterministic (its steps run eagerly)");
  const ops::DeterministicScope det_mode(cfg.deterministic);  // (the process's mode again on every exit)
  fmt::print("{:<14} {:<7} {:>10} {:>10} {:>12} {:>10} {:>9}\n", "variant", "step", "params", "ms/step", "steps/s",
             "peak MB", "captures");
  // Batches are prepared once (the trainer builds them on the CPU, overlapping nothing).
  const EvalFingerprints none = eval_fingerprints(*task, 1, 0, 0, 0, 0);
  TrainStream stream(*task, 1, none);
  std::vector<Batch> batches, host_batches;  // on the device; on the host (for the graphed steps)
  for (int64_t s = 0; s < cfg.warmup + cfg.steps; ++s) {
    std::vector<Sample> samples;
    for (int64_t i = 0; i < cfg.batch; ++i) samples.push_back(stream.at(s * cfg.batch + i));
    host_batches.push_back(make_batch(samples, true, len));
    batches.push_back(host_batches.back().to(dev));
  }
  for (const auto& variant : cfg.variants) {
    for (const bool graphed : graph_modes) {
      std::vector<double> rates;  // steps/s of each seed
      for (int64_t seed = 1; seed <= cfg.seeds; ++seed) {
        torch::manual_seed((uint64_t)seed);
        LanguageModel model(table1_model(variant, t1));
        model.to(dev);
        model.train();
        auto params = model.state_tensors();
        int64_t nparams = 0;
        for (auto& [n, p] : params) nparams += p.numel();
        AdamWOptions ao;
        ao.fused = !cfg.host_sync;
        AdamW opt(params, ao);
        std::vector<at::Tensor> metrics;  // per step (4) float64 on the device, read after the timing
        const StepSettings settings{cfg.precision, 0.1, 1.0};
        std::unique_ptr<StepGraph> graph;
        if (graphed) graph = std::make_unique<StepGraph>(model, opt, params, settings);
        auto step = [&](int64_t s) {
          if (graph) {  // the trainer's graphed step (host batches, padded)
            at::Tensor m = graph->run(host_batches[s], (uint64_t)s, 1e-3, 0);
            if (m.defined()) {
              metrics.push_back(m);
              return;
            }
          }
          ForwardContext ctx;
          ctx.training = true;
          ctx.seed = (uint64_t)s;
          if (!cfg.host_sync) {
            // The trainer's eager step: the metrics stay on the device, a non-finite step is skipped there.
            opt.zero_grad();
            metrics.push_back(device_train_step(model, params, batches[s], ctx, settings,
                                                [&](const at::Tensor& skip) { opt.step(1e-3, skip); }));
            return;
          }
          LossResult r;
          {
            RECORD_USER_SCOPE("hax::forward_and_loss");
            AutocastScope ac(cfg.precision, dev);
            Batch b = batches[s];  // as before: supervised positions found on the device
            b.supervised = at::Tensor(), b.supervised_samples = -1;
            r = masked_lm_loss(model, b, ctx);
          }
          opt.zero_grad();
          {
            RECORD_USER_SCOPE("hax::backward");
            (r.ranking.defined() ? r.loss + 0.1 * r.ranking : r.loss).backward();
          }
          clip_grad_norm(params, 1.0);
          opt.step(1e-3);
          (void)r.loss.item<double>();  // as the trainer did: the loss read every step
        };
        for (int64_t s = 0; s < cfg.warmup; ++s) step(s);
        if (gpu) {
          cuda_synchronize();
          cuda_reset_peak_memory();
        }
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t s = cfg.warmup; s < cfg.warmup + cfg.steps; ++s) step(s);
        if (!metrics.empty()) (void)at::stack(metrics).cpu();  // the trainer reads them at log intervals
        if (gpu) cuda_synchronize();
        const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double ms = 1e3 * sec / cfg.steps;
        const int64_t peak = gpu ? cuda_peak_memory_bytes() : -1;
        nlohmann::json row = {{"variant", variant}, {"seed", seed}, {"params", nparams}, {"ms_per_step", ms},
                              {"steps_per_s", 1e3 / ms}, {"peak_bytes", peak}, {"cuda_graphs", graphed}};
        if (graph) {
          row["graph_captures"] = graph->captures(), row["graph_replays"] = graph->replays();
          row["eager_steps"] = cfg.warmup + cfg.steps - graph->replays();  // warm-up, fallbacks
          if (graph->disabled()) row["graphs_off"] = graph->disabled_reason();
        }
        std::string op_table;
        if (cfg.op_counts > 0) {
          OpCounter counter;
          for (int64_t s = 0; s < 2; ++s) step(s);
          if (!metrics.empty()) (void)at::stack(metrics).cpu();
          if (gpu) cuda_synchronize();
          op_table = counter.table(cfg.op_counts, 2);
          int64_t leaves = 0;
          for (auto& [k, n] : counter.leaves()) leaves += n;
          row["operator_leaves_per_step"] = leaves / 2;
        }
        const std::string name = cfg.seeds > 1 ? fmt::format("{}/s{}", variant, seed) : variant;
        fmt::print("{:<14} {:<7} {:>10} {:>10.2f} {:>12.1f} {:>10} {:>9}\n", name, graphed ? "graph" : "eager",
                   nparams, ms, 1e3 / ms, peak >= 0 ? fmt::format("{:.1f}", peak / 1e6) : std::string("-"),
                   graph ? std::to_string(graph->captures()) : std::string("-"));
        if (graph && graph->disabled()) fmt::print("  CUDA graphs off: {}\n", graph->disabled_reason());
        if (!op_table.empty()) fmt::print("{}", op_table);
        std::fflush(stdout);
        report["results"].push_back(row);
        rates.push_back(1e3 / ms);
      }
      if (cfg.seeds > 1) {
        const Spread r = spread_of(rates);
        fmt::print("{:<14} {:<7} median {:.1f} steps/s over {} seeds (min {:.1f}, max {:.1f})\n", variant,
                   graphed ? "graph" : "eager", r.median, rates.size(), r.min, r.max);
        report["summary"].push_back({{"variant", variant}, {"cuda_graphs", graphed}, {"seeds", (int64_t)rates.size()},
                                     {"steps_per_s_median", r.median}, {"steps_per_s_min", r.min},
                                     {"steps_per_s_max", r.max}});
      }
    }
  }
  ops::set_check_device_values(checks_were);
  return report;
}

}  // namespace hax::bench
