// hax: long-context sequence models (Mamba, Mamba-2 and sparse-attention hybrids) on the
// synthetic recall tasks. See README.md.
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "commands.h"
#include "config_file.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "hax_default_config.h"
#include "train/trainer.h"

namespace {

using namespace hax::cli;

// Value of `--name X` or `--name=X` in args (last occurrence), or "".
std::string find_value(const std::vector<std::string>& args, const std::string& name) {
  std::string v;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == name && i + 1 < args.size()) v = args[i + 1];
    else if (args[i].rfind(name + "=", 0) == 0) v = args[i].substr(name.size() + 1);
  }
  return v;
}

bool has_flag(const std::vector<std::string>& args, const std::string& name) {
  for (auto& a : args)
    if (a == name) return true;
  return false;
}

// Inserts the arguments of the applicable config files right after the subcommand name, so
// that the user's own flags (which come later) override them. Layers, lowest first:
//   embedded default (when no --config and the command uses it) or the --config file;
//   with --resume, the run directory's config.toml replaces both as the base.
std::vector<std::string> expand_configs(const CLI::App& app, const std::vector<Command>& commands,
                                        const std::vector<std::string>& args) {
  size_t pos = 0;
  while (pos < args.size() && !args[pos].empty() && args[pos][0] == '-') ++pos;
  if (pos == args.size()) return args;
  const Command* cmd = nullptr;
  for (auto& c : commands)
    if (c.app->get_name() == args[pos]) cmd = &c;
  if (!cmd) return args;
  std::vector<std::string> user(args.begin() + pos + 1, args.end());
  std::vector<std::string> base;
  const std::string config = find_value(user, "--config");
  if (!config.empty()) {
    base = config_to_args(hax::read_file(config, "--config"), config, *cmd->app);
  } else if (cmd->embedded_default) {
    base = config_to_args(hax::kDefaultConfigToml, "(embedded default)", *cmd->app);
  }
  if (has_flag(user, "--resume")) {
    std::string run_dir = find_value(user, "--run-dir");
    if (run_dir.empty()) run_dir = find_value(base, "--run-dir");
    if (run_dir.empty()) run_dir = hax::TrainConfig().run_dir;
    const std::string saved = run_dir + "/config.toml";
    HAX_CHECK(hax::path_exists(saved), "--resume: run directory {} has no config.toml to continue from", run_dir);
    base = config_to_args(hax::read_file(saved, "run config"), saved, *cmd->app);
  }
  std::vector<std::string> out(args.begin(), args.begin() + pos + 1);
  out.insert(out.end(), base.begin(), base.end());
  out.insert(out.end(), user.begin(), user.end());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  hax::keep_freed_memory();
  CLI::App app{"hax: state-space models with sparse attention on long-context recall tasks"};
  app.name("hax");
  app.require_subcommand(1);
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)->always_capture_default();
  std::vector<Command> commands = {add_train_command(app), add_eval_command(app), add_data_command(app),
                                   add_info_command(app), add_bench_command(app),
                                   add_table1_command(app, argc, argv), add_compare_command(app, argc, argv), add_patterns_command(app)};
  try {
    std::vector<std::string> args = expand_configs(app, commands, std::vector<std::string>(argv + 1, argv + argc));
    std::reverse(args.begin(), args.end());  // CLI11 takes arguments in reverse order
    try {
      app.parse(args);
    } catch (const CLI::CallForHelp& e) {
      return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
      return app.exit(e);
    } catch (const CLI::ParseError& e) {
      std::fprintf(stderr, "hax: error: %s (see hax --help)\n", e.what());
      return kExitUsage;
    }
    for (auto& c : commands)
      if (c.app->parsed()) return c.run();
    return kExitUsage;
  } catch (const hax::UsageError& e) {
    std::fprintf(stderr, "hax: error: %s\n", e.what());
    return kExitUsage;
  } catch (const hax::NonFiniteLoss& e) {
    std::fprintf(stderr, "hax: error: %s\n", e.what());
    return kExitNonFinite;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "hax: internal error: %s\n", e.what_without_backtrace());
    return kExitInternal;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hax: internal error: %s\n", e.what());
    return kExitInternal;
  }
}
