// Helpers shared by the test binaries: where the source tree and the built binary are, polling,
// and running a command. Paths are compiled in by tests/CMakeLists.txt; the environment overrides
// them where tests run from another tree (the GPU machine, scripts/gpu.sh).
#pragma once

#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace infersweep {

inline std::string SourceDir() {
  const char* env = std::getenv("INFERSWEEP_SOURCE_DIR");
  return env ? env : INFERSWEEP_SOURCE_DIR;
}

inline std::string WorkerBinary() {
  const char* env = std::getenv("INFERSWEEP_BINARY");
  return env ? env : INFERSWEEP_BINARY;
}

// Sets the environment variable `name` to `value` (null: unsets it) for a scope, and puts back
// what it held before when the scope ends, so a value set from outside (scripts/gpu.sh sets some
// for a whole test binary) outlives the test that changed it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) saved_ = old;
    if (value != nullptr)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (saved_)
      setenv(name_.c_str(), saved_->c_str(), 1);
    else
      unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> saved_;
};

// max |a - ref| over max |ref| (infinite where a difference is NaN).
inline double RelMaxError(const std::vector<float>& a, const std::vector<float>& ref) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - ref[i]);
    diff = std::isnan(d) ? INFINITY : std::max(diff, d);
    scale = std::max(scale, std::fabs(static_cast<double>(ref[i])));
  }
  return diff / scale;
}

// The fixture folders under `root` (those holding an expected.json), sorted; none when `root` is
// absent.
inline std::vector<std::string> FixtureNames(const std::string& root) {
  std::vector<std::string> names;
  if (!std::filesystem::is_directory(root)) return names;
  for (const auto& entry : std::filesystem::directory_iterator(root))
    if (std::filesystem::exists(entry.path() / "expected.json"))
      names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

// A new, empty directory under the system's temporary folder, named PREFIX-XXXXXX ("" when it
// cannot be made). The caller removes it.
inline std::string MakeTempDir(const std::string& prefix) {
  std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  return mkdtemp(tmpl.data()) != nullptr ? tmpl : std::string();
}

// Polls `done` every 20 ms until it holds or `seconds` pass.
inline bool WaitFor(const std::function<bool()>& done, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

// Runs `command` through the shell; returns its stdout (add 2>&1 for stderr) and sets the exit
// code (128 + signal when killed).
inline std::string RunCommand(const std::string& command, int* exit_code) {
  std::string out;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) {
    *exit_code = -1;
    return out;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return out;
}

// Lines from several threads (coordinator, agents), kept for failure messages.
class LineLog {
 public:
  void Add(const std::string& who, const std::string& line) {
    std::lock_guard<std::mutex> lock(mu_);
    text_ += "[" + who + "] " + line + "\n";
  }
  std::string Text() {
    std::lock_guard<std::mutex> lock(mu_);
    return text_;
  }

 private:
  std::mutex mu_;
  std::string text_;
};

}  // namespace infersweep
