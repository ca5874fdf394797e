// Running one configuration of a multi-run experiment (hax table1, hax compare): a run directory
// that already holds a finished run of exactly this configuration is reused, one interrupted
// under it continues from its last checkpoint, anything else is trained afresh.
#pragma once
#include <string>

#include "train/trainer.h"

namespace hax {

struct ExperimentRun {
  double test_acc = 0;   // test accuracy of the best-validation model
  double seconds = 0;    // training seconds (of the session that finished it, when reused)
  bool reused = false;   // the run's summary.json was reused, nothing was trained
};

// run.config_text must be set. `who` names the experiment in messages (e.g. "table1") and `label`
// the run (e.g. "mamba2+hax seed 1"). An interruption throws hax::UsageError saying how to continue.
ExperimentRun train_or_reuse(RunConfig run, const std::string& who, const std::string& label);

}  // namespace hax
