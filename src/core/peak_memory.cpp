#include "core/peak_memory.h"

#include <fstream>
#include <string>

#ifdef __GLIBC__
#include <malloc.h>
#endif

namespace hax {

namespace {

// A "Key:   123 kB" line of /proc/self/status, in bytes; -1 if absent.
int64_t status_bytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = key;
  while (std::getline(in, line)) {
    if (line.compare(0, k.size(), k) != 0) continue;
    try {
      return std::stoll(line.substr(k.size())) * 1024;
    } catch (const std::exception&) {
      return -1;
    }
  }
  return -1;
}

}  // namespace

int64_t peak_memory_added(const std::function<void()>& fn) {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
  bool reset = false;
  {
    std::ofstream clear("/proc/self/clear_refs");
    if (clear) {
      clear << "5";  // 5: reset the peak resident size to the current one (Linux >= 4.0)
      clear.flush();
      reset = clear.good();
    }
  }
  const int64_t before = status_bytes("VmRSS:");
  fn();
  const int64_t peak = status_bytes("VmHWM:");
  if (!reset || before < 0 || peak < 0) return -1;
  return peak > before ? peak - before : 0;
}

}  // namespace hax
