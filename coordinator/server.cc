#include "coordinator/server.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/metrics.h"
#include "coordinator/regressions.h"
#include "coordinator/sweep_spec.h"
#include "api/backend_config.h"
#include "api/model_description.h"
#include "api/version.h"
#include "api/trial.h"
#include "proto/infersweep.grpc.pb.h"
#include "proto/log_line.h"
#include "proto/rpc.h"

namespace infersweep {
namespace {

using AgentStream = grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::AgentMessage>;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

constexpr size_t kMaxAgentIdLength = 128;
constexpr size_t kMaxTextField = 256;
constexpr int kMaxSlots = 256;
constexpr int kMaxQueryRows = 10000;
// A page of results stays below the message limit with room for the envelope.
constexpr size_t kMaxResultPageBytes = rpc::kMaxMessageBytes - 256 * 1024;
constexpr size_t kMaxProgressText = 4096;
// A scan reads 8 queued trials per free slot (at least 64), times a boost that grows 4x after
// each scan that placed nothing while the queue was longer, up to the max: trials behind an
// unplaceable backlog are still reached, and a scan stays cheap while few slots are free.
constexpr size_t kMinScanLimit = 64;
constexpr size_t kScanPerFreeSlot = 8;
constexpr size_t kMaxScanLimit = 65536;
// A scan that placed nothing is repeated on the next event, or after this long.
constexpr int64_t kIdleScanIntervalMs = 2000;

bool ValidAgentId(const std::string& id) {
  if (id.empty() || id.size() > kMaxAgentIdLength) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-' || c == ':';
    if (!ok) return false;
  }
  return true;
}

const char* MessageName(const v1::AgentMessage& m) {
  switch (m.msg_case()) {
    case v1::AgentMessage::kHello: return "Hello";
    case v1::AgentMessage::kHeartbeat: return "Heartbeat";
    case v1::AgentMessage::kProgress: return "Progress";
    case v1::AgentMessage::kResult: return "Result";
    default: return "an empty message";
  }
}

v1::CoordinatorMessage ErrorMessage(const std::string& text, const std::string& trial_id = "",
                                    int attempt = 0, bool permanent = false,
                                    absl::StatusCode code = absl::StatusCode::kUnknown) {
  v1::CoordinatorMessage m;
  v1::Error* e = m.mutable_error();
  e->set_message(text);
  e->set_trial_id(trial_id);
  e->set_attempt(attempt);
  e->set_permanent(permanent);
  e->set_code(static_cast<int32_t>(code));
  return m;
}

std::string RateLimitMessage(const std::string& what, const RateLimit& limit,
                             const std::string& who) {
  return absl::StrCat("rate limit: ", what, " from ", who, " exceed ", limit.rate_per_s,
                      "/s (burst ", limit.burst, "); retry later");
}

grpc::Status GrpcError(grpc::StatusCode code, const std::string& message) {
  return grpc::Status(code, message);
}

// What one agent slot offers: a GPU, or the CPU slot of a CPU-only agent.
struct SlotInfo {
  int index = 0;
  bool gpu = false;
  std::string gpu_name;  // "cpu" for the CPU slot
  int sm = 0;
  int64_t memory_bytes = 0;
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

}  // namespace

class CoordinatorServer::Impl {
 public:
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

  // SweepService.
  // RESOURCE_EXHAUSTED when the caller's address is over the user-call rate limit; else OK when
  // user auth is off or the call carries "authorization: Bearer <user_token>"; UNAUTHENTICATED
  // (counted in stats_.auth_failures) otherwise.
  grpc::Status CheckUser(grpc::ServerContext* context);
  grpc::Status SubmitSweep(const v1::SubmitSweepRequest& req, v1::SubmitSweepResponse* resp);
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
      if (grpc::Status a = impl_->CheckUser(context); !a.ok()) return a;
      return impl_->SubmitSweep(*req, resp);
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

  absl::Status ValidateHello(const v1::Hello& hello) const;
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
  std::map<std::string, std::regex> regex_cache_;
  RateLimiter agent_limiter_;    // per agent id, messages after Hello
  RateLimiter user_limiter_;     // per peer host, SweepService calls
  RateLimiter connect_limiter_;  // per peer host, Connect streams
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

// ------------------------------------------------------------------------------ lifecycle

absl::StatusOr<int> CoordinatorServer::Impl::Start(const std::string& address,
                                                   const std::string& db_path) {
  if (!options_.agent_token.empty() && options_.agent_token == options_.user_token)
    return absl::InvalidArgumentError(
        "the agent token and the user token must differ (each must not work on the other API)");
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      rpc::MakeServerCredentials(options_.tls);
  if (!credentials.ok()) return credentials.status();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (started_) return absl::FailedPreconditionError("coordinator already started");
    started_ = true;
  }
  StoreOptions store_options;
  store_options.busy_timeout_ms = options_.db_busy_timeout_ms;
  auto store = Store::Open(db_path, store_options);
  if (!store.ok()) return store.status();
  store_ = *std::move(store);
  // Nobody is connected to a coordinator that is only starting.
  if (auto agents = store_->ListAgents(); agents.ok()) {
    for (const AgentRecord& a : *agents)
      if (a.connected) (void)store_->SetAgentConnected(a.agent_id, false, NowMs());
  }
  RecoverHeld();
  if (!options_.metrics_listen.empty()) {
    absl::StatusOr<int> metrics_port = metrics_->Listen(options_.metrics_listen);
    if (!metrics_port.ok()) return metrics_port.status();
    Log(absl::StrCat("metrics on http://", options_.metrics_listen, "/metrics (port ",
                     *metrics_port, ")"));
  }

  agent_service_ = std::make_unique<AgentServiceImpl>(this);
  sweep_service_ = std::make_unique<SweepServiceImpl>(this);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, *credentials, &port);
  rpc::ConfigureServer(builder);
  builder.RegisterService(agent_service_.get());
  builder.RegisterService(sweep_service_.get());
  server_ = builder.BuildAndStart();
  if (!server_ || port == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address,
                                               " (address in use or not a host:port?)"));
  }
  scheduler_ = std::thread([this] { SchedulerLoop(); });
  committer_ = std::thread([this] { CommitLoop(); });
  const char* transport = !options_.tls.server_enabled()        ? "plaintext"
                          : options_.tls.client_ca_file.empty() ? "TLS"
                                                                : "mutual TLS";
  Log(absl::StrCat("listening on ", address, " (port ", port, ", ", transport, "), database ",
                   db_path));
  return port;
}

void CoordinatorServer::Impl::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  sched_cv_.notify_all();
  stopped_cv_.notify_all();
  if (scheduler_.joinable()) scheduler_.join();
  {
    // Under mu_: a stream still in conns_ has not finished, so its context is alive.
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, c] : conns_) c->context->TryCancel();
  }
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
  }
  // No stream is left to add results: store what waits, then stop.
  {
    std::lock_guard<std::mutex> lock(commit_mu_);
    commit_stopping_ = true;
  }
  commit_cv_.notify_all();
  if (committer_.joinable()) committer_.join();
}

void CoordinatorServer::Impl::RecoverHeld() {
  // Leases outlive a coordinator restart; rebuild which agent holds what, so a reconnecting agent
  // that lost a trial is noticed. Trial ids are "<sweep>-<index>" (Store::CreateSweep).
  auto sweeps = store_->ListSweeps();
  if (!sweeps.ok()) return;
  int recovered = 0;
  for (const SweepRecord& s : *sweeps) {
    if (s.state != "active" && s.state != "cancelled") continue;
    for (int64_t i = 0; i < s.trials_total; ++i) {
      auto t = store_->GetTrial(absl::StrCat(s.id, "-", i));
      if (!t.ok() || t->state != TrialState::kLeased || t->leased_to.empty()) continue;
      Held h;
      h.attempt = t->attempt;
      h.sweep_id = s.id;
      h.confirmed = false;
      held_[t->leased_to][t->trial_id] = h;
      ++recovered;
    }
  }
  if (recovered > 0) Log(absl::StrCat(recovered, " leased trial(s) recovered from the database"));
}

// ------------------------------------------------------------------------------ authentication

grpc::Status CoordinatorServer::Impl::CheckUser(grpc::ServerContext* context) {
  // The rate limit comes first, so that guessing tokens is limited too.
  if (const std::string peer = PeerHost(context->peer());
      OverRateLimit(user_limiter_, peer, "user"))
    return GrpcError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                     RateLimitMessage("user-API calls", user_limiter_.limit(), peer));
  if (options_.user_token.empty()) return grpc::Status::OK;
  bool ok = false;
  const auto& md = context->client_metadata();
  auto it = md.find(rpc::kAuthMetadataKey);
  if (it != md.end()) {
    const std::string_view value(it->second.data(), it->second.size());
    const std::string_view prefix(rpc::kBearerPrefix);
    if (value.size() > prefix.size() && value.substr(0, prefix.size()) == prefix)
      ok = rpc::ConstantTimeEquals(value.substr(prefix.size()), options_.user_token);
  }
  if (ok) return grpc::Status::OK;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.auth_failures;
  }
  metrics_->CountAuthFailure("user");
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid credentials");
}

// ------------------------------------------------------------------------------ agent stream

absl::Status CoordinatorServer::Impl::ValidateHello(const v1::Hello& h) const {
  if (h.protocol_version() != rpc::kProtocolVersion)
    return absl::FailedPreconditionError(
        absl::StrCat("Hello: protocol version ", h.protocol_version(), "; this coordinator speaks ",
                     rpc::kProtocolVersion));
  if (!ValidAgentId(h.agent_id()))
    return absl::InvalidArgumentError(absl::StrCat(
        "Hello: agent_id must be 1..", kMaxAgentIdLength,
        " characters of [A-Za-z0-9._:-], got '", h.agent_id().substr(0, kMaxAgentIdLength), "'"));
  if (h.host().size() > kMaxTextField || h.engine_version().size() > kMaxTextField)
    return absl::InvalidArgumentError("Hello: host or engine_version longer than 256 characters");
  if (h.gpus_size() > kMaxSlots)
    return absl::InvalidArgumentError(absl::StrCat("Hello: more than ", kMaxSlots, " GPUs"));
  if (h.cpu_only() && h.gpus_size() > 0)
    return absl::InvalidArgumentError("Hello: cpu_only with a non-empty GPU list");
  for (int i = 0; i < h.gpus_size(); ++i) {
    const v1::Gpu& g = h.gpus(i);
    if (g.index() != i)
      return absl::InvalidArgumentError(
          absl::StrCat("Hello: gpus[", i, "].index is ", g.index(), "; GPUs must be listed 0..n-1"));
    if (g.name().empty() || g.name().size() > kMaxTextField)
      return absl::InvalidArgumentError(absl::StrCat("Hello: gpus[", i, "].name is empty or too long"));
    if (g.sm() < 0 || g.sm() > 1000 || g.memory_bytes() < 0)
      return absl::InvalidArgumentError(absl::StrCat("Hello: gpus[", i, "]: sm or memory out of range"));
  }
  if (h.backends_size() > 4096 || h.running_size() > 4096)
    return absl::InvalidArgumentError("Hello: too many backends or running trials");
  if (h.spooled_size() > rpc::kMaxHelloSpooled)
    return absl::InvalidArgumentError(
        absl::StrCat("Hello: more than ", rpc::kMaxHelloSpooled, " spooled results listed"));
  return absl::OkStatus();
}

grpc::Status CoordinatorServer::Impl::Connect(grpc::ServerContext* context, AgentStream* stream) {
  if (const std::string peer = PeerHost(context->peer());
      OverRateLimit(connect_limiter_, peer, "connect"))
    return GrpcError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                     RateLimitMessage("agent streams", connect_limiter_.limit(), peer));
  v1::AgentMessage msg;
  if (!stream->Read(&msg)) return grpc::Status::OK;  // gone before saying anything
  // The agent id the stream claims, for the log ("" when its Hello has none that is valid).
  const std::string claimed =
      msg.has_hello() && ValidAgentId(msg.hello().agent_id()) ? msg.hello().agent_id() : "";
  // Closes the stream with `code`: the agent reads `text` and the code in an Error, then the
  // same in the stream's status.
  auto reject = [&](grpc::StatusCode code, const std::string& text) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.streams_rejected;
    }
    Log(absl::StrCat("stream rejected from ", context->peer(),
                     claimed.empty() ? "" : absl::StrCat(" (agent '", claimed, "')"), ": ",
                     absl::StatusCodeToString(static_cast<absl::StatusCode>(code)), ": ", text));
    stream->Write(
        ErrorMessage(text, "", 0, /*permanent=*/false, static_cast<absl::StatusCode>(code)));
    return GrpcError(code, text);
  };
  if (!msg.has_hello())
    return reject(grpc::StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("protocol error: the first message on a stream must be Hello, got ",
                               MessageName(msg)));
  // Authentication comes before any other check, so that a stranger learns nothing else.
  if (!options_.agent_token.empty() &&
      !rpc::ConstantTimeEquals(msg.hello().auth_token(), options_.agent_token)) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.auth_failures;
    }
    metrics_->CountAuthFailure("agent");
    return reject(grpc::StatusCode::UNAUTHENTICATED, "Hello: missing or invalid credentials");
  }
  if (absl::Status s = ValidateHello(msg.hello()); !s.ok())
    return reject(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));

  auto conn = std::make_shared<Conn>();
  conn->hello = msg.hello();
  conn->hello.clear_auth_token();
  conn->agent_id = conn->hello.agent_id();
  conn->context = context;
  if (conn->hello.gpus_size() == 0) {
    conn->slots.push_back(SlotInfo{0, false, "cpu", 0, 0});
  } else {
    for (const v1::Gpu& g : conn->hello.gpus())
      conn->slots.push_back(SlotInfo{g.index(), true, g.name(), g.sm(), g.memory_bytes()});
    conn->gpu_count = conn->hello.gpus_size();
  }
  const std::string& id = conn->agent_id;
  const int64_t now = NowMs();
  // Welcome is queued before the connection becomes visible to the scheduler, so no Assignment
  // can overtake it (an agent drops a stream whose first message is not Welcome).
  v1::CoordinatorMessage welcome;
  welcome.mutable_welcome()->set_coordinator_version(EngineVersion());
  welcome.mutable_welcome()->set_protocol_version(rpc::kProtocolVersion);
  welcome.mutable_welcome()->set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  welcome.mutable_welcome()->set_lease_ms(options_.lease_ms);
  conn->Enqueue(std::move(welcome));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return GrpcError(grpc::StatusCode::UNAVAILABLE, "coordinator is stopping");
    if (auto it = conns_.find(id); it != conns_.end()) {
      // The same agent again (it reconnected before its old stream was noticed dead): the new
      // stream replaces the old one.
      it->second->superseded = true;
      it->second->context->TryCancel();
      Log(absl::StrCat("agent ", id, " reconnected; closing its previous stream"));
    }
    conns_[id] = conn;
    ReconcileHeldLocked(*conn, now);
    conn->hello.clear_spooled();  // used up
  }
  {
    v1::Hello stored = conn->hello;
    stored.clear_running();
    stored.clear_spooled();
    std::string json;
    (void)google::protobuf::util::MessageToJsonString(stored, &json);
    AgentRecord rec{id, conn->hello.host(), json, now, true};
    if (absl::Status s = store_->UpsertAgent(rec); !s.ok())
      Log(absl::StrCat("storing agent ", id, ": ", s.message()));
  }
  Log(absl::StrCat("agent ", id, " connected from ", context->peer(), ": ",
                   conn->hello.gpus_size() == 0 ? "cpu-only" : absl::StrCat(conn->hello.gpus_size(), " GPU(s)"),
                   conn->hello.gpus_size() > 0 ? absl::StrCat(", ", conn->hello.gpus(0).name(), " sm_",
                                                              conn->hello.gpus(0).sm())
                                               : ""));

  std::thread writer([conn, stream] { conn->WriterLoop(stream); });
  Wake();

  grpc::Status end = grpc::Status::OK;
  int64_t dropped = 0;        // messages over the rate limit since the last log line
  int64_t next_drop_log = 0;  // when the next such line may be written
  while (stream->Read(&msg)) {
    if (OverRateLimit(agent_limiter_, id, "agent")) {
      // Nothing is processed or stored. A Result gets a retryable Error: it stays spooled.
      ++dropped;
      const std::string text =
          RateLimitMessage("messages", agent_limiter_.limit(), absl::StrCat("agent ", id));
      if (msg.has_result())
        conn->Enqueue(ErrorMessage(text, msg.result().trial_id(), msg.result().attempt(),
                                   /*permanent=*/false, absl::StatusCode::kResourceExhausted));
      if (const int64_t t = NowMs(); t >= next_drop_log) {
        Log(absl::StrCat(text, " (", dropped, " message(s) dropped)"));
        dropped = 0;
        next_drop_log = t + 5000;
      }
      continue;
    }
    if (msg.has_hello()) {
      const std::string text = "protocol error: a second Hello on the same stream";
      conn->Enqueue(
          ErrorMessage(text, "", 0, /*permanent=*/false, absl::StatusCode::kFailedPrecondition));
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.streams_rejected;
      }
      end = GrpcError(grpc::StatusCode::FAILED_PRECONDITION, text);
      Log(absl::StrCat("agent ", id, ": ", text, "; stream closed"));
      break;
    }
    switch (msg.msg_case()) {
      case v1::AgentMessage::kHeartbeat:
        OnHeartbeat(*conn, msg.heartbeat());
        break;
      case v1::AgentMessage::kProgress:
        OnProgress(*conn, msg.progress());
        break;
      case v1::AgentMessage::kResult:
        OnResult(conn, msg.result());
        break;
      default:
        Reject(*conn, "empty message: no field of AgentMessage is set", "", 0);
        break;
    }
  }

  bool current = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = conns_.find(id); it != conns_.end() && it->second == conn) {
      conns_.erase(it);
      current = true;
    }
    // Its trials keep their leases: they expire unless the agent comes back (docs/SERVICE.md).
    if (current) {
      for (auto& [tid, h] : held_[id])
        if (h.foreign) h.slots.clear();
    }
  }
  if (current) (void)store_->SetAgentConnected(id, false, NowMs());
  conn->CloseOutbound();
  writer.join();
  if (current) Log(absl::StrCat("agent ", id, " disconnected"));
  Wake();
  return end;
}

void CoordinatorServer::Impl::ReconcileHeldLocked(Conn& conn, int64_t now) {
  auto& held = held_[conn.agent_id];
  std::map<std::string, const v1::RunningTrial*> running;
  for (const v1::RunningTrial& r : conn.hello.running()) running[r.trial_id()] = &r;
  std::set<std::pair<std::string, int>> spooled;
  for (const v1::RunningTrial& r : conn.hello.spooled())
    spooled.insert({r.trial_id(), r.attempt()});
  auto valid_slots = [&](const v1::RunningTrial& r) {
    std::vector<int> slots;
    for (int s : r.slots())
      if (s >= 0 && s < static_cast<int>(conn.slots.size())) slots.push_back(s);
    if (slots.empty()) slots.push_back(0);
    return slots;
  };
  for (auto it = held.begin(); it != held.end();) {
    auto& [tid, h] = *it;
    auto r = running.find(tid);
    if (r != running.end() && r->second->attempt() == h.attempt) {
      h.slots = valid_slots(*r->second);
      h.lost_deadline = 0;
      h.confirmed = true;
      ++it;
    } else if (h.foreign) {
      it = held.erase(it);
    } else {
      // Not running any more: its result may be in the agent's spool, replayed right after this
      // Hello; the lease is released if it does not come within the grace period. An agent that
      // lists its spool says whether it is there: if not, the trial is lost now (its Assignment
      // was lost on the way, or the agent restarted without it).
      h.slots.clear();
      const bool lost_now = conn.hello.reports_spool() && !spooled.count({tid, h.attempt});
      h.lost_deadline = lost_now ? now : now + options_.lost_trial_grace_ms;
      ++it;
    }
  }
  for (const auto& [tid, r] : running) {
    if (held.count(tid)) continue;
    Held h;
    h.attempt = r->attempt();
    h.slots = valid_slots(*r);
    auto t = store_->GetTrial(tid);
    if (t.ok() && t->state == TrialState::kLeased && t->leased_to == conn.agent_id &&
        t->attempt == r->attempt()) {
      h.sweep_id = t->sweep_id;
    } else {
      h.foreign = true;  // occupies the slots until its result comes; the result is refused
    }
    held[tid] = std::move(h);
  }
}

void CoordinatorServer::Impl::Reject(Conn& conn, const std::string& message,
                                     const std::string& trial_id, int attempt,
                                     absl::StatusCode code) {
  ++conn.bad_messages;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.bad_messages;
  }
  Log(absl::StrCat("agent ", conn.agent_id, ": rejected: ", message));
  conn.Enqueue(ErrorMessage(message, trial_id, attempt, /*permanent=*/true, code));
}

void CoordinatorServer::Impl::OnHeartbeat(Conn& conn, const v1::Heartbeat& hb) {
  const int64_t now = NowMs();
  if (absl::Status s = store_->RenewLeases(conn.agent_id, now + options_.lease_ms); !s.ok())
    Log(absl::StrCat("renewing leases of ", conn.agent_id, ": ", s.message()));
  (void)store_->SetAgentConnected(conn.agent_id, true, now);
  std::set<std::string> running;
  for (const v1::RunningTrial& r : hb.running()) running.insert(r.trial_id());
  for (const std::string& id : hb.running_trial_ids()) running.insert(id);
  std::lock_guard<std::mutex> lock(mu_);
  auto& held = held_[conn.agent_id];
  for (auto it = held.begin(); it != held.end();) {
    if (it->second.foreign && !running.count(it->first)) {
      it = held.erase(it);
    } else {
      ++it;
    }
  }
}

void CoordinatorServer::Impl::OnProgress(Conn& conn, const v1::Progress& p) {
  // Advisory: kept for status displays, never an error.
  std::lock_guard<std::mutex> lock(mu_);
  auto& held = held_[conn.agent_id];
  if (auto it = held.find(p.trial_id()); it != held.end() && it->second.attempt == p.attempt())
    it->second.last_progress = p.text().substr(0, kMaxProgressText);
}

void CoordinatorServer::Impl::OnResult(const std::shared_ptr<Conn>& conn_ptr, const v1::Result& r) {
  Conn& conn = *conn_ptr;
  const auto received = std::chrono::steady_clock::now();
  const std::string& tid = r.trial_id();
  if (tid.empty()) return Reject(conn, "Result without trial_id", "", r.attempt());
  if (r.attempt() < 1)
    return Reject(conn, absl::StrCat("Result for ", tid, ": attempt must be >= 1, got ", r.attempt()),
                  tid, r.attempt());
  auto parsed = nlohmann::json::parse(r.result_json(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded())
    return Reject(conn, absl::StrCat("Result for ", tid, ": result_json is not valid JSON"), tid,
                  r.attempt());
  absl::StatusOr<TrialResult> result = TrialResultFromJson(parsed);
  if (!result.ok())
    return Reject(conn,
                  absl::StrCat("Result for ", tid, ": result_json is not a TrialResult: ",
                               result.status().message()),
                  tid, r.attempt());
  if (result->trial_id != tid || result->attempt != r.attempt())
    return Reject(conn,
                  absl::StrCat("Result names trial ", tid, " attempt ", r.attempt(),
                               " but its result_json names trial ", result->trial_id, " attempt ",
                               result->attempt),
                  tid, r.attempt());

  // The slot that ran it gives the GPU name and arch the result is filed under.
  int slot = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& held = held_[conn.agent_id];
    if (r.slots_size() > 0) {
      slot = r.slots(0);
    } else if (auto it = held.find(tid); it != held.end() && !it->second.slots.empty()) {
      slot = it->second.slots[0];
    }
  }
  if (slot < 0 || slot >= static_cast<int>(conn.slots.size())) slot = 0;
  const SlotInfo& info = conn.slots[slot];
  PendingResult pending{conn_ptr,
                        ResultSubmission{conn.agent_id, info.gpu_name, info.sm, *std::move(result)},
                        received};
  {
    std::lock_guard<std::mutex> lock(commit_mu_);
    if (!commit_stopping_) {
      commit_queue_.push_back(std::move(pending));
      commit_cv_.notify_one();
      return;
    }
  }
  // Stopping: nothing more is stored; the agent keeps the result spooled and sends it again.
  conn.Enqueue(ErrorMessage("the coordinator is stopping; send the result again later", tid,
                            r.attempt(), /*permanent=*/false, absl::StatusCode::kUnavailable));
}

void CoordinatorServer::Impl::CommitLoop() {
  // At most this many results a transaction: a commit stays short (a few ms) while the queue
  // behind it fills for the next one.
  constexpr size_t kMaxGroup = 512;
  for (;;) {
    std::vector<PendingResult> group;
    {
      std::unique_lock<std::mutex> lock(commit_mu_);
      commit_cv_.wait(lock, [&] { return commit_stopping_ || !commit_queue_.empty(); });
      if (commit_queue_.empty()) return;  // stopping, and everything is stored
      while (!commit_queue_.empty() && group.size() < kMaxGroup) {
        group.push_back(std::move(commit_queue_.front()));
        commit_queue_.pop_front();
      }
    }
    std::vector<ResultSubmission> submissions;
    submissions.reserve(group.size());
    for (const PendingResult& p : group) submissions.push_back(p.submission);
    const std::vector<absl::Status> stored = store_->RecordResultsEach(submissions);
    metrics_->ObserveCommitGroup(static_cast<double>(group.size()));
    for (size_t i = 0; i < group.size(); ++i) Answer(group[i], stored[i]);
    Wake();
  }
}

void CoordinatorServer::Impl::Answer(PendingResult& pending, const absl::Status& s) {
  Conn& conn = *pending.conn;
  const TrialResult& result = pending.submission.result;
  const std::string& tid = result.trial_id;
  const int attempt = result.attempt;
  bool fresh = false;  // the attempt was held: not a replay of a result stored before
  {
    // Whatever the store says, the agent is done with this attempt.
    std::lock_guard<std::mutex> lock(mu_);
    auto& held = held_[conn.agent_id];
    if (auto it = held.find(tid); it != held.end() && it->second.attempt == attempt) {
      fresh = true;
      held.erase(it);
    }
    if (s.ok()) ++stats_.results_stored;
  }
  if (s.ok()) {
    metrics_->ObserveIngestSeconds(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - pending.received).count());
    if (fresh) ExportResult(result, pending.submission.gpu_name, pending.submission.sm);
    v1::CoordinatorMessage ack;
    ack.mutable_ack()->set_trial_id(tid);
    ack.mutable_ack()->set_attempt(attempt);
    conn.Enqueue(std::move(ack));
    return;
  }
  switch (s.code()) {
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
      return Reject(conn, std::string(s.message()), tid, attempt, s.code());
    default: {
      // Storage trouble (busy, full): nothing was stored; the agent keeps the result spooled
      // and sends it again after a backoff.
      Log(absl::StrCat("storing the result of ", tid, " attempt ", attempt, " failed (the agent ",
                       conn.agent_id, " keeps it and retries): ", s.message()));
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.store_errors;
      }
      conn.Enqueue(ErrorMessage(absl::StrCat("could not store the result: ", s.message()), tid,
                                attempt, /*permanent=*/false, s.code()));
    }
  }
}

// ------------------------------------------------------------------------------ scheduler

void CoordinatorServer::Impl::SchedulerLoop() {
  while (true) {
    bool event;
    {
      std::unique_lock<std::mutex> lock(mu_);
      sched_cv_.wait_for(lock, std::chrono::milliseconds(options_.tick_ms),
                         [&] { return stopping_ || wake_; });
      if (stopping_) return;
      event = wake_;
      wake_ = false;
    }
    ScheduleOnce(event);
    UpdateFleetMetrics(NowMs());
  }
}

bool CoordinatorServer::Impl::SlotBusyLocked(const std::string& agent_id, int slot) const {
  auto it = held_.find(agent_id);
  if (it == held_.end()) return false;
  for (const auto& [tid, h] : it->second)
    if (std::find(h.slots.begin(), h.slots.end(), slot) != h.slots.end()) return true;
  return false;
}

bool CoordinatorServer::Impl::MatchesLocked(const Selector& sel, const SlotInfo& slot) {
  // CPU trials run on the host's CPU, so any slot can take one; CUDA trials need a GPU slot.
  if (sel.device != "cpu" && !slot.gpu) return false;
  if (!sel.sm_archs.empty() &&
      std::find(sel.sm_archs.begin(), sel.sm_archs.end(), slot.sm) == sel.sm_archs.end())
    return false;
  if (sel.min_memory_bytes > 0 && slot.memory_bytes < sel.min_memory_bytes) return false;
  if (!sel.gpu_name_regex.empty()) {
    auto it = regex_cache_.find(sel.gpu_name_regex);
    if (it == regex_cache_.end()) {
      try {
        it = regex_cache_.emplace(sel.gpu_name_regex, std::regex(sel.gpu_name_regex)).first;
      } catch (const std::regex_error&) {
        return false;  // validated at submit; a stored bad pattern matches nothing
      }
    }
    if (!std::regex_search(slot.gpu_name, it->second)) return false;
  }
  return true;
}

void CoordinatorServer::Impl::RecordCoordinatorResult(const TrialRecord& trial, TrialStatus status,
                                                      const std::string& reason,
                                                      const SlotInfo* slot) {
  TrialResult r;
  r.trial_id = trial.trial_id;
  r.attempt = trial.attempt + 1;
  r.status = status;
  r.reason = reason;
  r.model = trial.model;
  r.config = trial.config;
  r.device = ConfigDevice(trial.config) == "cpu" || slot == nullptr || !slot->gpu ? "cpu"
                                                                                   : slot->gpu_name;
  r.sm = slot ? slot->sm : 0;
  r.engine_version = EngineVersion();
  r.started_unix_ms = r.finished_unix_ms = NowMs();
  if (absl::Status s =
          store_->RecordResult("", slot ? slot->gpu_name : "", slot ? slot->sm : 0, r);
      !s.ok()) {
    Log(absl::StrCat("recording ", TrialStatusName(status).data(), " for ", trial.trial_id, ": ",
                     s.message()));
  } else {
    ExportResult(r, slot ? slot->gpu_name : "", slot ? slot->sm : 0);
  }
}

void CoordinatorServer::Impl::ExportResult(const TrialResult& result, const std::string& gpu_name,
                                           int sm) {
  std::string model = result.model;
  BackendConfig config = result.config;
  if (model.empty() || config.empty()) {
    // Filed under the trial's model and config, as the store does.
    if (absl::StatusOr<TrialRecord> t = store_->GetTrial(result.trial_id); t.ok()) {
      if (model.empty()) model = t->model;
      if (config.empty()) config = t->config;
    }
  }
  metrics_->OnResult(model, sm, gpu_name.empty() ? "unknown" : gpu_name, config, result);
}

void CoordinatorServer::Impl::UpdateFleetMetrics(int64_t now) {
  if (now < next_fleet_metrics_ms_) return;
  next_fleet_metrics_ms_ = now + 1000;
  {
    std::lock_guard<std::mutex> lock(mu_);
    metrics_->SetAgentsConnected(static_cast<int>(conns_.size()));
  }
  if (absl::StatusOr<TrialCounts> counts = store_->CountTrials(); counts.ok()) {
    metrics_->SetQueueDepth(counts->queued);
    metrics_->SetLeasedTrials(counts->leased);
  }
}

void CoordinatorServer::Impl::OnLeaseLost(const LostLease& l, const std::string& how) {
  if (l.requeued) {
    Log(absl::StrCat("trial ", l.trial_id, " attempt ", l.attempt, " lost (", how, ", agent ",
                     l.agent_id, "): requeued"));
    metrics_->CountLeaseLost(/*requeued=*/true);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.requeued;
    return;
  }
  Log(absl::StrCat("trial ", l.trial_id, " stored as ERROR: ", l.reason));
  metrics_->CountLeaseLost(/*requeued=*/false);
  if (absl::StatusOr<TrialRecord> t = store_->GetTrial(l.trial_id); t.ok()) {
    TrialResult r;
    r.trial_id = l.trial_id;
    r.attempt = l.attempt;
    r.status = TrialStatus::kError;
    r.reason = l.reason;
    ExportResult(r, t->lease_place.gpu_name, t->lease_place.sm);
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.attempts_exhausted;
}

void CoordinatorServer::Impl::ScheduleOnce(bool event) {
  const int64_t now = NowMs();
  absl::StatusOr<std::vector<LostLease>> expired = std::vector<LostLease>();
  if (now >= next_requeue_ms_) {  // a write transaction: once a tick, not on every event
    next_requeue_ms_ = now + options_.tick_ms;
    expired = store_->RequeueExpired(now, options_.max_attempts);
  }
  if (!expired.ok()) {
    Log(absl::StrCat("requeueing expired leases: ", expired.status().message()));
  } else if (!expired->empty()) {
    event = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const LostLease& l : *expired) {
        auto held = held_.find(l.agent_id);
        if (held == held_.end()) continue;
        if (auto it = held->second.find(l.trial_id);
            it != held->second.end() && !it->second.foreign)
          held->second.erase(it);
      }
    }
    for (const LostLease& l : *expired) OnLeaseLost(l, "expired");
  }

  // Trials a reconnected agent held but no longer runs, past their grace period: their leases
  // are released (requeued, or ERROR at the attempt cap).
  struct Lost {
    std::string agent_id, trial_id;
    int attempt;
  };
  std::vector<Lost> lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [agent, held] : held_) {
      if (!conns_.count(agent)) continue;  // away: its leases run out instead
      for (const auto& [tid, h] : held)
        if (h.lost_deadline > 0 && h.lost_deadline <= now) lost.push_back({agent, tid, h.attempt});
    }
  }
  for (const Lost& l : lost) {
    absl::StatusOr<LostLease> released =
        store_->ReleaseLease(l.trial_id, l.agent_id, l.attempt, options_.max_attempts,
                             "the agent reconnected without the trial and sent no result for it");
    // FailedPrecondition: its result came in the meantime, or the lease expired first.
    const bool settled = released.ok() || absl::IsFailedPrecondition(released.status());
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& held = held_[l.agent_id];
      if (auto it = held.find(l.trial_id); it != held.end() && it->second.attempt == l.attempt) {
        if (settled) {
          held.erase(it);
        } else {
          it->second.lost_deadline = now + 1000;  // the store is busy or full: try again later
        }
      }
      if (released.ok()) ++stats_.lost;
    }
    if (released.ok()) {
      OnLeaseLost(*released, "its agent came back without it");
    } else if (!settled) {
      Log(absl::StrCat("releasing the lease of ", l.trial_id, ": ", released.status().message()));
    }
  }

  if (!lost.empty()) event = true;
  size_t free_total = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [agent, slots] : FreeSlotsLocked()) free_total += slots.size();
  }
  // Nothing can be placed while every slot is busy (a trial that no agent supports is judged on
  // the next pass with a free slot); a freed slot is an event.
  if (free_total == 0) return;
  if (!event && now < next_idle_scan_ms_) return;
  const size_t limit =
      std::min(kMaxScanLimit, std::max(kMinScanLimit, kScanPerFreeSlot * free_total) * scan_boost_);
  auto queued = store_->QueuedTrials(static_cast<int>(limit));
  if (!queued.ok()) {
    Log(absl::StrCat("listing queued trials: ", queued.status().message()));
    return;
  }
  int changed = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    FreeSlots free = FreeSlotsLocked();
    std::vector<Conn*> order;  // every connected agent, the start rotating from pass to pass
    for (auto& [id, c] : conns_) order.push_back(c.get());
    if (!order.empty())
      std::rotate(order.begin(), order.begin() + static_cast<long>(rr_ % order.size()),
                  order.end());
    std::vector<Placement> placements;
    for (const TrialRecord& trial : *queued) {
      if (stopping_ || free.empty()) break;
      const size_t placed = placements.size();
      // Judged (UNSUPPORTED, ERROR) rather than placed: it left the queue already.
      if (TryPlaceLocked(trial, order, free, &placements) && placements.size() == placed) ++changed;
    }
    changed += LeaseAndAssignLocked(placements, now);
    ++rr_;
  }
  if (changed > 0) {
    next_idle_scan_ms_ = 0;
    scan_boost_ = 1;
  } else {
    next_idle_scan_ms_ = now + kIdleScanIntervalMs;
    if (queued->size() >= limit) scan_boost_ = std::min(scan_boost_ * 4, kMaxScanLimit);
  }
}

int CoordinatorServer::Impl::LeaseAndAssignLocked(const std::vector<Placement>& placements,
                                                  int64_t now) {
  if (placements.empty()) return 0;
  const int64_t expires = now + options_.lease_ms;
  std::vector<LeaseRequest> leases;
  leases.reserve(placements.size());
  for (const Placement& p : placements) {
    const SlotInfo& first = p.conn->slots[static_cast<size_t>(p.slots[0])];
    leases.push_back(
        {p.trial->trial_id, p.conn->agent_id, expires, LeasePlace{first.gpu_name, first.sm}});
  }
  std::vector<absl::StatusOr<TrialRecord>> leased = store_->LeaseTrials(leases);
  int assigned = 0;
  for (size_t i = 0; i < placements.size(); ++i) {
    const Placement& p = placements[i];
    if (!leased[i].ok()) {
      Log(absl::StrCat("leasing ", p.trial->trial_id, ": ", leased[i].status().message()));
      continue;
    }
    TrialRequest req;
    req.trial_id = leased[i]->trial_id;
    req.attempt = leased[i]->attempt;
    req.model = leased[i]->model;
    req.layers = leased[i]->layers;
    req.seed = leased[i]->seed;
    req.config = p.config;
    req.workload = leased[i]->workload;
    v1::CoordinatorMessage m;
    v1::Assignment* a = m.mutable_assignment();
    a->set_trial_id(req.trial_id);
    a->set_attempt(req.attempt);
    a->set_request_json(ToJson(req).dump());
    a->set_lease_expires_ms(expires);
    for (int s : p.slots) a->add_slots(s);
    Held h;
    h.attempt = req.attempt;
    h.sweep_id = leased[i]->sweep_id;
    h.slots = p.slots;
    held_[p.conn->agent_id][req.trial_id] = std::move(h);
    ++stats_.assignments;
    p.conn->Enqueue(std::move(m));
    ++assigned;
  }
  return assigned;
}

CoordinatorServer::Impl::FreeSlots CoordinatorServer::Impl::FreeSlotsLocked() const {
  FreeSlots free;
  std::vector<bool> busy;
  for (const auto& [id, conn] : conns_) {
    busy.assign(conn->slots.size(), false);
    if (auto h = held_.find(id); h != held_.end())
      for (const auto& [tid, held] : h->second)
        for (int slot : held.slots)
          if (slot >= 0 && static_cast<size_t>(slot) < busy.size()) busy[slot] = true;
    std::vector<int> slots;
    for (const SlotInfo& slot : conn->slots)
      if (!busy[static_cast<size_t>(slot.index)]) slots.push_back(slot.index);
    if (!slots.empty()) free.emplace_hint(free.end(), id, std::move(slots));
  }
  return free;
}

bool CoordinatorServer::Impl::TryPlaceLocked(const TrialRecord& trial,
                                             const std::vector<Conn*>& order, FreeSlots& free,
                                             std::vector<Placement>* placements) {
  absl::StatusOr<BackendConfig> config = NormalizeBackendConfig(trial.config);
  if (!config.ok()) {
    RecordCoordinatorResult(trial, TrialStatus::kError,
                            absl::StrCat("invalid config: ", config.status().message()), nullptr);
    return true;
  }
  const int needed = std::max(1, trial.selector.gpus_needed);
  // Preflight depends on the slot's SM and its agent's build and GPU count only: once per kind.
  std::map<std::tuple<int, bool, int>, PreflightResult> preflight;
  auto judge = [&](const Conn& conn, const SlotInfo& slot) -> const PreflightResult& {
    const std::tuple<int, bool, int> key{slot.sm, conn.hello.cuda_build(), conn.gpu_count};
    auto pf = preflight.find(key);
    if (pf == preflight.end()) {
      PreflightTarget target;
      target.has_cuda_build = conn.hello.cuda_build();
      target.sm = slot.sm;
      target.gpu_count = conn.gpu_count;
      pf = preflight.emplace(key, Preflight(*config, target)).first;
    }
    return pf->second;
  };

  for (Conn* conn : order) {
    auto f = free.find(conn->agent_id);
    if (f == free.end() || static_cast<int>(f->second.size()) < needed) continue;
    std::vector<int> free_supported;
    for (int index : f->second) {
      const SlotInfo& slot = conn->slots[static_cast<size_t>(index)];
      if (!MatchesLocked(trial.selector, slot) || !judge(*conn, slot).supported) continue;
      free_supported.push_back(index);
      if (static_cast<int>(free_supported.size()) == needed) break;
    }
    if (static_cast<int>(free_supported.size()) < needed) continue;

    placements->push_back(Placement{&trial, conn, *config, free_supported});
    for (int used : free_supported) std::erase(f->second, used);
    if (f->second.empty()) free.erase(f);
    return true;
  }

  // No free slot takes it. It is UNSUPPORTED when some agent matches it but none supports it.
  bool any_match = false, any_supported = false;
  std::string first_reason;
  std::optional<SlotInfo> first_slot;
  for (Conn* conn : order) {
    int matching = 0;
    for (const SlotInfo& slot : conn->slots) {
      if (!MatchesLocked(trial.selector, slot)) continue;
      ++matching;
      if (!first_slot) first_slot = slot;
      const PreflightResult& pf = judge(*conn, slot);
      if (pf.supported) {
        any_supported = true;
        break;
      }
      if (first_reason.empty()) first_reason = pf.reason;
    }
    if (matching >= needed) any_match = true;
    if (any_supported) return false;
  }
  if (any_match && !any_supported) {
    ++stats_.unsupported;
    RecordCoordinatorResult(trial, TrialStatus::kUnsupported, first_reason,
                            first_slot ? &*first_slot : nullptr);
    return true;
  }
  return false;
}

// ------------------------------------------------------------------------------ user API

grpc::Status CoordinatorServer::Impl::SubmitSweep(const v1::SubmitSweepRequest& req,
                                                  v1::SubmitSweepResponse* resp) {
  const std::string source = req.source().empty() ? "<request>" : req.source().substr(0, 256);
  if (req.spec_yaml().size() > kMaxSweepSpecBytes)
    return GrpcError(grpc::StatusCode::INVALID_ARGUMENT,
                     absl::StrCat(source, ": spec is ", req.spec_yaml().size(),
                                  " bytes; the limit is ", kMaxSweepSpecBytes));
  absl::StatusOr<SweepSpec> spec = ParseSweepSpec(req.spec_yaml(), source);
  if (!spec.ok()) return rpc::ToGrpcStatus(spec.status());
  absl::StatusOr<std::vector<std::string>> warnings = CheckSweepModel(*spec);
  if (!warnings.ok()) return rpc::ToGrpcStatus(warnings.status());
  absl::StatusOr<std::vector<TrialRecord>> trials =
      ExpandSweep(*spec, 0, options_.max_trials_per_sweep);
  if (!trials.ok()) return rpc::ToGrpcStatus(trials.status());
  // A preset's identity is known here (a pure function of name, layers, seed and format), so
  // every result of its trials is filed under it, also those made without an agent. A
  // checkpoint's needs its files: the agent that runs it says.
  std::map<std::tuple<std::string, int, uint64_t>, std::string> preset_keys;
  for (TrialRecord& t : *trials) {
    if (!absl::StartsWith(t.model, "preset:")) continue;
    auto [it, fresh] = preset_keys.try_emplace({t.model, t.layers, t.seed});
    if (fresh) {
      absl::StatusOr<ModelDescription> d = ParseModelDescription(t.model);
      absl::StatusOr<ModelIdentity> id =
          d.ok() ? DescribePreset(d->model.substr(7), t.layers, t.seed, d->quantize) : d.status();
      if (id.ok()) it->second = ModelIdentityKey(*id);
    }
    t.model_key = it->second;
  }
  absl::StatusOr<int64_t> id = store_->CreateSweep(MakeSweepRecord(*spec), *trials);
  if (!id.ok()) return rpc::ToGrpcStatus(id.status());
  resp->set_sweep_id(*id);
  resp->set_trial_count(static_cast<int64_t>(trials->size()));
  for (const std::string& w : *warnings) resp->add_warnings(w);
  Log(absl::StrCat("sweep ", *id, " '", spec->name, "' submitted: ", trials->size(), " trial(s)",
                   warnings->empty() ? "" : "; warning: ", absl::StrJoin(*warnings, "; ")));
  Wake();
  return grpc::Status::OK;
}

void CoordinatorServer::Impl::FillSweepInfo(const SweepRecord& s, bool with_counts,
                                            v1::SweepInfo* out) {
  out->set_sweep_id(s.id);
  out->set_name(s.name);
  out->set_model(s.model);
  out->set_state(s.state);
  out->set_created_unix_ms(s.created_unix_ms);
  out->set_trials_total(s.trials_total);
  out->set_trials_done(s.trials_done);
  out->set_priority(s.priority);
  // Running = leased: every lease the coordinator holds for the sweep, including those
  // recovered from the database after a restart (no slots until their agent's Hello confirms
  // them) and those of an agent that came back without the trial (released after a grace
  // period), so that queued = total - done - running counts only trials waiting for a slot.
  int64_t running = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [agent, held] : held_)
      for (const auto& [tid, h] : held)
        if (h.sweep_id == s.id && !h.foreign) ++running;
  }
  out->set_trials_running(running);
  if (!with_counts) return;
  if (auto counts = store_->CountResults(s.id); counts.ok())
    for (const auto& [status, n] : *counts) (*out->mutable_status_counts())[status] = n;
}

grpc::Status CoordinatorServer::Impl::GetSweep(const v1::GetSweepRequest& req, v1::SweepInfo* resp) {
  absl::StatusOr<SweepRecord> s = store_->GetSweep(req.sweep_id());
  if (!s.ok()) return rpc::ToGrpcStatus(s.status());
  FillSweepInfo(*s, /*with_counts=*/true, resp);
  resp->set_spec_yaml(s->spec_yaml);
  return grpc::Status::OK;
}

grpc::Status CoordinatorServer::Impl::ListSweeps(v1::ListSweepsResponse* resp) {
  absl::StatusOr<std::vector<SweepRecord>> sweeps = store_->ListSweeps();
  if (!sweeps.ok()) return rpc::ToGrpcStatus(sweeps.status());
  for (const SweepRecord& s : *sweeps) FillSweepInfo(s, /*with_counts=*/false, resp->add_sweeps());
  return grpc::Status::OK;
}

grpc::Status CoordinatorServer::Impl::CancelSweep(const v1::CancelSweepRequest& req,
                                                  v1::CancelSweepResponse* resp) {
  if (absl::Status s = store_->CancelSweep(req.sweep_id()); !s.ok()) return rpc::ToGrpcStatus(s);
  int64_t sent = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [agent, held] : held_) {
    auto c = conns_.find(agent);
    if (c == conns_.end()) continue;
    for (const auto& [tid, h] : held) {
      if (h.sweep_id != req.sweep_id() || h.foreign) continue;
      v1::CoordinatorMessage m;
      m.mutable_cancel()->set_trial_id(tid);
      c->second->Enqueue(std::move(m));
      ++sent;
    }
  }
  resp->set_trials_cancelled_running(sent);
  Log(absl::StrCat("sweep ", req.sweep_id(), " cancelled (", sent, " running trial(s) told)"));
  return grpc::Status::OK;
}

grpc::Status CoordinatorServer::Impl::ListAgents(v1::ListAgentsResponse* resp) {
  absl::StatusOr<std::vector<AgentRecord>> agents = store_->ListAgents();
  if (!agents.ok()) return rpc::ToGrpcStatus(agents.status());
  std::lock_guard<std::mutex> lock(mu_);
  for (const AgentRecord& a : *agents) {
    v1::AgentInfo* info = resp->add_agents();
    info->set_agent_id(a.agent_id);
    info->set_host(a.host);
    info->set_last_seen_unix_ms(a.last_seen_unix_ms);
    v1::Hello hello;
    google::protobuf::util::JsonParseOptions opts;
    opts.ignore_unknown_fields = true;
    if (google::protobuf::util::JsonStringToMessage(a.inventory_json, &hello, opts).ok()) {
      *info->mutable_gpus() = hello.gpus();
      info->set_cpu_only(hello.gpus_size() == 0);
      info->set_engine_version(hello.engine_version());
    }
    auto c = conns_.find(a.agent_id);
    info->set_connected(c != conns_.end());
    if (c == conns_.end()) continue;
    const Conn& conn = *c->second;
    info->set_slots(static_cast<int32_t>(conn.slots.size()));
    int free = 0;
    for (const SlotInfo& s : conn.slots)
      if (!SlotBusyLocked(a.agent_id, s.index)) ++free;
    info->set_free_slots(free);
    info->set_bad_messages(conn.bad_messages.load());
    if (auto h = held_.find(a.agent_id); h != held_.end())
      for (const auto& [tid, held] : h->second)
        if (!held.slots.empty()) info->add_running_trial_ids(tid);
  }
  return grpc::Status::OK;
}

namespace {

void FillRow(const StoredResult& r, std::string json, v1::ResultRow* row) {
  row->set_sweep_id(r.sweep_id);
  row->set_agent_id(r.agent_id);
  row->set_gpu_name(r.gpu_name);
  row->set_sm(r.sm);
  row->set_result_json(std::move(json));
  if (r.model_key) row->set_model_key(*r.model_key);
  if (r.workload) row->set_workload(*r.workload);
  if (r.engine_version) row->set_engine_version(*r.engine_version);
  if (r.software) row->set_software(*r.software);
}

}  // namespace

grpc::Status CoordinatorServer::Impl::QueryResults(const v1::QueryResultsRequest& req,
                                                   v1::QueryResultsResponse* resp) {
  ResultQuery q;
  if (req.has_sm()) q.sm = req.sm();
  if (req.has_gpu_name()) q.gpu_name = req.gpu_name();
  if (req.has_model()) q.model = req.model();
  if (req.has_model_key()) q.model_key = req.model_key();
  if (req.has_workload()) q.workload = req.workload();
  if (req.has_layers()) q.layers = req.layers();
  if (req.has_sweep_id()) q.sweep_id = req.sweep_id();
  q.with_kernels = req.with_kernels();
  if (req.has_status()) {
    std::optional<TrialStatus> st = TrialStatusFromName(req.status());
    if (!st)
      return GrpcError(grpc::StatusCode::INVALID_ARGUMENT,
                       absl::StrCat("unknown status '", req.status(),
                                    "' (known: OK, INCORRECT, CRASHED, UNSUPPORTED, TIMEOUT, ERROR)"));
    q.status = *st;
  }
  for (const auto& [axis, value] : req.axis_values()) q.axis_values[axis] = value;
  if (req.has_since_unix_ms()) q.since_unix_ms = req.since_unix_ms();
  if (req.has_until_unix_ms()) q.until_unix_ms = req.until_unix_ms();
  if (req.limit() < 0)
    return GrpcError(grpc::StatusCode::INVALID_ARGUMENT,
                     absl::StrCat("limit must be >= 0, got ", req.limit()));
  q.limit = req.limit() == 0 ? 1000 : std::min(req.limit(), kMaxQueryRows);
  // The stored JSON goes out as it is: the client parses it (the store's parse and a second
  // serialisation here would be most of a query's time).
  absl::StatusOr<std::vector<StoredResult>> rows = store_->QueryResultRows(q);
  if (!rows.ok()) return rpc::ToGrpcStatus(rows.status());
  size_t bytes = 0;
  for (StoredResult& r : *rows) {
    bytes += r.result_json.size() + r.agent_id.size() + r.gpu_name.size() + 256;
    if (bytes > kMaxResultPageBytes) {
      resp->set_truncated(true);
      break;
    }
    FillRow(r, std::move(r.result_json), resp->add_rows());
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorServer::Impl::Best(const v1::BestRequest& req, v1::BestResponse* resp) {
  BestQuery q;
  q.model = req.model();
  if (req.has_sweep_id()) {
    q.sweep_id = req.sweep_id();
    absl::StatusOr<SweepRecord> sweep = store_->GetSweep(req.sweep_id());
    if (!sweep.ok()) return rpc::ToGrpcStatus(sweep.status());
    if (q.model.empty()) q.model = sweep->model;
  }
  if (q.model.empty())
    return GrpcError(grpc::StatusCode::INVALID_ARGUMENT, "best: model (or sweep_id) is required");
  q.sm = req.sm();
  q.metric = req.metric().empty() ? "output_tok_s" : req.metric();
  q.batch = req.batch() == 0 ? 1 : req.batch();
  if (req.has_model_key()) q.model_key = req.model_key();
  if (req.has_workload()) q.workload = req.workload();
  if (req.has_layers()) q.layers = req.layers();
  absl::StatusOr<BestAnswer> best = store_->Best(q);
  if (!best.ok()) return rpc::ToGrpcStatus(best.status());
  resp->set_model(q.model);
  for (const ResultGroup& g : best->groups) {
    v1::ResultGroup* out = resp->add_groups();
    out->set_model_key(g.model_key);
    out->set_workload(g.workload);
    out->set_ok_results(g.ok_results);
    out->set_first_sweep(g.first_sweep);
    out->set_last_sweep(g.last_sweep);
    out->set_last_finished_unix_ms(g.last_finished_unix_ms);
  }
  if (!best->best) return grpc::Status::OK;
  resp->set_found(true);
  FillRow(*best->best, std::move(best->best->result_json), resp->mutable_row());
  return grpc::Status::OK;
}

grpc::Status CoordinatorServer::Impl::Regressions(const v1::RegressionsRequest& req,
                                                  v1::RegressionsResponse* resp) {
  RegressionQuery q;
  if (!req.metric().empty()) q.metric = req.metric();
  if (req.has_model()) q.model = req.model();
  if (req.has_sm()) q.sm = req.sm();
  if (req.has_sweep_id()) q.sweep_id = req.sweep_id();
  if (req.has_model_key()) q.model_key = req.model_key();
  if (req.has_workload()) q.workload = req.workload();
  if (req.has_layers()) q.layers = req.layers();
  if (req.window() != 0) q.options.window = req.window();
  if (req.min_history() != 0) q.options.min_history = req.min_history();
  if (!req.test().empty()) {
    absl::StatusOr<RegressionTest> test = ParseRegressionTest(req.test());
    if (!test.ok()) return rpc::ToGrpcStatus(test.status());
    q.options.test = *test;
  }
  if (req.z_threshold() != 0) q.options.z_threshold = req.z_threshold();
  if (req.iqr_k() != 0) q.options.iqr_k = req.iqr_k();
  if (req.has_min_change()) q.options.min_change = req.min_change();
  if (req.limit() < 0)
    return GrpcError(grpc::StatusCode::INVALID_ARGUMENT,
                     absl::StrCat("limit must be >= 0, got ", req.limit()));
  if (req.limit() != 0) q.limit = req.limit();
  absl::StatusOr<std::vector<RegressionRow>> rows = FindRegressions(*store_, q);
  if (!rows.ok()) return rpc::ToGrpcStatus(rows.status());
  for (const RegressionRow& r : *rows) *resp->add_series() = ToProto(r);
  return grpc::Status::OK;
}

// ------------------------------------------------------------------------------ facade

CoordinatorServer::CoordinatorServer(CoordinatorOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
CoordinatorServer::~CoordinatorServer() { Stop(); }
absl::StatusOr<int> CoordinatorServer::Start(const std::string& address,
                                             const std::string& db_path) {
  return impl_->Start(address, db_path);
}
void CoordinatorServer::Stop() { impl_->Stop(); }
void CoordinatorServer::Wait() { impl_->Wait(); }
Store* CoordinatorServer::store() { return impl_->store(); }
int CoordinatorServer::metrics_port() { return impl_->metrics_port(); }
std::string CoordinatorServer::MetricsText() { return impl_->MetricsText(); }
CoordinatorStats CoordinatorServer::stats() { return impl_->stats(); }

}  // namespace infersweep
