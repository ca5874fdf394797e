// Learning-rate schedule: linear warmup from 0, then constant or cosine decay to min_lr.
#pragma once
#include <cstdint>
#include <string>

namespace hax {

// Learning rate for optimizer step `step` (0-based) of `total` steps.
double learning_rate(int64_t step, int64_t total, double lr, double min_lr, int64_t warmup, const std::string& schedule);

}  // namespace hax
