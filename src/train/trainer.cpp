#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "core/atomic_file.h"
#include "core/device.h"
#include "ops/backend.h"
#include "core/error.h"
#include "core/progress.h"
#include "core/rng.h"
#include "core/signals.h"
#include "eval/evaluator.h"
#include "models/lm.h"
#include "tasks/batch.h"
#include "tasks/registry.h"
#include "tasks/splits.h"
#include "train/adamw.h"
#include "train/checkpoint.h"
#include "train/loss.h"
#include "train/metrics.h"
#include "train/precision.h"
#include "train/schedule.h"
#include "train/step_graph.h"
#include "train/train_step.h"

namespace hax {

std::string last_checkpoint_path(const std::string& run_dir) { return run_dir + "/checkpoints/last.safetensors"; }
std::string best_checkpoint_path(const std::string& run_dir) { return run_dir + "/checkpoints/best.safetensors"; }

namespace {

// Training metrics averaged over a logging window; saved in checkpoints so that a resumed run
// logs exactly what an uninterrupted one would.
struct Window {
  double loss = 0, acc = 0, grad_norm = 0, ranking = 0;
  int64_t steps = 0, tokens = 0;
  nlohmann::json to_json() const {
    return {{"loss", loss},   {"acc", acc},       {"grad_norm", grad_norm},
            {"ranking", ranking}, {"steps", steps}, {"tokens", tokens}};
  }
  static Window from_json(const nlohmann::json& j) {
    Window w;
    w.loss = j.at("loss"), w.acc = j.at("acc"), w.grad_norm = j.at("grad_norm"), w.steps = j.at("steps");
    w.tokens = j.at("tokens"), w.ranking = j.value("ranking", 0.0);
    return w;
  }
};

// Test hook: HAX_INJECT_NAN_AT_STEP=k makes step k's loss NaN (to exercise the NaN guard).
int64_t injected_nan_step() {
  const char* s = std::getenv("HAX_INJECT_NAN_AT_STEP");
  return s ? std::atoll(s) : -1;
}

}  // namespace

TrainSummary train(const RunConfig& run) {
  const TrainConfig& tc = run.train;
  run.model.validate();
  tc.validate();
  auto task = make_task(run.task);
  HAX_CHECK(run.model.vocab_size >= task->min_vocab(),
            "--vocab-size {} is too small for task {}, whose token ids reach {}: it must be at least {}",
            run.model.vocab_size, task->name(), task->min_vocab() - 1, task->min_vocab());
  const at::Device device = resolve_device(tc.device);
  check_precision(tc.precision, device);
  ops::set_deterministic(tc.deterministic);
  const int64_t pack_len = tc.pack_len > 0 ? tc.pack_len : task->max_length() - 1;

  const std::string last_path = last_checkpoint_path(tc.run_dir), best_path = best_checkpoint_path(tc.run_dir);
  const bool has_run = path_exists(last_path);
  if (tc.resume) {
    HAX_CHECK(has_run, "--resume: run directory {} has no checkpoint {} to continue from", tc.run_dir, last_path);
  } else if (has_run && !tc.overwrite) {
    fail("--run-dir {} already holds a run ({}); pass --resume to continue it or --overwrite to start afresh",
         tc.run_dir, last_path);
  }
  make_dirs(tc.run_dir + "/checkpoints");

  torch::manual_seed(tc.seed);
  LanguageModel model(run.model);  // initialized on the CPU (the same weights on every device), then moved
  model.to(device);
  model.train();
  if (tc.swa_warmup_window > 0)
    HAX_CHECK(model.set_swa_window(run.model.swa_window) > 0,
              "--swa-warmup-window {} needs sliding-window attention layers (--mixer samba, or --mixer transformer "
              "with --attention swa or swa+hsa); --mixer {} has none",
              tc.swa_warmup_window, run.model.mixer);
  auto params = model.state_tensors();
  AdamW opt(params, {tc.beta1, tc.beta2, tc.adam_eps, tc.weight_decay});

  CheckpointMeta meta{0, -1, -1, run.model, run.task, tc, run.config_text};
  Window window;
  if (tc.resume) {
    Checkpoint ck = read_checkpoint(last_path);
    HAX_CHECK(ck.has_optimizer, "--resume: checkpoint {} has no optimizer state", last_path);
    load_weights(model, ck, last_path);
    opt.load_state(ck.file.tensors, ck.meta.step, "checkpoint " + last_path);
    meta.step = ck.meta.step, meta.best_valid_acc = ck.meta.best_valid_acc, meta.best_step = ck.meta.best_step;
    if (ck.file.metadata.count("log_window")) window = Window::from_json(nlohmann::json::parse(ck.file.metadata.at("log_window")));
  }
  write_file_atomic(tc.run_dir + "/config.toml", run.config_text);
  MetricsLog metrics(tc.run_dir + "/metrics.jsonl", tc.resume ? meta.step : -1);

  // The validation set is kept (it is evaluated again and again); the test set only as
  // fingerprints until the end (long samples: 14.4K test samples of 16K tokens are 1.2 GB).
  EvalFingerprints splits = eval_fingerprints(*task, tc.seed, tc.n_valid, tc.n_test, tc.n_valid, 0);
  TrainStream stream(*task, tc.seed, splits);

  int64_t last_saved_step = tc.resume ? meta.step : -1;
  auto save_last = [&] {
    save_checkpoint(last_path, model, &opt, meta, {{"log_window", window.to_json().dump()}});
    last_saved_step = meta.step;
  };

  install_interrupt_handler();
  const int64_t nan_step = injected_nan_step();
  Progress bar(tc.steps, meta.step, tc.progress, tc.log_every);
  const auto t_start = std::chrono::steady_clock::now();
  auto t_window = t_start;
  TrainSummary summary;
  summary.run_dir = tc.run_dir;
  double last_loss = 0, last_acc = 0, tps = 0;

  // A step's metrics stay on the device until they are needed (a log line, a checkpoint, an
  // evaluation, the end): reading them every step would make the host wait for the GPU each step.
  // On the CPU they are read at once (nothing to overlap), which also stops a non-finite step
  // before its update, as always. flush() reads every pending step in one transfer and handles
  // each in order exactly as if it had been read at its own step.
  struct Pending {
    int64_t step = 0;         // 1-based step count after this step
    double lr = 0;
    int64_t tokens = 0, samples = 0;
    at::Tensor values;        // (4) float64: loss, ranking loss, gradient norm, Σ per-sample accuracy
  };
  std::vector<Pending> pending;
  const bool defer = device.is_cuda();
  auto flush = [&] {
    if (pending.empty()) return;
    std::vector<at::Tensor> vs;
    for (auto& p : pending) vs.push_back(p.values);
    const at::Tensor host = at::stack(vs).to(at::kCPU).contiguous();  // (n, 4): the one wait on the device
    const double* v = host.data_ptr<double>();
    std::vector<Pending> todo;
    todo.swap(pending);
    for (size_t i = 0; i < todo.size(); ++i) {
      const Pending& p = todo[i];
      const double loss = v[4 * i], ranking = v[4 * i + 1], correct_sum = v[4 * i + 3];
      const double gnorm = std::isfinite(loss) ? v[4 * i + 2] : 0.0;  // not computed for a non-finite loss
      if (!std::isfinite(loss) || !std::isfinite(gnorm)) {
        bar.finish();
        metrics.write({{"event", "error"}, {"step", p.step}, {"loss", std::isfinite(loss) ? loss : -1.0},
                       {"message", "non-finite loss or gradient"}});
        std::string kept = last_saved_step >= 0
                               ? fmt::format("the last good checkpoint {} (step {}) is kept", last_path, last_saved_step)
                               : "no checkpoint had been written yet";
        throw NonFiniteLoss(fmt::format("step {}: the {} is {}; training stopped and {}. Try a lower --lr or --grad-clip.",
                                        p.step, std::isfinite(loss) ? "gradient norm" : "loss",
                                        std::isfinite(loss) ? gnorm : loss, kept));
      }
      last_loss = loss;
      last_acc = p.samples ? correct_sum / p.samples : 0;
      window.loss += loss, window.acc += last_acc, window.grad_norm += gnorm, window.ranking += ranking;
      window.steps += 1;
      window.tokens += p.tokens;
      if (p.step % tc.log_every == 0 || p.step == tc.steps) {
        const auto now = std::chrono::steady_clock::now();
        const double dt = std::chrono::duration<double>(now - t_window).count();
        tps = dt > 0 ? window.tokens / dt : 0;
        nlohmann::json line = {{"event", "train"}, {"step", p.step}, {"loss", window.loss / window.steps},
                               {"acc", window.acc / window.steps}, {"grad_norm", window.grad_norm / window.steps},
                               {"lr", p.lr}, {"tokens", window.tokens}, {"tokens_per_s", tps}};
        if (window.ranking != 0) line["ranking_loss"] = window.ranking / window.steps;  // Σ layers, before α
        metrics.write(line);
        window = Window{};
        t_window = now;
      }
    }
    bar.update(todo.back().step, last_loss, last_acc, tps);
  };

  const StepSettings settings{tc.precision, tc.ranking_alpha, tc.grad_clip};
  // CUDA graphs (step_graph.h): "auto" uses them where they can run, "on" insists.
  std::unique_ptr<StepGraph> graphs;
  std::string graphs_unavailable;  // why, on a CUDA device, graphs cannot run
  if (tc.cuda_graphs != "off") {
    std::string why;
    if (step_graphs_possible(opt, device, tc.deterministic, &why)) {
      graphs = std::make_unique<StepGraph>(model, opt, params, settings, /*adaptive=*/tc.cuda_graphs == "auto");
    } else {
      HAX_CHECK(tc.cuda_graphs != "on", "--cuda-graphs on: CUDA graphs cannot run here: {}", why);
      if (device.is_cuda()) graphs_unavailable = why;
    }
  }
  bool graphs_reported = false;  // whether graphs turning themselves off has been reported

  for (int64_t step = meta.step; step < tc.steps; ++step) {
    std::vector<Sample> samples;
    for (int64_t i = 0; i < tc.batch_size; ++i) samples.push_back(stream.at(step * tc.batch_size + i));
    Batch batch = make_batch(samples, tc.pack, pack_len);
    const double lr = learning_rate(step, tc.steps, tc.lr, tc.min_lr, tc.warmup_steps, tc.schedule);
    const bool swa_warm = tc.swa_warmup_window > 0 && step < tc.swa_warmup_steps;
    if (tc.swa_warmup_window > 0)  // validations during the warm-up see the window the model trains with
      model.set_swa_window(swa_warm ? tc.swa_warmup_window : run.model.swa_window);
    const uint64_t seed = derive_seed(tc.seed, 0x57E9, (uint64_t)step);  // LSH hash resampled every step
    at::Tensor values;  // (4) float64 on the device: loss, ranking loss, gradient norm, Σ accuracy
    if (graphs && step != nan_step) {
      values = graphs->run(batch, seed, lr, swa_warm ? 1 : 0);
      if (graphs->disabled() && !graphs_reported) {
        graphs_reported = true;
        HAX_CHECK(tc.cuda_graphs != "on", "--cuda-graphs on: {}", graphs->disabled_reason());
        metrics.write({{"event", "cuda_graphs_off"}, {"step", step + 1}, {"message", graphs->disabled_reason()}});
        bar.message(fmt::format("CUDA graphs off: {}; the steps run eagerly", graphs->disabled_reason()));
      }
    }
    int64_t samples_supervised = batch.supervised_samples;
    if (!values.defined() && defer) {
      ForwardContext ctx;
      ctx.seed = seed;
      opt.zero_grad();
      // A non-finite step is skipped on the device (found_inf) and reported when its metrics are
      // read, before any checkpoint is written.
      values = device_train_step(model, params, batch, ctx, settings,
                                 [&](const at::Tensor& skip) { opt.step(lr, skip); }, step == nan_step,
                                 &samples_supervised);
    }
    if (values.defined()) {
      pending.push_back({step + 1, lr, batch.num_tokens, samples_supervised, values});
    } else {
      ForwardContext ctx;
      ctx.training = true;
      ctx.seed = seed;
      LossResult r;
      {
        AutocastScope autocast(tc.precision, device);
        r = masked_lm_loss(model, batch, ctx, /*read_accuracy=*/false);
      }
      if (step == nan_step) r.loss = r.loss * std::nan("");
      const auto f64 = at::TensorOptions().dtype(at::kDouble).device(device);
      at::Tensor loss_d = r.loss.detach().to(at::kDouble);
      at::Tensor ranking_d = r.ranking.defined() ? r.ranking.detach().to(at::kDouble) : at::zeros({}, f64);
      opt.zero_grad();
      at::Tensor gnorm_d;
      if (std::isfinite(loss_d.item<double>())) {
        (r.ranking.defined() ? r.loss + tc.ranking_alpha * r.ranking : r.loss).backward();
        gnorm_d = clip_grad_norm_async(params, tc.grad_clip);
      } else {
        gnorm_d = at::zeros({}, f64);
      }
      pending.push_back({step + 1, lr, batch.num_tokens, r.samples, at::stack({loss_d, ranking_d, gnorm_d, r.correct})});
      flush();  // throws on a non-finite step, before its update
      opt.step(lr);
    }
    meta.step = step + 1;
    if (meta.step % tc.log_every == 0 || meta.step == tc.steps || meta.step % tc.eval_every == 0 ||
        meta.step % tc.save_every == 0 || interrupted())
      flush();

    const bool final_step = meta.step == tc.steps;
    if (meta.step % tc.eval_every == 0 || final_step) {
      EvalResult v = evaluate(model, splits.valid, tc.eval_batch_size, tc.pack, pack_len, eval_seed(tc.seed));
      const bool better = v.accuracy > meta.best_valid_acc;
      if (better) {
        meta.best_valid_acc = v.accuracy;
        meta.best_step = meta.step;
        save_checkpoint(best_path, model, nullptr, meta);
      }
      metrics.write({{"event", "valid"}, {"step", meta.step}, {"loss", v.loss}, {"acc", v.accuracy},
                     {"best_acc", meta.best_valid_acc}, {"best_step", meta.best_step}});
      bar.message(fmt::format("step {}: validation loss {:.4f}, accuracy {:.2f}%{}", meta.step, v.loss,
                              100 * v.accuracy, better ? " (best so far)" : ""));
      save_last();
    } else if (meta.step % tc.save_every == 0) {
      save_last();
    }
    if (interrupted()) {
      flush();
      save_last();
      bar.finish();
      metrics.write({{"event", "interrupted"}, {"step", meta.step}});
      summary.interrupted = true;
      break;
    }
  }
  bar.finish();
  summary.steps_done = meta.step;
  summary.best_valid_acc = meta.best_valid_acc;
  summary.best_step = meta.best_step;
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  if (graphs) {
    summary.graph_replays = graphs->replays(), summary.graph_captures = graphs->captures();
    summary.graphs_off = graphs->disabled_reason();
  } else {
    summary.graphs_off = graphs_unavailable;
  }
  if (summary.interrupted) return summary;

  // Final test accuracy of the best-validation model, with the model's own window.
  model.set_swa_window(run.model.swa_window);
  if (path_exists(best_path)) load_weights(model, read_checkpoint(best_path), best_path);
  splits.valid.clear();
  splits.valid.shrink_to_fit();
  const std::vector<Sample> test = eval_fingerprints(*task, tc.seed, tc.n_valid, tc.n_test, 0, tc.n_test).test;
  EvalResult t = evaluate(model, test, tc.eval_batch_size, tc.pack, pack_len, eval_seed(tc.seed));
  summary.test_acc = t.accuracy;
  summary.test_loss = t.loss;
  metrics.write({{"event", "test"}, {"step", meta.step}, {"loss", t.loss}, {"acc", t.accuracy},
                 {"best_step", meta.best_step}});
  nlohmann::json s = {{"steps", summary.steps_done},       {"best_valid_acc", summary.best_valid_acc},
                      {"best_step", summary.best_step},    {"test_acc", summary.test_acc},
                      {"test_loss", summary.test_loss},    {"n_test", t.samples},
                      {"train_seconds_this_session", summary.seconds},
                      {"cuda_graph_replays", summary.graph_replays}, {"cuda_graph_captures", summary.graph_captures}};
  if (!summary.graphs_off.empty()) s["cuda_graphs_off"] = summary.graphs_off;
  write_file_atomic(tc.run_dir + "/summary.json", s.dump(2) + "\n");
  return summary;
}

}  // namespace hax
