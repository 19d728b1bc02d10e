// The agents' side of the coordinator: AgentService.Connect, one bidirectional stream per agent
// (docs/PROTOCOL.md). A stream is authenticated (coordinator/agent_identity.h), then its Hello is
// validated, then the one-stream-per-agent-id rule decides between it and a stream already
// connected under that id; the agent is answered with Welcome and then sends heartbeats (which
// renew its leases), progress (kept for status) and results (checked here, stored by the
// Committer, answered here with Ack or Error).
//
// AgentSessions owns the connections and the trials each agent holds, as the store leases them
// and the agents report them. The scheduler (coordinator/scheduler.h) reads and extends them
// through WithFleet and the lease methods below; the user API (coordinator/user_api.h) reads
// them through the status methods.
//
// Locks (an arrow: the left one may be held while the right one is taken, never the reverse):
//   mu_ -> a stream's outbound queue (Conn::out_mu): Welcome, Assignments, Cancels, answers
//   mu_ -> SelectorMatcher's lock: a scheduling pass matches selectors inside WithFleet
//   mu_ -> the store's own locks: a scheduling pass leases, a Hello's trials are looked up
// The outbound queues and the matcher take no other lock. The committer's and the scheduler's
// locks are never held while this class is called, and this class releases mu_ before it calls
// either (Committer::Submit, CoordinatorServices::wake).
//
// Private to coordinator/.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/agent_identity.h"
#include "coordinator/committer.h"
#include "coordinator/fleet.h"
#include "coordinator/rate_limit.h"
#include "coordinator/server.h"
#include "coordinator/services.h"
#include "proto/infersweep.grpc.pb.h"
#include "storage/store.h"

namespace infersweep::coordinator {

using AgentStream = grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::AgentMessage>;

// The checks a Hello passes before its stream is accepted (after authentication): protocol
// version, agent id, field sizes, GPU list and peers, list lengths.
absl::Status ValidateHello(const v1::Hello& hello);

class AgentSessions final : public v1::AgentService::Service {
 public:
  AgentSessions(const CoordinatorServices& services, AgentAuthenticator authenticator,
                Committer& committer);
  ~AgentSessions() override;

  // AgentService.Connect: the stream's whole life, from Hello to disconnect.
  grpc::Status Connect(grpc::ServerContext* context, AgentStream* stream) override;

  // How agent ids are bound to credentials, in words (docs/SECURITY.md "Agent identity").
  std::string DescribeIdentity() const;
  // Rebuilds which agent holds which trial from the leases in the store; before any stream.
  void RecoverHeld();
  // Shutdown, in two steps: from StopAccepting on, a new stream is answered UNAVAILABLE;
  // CancelStreams then cancels every stream still open.
  void StopAccepting();
  void CancelStreams();
  // The Committer's answer to a result (Ack, or an Error: permanent, or retryable when the store
  // could not take it now); either way the agent is done with the attempt.
  void Answer(PendingResult& pending, const absl::Status& stored);

  // ---- For the scheduler.

  // The fleet as one scheduling pass sees it. It exists only inside WithFleet, under mu_: no
  // stream joins or leaves and no trial is added or dropped until the pass ends.
  class Fleet {
   public:
    // Every connected agent, in agent-id order rotated left by `rotate` (modulo their number);
    // valid until the pass ends.
    std::vector<const AgentInventory*> Agents(size_t rotate) const;
    FreeSlots Free() const;
    // Holds the trial of `assignment` (leased in the store) on its slots and sends it to the
    // agent.
    void Assign(const std::string& agent_id, int64_t sweep_id, v1::CoordinatorMessage assignment);

   private:
    friend class AgentSessions;
    explicit Fleet(AgentSessions& sessions) : sessions_(sessions) {}
    AgentSessions& sessions_;
  };
  // Runs one scheduling pass over the fleet under mu_.
  void WithFleet(absl::FunctionRef<void(Fleet&)> pass);
  // Free slots across every connected agent.
  size_t FreeSlotCount();
  int ConnectedCount();
  // Drops the held trials whose leases the store has released as expired (an agent's trial
  // the store does not lease to it stays until the agent stops reporting it).
  void ForgetExpired(const std::vector<LostLease>& expired);
  // A held trial a reconnected agent no longer runs, whose grace period is over.
  struct LostTrial {
    std::string agent_id, trial_id;
    int attempt = 0;
  };
  std::vector<LostTrial> LostTrialsDue(int64_t now);
  // After the store released a lost trial's lease, or found it settled (`settled`), the trial
  // is no longer held; otherwise its release is tried again from `retry_at_ms`.
  void SettleLost(const LostTrial& lost, bool settled, int64_t retry_at_ms);

  // ---- For the user API.

  // Every connected agent's inventory, for reading without the lock.
  std::vector<std::shared_ptr<const AgentInventory>> Connected();
  // The trials of `sweep_id` the agents hold (leased: running, recovered after a restart and not
  // yet confirmed, or lost and in their grace period).
  int64_t HeldTrials(int64_t sweep_id);
  // Tells every connected agent to cancel its trials of `sweep_id`; returns how many were told.
  int64_t CancelHeld(int64_t sweep_id);
  // A connected agent's state now, for ListAgents.
  struct LiveAgent {
    int slots = 0;
    int free_slots = 0;
    int64_t bad_messages = 0;
    std::vector<std::string> running_trial_ids;  // held trials on slots
  };
  std::map<std::string, LiveAgent> LiveAgents();

  // Adds this part's counts (agents connected, results stored, refusals) to `stats`.
  void AddStats(CoordinatorStats* stats);

 private:
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
  using HeldByTrial = std::map<std::string, Held>;  // trial id -> held

  // The credential that proves the Hello's agent id (refusals counted), or why not.
  absl::StatusOr<AgentCredential> Authenticate(grpc::ServerContext& context,
                                               const v1::Hello& hello);
  // Makes `conn` the agent's stream and reconciles what it holds with `hello`'s running and
  // spooled trials. ALREADY_EXISTS (counted) when another credential holds the id;
  // UNAVAILABLE when the coordinator is stopping.
  absl::Status Register(const std::shared_ptr<Conn>& conn, const v1::Hello& hello, int64_t now);
  // Stores the agent's inventory and declares the trial series of its archs.
  void RecordAgent(const Conn& conn, const std::string& peer, int64_t now);
  // Reads the stream's messages until it ends; the status the stream ends with.
  absl::Status ServeMessages(const std::shared_ptr<Conn>& conn, AgentStream* stream);
  // Unregisters `conn` and marks its agent disconnected; false (nothing done) when a newer
  // stream replaced it.
  bool Leave(const std::shared_ptr<Conn>& conn);
  void ReconcileHeldLocked(const AgentInventory& agent, const v1::Hello& hello, int64_t now);
  void OnHeartbeat(Conn& conn, const v1::Heartbeat& hb);
  void OnProgress(Conn& conn, const v1::Progress& p);
  void OnResult(const std::shared_ptr<Conn>& conn, const v1::Result& r);
  // Sends a permanent Error (the agent drops that result) and counts a bad message.
  void Reject(Conn& conn, const std::string& message, const std::string& trial_id, int attempt,
              absl::StatusCode code = absl::StatusCode::kInvalidArgument);
  FreeSlots FreeSlotsLocked() const;

  const CoordinatorServices& services_;
  Committer& committer_;
  const AgentAuthenticator authenticator_;
  RateLimiter agent_limiter_;    // per agent id, messages after Hello
  RateLimiter connect_limiter_;  // per peer host, Connect streams

  std::mutex mu_;
  bool stopping_ = false;                               // guarded by mu_
  std::map<std::string, std::shared_ptr<Conn>> conns_;  // agent id -> live stream; by mu_
  std::map<std::string, HeldByTrial> held_;             // agent id -> held trials; by mu_

  struct Counts {
    std::atomic<int64_t> results_stored{0}, bad_messages{0}, streams_rejected{0}, auth_failures{0},
        rate_limited{0}, store_errors{0}, identity_refused{0}, results_conflicting{0};
  };
  Counts counts_;
};

}  // namespace infersweep::coordinator
