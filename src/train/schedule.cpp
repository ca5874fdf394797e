#include "train/schedule.h"

#include <algorithm>
#include <cmath>

namespace hax {

double learning_rate(int64_t step, int64_t total, double lr, double min_lr, int64_t warmup, const std::string& schedule) {
  if (step < warmup) return lr * (double)(step + 1) / (double)warmup;
  if (schedule != "cosine" || total <= warmup) return lr;
  const double progress = std::min(1.0, (double)(step - warmup) / (double)std::max<int64_t>(1, total - warmup));
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace hax
