// Evaluation of a model on a fixed set of samples: loss and per-sample mean accuracy.
#pragma once
#include <vector>

#include "models/lm.h"
#include "tasks/task.h"

namespace hax {

struct EvalResult {
  double loss = 0;       // mean cross-entropy over all supervised positions
  double accuracy = 0;   // per-sample accuracy averaged over samples (the paper's metric)
  int64_t samples = 0;
  int64_t positions = 0;
};

// Evaluates in batches of `batch_size` samples (packed into rows when `pack`), without gradients,
// with the randomness of the model (LSH hashing) fixed by `seed`.
EvalResult evaluate(LanguageModel& model, const std::vector<Sample>& samples, int64_t batch_size, bool pack,
                    int64_t pack_len, uint64_t seed);

// The evaluation seed of a run with training seed `train_seed` (the trainer's validation and
// test, and hax eval, all use it, so they hash alike).
uint64_t eval_seed(uint64_t train_seed);

}  // namespace hax
