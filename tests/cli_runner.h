// Runs the `hax` command line from tests: exit status and captured output.
#pragma once
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <ftw.h>
#include <cstdio>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

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

// Removes a directory tree. (Not std::filesystem::remove_all: the Python torch package's
// libtorch.so exports its own broken copy of it, which the dynamic linker may pick, and crashes.)
inline void remove_tree(const std::string& path) {
  nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
       FTW_DEPTH | FTW_PHYS);
}

// A fresh empty temporary directory.
inline std::string temp_dir(const std::string& tag) {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/hax-test-" + tag + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  return mkdtemp(buf.data());
}

// Runs `hax args...` with extra environment `env` ("K=V"). If `while_running` is given it is
// called repeatedly with the child's pid until the child exits (to send signals). The child is
// started with posix_spawn, which runs no code of this (multi-threaded) process in the child.
inline CliResult run_hax(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
                         const std::function<bool(pid_t)>& while_running = nullptr) {
  std::string dir = temp_dir("cli");
  std::string out_path = dir + "/out", err_path = dir + "/err";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> argv_s = {HAX_CLI_PATH};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) env_s.push_back(*e);
  env_s.insert(env_s.end(), env.begin(), env.end());
  std::vector<char*> argv, envp;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, HAX_CLI_PATH, &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  CliResult r;
  if (rc != 0) {
    r.err = "posix_spawn failed";
    return r;
  }
  int st = 0;
  if (while_running) {
    while (waitpid(pid, &st, WNOHANG) != pid) {
      if (!while_running(pid)) {
        waitpid(pid, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } else {
    waitpid(pid, &st, 0);
  }
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.out = slurp(out_path);
  r.err = slurp(err_path);
  remove_tree(dir);
  return r;
}

// Expects `hax args...` to exit with status 2 and one line on stderr that contains `needle`.
inline void expect_cli_error(const std::vector<std::string>& args, const std::string& needle) {
  CliResult r = run_hax(args);
  std::string cmd;
  for (auto& a : args) cmd += a + " ";
  EXPECT_EQ(r.status, 2) << cmd << "\nstderr: " << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << cmd << "\nexpected '" << needle << "' in: " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "not one line: " << r.err;
}

}  // namespace hax::testing
