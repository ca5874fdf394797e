// The subcommands of `hax`. Each adds itself to the app and returns what runs it.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>

namespace hax::cli {

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;        // returns the exit status
  bool embedded_default = false;   // applies the embedded default config when no --config is given
};

// Exit statuses.
inline constexpr int kExitOk = 0, kExitInternal = 1, kExitUsage = 2, kExitNonFinite = 3, kExitInterrupted = 130;

Command add_train_command(CLI::App& app);
Command add_eval_command(CLI::App& app);
Command add_data_command(CLI::App& app);
Command add_info_command(CLI::App& app);
Command add_bench_command(CLI::App& app);
Command add_table1_command(CLI::App& app, int argc, char** argv);
Command add_compare_command(CLI::App& app, int argc, char** argv);
Command add_patterns_command(CLI::App& app);

}  // namespace hax::cli
