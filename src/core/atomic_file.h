// Writing files so that a crash or Ctrl-C never leaves a half-written one behind.
#pragma once
#include <string>

namespace hax {

// Writes `bytes` to `path` atomically: a temporary file beside it is written, flushed to disk and
// renamed over `path`. Throws UsageError naming the path on failure.
void write_file_atomic(const std::string& path, const std::string& bytes);

// Whether a file or directory exists at `path`.
bool path_exists(const std::string& path);

// Creates directory `path` and its missing parents (like mkdir -p); throws UsageError on failure.
// (POSIX calls rather than std::filesystem: the Python torch package's libtorch.so exports its
// own copies of some std::filesystem functions, which can be picked at link time and crash.)
void make_dirs(const std::string& path);

// Reads a whole file; throws UsageError naming `what` and the path if it cannot be read.
std::string read_file(const std::string& path, const std::string& what);

}  // namespace hax
