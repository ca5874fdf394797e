// metrics.jsonl: one JSON object per line, appended and flushed as training goes.
#pragma once
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace hax {

class MetricsLog {
 public:
  // Opens `path` for appending. If resume_step >= 0, lines with "step" > resume_step (written
  // after the checkpoint being resumed) are dropped first, so the file reads as one run.
  MetricsLog(const std::string& path, int64_t resume_step);
  void write(const nlohmann::json& line);

 private:
  std::ofstream out_;
};

}  // namespace hax
