// Errors hax reports to its user.
//
// A UsageError is bad input (a flag, a config value, a tensor argument, a missing or corrupt
// file): the command line prints its message on one line and exits with status 2. Messages name
// the option or tensor, the value and the constraint, e.g.
//   "--headdim 24 must divide the inner width d_inner = 128".
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace hax {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw UsageError(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace hax

// HAX_CHECK(cond, "fmt", args...): throws hax::UsageError with the formatted message unless cond.
#define HAX_CHECK(cond, ...)        \
  do {                              \
    if (!(cond)) ::hax::fail(__VA_ARGS__); \
  } while (0)
