// CoordinatorServer: startup (store, recovered leases, metrics listener, gRPC services, the
// scheduler and committer threads), shutdown, and the public facade. The work is the parts'
// (coordinator/services.h lists them); Impl owns them and the services they share.
//
// Locks across parts (an arrow: the left one may be held while the right one is taken, never
// the reverse; coordinator/agent_sessions.h says where):
//   AgentSessions -> an agent stream's outbound queue
//   AgentSessions -> SelectorMatcher
//   AgentSessions -> the store's own locks
// The scheduler's and the committer's locks guard only their own queues and flags and are never
// held while another part is called; Impl's lock guards only its start and stop flags.
#include "coordinator/server.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "coordinator/agent_identity.h"
#include "coordinator/agent_sessions.h"
#include "coordinator/committer.h"
#include "coordinator/fleet.h"
#include "coordinator/metrics.h"
#include "coordinator/scheduler.h"
#include "coordinator/services.h"
#include "coordinator/user_api.h"
#include "proto/rpc.h"

namespace infersweep {

using coordinator::NowMs;

class CoordinatorServer::Impl {
 public:
  explicit Impl(CoordinatorOptions options) : options_(std::move(options)) {
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
    if (sessions_) return sessions_->DescribeIdentity();
    return AgentAuthenticator().Describe(options_.tls.server_enabled() &&
                                         !options_.tls.client_ca_file.empty());
  }
  int metrics_port() { return metrics_->port(); }
  std::string MetricsText() { return metrics_->Serialize(); }
  CoordinatorStats stats() {
    CoordinatorStats s;
    if (sessions_) sessions_->AddStats(&s);
    if (scheduler_) scheduler_->AddStats(&s);
    if (user_api_) user_api_->AddStats(&s);
    return s;
  }

 private:
  // The authenticator of agent streams, after the checks of the tokens against each other.
  absl::StatusOr<AgentAuthenticator> MakeAuthenticator() const;
  void Log(const std::string& line) const { services_->Log(line); }

  CoordinatorOptions options_;                   // normalized in the constructor
  std::unique_ptr<CoordinatorMetrics> metrics_;  // always kept; served when metrics_listen is set
  std::unique_ptr<Store> store_;
  // The parts, made in Start once the store is open; each outlives the threads that call it.
  std::unique_ptr<coordinator::CoordinatorServices> services_;
  coordinator::SelectorMatcher matcher_;
  std::unique_ptr<coordinator::Committer> committer_;
  std::unique_ptr<coordinator::AgentSessions> sessions_;
  std::unique_ptr<coordinator::Scheduler> scheduler_;
  std::unique_ptr<coordinator::UserApi> user_api_;
  std::unique_ptr<grpc::Server> server_;

  std::mutex mu_;
  std::condition_variable stopped_cv_;
  bool started_ = false;   // guarded by mu_
  bool stopping_ = false;  // guarded by mu_
};

absl::StatusOr<AgentAuthenticator> CoordinatorServer::Impl::MakeAuthenticator() const {
  if (!options_.agent_token.empty() && options_.agent_token == options_.user_token)
    return absl::InvalidArgumentError(
        "the agent token and the user token must differ (each must not work on the other API)");
  for (const auto& [id, token] : options_.agent_tokens)
    if (!options_.user_token.empty() && token == options_.user_token)
      return absl::InvalidArgumentError(absl::StrCat(
          "the token of agent '", id, "' is the user token; each must not work on the other API"));
  AgentAuthOptions auth;
  auth.shared_token = options_.agent_token;
  auth.agent_tokens = options_.agent_tokens;
  auth.bind_to_certificate = options_.bind_agent_to_certificate;
  return AgentAuthenticator::Create(std::move(auth));
}

absl::StatusOr<int> CoordinatorServer::Impl::Start(const std::string& address,
                                                   const std::string& db_path) {
  ASSIGN_OR_RETURN(AgentAuthenticator authenticator, MakeAuthenticator());
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   rpc::MakeServerCredentials(options_.tls));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (started_) return absl::FailedPreconditionError("coordinator already started");
    started_ = true;
  }
  StoreOptions store_options;
  store_options.busy_timeout_ms = options_.db_busy_timeout_ms;
  store_options.file_mode = options_.db_file_mode;
  ASSIGN_OR_RETURN(store_, Store::Open(db_path, store_options));

  services_ = std::make_unique<coordinator::CoordinatorServices>(coordinator::CoordinatorServices{
      options_, *store_, *metrics_, [this] { scheduler_->Wake(); }});
  committer_ = std::make_unique<coordinator::Committer>(
      *services_, [this](coordinator::PendingResult& pending, const absl::Status& stored) {
        sessions_->Answer(pending, stored);
      });
  sessions_ = std::make_unique<coordinator::AgentSessions>(*services_, std::move(authenticator),
                                                           *committer_);
  scheduler_ = std::make_unique<coordinator::Scheduler>(*services_, *sessions_, matcher_);
  user_api_ = std::make_unique<coordinator::UserApi>(*services_, *sessions_, matcher_);

  // Nobody is connected to a coordinator that is only starting.
  if (auto agents = store_->ListAgents(); agents.ok()) {
    for (const AgentRecord& a : *agents)
      if (a.connected) (void)store_->SetAgentConnected(a.agent_id, false, NowMs());
  }
  sessions_->RecoverHeld();
  if (auto keys = store_->ResultModelArchs(); keys.ok()) {
    for (const auto& [model, sm] : *keys) metrics_->DeclareTrialSeries(model, sm);
  } else {
    Log(absl::StrCat("listing stored (model, sm) for the metrics: ", keys.status().message()));
  }
  if (!options_.metrics_listen.empty()) {
    ASSIGN_OR_RETURN(const int metrics_port, metrics_->Listen(options_.metrics_listen));
    Log(absl::StrCat("metrics on http://", options_.metrics_listen, "/metrics (port ", metrics_port,
                     ")"));
  }

  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, credentials, &port);
  rpc::ConfigureServer(builder);
  builder.RegisterService(sessions_.get());
  builder.RegisterService(user_api_.get());
  server_ = builder.BuildAndStart();
  if (!server_ || port == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address,
                                               " (address in use or not a host:port?)"));
  }
  scheduler_->Start();
  committer_->Start();
  const char* transport = !options_.tls.server_enabled()        ? "plaintext"
                          : options_.tls.client_ca_file.empty() ? "TLS"
                                                                : "mutual TLS";
  Log(absl::StrCat("listening on ", address, " (port ", port, ", ", transport, "), database ",
                   db_path));
  Log(agent_identity());
  return port;
}

void CoordinatorServer::Impl::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  stopped_cv_.notify_all();
  if (sessions_) sessions_->StopAccepting();
  if (scheduler_) scheduler_->Stop();
  if (sessions_) sessions_->CancelStreams();
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
  }
  // No stream is left to add results: store what waits, then stop.
  if (committer_) committer_->Stop();
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
std::string CoordinatorServer::agent_identity() { return impl_->agent_identity(); }
Store* CoordinatorServer::store() { return impl_->store(); }
int CoordinatorServer::metrics_port() { return impl_->metrics_port(); }
std::string CoordinatorServer::MetricsText() { return impl_->MetricsText(); }
CoordinatorStats CoordinatorServer::stats() { return impl_->stats(); }

}  // namespace infersweep
