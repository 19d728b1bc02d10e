// The coordinator: a gRPC server (docs/PROTOCOL.md) with two services on one port.
//
//  - AgentService.Connect: one bidirectional stream per agent. The coordinator assigns queued
//    trials to free slots of connected agents, renews leases on heartbeats, and stores results.
//  - SweepService: the user API (submit, status, cancel, agents, results, best).
//
// Durable state is the SQLite Store; what lives only in memory is which agent is connected now,
// its slots, and which trials it holds (rebuilt from the store and the agents' Hellos after a
// restart). docs/SERVICE.md describes the operation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/rate_limit.h"
#include "proto/rpc.h"
#include "storage/store.h"

namespace infersweep {

struct CoordinatorOptions {
  // A lease lasts this long without a heartbeat; then the trial goes back to the queue.
  int64_t lease_ms = 60'000;
  // How often agents send heartbeats; 0 = lease_ms / 4, clamped to [50 ms, 15 s].
  int64_t heartbeat_interval_ms = 0;
  // Scheduler period (it also runs on events: submit, hello, result, disconnect).
  int64_t tick_ms = 100;
  // How long a reconnecting agent has to deliver the result of a trial it held but no longer
  // runs (its spool replays right after Hello) before its lease is released (requeued, or ERROR
  // at the attempt cap);
  // 0 = 3 heartbeat intervals, at least 1 s.
  int64_t lost_trial_grace_ms = 0;
  // A trial whose lease is lost (expired, or its agent came back without it) is queued again
  // until it has had this many attempts; then it is stored as ERROR "lease lost N times".
  // <= 0: no cap (docs/RELIABILITY.md).
  int max_attempts = 3;
  size_t max_trials_per_sweep = 10000;
  // How long a database write waits for another connection's lock before it fails as
  // UNAVAILABLE (the agent keeps the result spooled and sends it again).
  int db_busy_timeout_ms = 5000;
  // The mode a new database file gets, whatever the umask: 0600, or 0640 with a group reader.
  unsigned db_file_mode = 0600;
  // Request-rate limits (docs/SECURITY.md "Limits"); rate 0 disables one. Over the limit, a
  // user-API call or a stream open fails with RESOURCE_EXHAUSTED, and an agent message is
  // dropped (a Result is answered with a retryable Error, so it stays in the agent's spool).
  RateLimit agent_message_limit{50, 500};  // per agent id: every message after Hello
  RateLimit user_call_limit{20, 100};      // per peer address: every SweepService call
  RateLimit connect_limit{5, 50};          // per peer address: AgentService.Connect streams
  // Authentication (docs/SERVICE.md "Authentication"); empty disables that kind. When
  // agent_token is set, every agent's Hello must carry it in hello.auth_token; when user_token is
  // set, every SweepService call must carry the metadata "authorization: Bearer <user_token>".
  // Both are compared in constant time and never logged; they must differ when both are set.
  std::string agent_token;
  std::string user_token;
  // Per-agent tokens instead of agent_token: agent id -> its token. A Hello's token must be the
  // one of the agent id it names (docs/SECURITY.md "Agent identity").
  std::map<std::string, std::string> agent_tokens;
  // With mutual TLS, an agent's client certificate must name its agent id (CN or DNS name).
  bool bind_agent_to_certificate = true;
  // TLS on the gRPC port (docs/SERVICE.md "TLS"): tls.cert_file + tls.key_file serve TLS;
  // tls.client_ca_file also requires client certificates from that CA (mutual TLS). Empty:
  // plaintext.
  rpc::TlsOptions tls;
  // Where to serve Prometheus /metrics (coordinator/metrics.h), e.g. "127.0.0.1:9464"; port 0
  // picks a free one; empty serves none (the metrics are still kept).
  std::string metrics_listen;
  // Cardinality cap of the per-config metric families (docs/OBSERVABILITY.md).
  size_t metrics_max_config_series = 5000;
  // Log sink, given each line's text; default: stderr, as LogLine("coordinator", text)
  // (proto/log_line.h: an RFC 3339 UTC timestamp, then "[coordinator]").
  std::function<void(const std::string&)> log;
};

struct CoordinatorStats {
  int64_t agents_connected = 0;
  int64_t assignments = 0;        // Assignment messages sent
  int64_t results_stored = 0;     // agent results stored (or already stored: replays)
  int64_t unsupported = 0;        // UNSUPPORTED results made by preflight
  int64_t lost = 0;               // leases released because their agent came back without them
  int64_t bad_messages = 0;       // rejected agent messages (Error sent)
  int64_t streams_rejected = 0;   // streams closed for a protocol violation (or bad auth)
  int64_t auth_failures = 0;      // agent streams and user calls refused as UNAUTHENTICATED
  int64_t rate_limited = 0;       // calls, streams and agent messages refused by a rate limit
  int64_t requeued = 0;           // lost leases whose trial went back to the queue
  int64_t attempts_exhausted = 0;  // lost leases that ended their trial as ERROR (attempt cap)
  int64_t store_errors = 0;        // results the store could not take now (busy, full): retried
  int64_t identity_refused = 0;    // agent streams whose credentials do not prove their agent id,
                                   // or that claim a connected agent's id with another credential
  int64_t results_conflicting = 0;  // results refused: their attempt is stored with other content
};

class CoordinatorServer {
 public:
  explicit CoordinatorServer(CoordinatorOptions options = {});
  ~CoordinatorServer();  // Stop()s
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  // Opens the database, binds `address` ("127.0.0.1:0" picks a free port) and starts serving.
  // Returns the bound port.
  absl::StatusOr<int> Start(const std::string& address, const std::string& db_path);
  // Closes every agent stream, stops the scheduler and the server. Idempotent.
  void Stop();
  // Blocks until Stop() is called from another thread.
  void Wait();

  // How agent ids are bound to credentials, in words (docs/SECURITY.md "Agent identity");
  // valid after Start.
  std::string agent_identity();
  // The store, for tests and in-process tools; valid between Start and destruction.
  Store* store();
  // The port /metrics is served on; 0 when options.metrics_listen is empty or before Start.
  int metrics_port();
  // The metrics' text exposition (what /metrics serves), for tests and in-process tools.
  std::string MetricsText();
  CoordinatorStats stats();

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace infersweep
