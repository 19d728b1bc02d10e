// The service's daemons (docs/SERVICE.md): `coordinator` runs the gRPC service over its SQLite
// database, `agent` runs trials for a coordinator. Each runs until SIGINT or SIGTERM.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/agent.h"
#include "agent/inventory.h"
#include "api/status_macros.h"
#include "cli/client_flags.h"
#include "cli/commands.h"
#include "cli/output.h"
#include "coordinator/agent_identity.h"
#include "coordinator/metrics.h"
#include "coordinator/server.h"
#include "proto/log_line.h"
#include "proto/rpc.h"

namespace infersweep::cli {
namespace {

// SIGINT and SIGTERM, the signals that stop a daemon.
sigset_t StopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

// Blocks the stop signals in this thread (and every thread it starts later), so that
// WaitForSignal() can take them synchronously.
void BlockStopSignals() {
  const sigset_t set = StopSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

// Waits for SIGINT or SIGTERM (blocked by BlockStopSignals); returns which.
int WaitForSignal() {
  const sigset_t set = StopSignals();
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

// The agent token a daemon takes from --auth-token-env (the variable holding it) or from a file
// (`file_flag`, alternatives); "" where neither is given.
absl::StatusOr<std::string> AgentToken(const std::string& env, const char* file_flag,
                                       const std::string& file) {
  if (!env.empty()) {
    const char* token = std::getenv(env.c_str());
    if (token == nullptr || *token == '\0')
      return absl::InvalidArgumentError(
          absl::StrCat("--auth-token-env ", env, ": variable is empty"));
    if (file.empty()) return std::string(token);
    return absl::InvalidArgumentError(
        absl::StrCat(file_flag, " and --auth-token-env are alternatives; give one"));
  }
  if (!file.empty()) return rpc::ReadTokenFile(file);
  return std::string();
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

absl::StatusOr<int> RunCoordinator(const CoordinatorArgs& args) {
  if (args.lease_s < 1 || args.lease_s > 86400)
    return absl::InvalidArgumentError("--lease-s must be in [1, 86400]");
  if (args.max_attempts < 0)
    return absl::InvalidArgumentError("--max-attempts must be >= 0 (0: no cap)");
  if (args.db_busy_timeout_ms < 0)
    return absl::InvalidArgumentError("--db-busy-timeout-ms must be >= 0");
  for (double v : {args.agent_rate, args.agent_burst, args.user_rate, args.user_burst,
                   args.connect_rate, args.connect_burst})
    if (v < 0)
      return absl::InvalidArgumentError("rate limits and bursts must be >= 0 (rate 0: no limit)");
  const std::filesystem::path db(args.db);
  if (db.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(db.parent_path(), ec);
    if (ec)
      return absl::UnavailableError(
          absl::StrCat("cannot create ", db.parent_path().string(), ": ", ec.message()));
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
  ASSIGN_OR_RETURN(options.agent_token,
                   AgentToken(args.auth_token_env, "--agent-token-file", args.agent_token_file));
  if (!args.agent_tokens_file.empty()) {
    if (!options.agent_token.empty())
      return absl::InvalidArgumentError(
          "--agent-tokens-file and a shared agent token (--agent-token-file, --auth-token-env) "
          "are alternatives; give one");
    ASSIGN_OR_RETURN(options.agent_tokens, ReadAgentTokensFile(args.agent_tokens_file));
  }
  options.bind_agent_to_certificate = args.agent_cert_binding == "on";
  if (!args.user_token_file.empty()) {
    ASSIGN_OR_RETURN(options.user_token, rpc::ReadTokenFile(args.user_token_file));
  }
  options.tls.cert_file = args.tls_cert;
  options.tls.key_file = args.tls_key;
  options.tls.client_ca_file = args.tls_client_ca;
  // A write over a file size limit fails (EFBIG, reported as a full disk) instead of killing
  // the process.
  signal(SIGXFSZ, SIG_IGN);
  BlockStopSignals();
  CoordinatorServer server(options);
  ASSIGN_OR_RETURN(const int port, server.Start(args.listen, args.db));
  std::printf("# infersweep coordinator on %s (port %d), database %s, lease %.0f s\n",
              args.listen.c_str(), port, args.db.c_str(), args.lease_s);
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
    transport =
        options.tls.client_ca_file.empty() ? "TLS" : "mutual TLS (client certificates required)";
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

absl::StatusOr<int> RunAgent(const AgentArgs& args) {
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
  ASSIGN_OR_RETURN(options.auth_token,
                   AgentToken(args.auth_token_env, "--token-file", args.token_file));
  if (!options.spool_path.empty()) {
    const std::filesystem::path p(options.spool_path);
    std::error_code ec;
    if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  }
  signal(SIGXFSZ, SIG_IGN);  // a spool write over a file size limit fails instead of killing us
  BlockStopSignals();
  Agent agent(options);
  RETURN_IF_ERROR(agent.Start());
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

// --metrics-listen HOST:PORT, or an empty value (--metrics-listen= or --metrics-listen "") for no
// endpoint. The option takes 0 or 1 values so that CLI11 reads "--metrics-listen=" as empty
// rather than as a missing value that takes the next word; no capture_default_str, which would
// turn an empty value back into the default: the default is in the help text instead.
void AddMetricsListenOption(CLI::App* cmd, std::string* listen) {
  cmd->add_option("--metrics-listen", *listen,
                  absl::StrCat("host:port of the Prometheus /metrics endpoint "
                               "(docs/OBSERVABILITY.md; default ",
                               *listen, "); empty (--metrics-listen=) for none"))
      ->expected(0, 1);
}

}  // namespace

void AddDaemonCommands(CLI::App& app) {
  {
    static CoordinatorArgs args;
    CLI::App* cmd =
        app.add_subcommand("coordinator", "run the coordinator (gRPC service + SQLite)");
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
    cmd->callback([] { std::exit(ExitCode(RunCoordinator(args))); });
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
    cmd->callback([] { std::exit(ExitCode(RunAgent(args))); });
  }
}

}  // namespace infersweep::cli
