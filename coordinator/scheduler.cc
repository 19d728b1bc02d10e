// The scheduler: a loop woken by events (submit, hello, result, disconnect) or every tick. Each
// pass requeues expired leases, releases trials a reconnected agent lost, and places queued
// trials on free slots: preflight judges each config per kind of slot, a trial no agent supports
// is stored as UNSUPPORTED, and the placed trials are leased in one transaction and sent as
// Assignments. Results stored here and by the agent stream are exported to the metrics.
#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/trial.h"
#include "api/version.h"
#include "coordinator/server_impl.h"

namespace infersweep {

namespace {

using coordinator_internal::NowMs;
using coordinator_internal::SlotInfo;

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
      // Validated at submit; a stored pattern that no longer compiles matches nothing.
      absl::StatusOr<std::unique_ptr<re2::RE2>> re = CompileUntrustedRegex(sel.gpu_name_regex);
      it = regex_cache_.emplace(sel.gpu_name_regex, re.ok() ? *std::move(re) : nullptr).first;
    }
    if (it->second == nullptr || !RegexSearch(*it->second, slot.gpu_name)) return false;
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
    metrics_->DeclareTrialSeries(leased[i]->model,
                                 p.conn->slots[static_cast<size_t>(p.slots[0])].sm);
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
  // A GPU config's tensor-parallel ranks take a GPU each, whatever the selector asks for.
  const int needed = std::max({1, trial.selector.gpus_needed,
                               ConfigDevice(*config) == "cuda" ? TensorParallelRanks(*config) : 1});
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
    }
    if (static_cast<int>(free_supported.size()) < needed) continue;
    if (trial.selector.needs_p2p && needed > 1) {
      free_supported = PeerSet(conn->slots, free_supported, needed);
      if (free_supported.empty()) continue;
    } else {
      free_supported.resize(static_cast<size_t>(needed));
    }

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

}  // namespace infersweep
