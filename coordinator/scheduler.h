// The scheduler: one thread, woken by events (submit, hello, stored results, disconnect) or every
// tick. Each pass requeues expired leases, releases trials a reconnected agent lost, and places
// queued trials on free slots: preflight judges each config per kind of slot, a trial no agent
// supports is stored as UNSUPPORTED, and the placed trials are leased in one transaction and sent
// as Assignments. It also exports the fleet's state (agents, queue, leases) to the metrics.
//
// The connections and held trials it places on are the agent sessions' (AgentSessions): a pass
// runs inside AgentSessions::WithFleet, under the sessions' lock, so its view of free slots
// cannot change until its leases are held and sent. The scheduler's own lock (wake-up and stop)
// is never held while it calls another part.
//
// Private to coordinator/.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "api/backend_config.h"
#include "coordinator/agent_sessions.h"
#include "coordinator/fleet.h"
#include "coordinator/server.h"
#include "coordinator/services.h"
#include "storage/store.h"

namespace infersweep::coordinator {

class Scheduler {
 public:
  Scheduler(const CoordinatorServices& services, AgentSessions& sessions, SelectorMatcher& matcher);
  ~Scheduler();  // Stop()s
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  void Start();
  // Ends the pass under way, if any, and the thread. Idempotent.
  void Stop();
  // Runs a pass now rather than at the next tick.
  void Wake();

  // Adds this part's counts (assignments, UNSUPPORTED, lost, requeued, exhausted) to `stats`.
  void AddStats(CoordinatorStats* stats) const;

 private:
  // A trial placed on an agent's free slots, to be leased with the rest of its pass.
  struct Placement {
    const TrialRecord* trial;
    const AgentInventory* agent;
    BackendConfig config;  // normalized
    std::vector<int> slots;
  };

  void Loop();
  void ScheduleOnce(bool event);
  // Requeues expired leases (at most once a tick) and releases those of trials reconnected
  // agents lost; true when any lease was released.
  bool ReleaseLostLeases(int64_t now);
  // Logs, counts and exports a lease the store released (requeued or ended as ERROR).
  void OnLeaseLost(const LostLease& lost, const std::string& how);
  // Places or judges one queued trial on the agents in `order`, taking the slots it uses out of
  // `free` (a placement is added to `placements`, an UNSUPPORTED or ERROR result is stored);
  // returns true when it is no longer the queue's.
  bool TryPlace(const TrialRecord& trial, const std::vector<const AgentInventory*>& order,
                FreeSlots& free, std::vector<Placement>* placements);
  // Leases a pass's placements in one transaction and sends each its Assignment; returns how
  // many were leased.
  int LeaseAndAssign(AgentSessions::Fleet& fleet, const std::vector<Placement>& placements,
                     int64_t now);
  void RecordCoordinatorResult(const TrialRecord& trial, TrialStatus status,
                               const std::string& reason, const SlotInfo* slot);
  // Agents connected, queued and leased trials (at most once a second: CountTrials scans).
  void UpdateFleetMetrics(int64_t now);

  const CoordinatorServices& services_;
  AgentSessions& sessions_;
  SelectorMatcher& matcher_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool wake_ = false;                  // guarded by mu_
  std::atomic<bool> stopping_{false};  // read by the loop under mu_, by a pass without it
  std::thread thread_;

  // The scheduler thread's alone.
  size_t rr_ = 0;  // round-robin start among agents
  // Queue scans: how many queued trials one scan reads, and when a scan that changed nothing
  // may run again without an event.
  size_t scan_boost_ = 1;
  int64_t next_idle_scan_ms_ = 0;
  int64_t next_requeue_ms_ = 0;  // RequeueExpired runs at most once a tick
  int64_t next_fleet_metrics_ms_ = 0;

  struct Counts {
    std::atomic<int64_t> assignments{0}, unsupported{0}, lost{0}, requeued{0},
        attempts_exhausted{0};
  };
  Counts counts_;
};

}  // namespace infersweep::coordinator
