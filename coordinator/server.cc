// CoordinatorServer: startup (store, recovered leases, metrics listener, gRPC services, the
// scheduler and committer threads), shutdown, and the public facade over Impl
// (coordinator/server_impl.h).
#include "coordinator/server.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "coordinator/server_impl.h"

namespace infersweep {

using coordinator_internal::NowMs;

// ------------------------------------------------------------------------------ lifecycle

absl::StatusOr<int> CoordinatorServer::Impl::Start(const std::string& address,
                                                   const std::string& db_path) {
  if (!options_.agent_token.empty() && options_.agent_token == options_.user_token)
    return absl::InvalidArgumentError(
        "the agent token and the user token must differ (each must not work on the other API)");
  for (const auto& [id, token] : options_.agent_tokens)
    if (!options_.user_token.empty() && token == options_.user_token)
      return absl::InvalidArgumentError(absl::StrCat(
          "the token of agent '", id, "' is the user token; each must not work on the other API"));
  {
    AgentAuthOptions auth;
    auth.shared_token = options_.agent_token;
    auth.agent_tokens = options_.agent_tokens;
    auth.bind_to_certificate = options_.bind_agent_to_certificate;
    absl::StatusOr<AgentAuthenticator> authenticator = AgentAuthenticator::Create(std::move(auth));
    if (!authenticator.ok()) return authenticator.status();
    agent_auth_ = *std::move(authenticator);
  }
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
  store_options.file_mode = options_.db_file_mode;
  auto store = Store::Open(db_path, store_options);
  if (!store.ok()) return store.status();
  store_ = *std::move(store);
  // Nobody is connected to a coordinator that is only starting.
  if (auto agents = store_->ListAgents(); agents.ok()) {
    for (const AgentRecord& a : *agents)
      if (a.connected) (void)store_->SetAgentConnected(a.agent_id, false, NowMs());
  }
  RecoverHeld();
  if (auto keys = store_->ResultModelArchs(); keys.ok()) {
    for (const auto& [model, sm] : *keys) metrics_->DeclareTrialSeries(model, sm);
  } else {
    Log(absl::StrCat("listing stored (model, sm) for the metrics: ", keys.status().message()));
  }
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
  Log(agent_identity());
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
