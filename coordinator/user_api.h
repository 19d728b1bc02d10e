// SweepService, the user API: every call passes CheckUser (the per-address rate limit, then the
// bearer token), then submits, reads or cancels sweeps, lists agents, or answers a result, best
// or regression query from the store. What the agents hold and which agents are connected come
// from the agent sessions (AgentSessions), through calls that take the sessions' lock briefly;
// this class's own state is its rate limiter (locked inside) and its counts (atomic).
//
// Private to coordinator/.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "coordinator/agent_sessions.h"
#include "coordinator/fleet.h"
#include "coordinator/rate_limit.h"
#include "coordinator/server.h"
#include "coordinator/services.h"
#include "proto/infersweep.grpc.pb.h"
#include "storage/store.h"

namespace infersweep::coordinator {

class UserApi final : public v1::SweepService::Service {
 public:
  UserApi(const CoordinatorServices& services, AgentSessions& sessions, SelectorMatcher& matcher);

  // The RPC edge: CheckUser, then the call; absl::Status turns into the call's gRPC status here.
  grpc::Status SubmitSweep(grpc::ServerContext* context, const v1::SubmitSweepRequest* req,
                           v1::SubmitSweepResponse* resp) override;
  grpc::Status GetSweep(grpc::ServerContext* context, const v1::GetSweepRequest* req,
                        v1::SweepInfo* resp) override;
  grpc::Status ListSweeps(grpc::ServerContext* context, const v1::ListSweepsRequest* req,
                          v1::ListSweepsResponse* resp) override;
  grpc::Status CancelSweep(grpc::ServerContext* context, const v1::CancelSweepRequest* req,
                           v1::CancelSweepResponse* resp) override;
  grpc::Status ListAgents(grpc::ServerContext* context, const v1::ListAgentsRequest* req,
                          v1::ListAgentsResponse* resp) override;
  grpc::Status QueryResults(grpc::ServerContext* context, const v1::QueryResultsRequest* req,
                            v1::QueryResultsResponse* resp) override;
  grpc::Status Best(grpc::ServerContext* context, const v1::BestRequest* req,
                    v1::BestResponse* resp) override;
  grpc::Status Regressions(grpc::ServerContext* context, const v1::RegressionsRequest* req,
                           v1::RegressionsResponse* resp) override;

  // Adds this part's counts (user auth failures, rate-limited calls) to `stats`.
  void AddStats(CoordinatorStats* stats) const;

 private:
  // RESOURCE_EXHAUSTED when the caller's address is over the user-call rate limit; else OK when
  // user auth is off or the call carries "authorization: Bearer <user_token>"; UNAUTHENTICATED
  // (counted) otherwise.
  absl::Status CheckUser(grpc::ServerContext& context);
  // CheckUser, then `call`, as the call's gRPC status.
  grpc::Status Serve(grpc::ServerContext& context, absl::FunctionRef<absl::Status()> call);

  absl::Status Submit(const v1::SubmitSweepRequest& req, v1::SubmitSweepResponse* resp);
  // One log line for a refused submit: the caller's address, the spec's source and why (rate
  // limit refusals are counted in metrics instead: a flood must not flood the log).
  void LogRefusedSubmit(const std::string& peer, const std::string& source,
                        const absl::Status& status);
  absl::Status Get(const v1::GetSweepRequest& req, v1::SweepInfo* resp);
  absl::Status List(v1::ListSweepsResponse* resp);
  absl::Status Cancel(const v1::CancelSweepRequest& req, v1::CancelSweepResponse* resp);
  absl::Status Agents(v1::ListAgentsResponse* resp);
  absl::Status Query(const v1::QueryResultsRequest& req, v1::QueryResultsResponse* resp);
  absl::Status BestOf(const v1::BestRequest& req, v1::BestResponse* resp);
  // The lockstep configs that do not fit at the query's batch size (BestResponse.does_not_fit),
  // from the newest kMaxMemoryVerdictResults results that match it; where they cannot be read,
  // the answer goes without them and the log says why.
  absl::Status AddMemoryVerdicts(const BestQuery& best, v1::BestResponse* resp);
  absl::Status RegressionsOf(const v1::RegressionsRequest& req, v1::RegressionsResponse* resp);

  void FillSweepInfo(const SweepRecord& s, bool with_counts, v1::SweepInfo* out);
  // Why some of a sweep's queued trials cannot be placed: the selectors no connected agent
  // matches, in words (SweepInfo.waiting); empty when each has a matching agent.
  std::string UnmatchedSelectors(int64_t sweep_id);

  const CoordinatorServices& services_;
  AgentSessions& sessions_;
  SelectorMatcher& matcher_;
  RateLimiter user_limiter_;  // per peer host, every call

  std::atomic<int64_t> auth_failures_{0};
  std::atomic<int64_t> rate_limited_{0};
};

}  // namespace infersweep::coordinator
