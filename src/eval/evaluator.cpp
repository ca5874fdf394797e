#include "eval/evaluator.h"

#include "core/rng.h"
#include "train/loss.h"

namespace hax {

uint64_t eval_seed(uint64_t train_seed) { return derive_seed(train_seed, 0xE7A1); }

EvalResult evaluate(LanguageModel& model, const std::vector<Sample>& samples, int64_t batch_size, bool pack,
                    int64_t pack_len, uint64_t seed) {
  torch::NoGradGuard ng;
  const bool was_training = model.is_training();
  model.eval();
  EvalResult r;
  double loss_sum = 0, acc_sum = 0;
  for (size_t i = 0; i < samples.size(); i += batch_size) {
    std::vector<Sample> chunk(samples.begin() + i, samples.begin() + std::min(samples.size(), i + batch_size));
    Batch b = make_batch(chunk, pack, pack_len);
    ForwardContext ctx;
    ctx.seed = seed;
    LossResult lr = masked_lm_loss(model, b, ctx);
    loss_sum += lr.loss.item<double>() * lr.positions;
    acc_sum += lr.correct_sum;
    r.samples += lr.samples;
    r.positions += lr.positions;
  }
  if (r.positions) r.loss = loss_sum / r.positions;
  if (r.samples) r.accuracy = acc_sum / r.samples;
  model.train(was_training);
  return r;
}

}  // namespace hax
