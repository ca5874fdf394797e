#include "config_file.h"

#include <sstream>

#include "core/error.h"

namespace hax::cli {
namespace {

std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\r"), b = s.find_last_not_of(" \t\r");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

std::string dashed(std::string k) {
  for (auto& c : k)
    if (c == '_') c = '-';
  return k;
}

// Strips a trailing comment that is not inside quotes.
std::string strip_comment(const std::string& s) {
  char quote = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (quote) {
      if (s[i] == quote) quote = 0;
    } else if (s[i] == '"' || s[i] == '\'') {
      quote = s[i];
    } else if (s[i] == '#') {
      return s.substr(0, i);
    }
  }
  return s;
}

std::string unquote(const std::string& v) {
  if (v.size() >= 2 && (v[0] == '"' || v[0] == '\'') && v.back() == v[0]) return v.substr(1, v.size() - 2);
  return v;
}

}  // namespace

std::vector<std::string> config_to_args(const std::string& text, const std::string& source, const CLI::App& sub) {
  std::vector<std::string> args;
  std::istringstream in(text);
  std::string raw;
  int lineno = 0;
  while (std::getline(in, raw)) {
    ++lineno;
    std::string line = trim(strip_comment(raw));
    if (line.empty() || line[0] == '[') continue;
    size_t eq = line.find('=');
    HAX_CHECK(eq != std::string::npos, "config file {} line {}: expected `key = value`, got `{}`", source, lineno, line);
    std::string key = dashed(trim(line.substr(0, eq)));
    std::string value = trim(line.substr(eq + 1));
    HAX_CHECK(!key.empty() && !value.empty(), "config file {} line {}: expected `key = value`, got `{}`", source, lineno,
              line);
    const CLI::Option* opt = sub.get_option_no_throw("--" + key);
    HAX_CHECK(opt != nullptr && key != "config", "config file {} line {}: unknown key `{}` (not an option of hax {})",
              source, lineno, key, sub.get_name());
    if (opt->get_items_expected() == 0) {  // a boolean flag --x / --no-x
      HAX_CHECK(value == "true" || value == "false", "config file {} line {}: `{}` must be true or false, got {}", source,
                lineno, key, value);
      args.push_back(value == "true" ? "--" + key : "--no-" + key);
      continue;
    }
    if (value.front() == '[' && value.back() == ']') {  // a list: pass comma-separated
      std::string inner = value.substr(1, value.size() - 2), joined;
      std::istringstream items(inner);
      std::string item;
      while (std::getline(items, item, ',')) joined += (joined.empty() ? "" : ",") + unquote(trim(item));
      value = joined;
    }
    args.push_back("--" + key);
    args.push_back(unquote(value));
  }
  return args;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    const size_t comma = s.find(',', pos);
    out.push_back(s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    if (comma == std::string::npos) return out;
    pos = comma + 1;
  }
}

std::vector<int64_t> parse_size_list(const std::string& s, const std::string& flag) {
  std::vector<int64_t> out;
  std::istringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    item = trim(item);
    HAX_CHECK(!item.empty(), "{} {}: empty entry in the list", flag, s);
    int64_t mult = 1;
    char last = (char)std::tolower(item.back());
    if (last == 'k') mult = 1024, item.pop_back();
    else if (last == 'm') mult = 1024 * 1024, item.pop_back();
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (...) {
      used = 0;
    }
    HAX_CHECK(used == item.size() && v > 0, "{} {}: `{}` is not a positive size (like 4096 or 4k)", flag, s, item);
    out.push_back(v * mult);
  }
  HAX_CHECK(!out.empty(), "{} must list at least one size", flag);
  return out;
}

std::vector<double> parse_number_list(const std::string& s, const std::string& flag, double lo, double hi) {
  std::vector<double> out;
  std::istringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    item = trim(item);
    HAX_CHECK(!item.empty(), "{} {}: empty entry in the list", flag, s);
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(item, &used);
    } catch (...) {
      used = 0;
    }
    HAX_CHECK(used == item.size(), "{} {}: `{}` is not a number", flag, s, item);
    HAX_CHECK(v >= lo && v <= hi, "{} {}: `{}` is not in [{:g}, {:g}]", flag, s, item, lo, hi);
    out.push_back(v);
  }
  HAX_CHECK(!out.empty(), "{} must list at least one number", flag);
  return out;
}

}  // namespace hax::cli
