#include "train/train_config.h"

#include "core/error.h"

namespace hax {

void TrainConfig::validate() const {
  auto positive = [](const char* flag, int64_t v) { HAX_CHECK(v > 0, "{} {} must be positive", flag, v); };
  HAX_CHECK(!run_dir.empty(), "--run-dir must not be empty");
  HAX_CHECK(threads >= 0, "--threads {} must be >= 0 (0 uses all cores)", threads);
  HAX_CHECK(device == "cpu" || device == "cuda" || device == "auto" || device.rfind("cuda:", 0) == 0,
            "--device {} is unknown; choose cpu, cuda, cuda:N or auto", device);
  HAX_CHECK(precision == "fp32" || precision == "bf16", "--precision {} is unknown; choose fp32 or bf16", precision);
  HAX_CHECK(cuda_graphs == "auto" || cuda_graphs == "on" || cuda_graphs == "off",
            "--cuda-graphs {} is unknown; choose auto, on or off", cuda_graphs);
  positive("--steps", steps);
  positive("--batch-size", batch_size);
  positive("--eval-batch-size", eval_batch_size);
  positive("--log-every", log_every);
  positive("--eval-every", eval_every);
  positive("--save-every", save_every);
  positive("--n-valid", n_valid);
  positive("--n-test", n_test);
  HAX_CHECK(lr > 0, "--lr {} must be positive", lr);
  HAX_CHECK(min_lr >= 0 && min_lr <= lr, "--min-lr {} must be in [0, lr = {}]", min_lr, lr);
  HAX_CHECK(schedule == "constant" || schedule == "cosine", "--schedule {} is unknown; choose constant or cosine",
            schedule);
  HAX_CHECK(warmup_steps >= 0, "--warmup-steps {} must be >= 0", warmup_steps);
  HAX_CHECK(weight_decay >= 0, "--weight-decay {} must be >= 0", weight_decay);
  HAX_CHECK(beta1 >= 0 && beta1 < 1, "--beta1 {} must be in [0, 1)", beta1);
  HAX_CHECK(beta2 >= 0 && beta2 < 1, "--beta2 {} must be in [0, 1)", beta2);
  HAX_CHECK(adam_eps > 0, "--adam-eps {} must be positive", adam_eps);
  HAX_CHECK(grad_clip >= 0, "--grad-clip {} must be >= 0 (0 disables clipping)", grad_clip);
  HAX_CHECK(ranking_alpha >= 0, "--ranking-alpha {} must be >= 0", ranking_alpha);
  HAX_CHECK(swa_warmup_window >= 0, "--swa-warmup-window {} must be >= 0 (0 disables the warm-up)", swa_warmup_window);
  HAX_CHECK(swa_warmup_steps >= 0, "--swa-warmup-steps {} must be >= 0", swa_warmup_steps);
  HAX_CHECK(swa_warmup_window == 0 || swa_warmup_steps > 0,
            "--swa-warmup-window {} needs --swa-warmup-steps > 0 (got {})", swa_warmup_window, swa_warmup_steps);
  HAX_CHECK(pack_len >= 0, "--pack-len {} must be >= 0 (0 uses the task's longest sample)", pack_len);
}

nlohmann::ordered_json TrainConfig::to_json() const {
  return {{"run_dir", run_dir},       {"seed", seed},
          {"threads", threads},       {"device", device},
          {"precision", precision},   {"deterministic", deterministic},
          {"cuda_graphs", cuda_graphs},
          {"steps", steps},           {"batch_size", batch_size},
          {"lr", lr},                 {"min_lr", min_lr},
          {"schedule", schedule},     {"warmup_steps", warmup_steps},
          {"weight_decay", weight_decay}, {"beta1", beta1},
          {"beta2", beta2},           {"adam_eps", adam_eps},
          {"grad_clip", grad_clip},   {"ranking_alpha", ranking_alpha},
          {"swa_warmup_window", swa_warmup_window}, {"swa_warmup_steps", swa_warmup_steps}, {"pack", pack},
          {"pack_len", pack_len},     {"log_every", log_every},
          {"eval_every", eval_every}, {"save_every", save_every},
          {"n_valid", n_valid},       {"n_test", n_test},
          {"eval_batch_size", eval_batch_size}};
}

}  // namespace hax
