#include "bench/op_counts.h"

#include <ATen/record_function.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <set>
#include <vector>

namespace hax::bench {
namespace {

struct Frame {
  std::string name;
  bool has_child = false;
  bool user = false;  // a hax scope (RECORD_USER_SCOPE): its host time is summed
  std::chrono::steady_clock::time_point start;
};

std::mutex g_mutex;
std::map<std::pair<std::string, std::string>, int64_t> g_leaves;
std::map<std::string, std::pair<double, int64_t>> g_scopes;  // name -> (host seconds, calls)
thread_local std::vector<Frame> t_stack;

// Short form of an autograd node's record name ("autograd::engine::evaluate_function: XBackward0").
std::string short_name(const char* name) {
  std::string s(name);
  const std::string pre = "autograd::engine::evaluate_function: ";
  if (s.rfind(pre, 0) == 0) s = s.substr(pre.size());
  return s;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (!t_stack.empty()) t_stack.back().has_child = true;
  t_stack.push_back({short_name(fn.name()), false, fn.scope() == at::RecordScope::USER_SCOPE,
                     std::chrono::steady_clock::now()});
  return nullptr;
}

void on_end(const at::RecordFunction&, at::ObserverContext*) {
  if (t_stack.empty()) return;  // started before the counter was
  Frame f = std::move(t_stack.back());
  t_stack.pop_back();
  if (f.user) {
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - f.start).count();
    std::lock_guard<std::mutex> lock(g_mutex);
    auto& s = g_scopes[f.name];
    s.first += sec, s.second += 1;
    return;
  }
  if (f.has_child) return;
  // The caller chain, innermost first, up to three operators (then "(hax)" if the chain ends there).
  std::string caller;
  for (int i = (int)t_stack.size() - 1, n = 0; i >= 0 && n < 3; --i, ++n)
    caller += (n ? " < " : "") + t_stack[i].name;
  if (t_stack.size() < 4) caller += t_stack.empty() ? "(hax)" : " < (hax)";
  std::lock_guard<std::mutex> lock(g_mutex);
  ++g_leaves[{caller, f.name}];
}

// Operators that launch no kernel: views, shape queries, allocations.
bool launches_nothing(const std::string& op) {
  static const std::set<std::string> none = {
      "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::empty", "aten::empty_strided",
      "aten::empty_like", "aten::select", "aten::slice", "aten::narrow", "aten::transpose", "aten::permute",
      "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::t", "aten::alias", "aten::resize_",
      "aten::unbind", "aten::split", "aten::chunk", "aten::lift_fresh", "aten::_unsafe_view", "aten::set_",
      "aten::is_nonzero", "aten::result_type", "aten::to", "aten::_has_compatible_shallow_copy_type",
      "aten::split_with_sizes", "aten::flatten", "aten::view_as", "aten::expand_as", "aten::contiguous",
      "aten::numpy_T", "aten::record_stream", "aten::is_same_size"};
  return none.count(op) > 0;
}

}  // namespace

OpCounter::OpCounter() {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_leaves.clear();
    g_scopes.clear();
  }
  handle_ = at::addGlobalCallback(
      at::RecordFunctionCallback(on_start, on_end)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION, at::RecordScope::USER_SCOPE}));
}

OpCounter::~OpCounter() { at::removeCallback(handle_); }

std::map<std::pair<std::string, std::string>, int64_t> OpCounter::leaves() const {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_leaves;
}

std::string OpCounter::table(int top, int64_t per) const {
  auto all = leaves();
  std::vector<std::pair<int64_t, std::pair<std::string, std::string>>> work;
  int64_t n_work = 0, n_none = 0;
  for (auto& [k, n] : all) {
    if (launches_nothing(k.second)) {
      n_none += n;
    } else {
      n_work += n;
      work.push_back({n, k});
    }
  }
  std::sort(work.begin(), work.end(), [](auto& a, auto& b) { return a.first > b.first; });
  std::string out;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_scopes.empty()) {
      out += fmt::format("host time per step in hax's scopes (inclusive; counting slows them):\n");
      for (auto& [name, s] : g_scopes)
        out += fmt::format("{:>10.3f} ms {:>6.1f} x  {}\n", 1e3 * s.first / per, (double)s.second / per, name);
    }
  }
  out += fmt::format("operator leaves per step: {:.1f} that may launch work, {:.1f} views and allocations\n",
                                (double)n_work / per, (double)n_none / per);
  out += fmt::format("{:>8}  {:<28} {}\n", "calls", "operator", "called from");
  for (int i = 0; i < std::min<int>(top, work.size()); ++i)
    out += fmt::format("{:>8.1f}  {:<28} {}\n", (double)work[i].first / per, work[i].second.second,
                       work[i].second.first);
  return out;
}

}  // namespace hax::bench
