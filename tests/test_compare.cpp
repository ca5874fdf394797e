// hax compare end to end at a tiny budget: every variant trains, is evaluated at 1x and 2x its
// training length, appears in the markdown table and the JSON; a second run reuses the finished
// runs; bad variants and tasks are named in the error.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_runner.h"

using hax::testing::CliResult;
using hax::testing::run_hax;
using hax::testing::slurp;
using hax::testing::temp_dir;

TEST(CliCompare, EveryVariantTrainsAndIsEvaluatedAtEachLength) {
  const std::string dir = temp_dir("compare");
  const std::vector<std::string> args = {
      "compare", "--task", "niah", "--seq-len", "64", "--steps", "3", "--batch-size", "4", "--eval-every", "3",
      "--n-valid", "4", "--n-test", "4", "--factors", "1,2", "--eval-n", "2", "--d-model", "16", "--n-layers", "1",
      "--sparse-keys", "8", "--swa-window", "8", "--hsa-chunk", "8", "--hsa-topk", "2", "--runs-dir", dir + "/runs",
      "--out", dir + "/c.md", "--json", dir + "/c.json", "--threads", "2"};
  CliResult r = run_hax(args);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string md = slurp(dir + "/c.md");
  for (const char* v : {"| full |", "| swa |", "| swa+hsa |", "| mamba2 |", "| mamba2+hax |", "| mamba2+dma |",
                        "| mamba2+hsa |"})
    EXPECT_NE(md.find(v), std::string::npos) << v << " missing from\n" << md;
  EXPECT_NE(md.find("Command: `"), std::string::npos);
  EXPECT_NE(md.find("3 steps of batch 4"), std::string::npos) << md;
  const auto j = nlohmann::json::parse(slurp(dir + "/c.json"));
  ASSERT_EQ(j["rows"].size(), 7u);
  for (const auto& row : j["rows"]) {
    ASSERT_EQ(row["by_length"].size(), 2u) << row["variant"];
    EXPECT_EQ(row["by_length"][1]["length"], 128);
  }
  // Finished runs are reused, not trained again.
  CliResult again = run_hax(args);
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_EQ(again.out.find("compare: training"), std::string::npos) << again.out;
  EXPECT_NE(again.out.find("(reused)"), std::string::npos) << again.out;
  hax::testing::remove_tree(dir);
}

TEST(CliCompare, BadVariantAndTaskAreNamed) {
  CliResult r = run_hax({"compare", "--task", "niah", "--variants", "mamba2+lsh", "--steps", "1"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("mamba2+lsh"), std::string::npos) << r.err;
  CliResult t = run_hax({"compare", "--task", "joint_recall", "--steps", "1"});
  EXPECT_EQ(t.status, 2);
  EXPECT_NE(t.err.find("--task joint_recall"), std::string::npos) << t.err;
}
