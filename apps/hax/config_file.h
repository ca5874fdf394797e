// Config files: CLI11-style TOML (`key = value`, `# comments`, `[section]` headers for grouping).
// A config file is turned into command-line arguments placed before the user's own, so every
// value in it can be overridden by a flag. Keys are option names with '_' or '-'.
#pragma once
#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace hax::cli {

// Arguments equivalent to config text `text` (from `source`, named in errors) for subcommand
// `sub`. Unknown keys and malformed lines are UsageErrors naming the file and line.
std::vector<std::string> config_to_args(const std::string& text, const std::string& source, const CLI::App& sub);

// Splits "a,b,c" into its comma-separated items, as given (no trimming; "" gives one empty item).
std::vector<std::string> split_list(const std::string& s);

// Splits "1k,4k,16384" style lists; suffix k = 1024, m = 1024^2. Errors name `flag`.
std::vector<int64_t> parse_size_list(const std::string& s, const std::string& flag);

// Splits "0,0.25,0.5" into numbers, each in [lo, hi]. Errors name `flag`, the list and the item.
std::vector<double> parse_number_list(const std::string& s, const std::string& flag, double lo, double hi);

}  // namespace hax::cli
