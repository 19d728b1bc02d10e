// The agent: runs on a GPU host, holds one stream to the coordinator, runs the trials it is
// assigned (one per slot at a time, each in an isolated worker process through TrialRunner), and
// streams progress and results back. Results go to the local spool before they are sent and
// leave it only when the coordinator acks them; every (re)connect replays the spool.
//
// A slot is one GPU, or the single CPU slot of a CPU-only agent (index 0, sm 0). A trial's
// worker (or its rank processes) sees its slots' GPUs alone, through CUDA_VISIBLE_DEVICES.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "agent/inventory.h"
#include "agent/metrics.h"
#include "agent/spool.h"
#include "api/trial.h"
#include "proto/infersweep.pb.h"
#include "proto/rpc.h"

namespace infersweep {

struct AgentOptions {
  std::string coordinator = "127.0.0.1:7070";  // host:port
  std::string agent_id;                        // default: the host name
  std::string spool_path;                      // default: "infersweep-spool-<agent_id>.db"
  // The coordinator's agent token (docs/SERVICE.md "Authentication"), sent in Hello.auth_token;
  // empty sends none.
  std::string auth_token;
  // TLS to the coordinator (docs/SERVICE.md "TLS"): tls.ca_file verifies the coordinator;
  // tls.cert_file + tls.key_file are the agent's certificate for mutual TLS. Empty: plaintext.
  rpc::TlsOptions tls;
  // TEST ONLY: "NAME:SM:MEMORY_GIB" labels that replace the detected GPUs (see inventory.h).
  // Trials with device=cpu still run on the CPU.
  std::vector<std::string> test_fake_gpus;
  // argv of the trial worker; default {"/proc/self/exe", "worker"} (the infersweep binary), which
  // is given "--probe-cache <spool folder>/infersweep-probe-<agent_id>.jsonl", the capability
  // probe's answers, which the agent reads too (harness/runner.h).
  std::vector<std::string> worker_argv;
  // TEST ONLY: a fault (engine/fault_injection.h, e.g. "hang", "sleep:2") injected into every
  // trial this agent runs. Empty in production.
  std::string test_inject_fault;
  // When set, every finished result is appended to this file as one JSON line (the TrialResult
  // exactly as sent) before it is spooled: a local record of what this agent produced.
  std::string results_log_path;
  // Reconnect backoff: doubles from the initial delay up to the cap; reset by a Welcome. The
  // same schedule spaces the resends of results the coordinator could not take for a transient
  // reason (Error.permanent false: database busy or full, rate limit); reset by an Ack.
  int initial_backoff_ms = 200;
  int max_backoff_ms = 5000;
  // Where to serve Prometheus /metrics (agent/metrics.h), e.g. "127.0.0.1:9465"; port 0 picks a
  // free one; empty serves none.
  std::string metrics_listen;
  // Log sink, given each line's text; default: stderr, as LogLine("agent <id>", text)
  // (proto/log_line.h: an RFC 3339 UTC timestamp, then "[agent <id>]").
  std::function<void(const std::string&)> log;
};

struct AgentStats {
  int64_t connects = 0;          // streams that got a Welcome
  int64_t assignments = 0;
  int64_t results_sent = 0;      // Result messages written, replays included
  int64_t acks = 0;
  int64_t errors_received = 0;   // Error messages from the coordinator
  int64_t retries = 0;           // results sent again after a transient Error
  int64_t spooled = 0;           // results in the spool now
};

class Agent {
 public:
  explicit Agent(AgentOptions options);
  ~Agent();  // Stop()s
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Opens the spool, detects the inventory and starts the connection and slot threads.
  absl::Status Start();
  // Closes the stream, lets running trials end (unreported) and joins every thread. Idempotent.
  void Stop();
  // Blocks until Stop() is called from another thread (or a signal handler's thread).
  void Wait();

  const std::string& agent_id() const { return options_.agent_id; }
  const Inventory& inventory() const { return inventory_; }
  AgentStats stats();
  bool connected() const { return connected_.load(); }
  // The port /metrics is served on; 0 when options.metrics_listen is empty or before Start.
  int metrics_port() const;

 private:
  struct Slot;
  struct Link;
  struct Job;

  void ConnectionLoop();
  // One stream, from Hello to its end. Returns true when it got a Welcome.
  bool RunStream(const std::shared_ptr<Link>& link);
  void SlotLoop(Slot* slot);
  std::vector<int> JobDevices(const Job& job) const;
  // Writes on the current stream once it is welcomed; false while disconnected.
  bool Send(const v1::AgentMessage& message);
  void HandleAssignment(const v1::Assignment& assignment);
  void HandleCancel(const std::string& trial_id);
  // Spools the result, then sends it.
  void Finish(const Job& job, TrialResult result);
  // Sends the spooled results again: all of them, or only those in `only` when it is given.
  void SendSpooled(const std::set<std::pair<std::string, int>>* only = nullptr);
  // After an Error: a transient one about a result schedules a resend of it after a backoff.
  void OnError(const v1::Error& error);
  // Appends a finished result to options_.results_log_path.
  void AppendResultsLog(const std::string& result_json);
  void Log(const std::string& line);
  // Sets the spool depth gauge from the spool (when metrics are served).
  void UpdateSpoolMetric();
  // Under mu_: what runs or waits on the slots, and how many slots are idle.
  std::vector<v1::RunningTrial> RunningLocked() const;
  int FreeSlotsLocked() const;

  AgentOptions options_;
  Inventory inventory_;
  std::unique_ptr<Spool> spool_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;  // from options_.tls, made in Start
  std::unique_ptr<AgentMetrics> metrics_;  // null unless options_.metrics_listen is set

  std::mutex mu_;  // guards slots' queues/state, link_, stats_, stopping_
  std::condition_variable cv_;
  bool started_ = false;
  bool stopping_ = false;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::shared_ptr<Link> link_;  // the current stream; null while disconnected
  AgentStats stats_;
  std::atomic<bool> connected_{false};
  int failures_ = 0;  // connection attempts without a Welcome since the last one (loop thread)
  // The last stream was refused for a reason that does not clear by itself (loop thread): the
  // next attempt waits the longest backoff.
  bool refused_permanently_ = false;
  // Results to send again after a transient Error, when, and the backoff after that (mu_).
  std::set<std::pair<std::string, int>> retry_keys_;
  std::optional<std::chrono::steady_clock::time_point> retry_at_;
  int retry_backoff_ms_ = 0;
  std::mutex results_log_mu_;
  std::thread connection_thread_;
};

}  // namespace infersweep
