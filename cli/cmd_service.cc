// The fleet service's commands (docs/SERVICE.md): `coordinator` and `agent` run the service;
// `submit`, `status`, `cancel`, `results`, `best`, `compare` and `agents` talk to a coordinator.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "agent/agent.h"
#include "agent/inventory.h"
#include "api/trial.h"
#include "cli/client_flags.h"
#include "cli/commands.h"
#include "coordinator/agent_identity.h"
#include "coordinator/client.h"
#include "coordinator/metrics.h"
#include "coordinator/server.h"
#include "coordinator/sweep_spec.h"
#include "harness/report.h"
#include "proto/log_line.h"
#include "proto/rpc.h"

namespace infersweep::cli {
namespace {

constexpr int kUsageError = 2;

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kInvalidArgument ? kUsageError : 1;
}

int Usage(const std::string& message) {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  return kUsageError;
}

std::string S(std::string_view v) { return std::string(v); }

std::string FormatUnixMs(int64_t ms) {
  if (ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(ms), absl::LocalTimeZone());
}

std::string FormatBytes(int64_t bytes) {
  if (bytes <= 0) return "-";
  return absl::StrFormat("%.0f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
}

// An SM as the tables' sm column shows it: "90", or "cpu" for SM 0 (CPU results are stored under
// SM 0). In words elsewhere: SmArchLabel ("sm_90", "cpu").
std::string SmColumn(int sm) { return sm <= 0 ? std::string("cpu") : absl::StrCat(sm); }

// A result's device in words: "NVIDIA H200 sm_90", or "cpu" for a CPU slot's result.
std::string DeviceText(const std::string& gpu_name, int sm) {
  if (sm <= 0 && (gpu_name.empty() || gpu_name == "cpu")) return "cpu";
  return absl::StrCat(gpu_name.empty() ? "?" : gpu_name, " ", SmArchLabel(sm));
}

// Blocks SIGINT and SIGTERM in this thread (and every thread it starts later), so that
// WaitForSignal() can take them synchronously.
void BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

// ------------------------------------------------------------------------------ coordinator

struct CoordinatorArgs {
  std::string listen = "127.0.0.1:7070";
  std::string db = "data/infersweep.db";
  bool db_group_read = false;
  double lease_s = 60;
  int max_attempts = 3;
  size_t max_trials = 10000;
  int db_busy_timeout_ms = 5000;
  double agent_rate = 50, agent_burst = 500;
  double user_rate = 20, user_burst = 100;
  double connect_rate = 5, connect_burst = 50;
  std::string auth_token_env;
  std::string agent_token_file;
  std::string agent_tokens_file;
  std::string agent_cert_binding = "on";
  std::string user_token_file;
  std::string tls_cert, tls_key, tls_client_ca;
  std::string metrics_listen = "127.0.0.1:9464";
};

int RunCoordinator(const CoordinatorArgs& args) {
  if (args.lease_s < 1 || args.lease_s > 86400) return Usage("--lease-s must be in [1, 86400]");
  if (args.max_attempts < 0) return Usage("--max-attempts must be >= 0 (0: no cap)");
  if (args.db_busy_timeout_ms < 0) return Usage("--db-busy-timeout-ms must be >= 0");
  for (double v : {args.agent_rate, args.agent_burst, args.user_rate, args.user_burst,
                   args.connect_rate, args.connect_burst})
    if (v < 0) return Usage("rate limits and bursts must be >= 0 (rate 0: no limit)");
  const std::filesystem::path db(args.db);
  if (db.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(db.parent_path(), ec);
    if (ec)
      return Fail(absl::UnavailableError(
          absl::StrCat("cannot create ", db.parent_path().string(), ": ", ec.message())));
  }
  CoordinatorOptions options;
  options.lease_ms = static_cast<int64_t>(args.lease_s * 1000);
  options.max_trials_per_sweep = args.max_trials;
  options.max_attempts = args.max_attempts;
  options.db_busy_timeout_ms = args.db_busy_timeout_ms;
  options.db_file_mode = args.db_group_read ? 0640 : 0600;
  options.agent_message_limit = {args.agent_rate, args.agent_burst};
  options.user_call_limit = {args.user_rate, args.user_burst};
  options.connect_limit = {args.connect_rate, args.connect_burst};
  options.metrics_listen = args.metrics_listen;
  if (!args.auth_token_env.empty()) {
    const char* token = std::getenv(args.auth_token_env.c_str());
    if (token == nullptr || *token == '\0')
      return Usage(absl::StrCat("--auth-token-env ", args.auth_token_env, ": variable is empty"));
    options.agent_token = token;
  }
  if (!args.agent_token_file.empty()) {
    if (!args.auth_token_env.empty())
      return Usage("--agent-token-file and --auth-token-env are alternatives; give one");
    absl::StatusOr<std::string> token = rpc::ReadTokenFile(args.agent_token_file);
    if (!token.ok()) return Fail(token.status());
    options.agent_token = *std::move(token);
  }
  if (!args.agent_tokens_file.empty()) {
    if (!options.agent_token.empty())
      return Usage(
          "--agent-tokens-file and a shared agent token (--agent-token-file, --auth-token-env) "
          "are alternatives; give one");
    absl::StatusOr<std::map<std::string, std::string>> tokens =
        ReadAgentTokensFile(args.agent_tokens_file);
    if (!tokens.ok()) return Fail(tokens.status());
    options.agent_tokens = *std::move(tokens);
  }
  options.bind_agent_to_certificate = args.agent_cert_binding == "on";
  if (!args.user_token_file.empty()) {
    absl::StatusOr<std::string> token = rpc::ReadTokenFile(args.user_token_file);
    if (!token.ok()) return Fail(token.status());
    options.user_token = *std::move(token);
  }
  options.tls.cert_file = args.tls_cert;
  options.tls.key_file = args.tls_key;
  options.tls.client_ca_file = args.tls_client_ca;
  // A write over a file size limit fails (EFBIG, reported as a full disk) instead of killing
  // the process.
  signal(SIGXFSZ, SIG_IGN);
  BlockStopSignals();
  CoordinatorServer server(options);
  absl::StatusOr<int> port = server.Start(args.listen, args.db);
  if (!port.ok()) return Fail(port.status());
  std::printf("# infersweep coordinator on %s (port %d), database %s, lease %.0f s\n",
              args.listen.c_str(), *port, args.db.c_str(), args.lease_s);
  auto limit_text = [](const RateLimit& l) {
    return l.enabled() ? absl::StrCat(l.rate_per_s, "/s burst ", l.burst) : std::string("off");
  };
  std::printf(
      "# limits: %zu trials per sweep, %d attempts per trial; rates: agent messages %s, "
      "user calls %s, agent streams %s\n",
      args.max_trials, args.max_attempts, limit_text(options.agent_message_limit).c_str(),
      limit_text(options.user_call_limit).c_str(), limit_text(options.connect_limit).c_str());
  std::printf("# authentication: agents %s, users %s\n",
              !options.agent_tokens.empty() ? "per-agent tokens"
              : options.agent_token.empty() ? "off"
                                            : "shared token",
              options.user_token.empty() ? "off" : "token");
  std::printf("# agent identity: %s\n", server.agent_identity().c_str());
  const char* transport = "plaintext";
  if (options.tls.server_enabled())
    transport = options.tls.client_ca_file.empty() ? "TLS"
                                                   : "mutual TLS (client certificates required)";
  std::printf("# transport: %s\n", transport);
  if (server.metrics_port() > 0)
    std::printf("# metrics on %s (port %d)\n", args.metrics_listen.c_str(), server.metrics_port());
  std::fflush(stdout);
  const int sig = WaitForSignal();
  WriteLogLine("coordinator", absl::StrCat(sig == SIGINT ? "SIGINT" : "SIGTERM", ": stopping"));
  server.Stop();
  return 0;
}

// ------------------------------------------------------------------------------ agent

struct AgentArgs {
  std::string coordinator = DefaultCoordinator();
  std::string id;
  std::string spool;
  std::vector<std::string> fake_gpus;
  int max_backoff_ms = 5000;
  std::string auth_token_env;
  std::string token_file;
  std::string test_inject_fault;
  std::string results_log;
  std::string tls_ca, tls_cert, tls_key;
  std::string metrics_listen = "127.0.0.1:9465";
};

int RunAgent(const AgentArgs& args) {
  AgentOptions options;
  options.coordinator = args.coordinator;
  options.agent_id = args.id;
  options.spool_path = args.spool;
  options.test_fake_gpus = args.fake_gpus;
  options.max_backoff_ms = args.max_backoff_ms;
  options.metrics_listen = args.metrics_listen;
  options.test_inject_fault = args.test_inject_fault;
  options.results_log_path = args.results_log;
  options.tls.ca_file = args.tls_ca;
  options.tls.cert_file = args.tls_cert;
  options.tls.key_file = args.tls_key;
  if (!args.auth_token_env.empty()) {
    const char* token = std::getenv(args.auth_token_env.c_str());
    if (token == nullptr || *token == '\0')
      return Usage(absl::StrCat("--auth-token-env ", args.auth_token_env, ": variable is empty"));
    options.auth_token = token;
  }
  if (!args.token_file.empty()) {
    if (!args.auth_token_env.empty())
      return Usage("--token-file and --auth-token-env are alternatives; give one");
    absl::StatusOr<std::string> token = rpc::ReadTokenFile(args.token_file);
    if (!token.ok()) return Fail(token.status());
    options.auth_token = *std::move(token);
  }
  if (!options.spool_path.empty()) {
    const std::filesystem::path p(options.spool_path);
    std::error_code ec;
    if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  }
  signal(SIGXFSZ, SIG_IGN);  // a spool write over a file size limit fails instead of killing us
  BlockStopSignals();
  Agent agent(options);
  if (absl::Status s = agent.Start(); !s.ok()) return Fail(s);
  const Inventory& inv = agent.inventory();
  std::string slots;
  if (inv.gpus.empty()) {
    slots = "1 CPU slot (no GPU)";
  } else {
    std::vector<std::string> names;
    for (const GpuInfo& g : inv.gpus)
      names.push_back(
          absl::StrCat(g.name, " ", SmArchLabel(g.sm), g.test_fake ? " [TEST-FAKE LABEL]" : ""));
    slots = absl::StrJoin(names, ", ");
  }
  std::printf("# infersweep agent %s on %s -> coordinator %s; slots: %s\n",
              agent.agent_id().c_str(), inv.host.c_str(), args.coordinator.c_str(), slots.c_str());
  if (agent.metrics_port() > 0)
    std::printf("# metrics on %s (port %d)\n", args.metrics_listen.c_str(), agent.metrics_port());
  std::fflush(stdout);
  WaitForSignal();
  WriteLogLine(absl::StrCat("agent ", agent.agent_id()),
               "stopping (running trials finish first; Ctrl-C again to quit now)");
  std::thread second([] {
    WaitForSignal();
    std::_Exit(130);
  });
  second.detach();
  agent.Stop();
  return 0;
}

// ------------------------------------------------------------------------------ status

std::string StatusCounts(const v1::SweepInfo& s) {
  std::vector<std::string> parts;
  static const char* kOrder[] = {"OK", "INCORRECT", "CRASHED", "UNSUPPORTED", "TIMEOUT", "ERROR"};
  for (const char* name : kOrder) {
    auto it = s.status_counts().find(name);
    if (it != s.status_counts().end() && it->second > 0)
      parts.push_back(absl::StrCat(name, " ", it->second));
  }
  return parts.empty() ? "no results yet" : absl::StrJoin(parts, "  ");
}

std::string ProgressLine(const v1::SweepInfo& s) {
  constexpr int64_t kWidth = 30;
  const int64_t total = std::max<int64_t>(1, s.trials_total());
  const int64_t done = std::clamp<int64_t>(s.trials_done(), 0, total);
  const int64_t running = std::clamp<int64_t>(s.trials_running(), 0, total - done);
  const int64_t filled = kWidth * done / total;
  const int64_t busy = std::max<int64_t>(0, (kWidth * (done + running) + total - 1) / total - filled);
  std::string bar = std::string(static_cast<size_t>(filled), '#') +
                    std::string(static_cast<size_t>(std::min(busy, kWidth - filled)), '>');
  bar.resize(kWidth, '.');
  const int64_t queued = std::max<int64_t>(0, s.trials_total() - s.trials_done() - s.trials_running());
  return absl::StrFormat("sweep %d [%s] %d/%d done, %d running, %d queued | %s | %s%s",
                         s.sweep_id(), bar, s.trials_done(), s.trials_total(), s.trials_running(),
                         queued, StatusCounts(s), s.state(),
                         s.waiting().empty() ? "" : absl::StrCat(" | waiting: ", s.waiting()));
}

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
int WatchSweep(ServiceClient& client, int64_t id, double retry_s) {
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
      if (!IsTransient(s.status())) return Fail(s.status());
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

int RunStatus(const std::string& coordinator, int64_t sweep_id, bool once) {
  absl::StatusOr<std::string> user_token = UserToken();
  if (!user_token.ok()) return Fail(user_token.status());
  ServiceClient client(coordinator, 30'000, *user_token, ClientTls());
  if (sweep_id > 0) {
    absl::StatusOr<v1::SweepInfo> s = client.GetSweep(sweep_id);
    if (!s.ok()) return Fail(s.status());
    std::printf("# sweep %lld '%s', model %s, created %s, priority %d\n",
                static_cast<long long>(s->sweep_id()), s->name().c_str(), s->model().c_str(),
                FormatUnixMs(s->created_unix_ms()).c_str(), s->priority());
    if (once || s->state() != "active" || !isatty(STDOUT_FILENO)) {
      std::printf("%s\n", ProgressLine(*s).c_str());
      return 0;
    }
    return WatchSweep(client, sweep_id, kDefaultWaitRetryS);
  }
  absl::StatusOr<v1::ListSweepsResponse> list = client.ListSweeps();
  if (!list.ok()) return Fail(list.status());
  std::printf("# infersweep sweeps at %s\n", coordinator.c_str());
  std::printf("#%6s %-24s %-28s %-10s %8s %8s %8s %-19s\n", "sweep", " name", " model", " state",
              "done", "running", "total", " created");
  std::printf("#%6s %-24s %-28s %-10s %8s %8s %8s %-19s\n", "", "", "", "", "(trials)",
              "(trials)", "(trials)", " (local time)");
  for (const v1::SweepInfo& s : list->sweeps()) {
    std::printf(" %6lld %-24s %-28s %-10s %8lld %8lld %8lld %-19s\n",
                static_cast<long long>(s.sweep_id()), s.name().c_str(), s.model().c_str(),
                s.state().c_str(), static_cast<long long>(s.trials_done()),
                static_cast<long long>(s.trials_running()),
                static_cast<long long>(s.trials_total()), FormatUnixMs(s.created_unix_ms()).c_str());
    if (!s.waiting().empty()) std::printf("#        waiting: %s\n", s.waiting().c_str());
  }
  if (list->sweeps().empty()) std::printf("# no sweeps yet: infersweep submit sweep.yaml\n");
  return 0;
}

// ------------------------------------------------------------------------------ submit, cancel

int RunSubmit(const std::string& coordinator, const std::string& path, bool wait,
              double wait_retry_s) {
  if (!(wait_retry_s >= 0)) return Usage("--wait-retry-s must be >= 0");
  std::ifstream in(path);
  if (!in) return Fail(absl::NotFoundError(absl::StrCat("cannot read ", path)));
  std::stringstream text;
  text << in.rdbuf();
  // The coordinator refuses a bigger spec, and one over the gRPC message cap could not even be
  // sent: the same refusal, in the coordinator's words, without a round trip.
  if (const size_t size = text.str().size(); size > kMaxSweepSpecBytes)
    return Usage(
        absl::StrCat(path, ": spec is ", size, " bytes; the limit is ", kMaxSweepSpecBytes));
  absl::StatusOr<std::string> user_token = UserToken();
  if (!user_token.ok()) return Fail(user_token.status());
  ServiceClient client(coordinator, 30'000, *user_token, ClientTls());
  absl::StatusOr<v1::SubmitSweepResponse> r = client.SubmitSweep(text.str(), path);
  if (!r.ok()) return Fail(r.status());
  for (const std::string& w : r->warnings()) std::fprintf(stderr, "warning: %s\n", w.c_str());
  std::printf("sweep %lld: %lld trial(s) queued\n", static_cast<long long>(r->sweep_id()),
              static_cast<long long>(r->trial_count()));
  std::fflush(stdout);
  if (!wait) return 0;
  return WatchSweep(client, r->sweep_id(), wait_retry_s);
}

int RunCancel(const std::string& coordinator, int64_t sweep_id) {
  absl::StatusOr<std::string> user_token = UserToken();
  if (!user_token.ok()) return Fail(user_token.status());
  ServiceClient client(coordinator, 30'000, *user_token, ClientTls());
  absl::StatusOr<v1::CancelSweepResponse> r = client.CancelSweep(sweep_id);
  if (!r.ok()) return Fail(r.status());
  std::printf("sweep %lld cancelled; %lld running trial(s) told to stop\n",
              static_cast<long long>(sweep_id), static_cast<long long>(r->trials_cancelled_running()));
  return 0;
}

// ------------------------------------------------------------------------------ results

struct Row {
  int64_t sweep_id = 0;
  std::string agent_id, gpu_name;
  int sm = 0;
  // The stored identity (docs/RESULTS.md "Identity"); "" where unknown.
  std::string model_key, workload, engine_version, software;
  bool software_known = false;
  TrialResult result;
};

std::string Unknown(const std::string& s) { return s.empty() ? "unknown" : s; }

// --sweep, --workload, --layers, --model-key: which results a query reads, by identity.
struct IdentityArgs {
  int64_t sweep = 0;
  std::string workload;   // as given; canonical after CheckIdentityArgs
  std::string model_key;  // "unknown" selects results whose identity is unknown
  int layers = 0;
};

void AddIdentityFlags(CLI::App* cmd, IdentityArgs* a) {
  cmd->add_option("--sweep", a->sweep, "only this sweep's results");
  cmd->add_option("--workload", a->workload,
                  "only this workload: prompt=N,output=N[,warmup=N] (docs/RESULTS.md "
                  "\"Identity\"; other workload fields are ignored)");
  cmd->add_option("--layers", a->layers, "only models run with this many layers");
  cmd->add_option("--model-key", a->model_key,
                  "only this model identity, exactly as listed (\"unknown\": results stored "
                  "without one)");
}

absl::Status CheckIdentityArgs(IdentityArgs* a) {
  if (a->sweep < 0) return absl::InvalidArgumentError("--sweep must be >= 1");
  if (a->layers < 0) return absl::InvalidArgumentError("--layers must be >= 1");
  if (!a->workload.empty()) {
    absl::StatusOr<std::string> key = CanonicalWorkloadKey(a->workload);
    if (!key.ok())
      return absl::InvalidArgumentError(absl::StrCat("--workload: ", key.status().message()));
    a->workload = *key;
  }
  return absl::OkStatus();
}

template <typename Request>
void ApplyIdentity(const IdentityArgs& a, Request* req) {
  if (a.sweep > 0) req->set_sweep_id(a.sweep);
  if (!a.workload.empty()) req->set_workload(a.workload);
  if (a.layers > 0) req->set_layers(a.layers);
  if (!a.model_key.empty()) req->set_model_key(a.model_key == "unknown" ? "" : a.model_key);
}

std::vector<std::string> IdentityContext(const IdentityArgs& a) {
  std::vector<std::string> out;
  if (a.sweep > 0) out.push_back(absl::StrCat("sweep ", a.sweep));
  if (!a.workload.empty()) out.push_back(absl::StrCat("workload ", a.workload));
  if (a.layers > 0) out.push_back(absl::StrCat("layers ", a.layers));
  if (!a.model_key.empty()) out.push_back(absl::StrCat("model ", a.model_key));
  return out;
}

absl::StatusOr<Row> ParseRow(const v1::ResultRow& r) {
  absl::StatusOr<TrialResult> result =
      TrialResultFromJsonText(r.result_json(), "the coordinator's result_json");
  if (!result.ok()) return absl::DataLossError(result.status().message());
  Row row;
  row.sweep_id = r.sweep_id();
  row.agent_id = r.agent_id();
  row.gpu_name = r.gpu_name();
  row.sm = r.sm();
  row.model_key = r.has_model_key() ? r.model_key() : ModelIdentityKey(result->model_identity);
  row.workload = r.has_workload() ? r.workload() : result->workload;
  row.engine_version = r.has_engine_version() ? r.engine_version() : result->engine_version;
  row.software_known = r.has_software();
  row.software = r.software();
  row.result = *std::move(result);
  return row;
}

nlohmann::json OrNull(const std::string& s) {
  return s.empty() ? nlohmann::json() : nlohmann::json(s);
}

nlohmann::json RowJson(const Row& row) {
  return {{"sweep_id", row.sweep_id},
          {"agent_id", row.agent_id},
          {"gpu_name", row.gpu_name},
          {"sm", row.sm},
          {"model_key", OrNull(row.model_key)},
          {"workload", OrNull(row.workload)},
          {"engine_version", OrNull(row.engine_version)},
          {"software", row.software_known ? nlohmann::json(row.software) : nlohmann::json()},
          {"result", ToJson(row.result)}};
}

// Short names for the identities and workloads of a table's rows ("M1", "W1"), listed under it.
class Legend {
 public:
  std::string Model(const std::string& key) { return Name(models_, "M", key); }
  std::string Workload(const std::string& key) { return Name(workloads_, "W", key); }
  void Print() const {
    for (const auto& [name, key] : Sorted(models_))
      std::printf("# %s = %s\n", name.c_str(), key.c_str());
    for (const auto& [name, key] : Sorted(workloads_))
      std::printf("# %s = %s\n", name.c_str(), key.c_str());
  }

 private:
  static std::string Name(std::map<std::string, std::string>& names, const char* prefix,
                          const std::string& key) {
    if (key.empty()) return "?";
    auto [it, fresh] = names.try_emplace(key);
    if (fresh) it->second = absl::StrCat(prefix, names.size());
    return it->second;
  }
  static std::vector<std::pair<std::string, std::string>> Sorted(
      const std::map<std::string, std::string>& names) {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& [key, name] : names) out.emplace_back(name, key);
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
      return a.first.size() != b.first.size() ? a.first.size() < b.first.size() : a.first < b.first;
    });
    return out;
  }
  std::map<std::string, std::string> models_, workloads_;
};

const BatchFigures* FindBatch(const TrialResult& r, int batch) {
  for (const BatchFigures& b : r.batches)
    if (b.batch == batch) return &b;
  return nullptr;
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

absl::StatusOr<int64_t> ParseTimeArg(const std::string& text, const char* flag) {
  absl::Duration ago;
  if (absl::ParseDuration(text, &ago)) return absl::ToUnixMillis(absl::Now() - ago);
  absl::Time t;
  std::string err;
  if (absl::ParseTime(absl::RFC3339_full, text, &t, &err) ||
      absl::ParseTime("%Y-%m-%d", text, absl::LocalTimeZone(), &t, &err))
    return absl::ToUnixMillis(t);
  return absl::InvalidArgumentError(absl::StrCat(
      flag, " '", text, "': expected a duration ago (24h, 30m), a date (2025-01-31) or RFC 3339"));
}

struct ResultsArgs {
  std::string coordinator = DefaultCoordinator();
  IdentityArgs identity;
  std::string sm_arch, gpu, model, status, since, until, format = "table";
  std::vector<std::string> axes;
  int limit = rpc::kDefaultQueryRows;
  bool show_kernels = false;
};

// A serving load point on one line: its verdict and its headline figures (docs/METRICS.md).
std::string ServingPointText(const ServingPoint& p) {
  std::string text = absl::StrFormat(
      "%s %s: output_tok_s=%.1f output_tok_s_per_user=%.1f median_ttft_ms=%.3f "
      "p99_ttft_ms=%.3f median_tpot_ms=%.3f p99_tpot_ms=%.3f completed=%d matching=%d/%d",
      LoadPointName(p.point), TrialStatusName(p.verdict), p.output_throughput,
      p.output_tok_s_per_user, p.ttft_ms.median, p.ttft_ms.p99, p.tpot_ms.median, p.tpot_ms.p99,
      p.completed, p.requests_matching, p.requests_checked);
  if (p.request_goodput) absl::StrAppendFormat(&text, " goodput=%.3f", *p.request_goodput);
  if (p.meets_slo) absl::StrAppend(&text, " meets_slo=", *p.meets_slo ? "yes" : "no");
  return text;
}

void PrintResultsTable(const std::vector<Row>& rows, const std::string& context,
                       bool show_kernels) {
  Legend legend;
  std::printf("# infersweep results: %s\n", context.c_str());
  std::printf("#%6s %-10s %-14s %-22s %6s %-5s %-5s %-38s %5s %-11s %9s %9s %10s %10s %6s\n",
              "sweep", " trial", " agent", " gpu", "sm", " model", " load", " config", "batch",
              " status", "ttft", "tpot", "out", "prefill", "top1");
  std::printf("#%6s %-10s %-14s %-22s %6s %-5s %-5s %-38s %5s %-11s %9s %9s %10s %10s %6s\n", "",
              "", "", "", "", " (M#)", " (W#)", "", "", "", "(ms)", "(ms)", "(tok/s)", "(tok/s)",
              "(%)");
  for (const Row& row : rows) {
    const TrialResult& r = row.result;
    const std::string config = BackendConfigString(r.config);
    const std::string status = S(TrialStatusName(r.status));
    const std::string agent = row.agent_id.empty() ? "(coordinator)" : row.agent_id;
    const std::string model = legend.Model(row.model_key);
    const std::string workload = legend.Workload(row.workload);
    if (r.batches.empty()) {
      std::printf(" %6lld %-10s %-14s %-22s %6s %-5s %-5s %-38s %5s %-11s %9s %9s %10s %10s %6s\n",
                  static_cast<long long>(row.sweep_id), r.trial_id.c_str(), agent.c_str(),
                  row.gpu_name.c_str(), SmColumn(row.sm).c_str(), model.c_str(), workload.c_str(),
                  config.c_str(), "-", status.c_str(), "-", "-", "-", "-", "-");
      for (const ServingPoint& p : r.serving)
        std::printf("#   %s %s\n", r.trial_id.c_str(), ServingPointText(p).c_str());
      if (r.slo_search)
        std::printf("#   %s slo search: %s\n", r.trial_id.c_str(),
                    r.slo_search->best ? absl::StrCat("highest load meeting it ",
                                                      ServingPointText(*r.slo_search->best))
                                             .c_str()
                                       : "no probed load meets it");
      if (!r.reason.empty()) std::printf("#   %s: %s\n", r.trial_id.c_str(), r.reason.c_str());
      continue;
    }
    for (const BatchFigures& b : r.batches)
      std::printf(
          " %6lld %-10s %-14s %-22s %6s %-5s %-5s %-38s %5d %-11s %9.2f %9.3f %10.1f %10.1f "
          "%6.1f\n",
          static_cast<long long>(row.sweep_id), r.trial_id.c_str(), agent.c_str(),
          row.gpu_name.c_str(), SmColumn(row.sm).c_str(), model.c_str(), workload.c_str(),
          config.c_str(), b.batch, status.c_str(), b.ttft_ms.median, b.tpot_ms.median,
          b.output_tok_s.median, b.prefill_tok_s.median, 100 * r.verdict.top1_agreement);
    if (show_kernels)
      for (const BatchFigures& b : r.batches) {
        std::printf("#   %s batch %d: what ran\n", r.trial_id.c_str(), b.batch);
        std::fputs(FormatKernels(b).c_str(), stdout);
      }
    if (r.status != TrialStatus::kOk && !r.reason.empty())
      std::printf("#   %s: %s\n", r.trial_id.c_str(), r.reason.c_str());
  }
  std::printf("# %zu result(s); model identities (M#) and workloads (W#), ? where unknown:\n",
              rows.size());
  legend.Print();
}

void PrintResultsCsv(const std::vector<Row>& rows) {
  std::printf(
      "sweep_id,trial_id,attempt,agent_id,gpu_name,sm,model,model_key,workload,engine_version,"
      "software,config,status,batch,ttft_ms,tpot_ms,output_tok_s,prefill_tok_s,top1_agreement,"
      "kl_mean,peak_memory_bytes,finished_unix_ms,reason\n");
  for (const Row& row : rows) {
    const TrialResult& r = row.result;
    const std::string prefix = absl::StrCat(
        row.sweep_id, ",", CsvField(r.trial_id), ",", r.attempt, ",", CsvField(row.agent_id), ",",
        CsvField(row.gpu_name), ",", row.sm, ",", CsvField(r.model), ",", CsvField(row.model_key),
        ",", CsvField(row.workload), ",", CsvField(row.engine_version), ",", CsvField(row.software),
        ",", CsvField(BackendConfigString(r.config)), ",", S(TrialStatusName(r.status)));
    const std::string suffix =
        absl::StrCat(absl::StrFormat("%.6g", r.verdict.top1_agreement), ",",
                     absl::StrFormat("%.6g", r.verdict.kl_mean), ",", r.peak_memory_bytes, ",",
                     r.finished_unix_ms, ",", CsvField(r.reason));
    if (r.batches.empty()) {
      std::printf("%s,,,,,,%s\n", prefix.c_str(), suffix.c_str());
      continue;
    }
    for (const BatchFigures& b : r.batches)
      std::printf("%s,%d,%.6g,%.6g,%.6g,%.6g,%s\n", prefix.c_str(), b.batch, b.ttft_ms.median,
                  b.tpot_ms.median, b.output_tok_s.median, b.prefill_tok_s.median, suffix.c_str());
  }
}

int RunResults(const ResultsArgs& args) {
  if (args.limit < 1 || args.limit > rpc::kMaxQueryRows)
    return Usage(absl::StrCat("--limit ", args.limit, ": must lie in [1, ", rpc::kMaxQueryRows,
                              "] (the coordinator returns at most ", rpc::kMaxQueryRows,
                              " results a query)"));
  v1::QueryResultsRequest req;
  IdentityArgs identity = args.identity;
  if (absl::Status s = CheckIdentityArgs(&identity); !s.ok()) return Fail(s);
  ApplyIdentity(identity, &req);
  std::vector<std::string> context = IdentityContext(identity);
  if (!args.sm_arch.empty()) {
    absl::StatusOr<int> sm = ParseSmArch(args.sm_arch);
    if (!sm.ok()) return Fail(absl::InvalidArgumentError(absl::StrCat("--sm-arch: ", sm.status().message())));
    req.set_sm(*sm);
    context.push_back(SmArchLabel(*sm));
  }
  if (!args.gpu.empty()) {
    req.set_gpu_name(args.gpu);
    context.push_back(absl::StrCat("gpu '", args.gpu, "'"));
  }
  if (!args.model.empty()) {
    req.set_model(args.model);
    context.push_back(absl::StrCat("model ", args.model));
  }
  if (!args.status.empty()) {
    req.set_status(args.status);
    context.push_back(absl::StrCat("status ", args.status));
  }
  for (const std::string& a : args.axes) {
    std::pair<std::string, std::string> kv = absl::StrSplit(a, absl::MaxSplits('=', 1));
    if (kv.first.empty() || kv.second.empty())
      return Usage(absl::StrCat("--axis '", a, "': expected axis=value"));
    (*req.mutable_axis_values())[kv.first] = kv.second;
    context.push_back(a);
  }
  if (!args.since.empty()) {
    absl::StatusOr<int64_t> t = ParseTimeArg(args.since, "--since");
    if (!t.ok()) return Fail(t.status());
    req.set_since_unix_ms(*t);
    context.push_back(absl::StrCat("since ", FormatUnixMs(*t)));
  }
  if (!args.until.empty()) {
    absl::StatusOr<int64_t> t = ParseTimeArg(args.until, "--until");
    if (!t.ok()) return Fail(t.status());
    req.set_until_unix_ms(*t);
    context.push_back(absl::StrCat("until ", FormatUnixMs(*t)));
  }
  if (args.format != "table" && args.format != "csv" && args.format != "json")
    return Usage(absl::StrCat("--format '", args.format, "': expected table, csv or json"));
  req.set_limit(args.limit);
  req.set_with_kernels(args.show_kernels || args.format == "json");
  absl::StatusOr<std::string> user_token = UserToken();
  if (!user_token.ok()) return Fail(user_token.status());
  ServiceClient client(args.coordinator, 30'000, *user_token, ClientTls());
  absl::StatusOr<v1::QueryResultsResponse> resp = client.QueryResults(req);
  if (!resp.ok()) return Fail(resp.status());
  std::vector<Row> rows;
  for (const v1::ResultRow& r : resp->rows()) {
    absl::StatusOr<Row> row = ParseRow(r);
    if (!row.ok()) return Fail(row.status());
    rows.push_back(*std::move(row));
  }
  if (args.format == "json") {
    nlohmann::json out = nlohmann::json::array();
    for (const Row& row : rows) out.push_back(RowJson(row));
    std::printf("%s\n", out.dump(1).c_str());
  } else if (args.format == "csv") {
    PrintResultsCsv(rows);
  } else {
    PrintResultsTable(rows, context.empty() ? "all" : absl::StrJoin(context, ", "),
                      args.show_kernels);
  }
  if (resp->truncated())
    std::fprintf(stderr, "warning: more results matched than fit into one reply; narrow the query\n");
  return 0;
}

// ------------------------------------------------------------------------------ best, compare

void PrintFigures(const Row& row, int batch) {
  const TrialResult& r = row.result;
  const BatchFigures* b = FindBatch(r, batch);
  std::printf("# config        %s\n", BackendConfigString(r.config).c_str());
  std::printf("# trial         %s attempt %d (sweep %lld), agent %s, %s\n", r.trial_id.c_str(),
              r.attempt, static_cast<long long>(row.sweep_id), row.agent_id.c_str(),
              DeviceText(row.gpu_name, row.sm).c_str());
  if (b == nullptr) return;
  // roof: the decode step's share of the memory roofline; p_roof: the prefill's share of the
  // compute roofline (docs/METRICS.md); "-" where the device has no measured figures.
  auto percent = [](const std::optional<double>& f) {
    return f ? absl::StrFormat("%.1f", 100 * *f) : std::string("-");
  };
  std::printf("#%-16s %9s %9s %10s %10s %9s %6s %6s %6s\n", " batch", "ttft", "tpot", "out",
              "prefill", "itl_p99", "top1", "roof", "p_roof");
  std::printf("#%-16s %9s %9s %10s %10s %9s %6s %6s %6s\n", "", "(ms)", "(ms)", "(tok/s)",
              "(tok/s)", "(ms)", "(%)", "(%)", "(%)");
  std::printf(" %-16d %9.2f %9.3f %10.1f %10.1f %9.3f %6.1f %6s %6s\n", b->batch,
              b->ttft_ms.median, b->tpot_ms.median, b->output_tok_s.median,
              b->prefill_tok_s.median, b->itl_ms.p99, 100 * r.verdict.top1_agreement,
              percent(b->roofline_fraction).c_str(), percent(b->prefill_roofline_fraction).c_str());
}

// A (model identity, workload) group, as `best` and `compare` list them (and its load point,
// for serving groups).
struct Group {
  std::string model_key, workload, load_point;
  int64_t ok_results = 0;
  int64_t first_sweep = 0, last_sweep = 0;
};

// Lists the groups a query could mean, with the flags that pick each, and returns the usage
// exit code: the tool never ranks across them.
int AskForGroup(const std::string& what, const std::vector<Group>& groups) {
  std::fprintf(stderr,
               "error: %s spans %zu (model identity, workload) groups, which are never ranked "
               "together; choose one with --model-key (or --layers) and --workload, or --sweep:\n",
               what.c_str(), groups.size());
  const bool serving = !groups.empty() && !groups[0].load_point.empty();
  if (serving)
    std::fprintf(stderr, "#  serving groups are keyed by their load point too (--load-point)\n");
  std::fprintf(stderr, "#  %-60s %-30s %s%10s %s\n", "model identity (--model-key)",
               "workload (--workload)", serving ? "load point (--load-point)   " : "", "OK results",
               "sweeps");
  for (const Group& g : groups)
    std::fprintf(
        stderr, "   %-60s %-30s %s%10lld %s\n", Unknown(g.model_key).c_str(),
        Unknown(g.workload).c_str(), serving ? absl::StrFormat("%-28s", g.load_point).c_str() : "",
        static_cast<long long>(g.ok_results),
        g.first_sweep == g.last_sweep ? absl::StrCat(g.first_sweep).c_str()
                                      : absl::StrCat(g.first_sweep, "-", g.last_sweep).c_str());
  return kUsageError;
}

struct BestArgs {
  std::string coordinator = DefaultCoordinator();
  std::string model, sm_arch, metric = "output_tok_s", format = "table";
  int batch = 1;
  bool serving = false;
  std::string load_point;
  IdentityArgs identity;
};

// A serving best's figures: the winning result's row for its load point.
void PrintServingFigures(const Row& row, const std::string& load_point) {
  const TrialResult& r = row.result;
  std::printf("# config        %s\n", BackendConfigString(r.config).c_str());
  std::printf("# trial         %s attempt %d (sweep %lld), agent %s, %s\n", r.trial_id.c_str(),
              r.attempt, static_cast<long long>(row.sweep_id), row.agent_id.c_str(),
              DeviceText(row.gpu_name, row.sm).c_str());
  for (const ServingPoint& p : r.serving)
    if (LoadPointName(p.point) == load_point)
      std::printf("# serving       %s\n", ServingPointText(p).c_str());
}

// --batch of best and compare: one lockstep batch size.
absl::Status CheckBatchFlag(int batch) {
  if (batch >= 1 && batch <= kMaxBatchSize) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--batch ", batch, ": must lie in [1, ", kMaxBatchSize, "] (a batch size)"));
}

int RunBest(const BestArgs& args) {
  absl::StatusOr<int> sm = ParseSmArch(args.sm_arch);
  if (!sm.ok())
    return Fail(absl::InvalidArgumentError(absl::StrCat("--sm-arch: ", sm.status().message())));
  if (absl::Status s = CheckBatchFlag(args.batch); !s.ok()) return Fail(s);
  if (args.format != "table" && args.format != "json")
    return Usage(absl::StrCat("--format '", args.format, "': expected table or json"));
  if (args.model.empty() && args.identity.sweep <= 0)
    return Usage("best needs --model, or --sweep (whose model it ranks)");
  IdentityArgs identity = args.identity;
  if (absl::Status s = CheckIdentityArgs(&identity); !s.ok()) return Fail(s);
  v1::BestRequest req;
  req.set_model(args.model);
  req.set_sm(*sm);
  req.set_metric(args.metric);
  req.set_batch(args.batch);
  req.set_serving(args.serving);
  if (!args.load_point.empty()) req.set_load_point(args.load_point);
  ApplyIdentity(identity, &req);
  absl::StatusOr<std::string> user_token = UserToken();
  if (!user_token.ok()) return Fail(user_token.status());
  ServiceClient client(args.coordinator, 30'000, *user_token, ClientTls());
  absl::StatusOr<v1::BestResponse> resp = client.Best(req);
  if (!resp.ok()) return Fail(resp.status());
  // The coordinator answers from serving load points when the request names one, asks for
  // them, or names a metric only they have; its groups then carry their load point.
  const bool serving = args.serving || !args.load_point.empty() || args.metric == "goodput" ||
                       args.metric == "output_tok_s_per_user" || args.metric == "p99_ttft_ms" ||
                       args.metric == "p99_tpot_ms" ||
                       (resp->groups_size() > 0 && !resp->groups(0).load_point().empty());
  const std::string scope =
      serving ? absl::StrCat(resp->model(), " on ", SmArchLabel(*sm), " serving at ",
                             resp->groups_size() == 1  ? resp->groups(0).load_point()
                             : args.load_point.empty() ? std::string("any load point")
                                                       : args.load_point)
              : absl::StrCat(resp->model(), " on ", SmArchLabel(*sm), " at batch ", args.batch);
  if (resp->groups_size() > 1) {
    std::vector<Group> groups;
    for (const v1::ResultGroup& g : resp->groups())
      groups.push_back({g.model_key(), g.workload(), g.load_point(), g.ok_results(),
                        g.first_sweep(), g.last_sweep()});
    return AskForGroup(absl::StrCat("best ", args.metric, " for ", scope), groups);
  }
  if (!resp->found()) {
    if (args.format == "json") {
      std::printf("null\n");
    } else {
      std::printf("# no OK result for %s with %s\n", scope.c_str(), args.metric.c_str());
    }
    return 1;
  }
  absl::StatusOr<Row> row = ParseRow(resp->row());
  if (!row.ok()) return Fail(row.status());
  if (args.format == "json") {
    std::printf("%s\n", RowJson(*row).dump(1).c_str());
    return 0;
  }
  const v1::ResultGroup& group = resp->groups(0);
  std::printf("# best %s for %s\n", args.metric.c_str(), scope.c_str());
  std::printf("# ranked within: model %s, workload %s (%lld OK results, sweeps %lld-%lld)\n",
              Unknown(group.model_key()).c_str(), Unknown(group.workload()).c_str(),
              static_cast<long long>(group.ok_results()),
              static_cast<long long>(group.first_sweep()),
              static_cast<long long>(group.last_sweep()));
  if (serving) {
    PrintServingFigures(*row, group.load_point());
  } else {
    PrintFigures(*row, args.batch);
  }
  std::printf("%s\n", BackendConfigString(row->result.config).c_str());
  return 0;
}

struct CompareArgs {
  std::string coordinator = DefaultCoordinator();
  std::string model;
  std::vector<std::string> configs;
  std::vector<std::string> sm_archs;
  int batch = 1;
  IdentityArgs identity;
};

// The OK results with figures at `batch` matching a partial config on one arch, grouped by
// (model identity, workload).
using GroupKey = std::pair<std::string, std::string>;
absl::StatusOr<std::map<GroupKey, std::vector<Row>>> MatchingByGroup(ServiceClient& client,
                                                                     const std::string& model,
                                                                     const BackendConfig& config,
                                                                     int sm, int batch,
                                                                     const IdentityArgs& identity) {
  v1::QueryResultsRequest req;
  req.set_model(model);
  req.set_sm(sm);
  req.set_status("OK");
  req.set_limit(rpc::kMaxQueryRows);
  req.set_with_kernels(true);  // compare says what each side ran
  ApplyIdentity(identity, &req);
  for (const auto& [axis, value] : config) (*req.mutable_axis_values())[axis] = value;
  absl::StatusOr<v1::QueryResultsResponse> resp = client.QueryResults(req);
  if (!resp.ok()) return resp.status();
  std::map<GroupKey, std::vector<Row>> out;
  for (const v1::ResultRow& r : resp->rows()) {
    absl::StatusOr<Row> row = ParseRow(r);
    if (!row.ok()) return row.status();
    if (FindBatch(row->result, batch) == nullptr) continue;
    out[{row->model_key, row->workload}].push_back(*std::move(row));
  }
  return out;
}

std::optional<Row> Fastest(const std::vector<Row>& rows, int batch) {
  std::optional<Row> best;
  double best_tok_s = -1;
  for (const Row& row : rows) {
    const BatchFigures* b = FindBatch(row.result, batch);
    if (b != nullptr && b->output_tok_s.median > best_tok_s) {
      best_tok_s = b->output_tok_s.median;
      best = row;
    }
  }
  return best;
}

int RunCompare(const CompareArgs& args) {
  if (args.model.empty()) return Usage("--model is required");
  if (absl::Status s = CheckBatchFlag(args.batch); !s.ok()) return Fail(s);
  IdentityArgs identity = args.identity;
  if (absl::Status s = CheckIdentityArgs(&identity); !s.ok()) return Fail(s);
  std::vector<std::pair<std::string, int>> sides;  // config text, sm
  std::vector<int> sms;
  for (const std::string& a : args.sm_archs) {
    absl::StatusOr<int> sm = ParseSmArch(a);
    if (!sm.ok()) return Fail(absl::InvalidArgumentError(absl::StrCat("--sm-arch: ", sm.status().message())));
    sms.push_back(*sm);
  }
  if (args.configs.size() == 2 && sms.size() == 1) {
    sides = {{args.configs[0], sms[0]}, {args.configs[1], sms[0]}};
  } else if (args.configs.size() == 1 && sms.size() == 2) {
    sides = {{args.configs[0], sms[0]}, {args.configs[0], sms[1]}};
  } else {
    return Usage(
        "compare takes two --config on one --sm-arch, or one --config on two --sm-arch");
  }
  absl::StatusOr<std::string> user_token = UserToken();
  if (!user_token.ok()) return Fail(user_token.status());
  ServiceClient client(args.coordinator, 30'000, *user_token, ClientTls());
  std::vector<std::map<GroupKey, std::vector<Row>>> by_side;
  for (const auto& [text, sm] : sides) {
    absl::StatusOr<BackendConfig> config = ParseBackendConfig(text);
    if (!config.ok())
      return Fail(absl::InvalidArgumentError(absl::StrCat("--config '", text, "': ", config.status().message())));
    auto rows = MatchingByGroup(client, args.model, *config, sm, args.batch, identity);
    if (!rows.ok()) return Fail(rows.status());
    by_side.push_back(*std::move(rows));
  }
  // The two sides are compared within one (model identity, workload) both measured.
  std::vector<GroupKey> common;
  for (const auto& [key, rows] : by_side[0])
    if (by_side[1].count(key)) common.push_back(key);
  auto side_text = [&](size_t i) {
    return absl::StrCat(sides[i].first, " on ", SmArchLabel(sides[i].second));
  };
  auto groups_of = [&](const std::vector<GroupKey>& keys) {
    std::vector<Group> out;
    for (const GroupKey& k : keys) {
      Group g{k.first, k.second, "", 0, 0, 0};
      for (const auto& side : by_side) {
        auto it = side.find(k);
        if (it == side.end()) continue;
        for (const Row& r : it->second) {
          ++g.ok_results;
          g.first_sweep = g.first_sweep == 0 ? r.sweep_id : std::min(g.first_sweep, r.sweep_id);
          g.last_sweep = std::max(g.last_sweep, r.sweep_id);
        }
      }
      out.push_back(g);
    }
    return out;
  };
  if (common.size() > 1)
    return AskForGroup(absl::StrCat("compare of ", args.model, " at batch ", args.batch),
                       groups_of(common));
  std::vector<std::optional<Row>> found(2);
  if (common.size() == 1) {
    for (size_t i = 0; i < 2; ++i) found[i] = Fastest(by_side[i][common[0]], args.batch);
  } else if (!by_side[0].empty() && !by_side[1].empty()) {
    std::fprintf(stderr,
                 "error: A (%s) and B (%s) have OK results at batch %d, but never of the same "
                 "(model identity, workload); they measured different things:\n",
                 side_text(0).c_str(), side_text(1).c_str(), args.batch);
    for (size_t i = 0; i < 2; ++i)
      for (const auto& [key, rows] : by_side[i])
        std::fprintf(stderr, "  %c: %s | %s (%zu results)\n", static_cast<char>('A' + i),
                     Unknown(key.first).c_str(), Unknown(key.second).c_str(), rows.size());
    return 1;
  } else {
    for (size_t i = 0; i < 2; ++i)
      if (by_side[i].size() == 1) found[i] = Fastest(by_side[i].begin()->second, args.batch);
  }
  std::printf("# infersweep compare: %s, batch %d; each side is its fastest OK result (output "
              "tok/s)\n",
              args.model.c_str(), args.batch);
  if (common.size() == 1)
    std::printf("# within: model %s, workload %s\n", Unknown(common[0].first).c_str(),
                Unknown(common[0].second).c_str());
  for (size_t i = 0; i < sides.size(); ++i)
    std::printf("# %c: %s%s\n", static_cast<char>('A' + i), side_text(i).c_str(),
                found[i] ? "" : "  -- no OK result");
  auto cell = [&](size_t i, auto get) -> std::string {
    if (!found[i]) return "-";
    const BatchFigures* b = FindBatch(found[i]->result, args.batch);
    if (b == nullptr) return "-";
    return absl::StrFormat("%.4g", get(found[i]->result, *b));
  };
  auto value = [&](size_t i, auto get) -> std::optional<double> {
    if (!found[i]) return std::nullopt;
    const BatchFigures* b = FindBatch(found[i]->result, args.batch);
    if (b == nullptr) return std::nullopt;
    return get(found[i]->result, *b);
  };
  std::printf("#%-26s %-40s %-40s %8s\n", " metric", " A", " B", "B/A");
  auto text_row = [&](const char* name, auto get) {
    std::printf(" %-26s %-40s %-40s %8s\n", name, found[0] ? get(*found[0]).c_str() : "-",
                found[1] ? get(*found[1]).c_str() : "-", "");
  };
  text_row("config", [](const Row& r) { return BackendConfigString(r.result.config); });
  text_row("gpu", [](const Row& r) { return DeviceText(r.gpu_name, r.sm); });
  text_row("agent", [](const Row& r) { return r.agent_id; });
  text_row("trial", [](const Row& r) { return absl::StrCat(r.result.trial_id, " (sweep ", r.sweep_id, ")"); });
  auto num_row = [&](const char* name, auto get) {
    const auto a = value(0, get), b = value(1, get);
    const std::string ratio = a && b && *a != 0 ? absl::StrFormat("%.3g", *b / *a) : "-";
    std::printf(" %-26s %-40s %-40s %8s\n", name, cell(0, get).c_str(), cell(1, get).c_str(),
                ratio.c_str());
  };
  num_row("ttft (ms)", [](const TrialResult&, const BatchFigures& b) { return b.ttft_ms.median; });
  num_row("tpot (ms)", [](const TrialResult&, const BatchFigures& b) { return b.tpot_ms.median; });
  num_row("output (tok/s)",
          [](const TrialResult&, const BatchFigures& b) { return b.output_tok_s.median; });
  num_row("output per seq (tok/s)",
          [](const TrialResult&, const BatchFigures& b) { return b.output_tok_s_per_seq.median; });
  num_row("prefill (tok/s)",
          [](const TrialResult&, const BatchFigures& b) { return b.prefill_tok_s.median; });
  num_row("itl p99 (ms)", [](const TrialResult&, const BatchFigures& b) { return b.itl_ms.p99; });
  num_row("peak memory (MiB)", [](const TrialResult& r, const BatchFigures&) {
    return static_cast<double>(r.peak_memory_bytes) / (1024.0 * 1024.0);
  });
  num_row("top1 agreement (%)",
          [](const TrialResult& r, const BatchFigures&) { return 100 * r.verdict.top1_agreement; });
  num_row("kl mean (nats)", [](const TrialResult& r, const BatchFigures&) { return r.verdict.kl_mean; });
  // What each side launched: a config string names axis values, not the kernels that ran (a
  // fused path can hand rows to a library, a graph can be skipped).
  if (found[0] && found[1]) {
    const BatchFigures* a = FindBatch(found[0]->result, args.batch);
    const BatchFigures* b = FindBatch(found[1]->result, args.batch);
    const bool same_config = BackendConfigString(found[0]->result.config) ==
                             BackendConfigString(found[1]->result.config);
    if (a != nullptr && b != nullptr) {
      if (!a->decode_kernels || !b->decode_kernels) {
        std::printf("# kernels: not compared (%s recorded no launch log)\n",
                    !a->decode_kernels ? "A" : "B");
      } else if (const std::vector<std::string> diff = KernelDifferences(*a, *b); diff.empty()) {
        std::printf("# kernels: A and B ran the same kernels\n");
      } else {
        std::printf("# kernels: %s\n",
                    same_config ? "A and B have the same config string but ran different kernels"
                                : "A and B ran different kernels");
        for (const std::string& line : diff) std::printf("#   %s\n", line.c_str());
      }
    }
  }
  return found[0] && found[1] ? 0 : 1;
}

// ------------------------------------------------------------------------------ agents

int RunAgents(const std::string& coordinator) {
  absl::StatusOr<std::string> user_token = UserToken();
  if (!user_token.ok()) return Fail(user_token.status());
  ServiceClient client(coordinator, 30'000, *user_token, ClientTls());
  absl::StatusOr<v1::ListAgentsResponse> resp = client.ListAgents();
  if (!resp.ok()) return Fail(resp.status());
  std::printf("# infersweep agents at %s\n", coordinator.c_str());
  std::printf("#%-20s %-16s %-10s %7s %-40s %-19s %s\n", " agent", " host", " state", "free",
              " devices", " last seen", "running");
  std::printf("#%-20s %-16s %-10s %7s %-40s %-19s %s\n", "", "", "", "(slots)", " (name sm memory)",
              " (local time)", "(trials)");
  for (const v1::AgentInfo& a : resp->agents()) {
    std::string devices;
    if (a.gpus_size() == 0) {
      devices = "cpu";
    } else {
      std::vector<std::string> parts;
      for (const v1::Gpu& g : a.gpus())
        parts.push_back(
            absl::StrCat(g.name(), " ", SmArchLabel(g.sm()), " ", FormatBytes(g.memory_bytes())));
      devices = absl::StrJoin(parts, "; ");
    }
    const std::string free =
        a.connected() ? absl::StrCat(a.free_slots(), "/", a.slots()) : std::string("-");
    std::printf(" %-20s %-16s %-10s %7s %-40s %-19s %s\n", a.agent_id().c_str(), a.host().c_str(),
                a.connected() ? "connected" : "away", free.c_str(), devices.c_str(),
                FormatUnixMs(a.last_seen_unix_ms()).c_str(),
                a.running_trial_ids().empty() ? "-"
                                              : absl::StrJoin(a.running_trial_ids(), ",").c_str());
  }
  if (resp->agents().empty()) std::printf("# no agents have connected yet\n");
  return 0;
}

// --metrics-listen HOST:PORT, or an empty value (--metrics-listen= or --metrics-listen "") for no
// endpoint. The option takes 0 or 1 values so that CLI11 reads "--metrics-listen=" as empty
// rather than as a missing value that takes the next word; no capture_default_str, which would
// turn an empty value back into the default: the default is in the help text instead.
void AddMetricsListenOption(CLI::App* cmd, std::string* listen) {
  cmd->add_option("--metrics-listen", *listen,
                  absl::StrCat("host:port of the Prometheus /metrics endpoint "
                               "(docs/OBSERVABILITY.md; default ", *listen,
                               "); empty (--metrics-listen=) for none"))
      ->expected(0, 1);
}

}  // namespace

void AddServiceCommands(CLI::App& app) {
  {
    static CoordinatorArgs args;
    CLI::App* cmd = app.add_subcommand("coordinator", "run the coordinator (gRPC service + SQLite)");
    cmd->add_option("--listen", args.listen, "host:port to bind")->capture_default_str();
    cmd->add_option("--db", args.db, "SQLite database file")->capture_default_str();
    cmd->add_flag("--db-group-read", args.db_group_read,
                  "create the database 0640 instead of 0600, for a group reader such as Grafana's "
                  "SQLite data source (whatever the umask)");
    cmd->add_option("--lease-s", args.lease_s, "trial lease without a heartbeat, seconds")
        ->capture_default_str();
    cmd->add_option("--max-trials", args.max_trials, "cap on the trials of one sweep")
        ->capture_default_str();
    cmd->add_option("--max-attempts", args.max_attempts,
                    "leases a trial may lose (expired, agent restarted) before it is stored as "
                    "ERROR; 0: no cap")
        ->capture_default_str();
    cmd->add_option("--db-busy-timeout-ms", args.db_busy_timeout_ms,
                    "how long a database write waits for another connection's lock")
        ->capture_default_str();
    cmd->add_option("--agent-rate", args.agent_rate,
                    "messages per second per agent id (0: no limit)")
        ->capture_default_str();
    cmd->add_option("--agent-burst", args.agent_burst, "burst of --agent-rate")
        ->capture_default_str();
    cmd->add_option("--user-rate", args.user_rate,
                    "user-API calls per second per client address (0: no limit)")
        ->capture_default_str();
    cmd->add_option("--user-burst", args.user_burst, "burst of --user-rate")->capture_default_str();
    cmd->add_option("--connect-rate", args.connect_rate,
                    "agent streams opened per second per client address (0: no limit)")
        ->capture_default_str();
    cmd->add_option("--connect-burst", args.connect_burst, "burst of --connect-rate")
        ->capture_default_str();
    cmd->add_option("--auth-token-env", args.auth_token_env,
                    "environment variable holding the token agents must present (or "
                    "--agent-token-file)");
    cmd->add_option("--agent-token-file", args.agent_token_file,
                    "file holding the token every agent must present (shared: it does not bind "
                    "agent ids; docs/SECURITY.md)");
    cmd->add_option("--agent-tokens-file", args.agent_tokens_file,
                    "file of 'AGENT_ID TOKEN' lines: each agent's own token, binding its id "
                    "(instead of --agent-token-file)");
    cmd->add_option("--agent-cert-binding", args.agent_cert_binding,
                    "with mutual TLS, an agent's client certificate must name its agent id (CN or "
                    "DNS name): on or off")
        ->check(CLI::IsMember({"on", "off"}))
        ->capture_default_str();
    cmd->add_option("--user-token-file", args.user_token_file,
                    "file holding the bearer token every user-API call must carry");
    cmd->add_option("--tls-cert", args.tls_cert,
                    "PEM certificate (chain) to serve TLS with; needs --tls-key");
    cmd->add_option("--tls-key", args.tls_key, "PEM private key of --tls-cert");
    cmd->add_option("--tls-client-ca", args.tls_client_ca,
                    "PEM CA whose client certificates are required (mutual TLS)");
    AddMetricsListenOption(cmd, &args.metrics_listen);
    cmd->callback([] { std::exit(RunCoordinator(args)); });
  }
  {
    static AgentArgs args;
    CLI::App* cmd = app.add_subcommand("agent", "run an agent: execute trials for a coordinator");
    cmd->add_option("--coordinator", args.coordinator, "coordinator host:port")
        ->capture_default_str();
    cmd->add_option("--id", args.id, "agent id (default: host name)");
    cmd->add_option("--spool", args.spool,
                    "SQLite spool of unacknowledged results (default: infersweep-spool-<id>.db)");
    cmd->add_option("--test-fake-gpu", args.fake_gpus,
                    "TEST ONLY: advertise a GPU label \"NAME:SM:MEMORY_GIB\" (repeatable); trials "
                    "still run on the CPU");
    cmd->add_option("--max-backoff-ms", args.max_backoff_ms,
                    "cap of the reconnect and resend backoff")
        ->capture_default_str();
    cmd->add_option("--results-log", args.results_log,
                    "append every finished result to this file, one JSON line each");
    cmd->add_option("--test-inject-fault", args.test_inject_fault,
                    "TEST ONLY: inject a fault into every trial (hang, delay:S, segv, ...; "
                    "docs/VERDICTS.md)");
    cmd->add_option("--auth-token-env", args.auth_token_env,
                    "environment variable holding the coordinator's agent token");
    cmd->add_option("--token-file", args.token_file, "file holding the coordinator's agent token");
    cmd->add_option("--tls-ca", args.tls_ca,
                    "PEM CA that verifies the coordinator's certificate (turns TLS on)");
    cmd->add_option("--tls-cert", args.tls_cert,
                    "PEM client certificate, for a coordinator that requires mutual TLS");
    cmd->add_option("--tls-key", args.tls_key, "PEM private key of --tls-cert");
    AddMetricsListenOption(cmd, &args.metrics_listen);
    cmd->callback([] { std::exit(RunAgent(args)); });
  }
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
    cmd->callback([] { std::exit(RunSubmit(coordinator, path, wait, wait_retry_s)); });
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
    cmd->callback([] { std::exit(RunStatus(coordinator, sweep, once)); });
  }
  {
    static std::string coordinator = DefaultCoordinator();
    static int64_t sweep = 0;
    CLI::App* cmd = app.add_subcommand("cancel", "cancel a sweep's remaining trials");
    cmd->add_option("sweep_id", sweep, "sweep id")->required();
    cmd->add_option("--coordinator", coordinator, "coordinator host:port")->capture_default_str();
    AddUserClientFlags(cmd);
    cmd->callback([] { std::exit(RunCancel(coordinator, sweep)); });
  }
  {
    static ResultsArgs args;
    CLI::App* cmd = app.add_subcommand("results", "query stored results");
    cmd->add_option("--coordinator", args.coordinator, "coordinator host:port")->capture_default_str();
    AddUserClientFlags(cmd);
    AddIdentityFlags(cmd, &args.identity);
    cmd->add_option("--sm-arch", args.sm_arch,
                    "SM architecture: sm_90, 90, sm_90a, or cpu (CPU results)");
    cmd->add_option("--gpu", args.gpu, "GPU name, exactly as the agent reports it");
    cmd->add_option("--model", args.model, "model (checkpoint folder or preset:NAME)");
    cmd->add_option("--axis", args.axes, "axis=value the config must have (repeatable)");
    cmd->add_option("--status", args.status, "OK, INCORRECT, CRASHED, UNSUPPORTED, TIMEOUT, ERROR");
    cmd->add_option("--since", args.since, "finished at or after: 24h (ago), 2025-01-31, RFC 3339");
    cmd->add_option("--until", args.until, "finished before (same forms as --since)");
    cmd->add_option("--limit", args.limit,
                    absl::StrCat("at most this many results, newest first: 1 to ",
                                 rpc::kMaxQueryRows, " (the coordinator's cap)"))
        ->capture_default_str();
    cmd->add_option("--format", args.format, "table, csv or json")->capture_default_str();
    cmd->add_flag("--show-kernels", args.show_kernels,
                  "table: under each result, the kernels each phase launched at each batch, "
                  "graph replays and fallbacks (docs/RESULTS.md; the JSON always has them)");
    cmd->callback([] { std::exit(RunResults(args)); });
  }
  {
    static BestArgs args;
    CLI::App* cmd = app.add_subcommand(
        "best",
        "the fastest OK config for a model on an arch, within one model identity and "
        "workload");
    cmd->add_option("--coordinator", args.coordinator, "coordinator host:port")
        ->capture_default_str();
    AddUserClientFlags(cmd);
    cmd->add_option("--model", args.model, "model (default with --sweep: the sweep's)");
    cmd->add_option("--sm-arch", args.sm_arch,
                    "SM architecture: sm_90, 90, sm_90a, or cpu (CPU results)")
        ->required();
    cmd->add_option("--metric", args.metric,
                    "lockstep batches: output_tok_s, ttft_ms, tpot_ms or prefill_tok_s; serving "
                    "load points: goodput, output_tok_s, output_tok_s_per_user, p99_ttft_ms or "
                    "p99_tpot_ms")
        ->capture_default_str();
    cmd->add_option("--batch", args.batch,
                    absl::StrCat("lockstep batch size the metric is read at, 1 to ", kMaxBatchSize))
        ->capture_default_str();
    cmd->add_flag("--serving", args.serving,
                  "rank serving load points, never lockstep batches (implied by --load-point "
                  "and by a metric only serving points have)");
    cmd->add_option("--load-point", args.load_point,
                    "the serving load point: concurrency=4, rate=2 or rate=2,max_concurrency=8");
    AddIdentityFlags(cmd, &args.identity);
    cmd->add_option("--format", args.format, "table or json")->capture_default_str();
    cmd->callback([] { std::exit(RunBest(args)); });
  }
  {
    static CompareArgs args;
    CLI::App* cmd = app.add_subcommand(
        "compare", "two configs on one arch, or one config on two archs, side by side");
    cmd->add_option("--coordinator", args.coordinator, "coordinator host:port")->capture_default_str();
    AddUserClientFlags(cmd);
    cmd->add_option("--model", args.model, "model")->required();
    cmd->add_option("--config", args.configs, "axis=value,... (partial configs match any value of "
                                              "the axes they leave out)");
    cmd->add_option("--sm-arch", args.sm_archs,
                    "SM architecture(s): sm_90, 90, sm_90a, or cpu (CPU results)");
    cmd->add_option("--batch", args.batch, absl::StrCat("batch size, 1 to ", kMaxBatchSize))
        ->capture_default_str();
    AddIdentityFlags(cmd, &args.identity);
    cmd->callback([] { std::exit(RunCompare(args)); });
  }
  {
    static std::string coordinator = DefaultCoordinator();
    CLI::App* cmd = app.add_subcommand("agents", "agents known to the coordinator");
    cmd->add_option("--coordinator", coordinator, "coordinator host:port")->capture_default_str();
    AddUserClientFlags(cmd);
    cmd->callback([] { std::exit(RunAgents(coordinator)); });
  }
}

}  // namespace infersweep::cli
