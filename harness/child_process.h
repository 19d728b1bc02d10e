// A child process on pipes, as the trial runner (harness/runner.h) and the rank supervisor
// (harness/rank_supervisor.h) start them: stdin for requests, stdout for result lines, stderr
// kept as a tail of lines (progress lines go to a callback). The child dies with the thread that
// started it (PR_SET_PDEATHSIG), so a killed parent leaves none behind.
#pragma once

#include <sys/types.h>

#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace infersweep {

struct PipedChild {
  pid_t pid = -1;
  int in = -1, out = -1, err = -1;
  std::string out_buffer, err_buffer;
  std::deque<std::string> stderr_tail;
  bool out_open = true, err_open = true;

  ~PipedChild() { Kill(); }
  // Closes the pipes, SIGKILLs the child and reaps it (no zombie is left).
  void Kill();
  // Moves complete stderr lines into stderr_tail (at most `tail_lines`), handing "#progress "
  // lines to `on_progress` instead.
  void TakeStderrLines(int tail_lines, const std::function<void(const std::string&)>& on_progress);
};

// Environment variables a child gets on top of (or in place of) the parent's, name and value.
using EnvOverrides = std::vector<std::pair<std::string, std::string>>;

// fork + execve of argv[0] with its stdin, stdout and stderr on pipes (O_CLOEXEC elsewhere),
// into `child` (a fresh one: no pid, no pipes), in this process's environment with `env` set.
absl::Status SpawnChild(std::vector<std::string> argv, PipedChild* child,
                        const EnvOverrides& env = {});

// CUDA_VISIBLE_DEVICES for a child that is to see this process's CUDA devices `devices` (its
// device i is devices[i]): the indices themselves, or, where this process runs under
// CUDA_VISIBLE_DEVICES (`inherited`, null when unset), the entries of that list they name, so
// that the child's numbering is the physical one the parent's was mapped through. An index past
// the inherited list is an error.
absl::StatusOr<std::string> ChildVisibleDevices(const std::vector<int>& devices,
                                                const char* inherited);

// Writes all of `data` (EINTR retried); false once the reader is gone.
bool WriteAll(int fd, const std::string& data);
// Appends what `fd` has to `buffer`; false at EOF or on error.
bool ReadSome(int fd, std::string& buffer);
// Reaps `pid` and says how it ended, after `who`: "<who> killed by signal 9 (SIGKILL: Killed)"
// or "<who> exited with code 3".
std::string ReapAndDescribe(pid_t pid, const std::string& who);

}  // namespace infersweep
