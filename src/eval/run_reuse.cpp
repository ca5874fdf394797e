#include "eval/run_reuse.h"

#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace hax {

ExperimentRun train_or_reuse(RunConfig run, const std::string& who, const std::string& label) {
  const std::string summary_path = run.train.run_dir + "/summary.json";
  const std::string config_path = run.train.run_dir + "/config.toml";
  const bool same_config = path_exists(config_path) && read_file(config_path, "run config") == run.config_text;
  ExperimentRun r;
  if (same_config && path_exists(summary_path)) {
    auto s = nlohmann::json::parse(read_file(summary_path, "run summary"));
    r.test_acc = s.at("test_acc").get<double>();
    r.seconds = s.value("train_seconds_this_session", NAN);
    r.reused = true;
    return r;
  }
  // A run interrupted under this same config continues from its last checkpoint.
  const bool resume = same_config && path_exists(last_checkpoint_path(run.train.run_dir));
  run.train.resume = resume;
  run.train.overwrite = !resume;
  fmt::print("{}: {} {} for {} steps -> {}\n", who, resume ? "resuming" : "training", label, run.train.steps,
             run.train.run_dir);
  std::fflush(stdout);
  TrainSummary s = train(run);
  HAX_CHECK(!s.interrupted, "{} interrupted during {}; run it again to continue", who, label);
  r.test_acc = s.test_acc;
  r.seconds = s.seconds;
  return r;
}

}  // namespace hax
