// Ctrl-C handling for long runs: the first SIGINT/SIGTERM sets a flag that the training loop polls
// (it then writes a checkpoint and exits cleanly); a second one terminates at once.
#pragma once

namespace hax {

void install_interrupt_handler();
bool interrupted();
void reset_interrupt();  // for tests

}  // namespace hax
