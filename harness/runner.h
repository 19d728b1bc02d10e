// Runs trials in an isolated worker child process and always returns a TrialResult: a crash
// (signal, abort, sticky CUDA error) becomes CRASHED with the stderr tail, a hang past the
// workload's deadline is killed and becomes TIMEOUT. The parent survives and carries on.
//
// A worker stays alive across trials of the same model (weights stay loaded) and is restarted
// after any failure or when the model changes.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "harness/trial.h"

namespace infersweep {

struct RunnerOptions {
  // argv of the worker; it reads TrialRequest JSON lines on stdin and writes one TrialResult
  // JSON line per request on stdout. Default: {"/proc/self/exe", "worker"}.
  std::vector<std::string> worker_argv;
  int stderr_tail_lines = 40;
  // Called with progress lines the worker prints on stderr as "#progress <json>".
  std::function<void(const std::string&)> on_progress;
};

class TrialRunner {
 public:
  explicit TrialRunner(RunnerOptions options = {});
  ~TrialRunner();
  TrialRunner(const TrialRunner&) = delete;
  TrialRunner& operator=(const TrialRunner&) = delete;

  // Never fails: every outcome, including the worker's death, is a TrialResult.
  TrialResult Run(const TrialRequest& request);
  // Kills the current worker, if any (used on cancel).
  void Kill();

 private:
  struct Worker;
  RunnerOptions options_;
  std::unique_ptr<Worker> worker_;
  std::string worker_model_key_;
};

// The worker side: serves TrialRequests from stdin until EOF. Returns the process exit code.
int WorkerMain();

}  // namespace infersweep
