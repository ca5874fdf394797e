#include "train/metrics.h"

#include <sstream>

#include "core/atomic_file.h"
#include "core/error.h"

namespace hax {

MetricsLog::MetricsLog(const std::string& path, int64_t resume_step) {
  if (resume_step >= 0) {
    std::ifstream in(path);
    std::string line, kept;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) continue;  // a line cut short by a crash
      if (j.contains("step") && j["step"].get<int64_t>() > resume_step) continue;
      kept += line + "\n";
    }
    write_file_atomic(path, kept);
    out_.open(path, std::ios::app);
  } else {
    out_.open(path, std::ios::trunc);
  }
  HAX_CHECK(out_.good(), "cannot write metrics file {}", path);
}

void MetricsLog::write(const nlohmann::json& line) {
  out_ << line.dump() << "\n";
  out_.flush();
}

}  // namespace hax
