// The Store's fleet state: sweeps and their trials, the trials' leases, and the agents.
// Internal to storage/.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "storage/ingest.h"
#include "storage/sqlite.h"
#include "storage/store.h"

namespace infersweep {

// Every method runs with the connection's lock held (the Store takes it for the whole call) and
// does what the Store method of its name documents. Trials point at interned configs, and a
// lease lost for the last time ends in an ERROR result: both go through `ingest`.
class FleetState {
 public:
  FleetState(Connection& conn, Ingest& ingest) : conn_(conn), ingest_(ingest) {}
  FleetState(const FleetState&) = delete;
  FleetState& operator=(const FleetState&) = delete;

  // Sweeps.
  absl::StatusOr<int64_t> CreateSweep(const SweepRecord& sweep,
                                      const std::vector<TrialRecord>& trials)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<SweepRecord> GetSweep(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<std::vector<SweepRecord>> ListSweeps() ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::Status CancelSweep(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());

  // Trials.
  absl::StatusOr<std::vector<TrialRecord>> QueuedTrials(int limit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<std::vector<Selector>> QueuedSelectors(int64_t sweep_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<TrialCounts> CountTrials() ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<TrialRecord> GetTrial(const std::string& trial_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());

  // Leases.
  std::vector<absl::StatusOr<TrialRecord>> LeaseTrials(const std::vector<LeaseRequest>& leases)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::Status RenewLeases(const std::string& agent_id, int64_t expires_unix_ms)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<std::vector<LostLease>> RequeueExpired(int64_t now_unix_ms, int max_attempts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<LostLease> ReleaseLease(const std::string& trial_id, const std::string& agent_id,
                                         int attempt, int max_attempts, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());

  // Agents.
  absl::Status UpsertAgent(const AgentRecord& agent) ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::Status SetAgentConnected(const std::string& agent_id, bool connected, int64_t now_unix_ms)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<std::vector<AgentRecord>> ListAgents() ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());

 private:
  // One lease inside the caller's transaction: queued -> leased, attempt + 1.
  absl::StatusOr<TrialRecord> LeaseOneLocked(const LeaseRequest& l)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  // One lost lease inside the caller's transaction: requeue it, or finish it with an ERROR when
  // it has had max_attempts attempts. `attempt` < 0 accepts the current attempt.
  absl::StatusOr<LostLease> LoseLeaseLocked(const std::string& trial_id,
                                            const std::string& agent_id, int attempt,
                                            int max_attempts, const std::string& why,
                                            const std::string& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());

  Connection& conn_;
  Ingest& ingest_;
};

}  // namespace infersweep
