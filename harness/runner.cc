#include "harness/runner.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/wall_clock.h"
#include "harness/child_process.h"
#include "harness/executor.h"
#include "harness/rank_supervisor.h"

namespace infersweep {
namespace {

using Clock = std::chrono::steady_clock;

// How a worker that gave no result ended: "worker exited with code N" gains "without a result".
std::string WithoutResult(const std::string& how) {
  return how.find(" exited with code ") != std::string::npos ? how + " without a result" : how;
}

}  // namespace

struct TrialRunner::Worker : PipedChild {};

TrialRunner::TrialRunner(RunnerOptions options) : options_(std::move(options)) {
  if (options_.worker_argv.empty()) options_.worker_argv = {"/proc/self/exe", "worker"};
  if (!options_.probe_cache_path.empty()) {
    options_.worker_argv.push_back("--probe-cache");
    options_.worker_argv.push_back(options_.probe_cache_path);
  }
  signal(SIGPIPE, SIG_IGN);  // a dead worker must surface as EPIPE, not kill the parent
}

TrialRunner::~TrialRunner() = default;

void TrialRunner::Kill() { worker_.reset(); }

void TrialRunner::Cancel() {
  cancel_requested_ = true;
  // Run() publishes the pid before it checks the flag; this sets the flag before it reads the
  // pid: one of the two always sees the other.
  if (const pid_t pid = running_pid_.load(); pid > 0) kill(pid, SIGKILL);
}

void TrialRunner::ClearCancel() { cancel_requested_ = false; }

std::optional<std::string> TrialRunner::ProbeRefusal(const TrialRequest& request) {
  if (options_.probe_cache_path.empty()) return std::nullopt;
  absl::StatusOr<BackendConfig> config = NormalizeBackendConfig(request.config);
  if (!config.ok()) return std::nullopt;  // the worker says what is wrong with it
  absl::StatusOr<ModelConfig> shapes = DescribeModelShapes(request.model, request.layers);
  if (!shapes.ok()) return std::nullopt;
  if (probe_environment_.empty()) probe_environment_ = ProbeEnvironmentKey(ProbeLocalDevices());
  std::optional<absl::Status> answer =
      CachedProbeAnswer(options_.probe_cache_path, probe_environment_, *config, *shapes,
                        DeclaredWeightFormat(request.model));
  if (!answer || answer->ok()) return std::nullopt;
  return absl::StrCat("capability probe: ", answer->message());
}

TrialResult TrialRunner::Run(const TrialRequest& request, const std::vector<int>& devices) {
  TrialResult result = StartedResult(request);
  auto fail = [&](TrialStatus status, std::string reason) {
    running_pid_ = -1;
    // What the request names; the worker did not say (it died, hung or never ran).
    NameRequestedModel(request, &result);
    if (cancel_requested_ && reason.rfind("cancelled", 0) != 0) {  // the death was the cancel
      status = TrialStatus::kError;
      reason = "cancelled while running; worker killed";
    }
    result.status = status;
    result.reason = std::move(reason);
    if (worker_) result.stderr_tail = absl::StrJoin(worker_->stderr_tail, "\n");
    result.finished_unix_ms = NowUnixMs();
    worker_.reset();  // restarted after any failure
    return result;
  };
  if (cancel_requested_) return fail(TrialStatus::kError, "cancelled before it started");
  if (std::optional<std::string> refused = ProbeRefusal(request)) {
    result.status = TrialStatus::kUnsupported;
    result.reason = *std::move(refused);
    if (absl::StatusOr<BackendConfig> config = NormalizeBackendConfig(request.config); config.ok())
      result.config = *config;
    NameRequestedModel(request, &result);
    result.finished_unix_ms = NowUnixMs();
    return result;
  }
  EnvOverrides env;
  if (!devices.empty()) {
    absl::StatusOr<std::string> visible =
        ChildVisibleDevices(devices, std::getenv("CUDA_VISIBLE_DEVICES"));
    if (!visible.ok())
      return fail(TrialStatus::kError,
                  absl::StrCat("the trial's GPUs: ", visible.status().message()));
    env.emplace_back("CUDA_VISIBLE_DEVICES", *visible);
  }
  // A trial over rank processes (RankProcesses) runs under the rank supervisor, one fresh process
  // a rank. The handshake is left empty: CUDA ranks bootstrap through the supervisor's exchange
  // rounds (rank 0 makes the ncclUniqueId), so that no NCCL bootstrap root waits in this process
  // for ranks that died before they connected.
  if (const int ranks = RankProcesses(request); ranks > 0) {
    worker_.reset();
    RankSupervisorOptions supervised;
    supervised.rank_argv = {options_.worker_argv[0], "rank-worker"};
    supervised.stderr_tail_lines = options_.stderr_tail_lines;
    supervised.on_progress = options_.on_progress;
    supervised.env = env;
    return RunRankTrial(request, ranks, /*handshake=*/"", supervised).result;
  }

  // The worker keeps its weights for the next trial of the same model on the same devices.
  const std::string key = absl::StrCat(TrialExecutor::ModelKey(request),
                                       "|devices=", env.empty() ? "inherited" : env[0].second);
  if (worker_ && key != worker_model_key_) worker_.reset();
  if (!worker_) {
    auto w = std::make_unique<Worker>();
    if (absl::Status s = SpawnChild(options_.worker_argv, w.get(), env); !s.ok())
      return fail(TrialStatus::kError, std::string(s.message()));
    worker_ = std::move(w);
    worker_model_key_ = key;
  }
  Worker& w = *worker_;
  w.stderr_tail.clear();
  running_pid_ = w.pid;
  if (cancel_requested_) {  // a Cancel() that read no pid yet
    kill(w.pid, SIGKILL);
    waitpid(w.pid, nullptr, 0);
    w.pid = -1;
    return fail(TrialStatus::kError, "cancelled before it started");
  }

  if (!WriteAll(w.in, ToJson(request).dump() + "\n")) {
    // It died before reading the request (an exec failure exits 127 that fast).
    const std::string how = ReapAndDescribe(w.pid, "worker");
    w.pid = -1;
    return fail(TrialStatus::kCrashed, WithoutResult(how) + "; it died before reading the request");
  }

  const auto deadline = Clock::now() + std::chrono::milliseconds(
                                           static_cast<int64_t>(request.workload.timeout_s * 1e3));
  auto take_stderr_lines = [&] {
    w.TakeStderrLines(options_.stderr_tail_lines, options_.on_progress);
  };

  while (true) {
    if (const size_t nl = w.out_buffer.find('\n'); nl != std::string::npos) {
      const std::string line = w.out_buffer.substr(0, nl);
      w.out_buffer.erase(0, nl + 1);
      auto worker_result = TrialResultFromJsonText(line, "worker result");
      if (!worker_result.ok())
        return fail(TrialStatus::kError,
                    absl::StrCat(worker_result.status().message().substr(0, 400),
                                 " (line: ", line.substr(0, 200), ")"));
      take_stderr_lines();
      if (worker_result->status != TrialStatus::kOk)
        worker_result->stderr_tail = absl::StrJoin(w.stderr_tail, "\n");
      running_pid_ = -1;
      // A Cancel() racing the result may have killed the worker after it answered: start a
      // fresh one next time rather than write to a dead one.
      if (cancel_requested_) worker_.reset();
      return *worker_result;
    }
    if (!w.out_open) break;  // EOF without a result: the worker died
    const auto now = Clock::now();
    if (now >= deadline) {
      kill(w.pid, SIGKILL);
      waitpid(w.pid, nullptr, 0);
      w.pid = -1;
      take_stderr_lines();
      return fail(
          TrialStatus::kTimeout,
          absl::StrCat("no result within ", request.workload.timeout_s, " s; worker killed"));
    }
    pollfd fds[2] = {{w.out, POLLIN, 0}, {w.err_open ? w.err : -1, POLLIN, 0}};
    const int wait_ms = static_cast<int>(std::min<int64_t>(
        1000, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1));
    if (poll(fds, 2, wait_ms) < 0 && errno != EINTR)
      return fail(TrialStatus::kError, absl::StrCat("poll: ", strerror(errno)));
    if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) w.out_open = ReadSome(w.out, w.out_buffer);
    if (w.err_open && (fds[1].revents & (POLLIN | POLLHUP | POLLERR))) {
      w.err_open = ReadSome(w.err, w.err_buffer);
      take_stderr_lines();
    }
  }

  // The worker closed stdout: collect the rest of its stderr and how it ended.
  while (w.err_open) {
    pollfd fd = {w.err, POLLIN, 0};
    if (poll(&fd, 1, 2000) <= 0) break;
    w.err_open = ReadSome(w.err, w.err_buffer);
  }
  if (!w.err_buffer.empty()) w.err_buffer.push_back('\n');
  take_stderr_lines();
  const std::string how = ReapAndDescribe(w.pid, "worker");
  w.pid = -1;
  return fail(TrialStatus::kCrashed, WithoutResult(how));
}

int WorkerMain(const std::string& probe_cache_path) {
  LocalDevices devices = ProbeLocalDevices();
  std::shared_ptr<CapabilityProbe> probe = MakeCachedDeviceProbe(devices, probe_cache_path);
  TrialExecutor executor(std::move(devices), {}, std::move(probe));
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    TrialResult result;
    auto parsed = nlohmann::json::parse(line, nullptr, false);
    auto request =
        parsed.is_discarded()
            ? absl::StatusOr<TrialRequest>(absl::InvalidArgumentError("request is not JSON"))
            : TrialRequestFromJson(parsed);
    if (!request.ok()) {
      result.status = TrialStatus::kError;
      result.reason = std::string(request.status().message());
    } else {
      const std::string trial_id = request->trial_id;
      result = executor.Execute(*request, [&](const std::string& message) {
        std::cerr << "#progress "
                  << nlohmann::json{{"trial_id", trial_id}, {"message", message}}.dump()
                  << std::endl;
      });
    }
    std::cout << ToJson(result).dump() << std::endl;
  }
  return 0;
}

}  // namespace infersweep
