// The sweep commands (docs/SERVICE.md): `submit` sends a sweep spec to a coordinator, `status`
// lists sweeps or follows one's progress, `cancel` stops one's remaining trials. `submit --wait`
// and `status` follow a sweep with one progress line that rides out a coordinator restart.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "cli/client_flags.h"
#include "cli/commands.h"
#include "cli/output.h"
#include "coordinator/client.h"
#include "coordinator/sweep_spec.h"

namespace infersweep::cli {
namespace {

// Whether a failed call may succeed when it is made again: the coordinator is restarting or
// out of reach (UNAVAILABLE), slow (DEADLINE_EXCEEDED) or busy (ABORTED; RESOURCE_EXHAUSTED: a
// rate limit or a full disk). Anything else (NOT_FOUND, UNAUTHENTICATED, PERMISSION_DENIED,
// INVALID_ARGUMENT, ...) is answered the same however often it is asked.
bool IsTransient(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kResourceExhausted:
      return true;
    default:
      return false;
  }
}

// How long a watch keeps retrying a coordinator that does not answer, seconds (--wait-retry-s).
constexpr double kDefaultWaitRetryS = 120;

// Polls the sweep until it is no longer active; redraws one line on a terminal. A transient
// failure (IsTransient) is retried, 250 ms apart doubling to 5 s, for up to `retry_s` seconds
// from the first failure in a row; stderr gets one line when the coordinator stops answering and
// one when it answers again. After `retry_s`, or at once on any other error, it exits 1.
absl::StatusOr<int> WatchSweep(ServiceClient& client, int64_t id, double retry_s) {
  using Clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  constexpr milliseconds kPollInterval(500);
  constexpr milliseconds kFirstRetry(250);
  constexpr milliseconds kMaxRetry(5000);
  constexpr int64_t kCallTimeoutMs = 30'000;
  const milliseconds budget(static_cast<int64_t>(retry_s * 1000));
  const bool tty = isatty(STDOUT_FILENO);
  std::string last;
  auto last_print = Clock::now() - std::chrono::hours(1);
  bool lost = false;                 // the last call failed
  Clock::time_point lost_at;         // the first failure of the current run of them
  milliseconds retry = kFirstRetry;  // the next retry's interval
  milliseconds interval(0);          // this call's, when it is a retry
  while (true) {
    const Clock::time_point called = Clock::now();
    absl::StatusOr<v1::SweepInfo> s = client.GetSweep(id);
    if (!s.ok()) {
      if (tty && !lost) std::printf("\n");  // ends the progress line
      std::fflush(stdout);
      if (!IsTransient(s.status())) return s.status();
      if (!lost) {
        lost = true;
        lost_at = called;
        std::fprintf(stderr,
                     "lost the connection to the coordinator at %s (%s: %s); retrying for up to "
                     "%g s\n",
                     client.address().c_str(), absl::StatusCodeToString(s.status().code()).c_str(),
                     std::string(s.status().message()).c_str(), retry_s);
      }
      // A retry waits (gRPC's wait_for_ready) up to its interval for the channel to connect, so
      // it returns as soon as the coordinator is back: a call that fails at once leaves the
      // reconnection to gRPC's idle background polling, seconds late. One that failed sooner
      // (the coordinator answered with an error) is spaced out to its interval here.
      if (Clock::now() - called < interval) std::this_thread::sleep_until(called + interval);
      const Clock::duration left = budget - (Clock::now() - lost_at);
      if (left <= Clock::duration::zero()) {
        std::fprintf(stderr,
                     "error: the coordinator at %s has not answered for %g s; stopped waiting for "
                     "sweep %lld, which carries on there (infersweep status %lld --coordinator "
                     "%s)\n",
                     client.address().c_str(), retry_s, static_cast<long long>(id),
                     static_cast<long long>(id), client.address().c_str());
        return 1;
      }
      interval = std::min(
          retry, std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(left)));
      client.set_wait_for_ready(true);
      client.set_timeout_ms(interval.count());
      retry = std::min(retry * 2, kMaxRetry);
      continue;
    }
    if (lost) {
      std::fprintf(stderr, "the connection to the coordinator at %s is back after %.1f s\n",
                   client.address().c_str(),
                   std::chrono::duration<double>(Clock::now() - lost_at).count());
      lost = false;
      retry = kFirstRetry;
      interval = milliseconds(0);
      client.set_wait_for_ready(false);
      client.set_timeout_ms(kCallTimeoutMs);
      last.clear();  // show the progress at once
    }
    const std::string line = ProgressLine(*s);
    const bool active = s->state() == "active";
    if (tty) {
      std::printf("\r%s\033[K", line.c_str());
      if (!active) std::printf("\n");
    } else if (line != last && (!active || Clock::now() - last_print > std::chrono::seconds(5))) {
      std::printf("%s\n", line.c_str());
      last = line;
      last_print = Clock::now();
    }
    std::fflush(stdout);
    if (!active) return s->state() == "done" ? 0 : 1;
    std::this_thread::sleep_for(kPollInterval);
  }
}

absl::StatusOr<int> RunStatus(const std::string& coordinator, int64_t sweep_id, bool once) {
  ASSIGN_OR_RETURN(ServiceClient client, UserClient(coordinator));
  if (sweep_id > 0) {
    ASSIGN_OR_RETURN(const v1::SweepInfo s, client.GetSweep(sweep_id));
    std::printf("# sweep %lld '%s', model %s, created %s, priority %d\n",
                static_cast<long long>(s.sweep_id()), s.name().c_str(), s.model().c_str(),
                FormatUnixMs(s.created_unix_ms()).c_str(), s.priority());
    if (once || s.state() != "active" || !isatty(STDOUT_FILENO)) {
      std::printf("%s\n", ProgressLine(s).c_str());
      return 0;
    }
    return WatchSweep(client, sweep_id, kDefaultWaitRetryS);
  }
  ASSIGN_OR_RETURN(const v1::ListSweepsResponse list, client.ListSweeps());
  std::printf("# infersweep sweeps at %s\n", coordinator.c_str());
  std::printf("#%6s %-24s %-28s %-10s %8s %8s %8s %-19s\n", "sweep", " name", " model", " state",
              "done", "running", "total", " created");
  std::printf("#%6s %-24s %-28s %-10s %8s %8s %8s %-19s\n", "", "", "", "", "(trials)", "(trials)",
              "(trials)", " (local time)");
  for (const v1::SweepInfo& s : list.sweeps()) {
    std::printf(
        " %6lld %-24s %-28s %-10s %8lld %8lld %8lld %-19s\n", static_cast<long long>(s.sweep_id()),
        s.name().c_str(), s.model().c_str(), s.state().c_str(),
        static_cast<long long>(s.trials_done()), static_cast<long long>(s.trials_running()),
        static_cast<long long>(s.trials_total()), FormatUnixMs(s.created_unix_ms()).c_str());
    if (!s.waiting().empty()) std::printf("#        waiting: %s\n", s.waiting().c_str());
  }
  if (list.sweeps().empty()) std::printf("# no sweeps yet: infersweep submit sweep.yaml\n");
  return 0;
}

// ------------------------------------------------------------------------------ submit, cancel

absl::StatusOr<int> RunSubmit(const std::string& coordinator, const std::string& path, bool wait,
                              double wait_retry_s) {
  if (!(wait_retry_s >= 0)) return absl::InvalidArgumentError("--wait-retry-s must be >= 0");
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  // The coordinator refuses a bigger spec, and one over the gRPC message cap could not even be
  // sent: the same refusal, in the coordinator's words, without a round trip.
  if (const size_t size = text.str().size(); size > kMaxSweepSpecBytes)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": spec is ", size, " bytes; the limit is ", kMaxSweepSpecBytes));
  ASSIGN_OR_RETURN(ServiceClient client, UserClient(coordinator));
  ASSIGN_OR_RETURN(const v1::SubmitSweepResponse r, client.SubmitSweep(text.str(), path));
  for (const std::string& w : r.warnings()) std::fprintf(stderr, "warning: %s\n", w.c_str());
  std::printf("sweep %lld: %lld trial(s) queued\n", static_cast<long long>(r.sweep_id()),
              static_cast<long long>(r.trial_count()));
  std::fflush(stdout);
  if (!wait) return 0;
  return WatchSweep(client, r.sweep_id(), wait_retry_s);
}

absl::StatusOr<int> RunCancel(const std::string& coordinator, int64_t sweep_id) {
  ASSIGN_OR_RETURN(ServiceClient client, UserClient(coordinator));
  ASSIGN_OR_RETURN(const v1::CancelSweepResponse r, client.CancelSweep(sweep_id));
  std::printf("sweep %lld cancelled; %lld running trial(s) told to stop\n",
              static_cast<long long>(sweep_id),
              static_cast<long long>(r.trials_cancelled_running()));
  return 0;
}

}  // namespace

void AddSweepCommands(CLI::App& app) {
  {
    static std::string coordinator = DefaultCoordinator(), path;
    static bool wait = false;
    static double wait_retry_s = kDefaultWaitRetryS;
    CLI::App* cmd = app.add_subcommand("submit", "submit a sweep spec (YAML); prints its id");
    cmd->add_option("spec", path, "sweep spec file")->required();
    cmd->add_option("--coordinator", coordinator, "coordinator host:port")->capture_default_str();
    AddUserClientFlags(cmd);
    cmd->add_flag("--wait", wait, "wait for the sweep to finish, showing progress");
    cmd->add_option("--wait-retry-s", wait_retry_s,
                    "with --wait: how long to keep retrying a coordinator that does not answer "
                    "(restart, network), seconds")
        ->capture_default_str();
    cmd->callback([] { std::exit(ExitCode(RunSubmit(coordinator, path, wait, wait_retry_s))); });
  }
  {
    static std::string coordinator = DefaultCoordinator();
    static int64_t sweep = 0;
    static bool once = false;
    CLI::App* cmd = app.add_subcommand("status", "sweeps, or one sweep's live progress");
    cmd->add_option("sweep_id", sweep, "sweep id (default: list every sweep)");
    cmd->add_option("--coordinator", coordinator, "coordinator host:port")->capture_default_str();
    AddUserClientFlags(cmd);
    cmd->add_flag("--once", once, "print one snapshot instead of a live bar");
    cmd->callback([] { std::exit(ExitCode(RunStatus(coordinator, sweep, once))); });
  }
  {
    static std::string coordinator = DefaultCoordinator();
    static int64_t sweep = 0;
    CLI::App* cmd = app.add_subcommand("cancel", "cancel a sweep's remaining trials");
    cmd->add_option("sweep_id", sweep, "sweep id")->required();
    cmd->add_option("--coordinator", coordinator, "coordinator host:port")->capture_default_str();
    AddUserClientFlags(cmd);
    cmd->callback([] { std::exit(ExitCode(RunCancel(coordinator, sweep))); });
  }
}

}  // namespace infersweep::cli
