// Checks shared by the task tests.
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "tasks/registry.h"
#include "tasks/task_config.h"

namespace hax::testing {

// Expects validate() (and make_task) to fail with a one-line message holding every piece of `parts`.
inline void expect_invalid(const TaskConfig& c, std::vector<std::string> parts) {
  try {
    c.validate();
    ADD_FAILURE() << "accepted; expected an error with " << parts[0];
    return;
  } catch (const hax::UsageError& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << msg << "\nlacks " << p;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "multi-line message: " << msg;
  }
  EXPECT_THROW(hax::make_task(c), hax::UsageError);
}

}  // namespace hax::testing
