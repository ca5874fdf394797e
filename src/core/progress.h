// A progress bar for training: step count, loss, accuracy, tokens/s and ETA. On a terminal it
// redraws one line; otherwise it prints a line every `every` updates.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace hax {

class Progress {
 public:
  Progress(int64_t total, int64_t start, bool enabled, int64_t every);
  // Called after each step with the step just completed (1-based count) and its metrics.
  void update(int64_t done, double loss, double acc, double tokens_per_s);
  // Prints a message on its own line without breaking the bar.
  void message(const std::string& line);
  void finish();

 private:
  void draw(bool newline);
  int64_t total_, start_, done_, every_;
  bool enabled_, tty_;
  double loss_ = 0, acc_ = 0, tps_ = 0;
  std::chrono::steady_clock::time_point t0_;
};

std::string format_duration(double seconds);

}  // namespace hax
