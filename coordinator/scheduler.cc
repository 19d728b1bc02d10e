#include "coordinator/scheduler.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "api/trial.h"
#include "api/version.h"

namespace infersweep::coordinator {

namespace {

// A scan reads 8 queued trials per free slot (at least 64), times a boost that grows 4x after
// each scan that placed nothing while the queue was longer, up to the max: trials behind an
// unplaceable backlog are still reached, and a scan stays cheap while few slots are free.
constexpr size_t kMinScanLimit = 64;
constexpr size_t kScanPerFreeSlot = 8;
constexpr size_t kMaxScanLimit = 65536;
// A scan that placed nothing is repeated on the next event, or after this long.
constexpr int64_t kIdleScanIntervalMs = 2000;

// Whether slots a and b reach each other by peer access, as both report it.
bool PeerAccess(const std::vector<SlotInfo>& slots, int a, int b) {
  auto reaches = [&](int from, int to) {
    const std::vector<int>& peers = slots[static_cast<size_t>(from)].p2p_peers;
    return std::find(peers.begin(), peers.end(), to) != peers.end();
  };
  return reaches(a, b) && reaches(b, a);
}

// `needed` of `candidates` (slot indices, in order) that reach each other pairwise by peer
// access, the first such set in candidate order; empty when there is none. A backtracking search
// over at most 64 slots and sets of at most 64.
std::vector<int> PeerSet(const std::vector<SlotInfo>& slots, const std::vector<int>& candidates,
                         int needed) {
  std::vector<int> chosen;
  std::function<bool(size_t)> extend = [&](size_t from) {
    if (static_cast<int>(chosen.size()) == needed) return true;
    for (size_t i = from; i < candidates.size(); ++i) {
      const int slot = candidates[i];
      if (!std::all_of(chosen.begin(), chosen.end(),
                       [&](int other) { return PeerAccess(slots, slot, other); }))
        continue;
      chosen.push_back(slot);
      if (extend(i + 1)) return true;
      chosen.pop_back();
    }
    return false;
  };
  return extend(0) ? chosen : std::vector<int>{};
}

}  // namespace

Scheduler::Scheduler(const CoordinatorServices& services, AgentSessions& sessions,
                     SelectorMatcher& matcher)
    : services_(services), sessions_(sessions), matcher_(matcher) {}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void Scheduler::Stop() {
  stopping_ = true;
  Wake();  // takes mu_, so the loop sees stopping_ whether it waits now or is about to
  if (thread_.joinable()) thread_.join();
}

void Scheduler::Wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    wake_ = true;
  }
  cv_.notify_all();
}

void Scheduler::AddStats(CoordinatorStats* stats) const {
  stats->assignments += counts_.assignments;
  stats->unsupported += counts_.unsupported;
  stats->lost += counts_.lost;
  stats->requeued += counts_.requeued;
  stats->attempts_exhausted += counts_.attempts_exhausted;
}

void Scheduler::Loop() {
  while (true) {
    bool event;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(services_.options.tick_ms),
                   [&] { return stopping_ || wake_; });
      if (stopping_) return;
      event = wake_;
      wake_ = false;
    }
    ScheduleOnce(event);
    UpdateFleetMetrics(NowMs());
  }
}

// ------------------------------------------------------------------------------ lost leases

bool Scheduler::ReleaseLostLeases(int64_t now) {
  bool released_any = false;
  absl::StatusOr<std::vector<LostLease>> expired = std::vector<LostLease>();
  if (now >= next_requeue_ms_) {  // a write transaction: once a tick, not on every event
    next_requeue_ms_ = now + services_.options.tick_ms;
    expired = services_.store.RequeueExpired(now, services_.options.max_attempts);
  }
  if (!expired.ok()) {
    services_.Log(absl::StrCat("requeueing expired leases: ", expired.status().message()));
  } else if (!expired->empty()) {
    released_any = true;
    sessions_.ForgetExpired(*expired);
    for (const LostLease& l : *expired) OnLeaseLost(l, "expired");
  }

  // Trials a reconnected agent held but no longer runs, past their grace period: their leases
  // are released (requeued, or ERROR at the attempt cap).
  const std::vector<AgentSessions::LostTrial> lost = sessions_.LostTrialsDue(now);
  for (const AgentSessions::LostTrial& l : lost) {
    absl::StatusOr<LostLease> released = services_.store.ReleaseLease(
        l.trial_id, l.agent_id, l.attempt, services_.options.max_attempts,
        "the agent reconnected without the trial and sent no result for it");
    // FailedPrecondition: its result came in the meantime, or the lease expired first. Else the
    // store is busy or full: the release is tried again later.
    const bool settled = released.ok() || absl::IsFailedPrecondition(released.status());
    sessions_.SettleLost(l, settled, now + 1000);
    if (released.ok()) {
      ++counts_.lost;
      OnLeaseLost(*released, "its agent came back without it");
    } else if (!settled) {
      services_.Log(
          absl::StrCat("releasing the lease of ", l.trial_id, ": ", released.status().message()));
    }
  }
  return released_any || !lost.empty();
}

void Scheduler::OnLeaseLost(const LostLease& l, const std::string& how) {
  if (l.requeued) {
    services_.Log(absl::StrCat("trial ", l.trial_id, " attempt ", l.attempt, " lost (", how,
                               ", agent ", l.agent_id, "): requeued"));
    services_.metrics.CountLeaseLost(/*requeued=*/true);
    ++counts_.requeued;
    return;
  }
  services_.Log(absl::StrCat("trial ", l.trial_id, " stored as ERROR: ", l.reason));
  services_.metrics.CountLeaseLost(/*requeued=*/false);
  if (absl::StatusOr<TrialRecord> t = services_.store.GetTrial(l.trial_id); t.ok()) {
    TrialResult r;
    r.trial_id = l.trial_id;
    r.attempt = l.attempt;
    r.status = TrialStatus::kError;
    r.reason = l.reason;
    services_.ExportResult(r, t->lease_place.gpu_name, t->lease_place.sm);
  }
  ++counts_.attempts_exhausted;
}

// ------------------------------------------------------------------------------ placement

void Scheduler::ScheduleOnce(bool event) {
  const int64_t now = NowMs();
  if (ReleaseLostLeases(now)) event = true;
  // Nothing can be placed while every slot is busy (a trial that no agent supports is judged on
  // the next pass with a free slot); a freed slot is an event.
  const size_t free_total = sessions_.FreeSlotCount();
  if (free_total == 0) return;
  if (!event && now < next_idle_scan_ms_) return;
  const size_t limit =
      std::min(kMaxScanLimit, std::max(kMinScanLimit, kScanPerFreeSlot * free_total) * scan_boost_);
  auto queued = services_.store.QueuedTrials(static_cast<int>(limit));
  if (!queued.ok()) {
    services_.Log(absl::StrCat("listing queued trials: ", queued.status().message()));
    return;
  }
  int changed = 0;
  sessions_.WithFleet([&](AgentSessions::Fleet& fleet) {
    FreeSlots free = fleet.Free();
    // Every connected agent, the start rotating from pass to pass.
    const std::vector<const AgentInventory*> order = fleet.Agents(rr_);
    std::vector<Placement> placements;
    for (const TrialRecord& trial : *queued) {
      if (stopping_ || free.empty()) break;
      const size_t placed = placements.size();
      // Judged (UNSUPPORTED, ERROR) rather than placed: it left the queue already.
      if (TryPlace(trial, order, free, &placements) && placements.size() == placed) ++changed;
    }
    changed += LeaseAndAssign(fleet, placements, now);
    ++rr_;
  });
  if (changed > 0) {
    next_idle_scan_ms_ = 0;
    scan_boost_ = 1;
  } else {
    next_idle_scan_ms_ = now + kIdleScanIntervalMs;
    if (queued->size() >= limit) scan_boost_ = std::min(scan_boost_ * 4, kMaxScanLimit);
  }
}

int Scheduler::LeaseAndAssign(AgentSessions::Fleet& fleet, const std::vector<Placement>& placements,
                              int64_t now) {
  if (placements.empty()) return 0;
  const int64_t expires = now + services_.options.lease_ms;
  std::vector<LeaseRequest> leases;
  leases.reserve(placements.size());
  for (const Placement& p : placements) {
    const SlotInfo& first = p.agent->slots[static_cast<size_t>(p.slots[0])];
    leases.push_back(
        {p.trial->trial_id, p.agent->agent_id, expires, LeasePlace{first.gpu_name, first.sm}});
  }
  std::vector<absl::StatusOr<TrialRecord>> leased = services_.store.LeaseTrials(leases);
  int assigned = 0;
  for (size_t i = 0; i < placements.size(); ++i) {
    const Placement& p = placements[i];
    if (!leased[i].ok()) {
      services_.Log(
          absl::StrCat("leasing ", p.trial->trial_id, ": ", leased[i].status().message()));
      continue;
    }
    services_.metrics.DeclareTrialSeries(leased[i]->model,
                                         p.agent->slots[static_cast<size_t>(p.slots[0])].sm);
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
    ++counts_.assignments;
    fleet.Assign(p.agent->agent_id, leased[i]->sweep_id, std::move(m));
    ++assigned;
  }
  return assigned;
}

bool Scheduler::TryPlace(const TrialRecord& trial, const std::vector<const AgentInventory*>& order,
                         FreeSlots& free, std::vector<Placement>* placements) {
  absl::StatusOr<BackendConfig> config = NormalizeBackendConfig(trial.config);
  if (!config.ok()) {
    RecordCoordinatorResult(trial, TrialStatus::kError,
                            absl::StrCat("invalid config: ", config.status().message()), nullptr);
    return true;
  }
  // A GPU config's tensor-parallel ranks take a GPU each, whatever the selector asks for.
  const int needed =
      std::max({1, trial.selector.gpus_needed,
                ConfigDevice(*config) == Device::kCuda ? TensorParallelRanks(*config) : 1});
  // Preflight depends on the slot's SM and its agent's build and GPU count only: once per kind.
  std::map<std::tuple<int, bool, int>, PreflightResult> preflight;
  auto judge = [&](const AgentInventory& agent, const SlotInfo& slot) -> const PreflightResult& {
    const std::tuple<int, bool, int> key{slot.sm, agent.hello.cuda_build(), agent.gpu_count};
    auto pf = preflight.find(key);
    if (pf == preflight.end()) {
      PreflightTarget target;
      target.has_cuda_build = agent.hello.cuda_build();
      target.sm = slot.sm;
      target.gpu_count = agent.gpu_count;
      pf = preflight.emplace(key, Preflight(*config, target)).first;
    }
    return pf->second;
  };

  for (const AgentInventory* agent : order) {
    auto f = free.find(agent->agent_id);
    if (f == free.end() || static_cast<int>(f->second.size()) < needed) continue;
    std::vector<int> free_supported;
    for (int index : f->second) {
      const SlotInfo& slot = agent->slots[static_cast<size_t>(index)];
      if (!matcher_.Matches(trial.selector, slot) || !judge(*agent, slot).supported) continue;
      free_supported.push_back(index);
    }
    if (static_cast<int>(free_supported.size()) < needed) continue;
    if (trial.selector.needs_p2p && needed > 1) {
      free_supported = PeerSet(agent->slots, free_supported, needed);
      if (free_supported.empty()) continue;
    } else {
      free_supported.resize(static_cast<size_t>(needed));
    }

    placements->push_back(Placement{&trial, agent, *config, free_supported});
    for (int used : free_supported) std::erase(f->second, used);
    if (f->second.empty()) free.erase(f);
    return true;
  }

  // No free slot takes it. It is UNSUPPORTED when some agent matches it but none supports it.
  bool any_match = false, any_supported = false;
  std::string first_reason;
  std::optional<SlotInfo> first_slot;
  for (const AgentInventory* agent : order) {
    int matching = 0;
    for (const SlotInfo& slot : agent->slots) {
      if (!matcher_.Matches(trial.selector, slot)) continue;
      ++matching;
      if (!first_slot) first_slot = slot;
      const PreflightResult& pf = judge(*agent, slot);
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
    ++counts_.unsupported;
    RecordCoordinatorResult(trial, TrialStatus::kUnsupported, first_reason,
                            first_slot ? &*first_slot : nullptr);
    return true;
  }
  return false;
}

void Scheduler::RecordCoordinatorResult(const TrialRecord& trial, TrialStatus status,
                                        const std::string& reason, const SlotInfo* slot) {
  TrialResult r;
  r.trial_id = trial.trial_id;
  r.attempt = trial.attempt + 1;
  r.status = status;
  r.reason = reason;
  r.model = trial.model;
  r.config = trial.config;
  r.device = ConfigDevice(trial.config) == Device::kCpu || slot == nullptr || !slot->gpu
                 ? "cpu"
                 : slot->gpu_name;
  r.sm = slot ? slot->sm : 0;
  r.engine_version = EngineVersion();
  r.started_unix_ms = r.finished_unix_ms = NowMs();
  if (absl::Status s =
          services_.store.RecordResult("", slot ? slot->gpu_name : "", slot ? slot->sm : 0, r);
      !s.ok()) {
    services_.Log(absl::StrCat("recording ", TrialStatusName(status).data(), " for ",
                               trial.trial_id, ": ", s.message()));
  } else {
    services_.ExportResult(r, slot ? slot->gpu_name : "", slot ? slot->sm : 0);
  }
}

// ------------------------------------------------------------------------------ fleet metrics

void Scheduler::UpdateFleetMetrics(int64_t now) {
  if (now < next_fleet_metrics_ms_) return;
  next_fleet_metrics_ms_ = now + 1000;
  services_.metrics.SetAgentsConnected(sessions_.ConnectedCount());
  if (absl::StatusOr<TrialCounts> counts = services_.store.CountTrials(); counts.ok()) {
    services_.metrics.SetQueueDepth(counts->queued);
    services_.metrics.SetLeasedTrials(counts->leased);
  }
}

}  // namespace infersweep::coordinator
