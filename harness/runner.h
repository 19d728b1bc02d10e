// Runs trials in an isolated worker child process and always returns a TrialResult: a crash
// (signal, abort, sticky CUDA error) becomes CRASHED with the stderr tail, a hang past the
// workload's deadline is killed and becomes TIMEOUT. The parent survives and carries on.
//
// A worker stays alive across trials of the same model (weights stay loaded) and is restarted
// after any failure or when the model changes.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "api/trial.h"

namespace infersweep {

struct RunnerOptions {
  // argv of the worker; it reads TrialRequest JSON lines on stdin and writes one TrialResult
  // JSON line per request on stdout. Default: {"/proc/self/exe", "worker"}.
  std::vector<std::string> worker_argv;
  int stderr_tail_lines = 40;
  // When set, the worker caches the capability probe's answers in this file
  // ("--probe-cache PATH" after worker_argv), which every later worker reads; and a config the
  // file says the probe refused is UNSUPPORTED at once, without a worker.
  std::string probe_cache_path;
  // Called with progress lines the worker prints on stderr as "#progress <json>".
  std::function<void(const std::string&)> on_progress;
};

class TrialRunner {
 public:
  explicit TrialRunner(RunnerOptions options = {});
  ~TrialRunner();
  TrialRunner(const TrialRunner&) = delete;
  TrialRunner& operator=(const TrialRunner&) = delete;

  // Never fails: every outcome, including the worker's death, is a TrialResult. `devices`: the
  // CUDA devices (this process's numbering) the trial is given; its worker, or its rank
  // processes, then see those alone, in that order (CUDA_VISIBLE_DEVICES, ChildVisibleDevices),
  // and a worker that saw others is restarted. Empty: the environment as inherited.
  TrialResult Run(const TrialRequest& request, const std::vector<int>& devices = {});
  // Kills the current worker, if any. Not while Run() is running on another thread: use Cancel.
  void Kill();

  // Thread-safe: ends the trial Run() is running (or the next one it starts, if it has not
  // started yet) by killing its worker; Run() then returns ERROR "cancelled while running".
  // ClearCancel() withdraws a request that came too late to matter (the caller's own ordering
  // decides which trial a cancellation belongs to).
  void Cancel();
  void ClearCancel();

 private:
  struct Worker;
  // The probe's refusal of `request` as the probe cache file holds it ("capability probe: ..."),
  // or nullopt: no cache file, no answer there, or an answer that accepts.
  std::optional<std::string> ProbeRefusal(const TrialRequest& request);
  RunnerOptions options_;
  std::unique_ptr<Worker> worker_;
  std::string worker_model_key_;
  std::atomic<bool> cancel_requested_{false};
  std::atomic<pid_t> running_pid_{-1};  // the worker Run() is waiting on, else -1
  // ProbeEnvironmentKey of this machine, read once, for the probe cache's answers.
  std::string probe_environment_;
};

// The worker side: serves TrialRequests from stdin until EOF, the capability probe's answers
// cached in `probe_cache_path` (empty: in memory). Returns the process exit code.
int WorkerMain(const std::string& probe_cache_path = "");

}  // namespace infersweep
