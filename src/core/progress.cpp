#include "core/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>

namespace hax {

std::string format_duration(double s) {
  if (s < 0 || s != s) return "?";
  int64_t t = (int64_t)(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t / 60) % 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

Progress::Progress(int64_t total, int64_t start, bool enabled, int64_t every)
    : total_(total), start_(start), done_(start), every_(every), enabled_(enabled),
      tty_(isatty(fileno(stderr))), t0_(std::chrono::steady_clock::now()) {}

void Progress::update(int64_t done, double loss, double acc, double tps) {
  done_ = done, loss_ = loss, acc_ = acc, tps_ = tps;
  if (!enabled_) return;
  if (tty_) draw(false);
  else if (done % every_ == 0 || done == total_) draw(true);
}

void Progress::draw(bool newline) {
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const int64_t did = done_ - start_;
  const double eta = did > 0 ? el / did * (total_ - done_) : -1;
  const int width = 24;
  const int filled = total_ > 0 ? (int)(width * done_ / total_) : width;
  std::string bar(filled, '=');
  if (filled < width) bar += '>' + std::string(width - filled - 1, ' ');
  std::string line = fmt::format("step {}/{} [{}] loss {:.4f} acc {:5.1f}% | {:.0f} tok/s | {} elapsed, ETA {}", done_,
                                 total_, bar, loss_, 100 * acc_, tps_, format_duration(el), format_duration(eta));
  if (newline) std::fprintf(stderr, "%s\n", line.c_str());
  else std::fprintf(stderr, "\r%s\x1b[K", line.c_str());
  std::fflush(stderr);
}

void Progress::message(const std::string& line) {
  if (enabled_ && tty_) std::fprintf(stderr, "\r\x1b[K");
  std::fprintf(stderr, "%s\n", line.c_str());
  if (enabled_ && tty_) draw(false);
  std::fflush(stderr);
}

void Progress::finish() {
  if (enabled_ && tty_) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

}  // namespace hax
