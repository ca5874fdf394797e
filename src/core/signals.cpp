#include "core/signals.h"

#include <atomic>
#include <csignal>

namespace hax {
namespace {
std::atomic<bool> g_interrupted{false};

void on_signal(int sig) {
  if (g_interrupted.exchange(true)) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}
}  // namespace

void install_interrupt_handler() {
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
}

bool interrupted() { return g_interrupted.load(); }
void reset_interrupt() { g_interrupted = false; }

}  // namespace hax
