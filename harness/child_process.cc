#include "harness/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

extern char** environ;

namespace infersweep {

void PipedChild::Kill() {
  for (int* fd : {&in, &out, &err})
    if (*fd >= 0) {
      close(*fd);
      *fd = -1;
    }
  if (pid > 0) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    pid = -1;
  }
}

void PipedChild::TakeStderrLines(int tail_lines,
                                 const std::function<void(const std::string&)>& on_progress) {
  size_t pos;
  while ((pos = err_buffer.find('\n')) != std::string::npos) {
    std::string line = err_buffer.substr(0, pos);
    err_buffer.erase(0, pos + 1);
    if (line.rfind("#progress ", 0) == 0) {
      if (on_progress) on_progress(line.substr(10));
      continue;
    }
    stderr_tail.push_back(std::move(line));
    while (static_cast<int>(stderr_tail.size()) > tail_lines) stderr_tail.pop_front();
  }
}

absl::Status SpawnChild(std::vector<std::string> argv_strings, PipedChild* child,
                        const EnvOverrides& env) {
  int in_pipe[2], out_pipe[2], err_pipe[2];
  if (pipe2(in_pipe, O_CLOEXEC) || pipe2(out_pipe, O_CLOEXEC) || pipe2(err_pipe, O_CLOEXEC))
    return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
  std::vector<char*> argv;
  for (std::string& a : argv_strings) argv.push_back(a.data());
  argv.push_back(nullptr);
  // The child's environment is built here, before fork: between fork and exec a child of a
  // threaded parent may only make async-signal-safe calls (no setenv, no malloc).
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const bool replaced = std::any_of(env.begin(), env.end(), [&](const auto& kv) {
      return entry.size() > kv.first.size() && entry.substr(0, kv.first.size()) == kv.first &&
             entry[kv.first.size()] == '=';
    });
    if (!replaced) env_strings.emplace_back(entry);
  }
  for (const auto& [name, value] : env) env_strings.push_back(absl::StrCat(name, "=", value));
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    for (int fd : {in_pipe[0], in_pipe[1], out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]})
      close(fd);
    return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  }
  if (pid == 0) {
    // The child dies with the thread that started it: an agent killed outright (SIGKILL, OOM)
    // leaves no worker behind holding its GPU, or hanging forever.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before prctl
    dup2(in_pipe[0], 0);
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  close(in_pipe[0]);
  close(out_pipe[1]);
  close(err_pipe[1]);
  child->pid = pid;
  child->in = in_pipe[1];
  child->out = out_pipe[0];
  child->err = err_pipe[0];
  return absl::OkStatus();
}

absl::StatusOr<std::string> ChildVisibleDevices(const std::vector<int>& devices,
                                                const char* inherited) {
  std::vector<std::string> names;
  if (inherited != nullptr && *inherited != '\0') names = absl::StrSplit(inherited, ',');
  std::vector<std::string> out;
  for (int d : devices) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("device index ", d, " is negative"));
    if (names.empty()) {
      out.push_back(absl::StrCat(d));
    } else if (d < static_cast<int>(names.size())) {
      out.push_back(names[d]);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("device ", d, " is past this process's CUDA_VISIBLE_DEVICES=", inherited,
                       " (", names.size(), " devices)"));
    }
  }
  return absl::StrJoin(out, ",");
}

bool WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

bool ReadSome(int fd, std::string& buffer) {
  char chunk[65536];
  const ssize_t n = read(fd, chunk, sizeof chunk);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
  if (n <= 0) return false;
  buffer.append(chunk, static_cast<size_t>(n));
  return true;
}

std::string ReapAndDescribe(pid_t pid, const std::string& who) {
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  if (WIFSIGNALED(wstatus)) {
    const int sig = WTERMSIG(wstatus);
    const char* abbrev = sigabbrev_np(sig);
    return absl::StrCat(who, " killed by signal ", sig, " (SIG", abbrev ? abbrev : "?", ": ",
                        strsignal(sig), ")");
  }
  return absl::StrCat(who, " exited with code ", WEXITSTATUS(wstatus));
}

}  // namespace infersweep
