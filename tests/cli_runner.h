// Runs the `hax` command line from tests: exit status and captured output.
#pragma once
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace hax::testing {

struct CliResult {
  int status = -1;  // exit status, or 128 + signal
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A fresh empty temporary directory.
inline std::string temp_dir(const std::string& tag) {
  std::string tmpl = (std::filesystem::temp_directory_path() / ("hax-test-" + tag + "-XXXXXX")).string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  return mkdtemp(buf.data());
}

// Runs `hax args...` with extra environment `env` ("K=V"). If `while_running` is given it is
// called repeatedly with the child's pid until the child exits (to send signals).
inline CliResult run_hax(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
                         const std::function<bool(pid_t)>& while_running = nullptr) {
  std::string dir = temp_dir("cli");
  std::string out_path = dir + "/out", err_path = dir + "/err";
  pid_t pid = fork();
  if (pid == 0) {
    int o = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int e = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(o, 1), dup2(e, 2);
    for (auto& kv : env) putenv(strdup(kv.c_str()));
    std::vector<char*> argv;
    argv.push_back(strdup(HAX_CLI_PATH));
    for (auto& a : args) argv.push_back(strdup(a.c_str()));
    argv.push_back(nullptr);
    execv(HAX_CLI_PATH, argv.data());
    _exit(127);
  }
  int st = 0;
  if (while_running) {
    bool done = false;
    while (!done) {
      pid_t r = waitpid(pid, &st, WNOHANG);
      if (r == pid) break;
      if (!while_running(pid)) {
        waitpid(pid, &st, 0);
        done = true;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  } else {
    waitpid(pid, &st, 0);
  }
  CliResult r;
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.out = slurp(out_path);
  r.err = slurp(err_path);
  std::filesystem::remove_all(dir);
  return r;
}

}  // namespace hax::testing
