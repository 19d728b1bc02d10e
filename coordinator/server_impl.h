// The coordinator's implementation class, shared by the files that define its parts:
//
//  - coordinator/server.cc: startup, shutdown, recovery of leases, the public facade.
//  - coordinator/agent_stream.cc: AgentService.Connect (Hello/Welcome, heartbeats, progress,
//    results and their group commit, assignment delivery through the stream's writer).
//  - coordinator/scheduler.cc: the scheduler loop (lease expiry and requeue, preflight per slot,
//    placement, leasing and Assignments) and the metrics export of results.
//  - coordinator/user_api.cc: SweepService (user auth and rate limit, submit, status, cancel,
//    agents, results, best, regressions).
//
// Private to coordinator/: only those files include it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "api/backend_config.h"
#include "api/untrusted_regex.h"
#include "coordinator/agent_identity.h"
#include "coordinator/metrics.h"
#include "coordinator/rate_limit.h"
#include "coordinator/server.h"
#include "proto/infersweep.grpc.pb.h"
#include "proto/log_line.h"
#include "proto/rpc.h"
#include "storage/store.h"

namespace infersweep {
namespace coordinator_internal {

using AgentStream = grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::AgentMessage>;

inline int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

inline std::string RateLimitMessage(const std::string& what, const RateLimit& limit,
                                    const std::string& who) {
  return absl::StrCat("rate limit: ", what, " from ", who, " exceed ", limit.rate_per_s,
                      "/s (burst ", limit.burst, "); retry later");
}

inline grpc::Status GrpcError(grpc::StatusCode code, const std::string& message) {
  return grpc::Status(code, message);
}

// What one agent slot offers: a GPU, or the CPU slot of a CPU-only agent.
struct SlotInfo {
  int index = 0;
  bool gpu = false;
  std::string gpu_name;  // "cpu" for the CPU slot
  int sm = 0;
  int64_t memory_bytes = 0;
  std::vector<int> p2p_peers;  // the slots this GPU reaches by peer access
};

// One agent stream. Messages to the agent go through a queue drained by a writer thread, so the
// scheduler never blocks on a slow agent.
struct Conn {
  std::string agent_id;
  v1::Hello hello;
  std::vector<SlotInfo> slots;
  int gpu_count = 0;
  grpc::ServerContext* context = nullptr;
  std::atomic<int64_t> bad_messages{0};
  std::atomic<bool> superseded{false};
  AgentCredential credential;  // what a replacing stream must present again

  std::mutex out_mu;
  std::condition_variable out_cv;
  std::deque<v1::CoordinatorMessage> out;
  bool out_closed = false;

  void Enqueue(v1::CoordinatorMessage m) {
    {
      std::lock_guard<std::mutex> lock(out_mu);
      if (out_closed) return;
      out.push_back(std::move(m));
    }
    out_cv.notify_one();
  }
  // Stops the writer after it has written what is queued.
  void CloseOutbound() {
    {
      std::lock_guard<std::mutex> lock(out_mu);
      out_closed = true;
    }
    out_cv.notify_one();
  }
  void WriterLoop(AgentStream* stream) {
    bool ok = true;
    while (true) {
      v1::CoordinatorMessage m;
      {
        std::unique_lock<std::mutex> lock(out_mu);
        out_cv.wait(lock, [&] { return out_closed || !out.empty(); });
        if (out.empty()) return;
        m = std::move(out.front());
        out.pop_front();
      }
      if (ok && !stream->Write(m)) {
        ok = false;
        context->TryCancel();  // the reader sees the end of the stream
      }
    }
  }
};

// A trial leased to an agent, as the coordinator knows it.
struct Held {
  int attempt = 0;
  int64_t sweep_id = 0;
  std::vector<int> slots;     // the slots it occupies; empty while its agent is away
  int64_t lost_deadline = 0;  // >0: the agent reconnected without it; recorded lost after this
  bool confirmed = true;      // false: recovered from the store, not yet seen in a Hello
  bool foreign = false;       // the agent runs it but the store does not lease it to it
  std::string last_progress;
};

}  // namespace coordinator_internal

class CoordinatorServer::Impl {
 public:
  // The shared types of coordinator_internal, by their short names in every part.
  using AgentStream = coordinator_internal::AgentStream;
  using Conn = coordinator_internal::Conn;
  using Held = coordinator_internal::Held;
  using SlotInfo = coordinator_internal::SlotInfo;

  explicit Impl(CoordinatorOptions options)
      : options_(std::move(options)),
        agent_limiter_(options_.agent_message_limit),
        user_limiter_(options_.user_call_limit),
        connect_limiter_(options_.connect_limit) {
    CoordinatorMetricsOptions mo;
    mo.max_config_series = options_.metrics_max_config_series;
    metrics_ = std::make_unique<CoordinatorMetrics>(mo);
    if (options_.lease_ms < 100) options_.lease_ms = 100;
    if (options_.heartbeat_interval_ms <= 0)
      options_.heartbeat_interval_ms = std::clamp<int64_t>(options_.lease_ms / 4, 50, 15'000);
    if (options_.tick_ms <= 0) options_.tick_ms = 100;
    if (options_.lost_trial_grace_ms <= 0)
      options_.lost_trial_grace_ms = std::max<int64_t>(1000, 3 * options_.heartbeat_interval_ms);
  }

  ~Impl() { Stop(); }

  absl::StatusOr<int> Start(const std::string& address, const std::string& db_path);
  void Stop();
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    stopped_cv_.wait(lock, [&] { return stopping_; });
  }
  Store* store() { return store_.get(); }
  std::string agent_identity() const {
    return agent_auth_.Describe(options_.tls.server_enabled() &&
                                !options_.tls.client_ca_file.empty());
  }
  int metrics_port() { return metrics_->port(); }
  std::string MetricsText() { return metrics_->Serialize(); }
  CoordinatorStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    CoordinatorStats s = stats_;
    s.agents_connected = static_cast<int64_t>(conns_.size());
    return s;
  }

  // AgentService.
  grpc::Status Connect(grpc::ServerContext* context, AgentStream* stream);
  // The checks a Hello passes before its stream is accepted (public for the fuzz harness).
  absl::Status ValidateHello(const v1::Hello& hello) const;

  // SweepService.
  // RESOURCE_EXHAUSTED when the caller's address is over the user-call rate limit; else OK when
  // user auth is off or the call carries "authorization: Bearer <user_token>"; UNAUTHENTICATED
  // (counted in stats_.auth_failures) otherwise.
  grpc::Status CheckUser(grpc::ServerContext* context);
  grpc::Status SubmitSweep(const v1::SubmitSweepRequest& req, v1::SubmitSweepResponse* resp);
  // Why some of a sweep's queued trials cannot be placed: the selectors no connected agent
  // matches, in words (SweepInfo.waiting); empty when each has a matching agent.
  std::string UnmatchedSelectors(int64_t sweep_id);
  // One log line for a refused submit: the caller's address, the spec's source and why (rate
  // limit refusals are counted in metrics instead: a flood must not flood the log).
  void LogRefusedSubmit(const std::string& peer, const std::string& source,
                        const grpc::Status& status);
  grpc::Status GetSweep(const v1::GetSweepRequest& req, v1::SweepInfo* resp);
  grpc::Status ListSweeps(v1::ListSweepsResponse* resp);
  grpc::Status CancelSweep(const v1::CancelSweepRequest& req, v1::CancelSweepResponse* resp);
  grpc::Status ListAgents(v1::ListAgentsResponse* resp);
  grpc::Status QueryResults(const v1::QueryResultsRequest& req, v1::QueryResultsResponse* resp);
  grpc::Status Best(const v1::BestRequest& req, v1::BestResponse* resp);
  grpc::Status Regressions(const v1::RegressionsRequest& req, v1::RegressionsResponse* resp);

 private:
  class AgentServiceImpl final : public v1::AgentService::Service {
   public:
    explicit AgentServiceImpl(Impl* impl) : impl_(impl) {}
    grpc::Status Connect(grpc::ServerContext* context, AgentStream* stream) override {
      return impl_->Connect(context, stream);
    }

   private:
    Impl* impl_;
  };

  class SweepServiceImpl final : public v1::SweepService::Service {
   public:
    explicit SweepServiceImpl(Impl* impl) : impl_(impl) {}
    grpc::Status SubmitSweep(grpc::ServerContext* context, const v1::SubmitSweepRequest* req,
                             v1::SubmitSweepResponse* resp) override {
      grpc::Status s = impl_->CheckUser(context);
      if (s.ok()) s = impl_->SubmitSweep(*req, resp);
      if (!s.ok()) impl_->LogRefusedSubmit(context->peer(), req->source(), s);
      return s;
    }
    grpc::Status GetSweep(grpc::ServerContext* context, const v1::GetSweepRequest* req,
                          v1::SweepInfo* resp) override {
      if (grpc::Status a = impl_->CheckUser(context); !a.ok()) return a;
      return impl_->GetSweep(*req, resp);
    }
    grpc::Status ListSweeps(grpc::ServerContext* context, const v1::ListSweepsRequest*,
                            v1::ListSweepsResponse* resp) override {
      if (grpc::Status a = impl_->CheckUser(context); !a.ok()) return a;
      return impl_->ListSweeps(resp);
    }
    grpc::Status CancelSweep(grpc::ServerContext* context, const v1::CancelSweepRequest* req,
                             v1::CancelSweepResponse* resp) override {
      if (grpc::Status a = impl_->CheckUser(context); !a.ok()) return a;
      return impl_->CancelSweep(*req, resp);
    }
    grpc::Status ListAgents(grpc::ServerContext* context, const v1::ListAgentsRequest*,
                            v1::ListAgentsResponse* resp) override {
      if (grpc::Status a = impl_->CheckUser(context); !a.ok()) return a;
      return impl_->ListAgents(resp);
    }
    grpc::Status QueryResults(grpc::ServerContext* context, const v1::QueryResultsRequest* req,
                              v1::QueryResultsResponse* resp) override {
      if (grpc::Status a = impl_->CheckUser(context); !a.ok()) return a;
      return impl_->QueryResults(*req, resp);
    }
    grpc::Status Best(grpc::ServerContext* context, const v1::BestRequest* req,
                      v1::BestResponse* resp) override {
      if (grpc::Status a = impl_->CheckUser(context); !a.ok()) return a;
      return impl_->Best(*req, resp);
    }
    grpc::Status Regressions(grpc::ServerContext* context, const v1::RegressionsRequest* req,
                             v1::RegressionsResponse* resp) override {
      if (grpc::Status a = impl_->CheckUser(context); !a.ok()) return a;
      return impl_->Regressions(*req, resp);
    }

   private:
    Impl* impl_;
  };

  void Log(const std::string& line) {
    if (options_.log) {
      options_.log(line);
    } else {
      WriteLogLine("coordinator", line);
    }
  }
  // True (and counted, by `api` in the metrics) when `key` is over `limiter`'s rate.
  bool OverRateLimit(RateLimiter& limiter, const std::string& key, const char* api) {
    if (limiter.Allow(key)) return false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.rate_limited;
    }
    metrics_->CountRateLimited(api);
    return true;
  }
  void Wake() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      wake_ = true;
    }
    sched_cv_.notify_all();
  }

  void RecoverHeld();
  void ReconcileHeldLocked(Conn& conn, int64_t now);
  void OnHeartbeat(Conn& conn, const v1::Heartbeat& hb);
  void OnProgress(Conn& conn, const v1::Progress& p);
  void OnResult(const std::shared_ptr<Conn>& conn, const v1::Result& r);
  // Group commit: results wait in commit_queue_ for the committer thread, which stores all that
  // wait in one transaction (Store::RecordResultsEach) and then answers each agent (Ack, or an
  // Error). One durable commit serves many results, and each Ack still follows its own commit.
  struct PendingResult {
    std::shared_ptr<Conn> conn;
    ResultSubmission submission;
    std::chrono::steady_clock::time_point received;
  };
  void CommitLoop();
  void Answer(PendingResult& pending, const absl::Status& stored);
  // Sends a permanent Error (the agent drops that result) and counts a bad message.
  void Reject(Conn& conn, const std::string& message, const std::string& trial_id, int attempt,
              absl::StatusCode code = absl::StatusCode::kInvalidArgument);

  void SchedulerLoop();
  void ScheduleOnce(bool event);
  // Logs, counts and exports a lease the store released (requeued or ended as ERROR).
  void OnLeaseLost(const LostLease& lost, const std::string& how);
  // Free slots per connected agent (agent id -> slot indices), for one scheduling pass.
  using FreeSlots = std::map<std::string, std::vector<int>>;
  FreeSlots FreeSlotsLocked() const;
  // A trial placed on an agent's free slots, to be leased with the rest of its pass.
  struct Placement {
    const TrialRecord* trial;
    Conn* conn;
    BackendConfig config;  // normalized
    std::vector<int> slots;
  };
  // Places or judges one queued trial on the agents in `order`, taking the slots it uses out of
  // `free` (a placement is added to `placements`, an UNSUPPORTED or ERROR result is stored);
  // returns true when it is no longer the queue's.
  bool TryPlaceLocked(const TrialRecord& trial, const std::vector<Conn*>& order, FreeSlots& free,
                      std::vector<Placement>* placements);
  // Leases a pass's placements in one transaction and sends each its Assignment; returns how
  // many were leased.
  int LeaseAndAssignLocked(const std::vector<Placement>& placements, int64_t now);
  bool SlotBusyLocked(const std::string& agent_id, int slot) const;
  bool MatchesLocked(const Selector& selector, const SlotInfo& slot);
  void RecordCoordinatorResult(const TrialRecord& trial, TrialStatus status,
                               const std::string& reason, const SlotInfo* slot);
  void FillSweepInfo(const SweepRecord& s, bool with_counts, v1::SweepInfo* out);
  // Exports a stored result (fresh, not a replay) to the metrics.
  void ExportResult(const TrialResult& result, const std::string& gpu_name, int sm);
  // Agents connected, queued and leased trials (at most once a second: CountTrials scans).
  void UpdateFleetMetrics(int64_t now);

  CoordinatorOptions options_;
  std::unique_ptr<Store> store_;
  std::mutex commit_mu_;
  std::condition_variable commit_cv_;
  std::deque<PendingResult> commit_queue_;  // guarded by commit_mu_
  bool commit_stopping_ = false;            // guarded by commit_mu_
  std::thread committer_;
  std::unique_ptr<AgentServiceImpl> agent_service_;
  std::unique_ptr<SweepServiceImpl> sweep_service_;
  std::unique_ptr<grpc::Server> server_;
  std::thread scheduler_;

  std::mutex mu_;
  std::condition_variable sched_cv_;
  std::condition_variable stopped_cv_;
  bool wake_ = false;
  bool started_ = false;
  bool stopping_ = false;
  std::map<std::string, std::shared_ptr<Conn>> conns_;            // agent id -> live stream
  std::map<std::string, std::map<std::string, Held>> held_;       // agent id -> trial id -> held
  std::map<std::string, std::unique_ptr<re2::RE2>> regex_cache_;  // nullptr: does not compile
  RateLimiter agent_limiter_;    // per agent id, messages after Hello
  RateLimiter user_limiter_;     // per peer host, SweepService calls
  RateLimiter connect_limiter_;  // per peer host, Connect streams
  AgentAuthenticator agent_auth_;  // set in Start
  size_t rr_ = 0;  // round-robin start among agents
  // Queue scans: how many queued trials one scan reads, and when a scan that changed nothing
  // may run again without an event (scheduler thread only).
  size_t scan_boost_ = 1;
  int64_t next_idle_scan_ms_ = 0;
  int64_t next_requeue_ms_ = 0;  // RequeueExpired runs at most once a tick (scheduler thread)
  CoordinatorStats stats_;
  std::unique_ptr<CoordinatorMetrics> metrics_;  // always kept; served when metrics_listen is set
  int64_t next_fleet_metrics_ms_ = 0;           // scheduler thread only
};

}  // namespace infersweep
