#include "storage/fleet_state.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "api/status_macros.h"
#include "core/wall_clock.h"
#include "storage/codec.h"

namespace infersweep {
namespace {

using nlohmann::json;

constexpr const char* kStateNames[] = {"queued", "leased", "done", "cancelled"};

std::optional<TrialState> StateFromName(absl::string_view name) {
  for (int i = 0; i < 4; ++i)
    if (name == kStateNames[i]) return static_cast<TrialState>(i);
  return std::nullopt;
}

json SelectorJson(const Selector& s) {
  return {{"sm", s.sm_archs},
          {"gpu_name", s.gpu_name_regex},
          {"min_memory_bytes", s.min_memory_bytes},
          {"gpus", s.gpus_needed},
          {"p2p", s.needs_p2p},
          {"device", DeviceName(s.device)}};
}

// SelectorJson's text back; DataLoss naming `where` when it is damaged.
absl::StatusOr<Selector> SelectorFromStoredJson(const std::string& text, const std::string& where) {
  ASSIGN_OR_RETURN(const json selector, ParseStoredJson(text, where + " selector"));
  Selector s;
  std::string device_name;  // parsed below: a device the registry does not know is damage too
  try {
    s.sm_archs = selector.value("sm", std::vector<int>{});
    s.gpu_name_regex = selector.value("gpu_name", std::string());
    s.min_memory_bytes = selector.value("min_memory_bytes", int64_t{0});
    s.gpus_needed = selector.value("gpus", 1);
    s.needs_p2p = selector.value("p2p", false);
    device_name = selector.value("device", std::string(DeviceName(Device::kCuda)));
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat(where, ": stored JSON is malformed: ", e.what()));
  }
  absl::StatusOr<Device> parsed = ParseDevice(device_name, "selector device");
  if (!parsed.ok())
    return absl::DataLossError(absl::StrCat(where, ": ", parsed.status().message()));
  s.device = *parsed;
  return s;
}

constexpr char kTrialCols[] =
    "trial_id, sweep_id, model, layers, seed, "
    "(SELECT config_string FROM configs AS c WHERE c.config_id = trials.config_id), "
    "workload_json, selector_json, "
    "priority, state, attempt, leased_to, lease_expires_ms, lease_gpu_name, lease_sm, model_key";
constexpr char kSweepCols[] =
    "sweep_id, name, spec_yaml, model, priority, state, created_ms, trials_total, trials_done";

SweepRecord ReadSweep(const Stmt& q) {
  SweepRecord s;
  s.id = q.Int(0);
  s.name = q.Text(1);
  s.spec_yaml = q.Text(2);
  s.model = q.Text(3);
  s.priority = static_cast<int>(q.Int(4));
  s.state = q.Text(5);
  s.created_unix_ms = q.Int(6);
  s.trials_total = q.Int(7);
  s.trials_done = q.Int(8);
  return s;
}

// Columns as kTrialCols.
absl::StatusOr<TrialRecord> ReadTrial(const Stmt& q) {
  TrialRecord t;
  t.trial_id = q.Text(0);
  const std::string where = absl::StrCat("trial '", t.trial_id, "'");
  t.sweep_id = q.Int(1);
  t.model = q.Text(2);
  t.layers = static_cast<int>(q.Int(3));
  t.seed = static_cast<uint64_t>(q.Int(4));
  absl::StatusOr<BackendConfig> config = ParseBackendConfig(q.Text(5));
  if (!config.ok())
    return absl::DataLossError(
        absl::StrCat(where, ": stored config '", q.Text(5), "': ", config.status().message()));
  t.config = *std::move(config);
  ASSIGN_OR_RETURN(json workload, ParseStoredJson(q.Text(6), where + " workload"));
  ASSIGN_OR_RETURN(t.selector, SelectorFromStoredJson(q.Text(7), where));
  absl::StatusOr<Workload> w = WorkloadFromJson(workload);
  if (!w.ok())
    return absl::DataLossError(absl::StrCat(where, ": stored workload: ", w.status().message()));
  t.workload = *w;
  t.priority = static_cast<int>(q.Int(8));
  std::optional<TrialState> state = StateFromName(q.Text(9));
  if (!state) return absl::DataLossError(absl::StrCat(where, ": unknown state '", q.Text(9), "'"));
  t.state = *state;
  t.attempt = static_cast<int>(q.Int(10));
  t.leased_to = q.Text(11);
  t.lease_expires_unix_ms = q.IsNull(12) ? 0 : q.Int(12);
  t.lease_place.gpu_name = q.Text(13);
  t.lease_place.sm = static_cast<int>(q.Int(14));
  t.model_key = q.Text(15);
  return t;
}

}  // namespace

absl::StatusOr<int64_t> FleetState::CreateSweep(const SweepRecord& sweep,
                                                const std::vector<TrialRecord>& trials) {
  const std::string op = absl::StrCat("creating sweep '", sweep.name, "'");
  Txn txn(conn_);
  RETURN_IF_ERROR(txn.Begin(op));
  const int64_t created = sweep.created_unix_ms != 0 ? sweep.created_unix_ms : NowUnixMs();
  int64_t id = 0;
  {
    ASSIGN_OR_RETURN(
        Stmt insert,
        conn_.Prepare("INSERT INTO sweeps (sweep_id, name, spec_yaml, model, priority, state, "
                      "created_ms, trials_total, trials_done) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
                      op));
    if (sweep.id != 0) {
      insert.Bind(sweep.id);
    } else {
      insert.BindNull();
    }
    insert.Bind(sweep.name)
        .Bind(sweep.spec_yaml)
        .Bind(sweep.model)
        .Bind(sweep.priority)
        .Bind(trials.empty() ? "done" : "active")
        .Bind(created)
        .Bind(static_cast<int64_t>(trials.size()));
    absl::Status s = insert.Run();
    if (absl::IsAlreadyExists(s))
      return absl::AlreadyExistsError(absl::StrCat(op, ": sweep id ", sweep.id, " is taken"));
    RETURN_IF_ERROR(s);
    id = conn_.LastInsertRowid();
  }
  ASSIGN_OR_RETURN(
      Stmt insert,
      conn_.Prepare("INSERT INTO trials (trial_id, sweep_id, model, layers, seed, config_id, "
                    "workload_json, selector_json, priority, state, attempt, leased_to, "
                    "lease_expires_ms, created_ms, model_key, workload_key) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'queued', 0, NULL, NULL, ?, ?, ?)",
                    absl::StrCat(op, ": inserting a trial")));
  for (size_t i = 0; i < trials.size(); ++i) {
    const TrialRecord& t = trials[i];
    if (t.sweep_id != 0 && t.sweep_id != id)
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": trial '", t.trial_id, "' belongs to sweep ", t.sweep_id, ", not ", id));
    const std::string trial_id = t.trial_id.empty() ? absl::StrCat(id, "-", i) : t.trial_id;
    if (absl::Status w = ValidateWorkload(t.workload); !w.ok())
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": trial '", trial_id, "': ", w.message()));
    ASSIGN_OR_RETURN(int64_t config_id,
                     ingest_.ConfigIdLocked(t.config, BackendConfigString(t.config), op));
    insert.Reset();
    insert.Bind(trial_id)
        .Bind(id)
        .Bind(t.model)
        .Bind(t.layers)
        .Bind(static_cast<int64_t>(t.seed))
        .Bind(config_id)
        .Bind(ToJson(t.workload).dump())
        .Bind(SelectorJson(t.selector).dump())
        .Bind(t.priority)
        .Bind(created);
    if (t.model_key.empty()) {
      insert.BindNull();
    } else {
      insert.Bind(t.model_key);
    }
    insert.Bind(WorkloadKey(t.workload));
    absl::Status s = insert.Run();
    if (absl::IsAlreadyExists(s))
      return absl::AlreadyExistsError(
          absl::StrCat(op, ": trial id '", trial_id, "' already exists"));
    RETURN_IF_ERROR(s);
  }
  RETURN_IF_ERROR(txn.Commit(op));
  return id;
}

absl::StatusOr<SweepRecord> FleetState::GetSweep(int64_t id) {
  const std::string op = absl::StrCat("reading sweep ", id);
  ASSIGN_OR_RETURN(
      Stmt q,
      conn_.Prepare(absl::StrCat("SELECT ", kSweepCols, " FROM sweeps WHERE sweep_id = ?"), op));
  q.Bind(id);
  ASSIGN_OR_RETURN(bool row, q.Step());
  if (!row) return absl::NotFoundError(absl::StrCat("sweep ", id, " not found"));
  return ReadSweep(q);
}

absl::StatusOr<std::vector<SweepRecord>> FleetState::ListSweeps() {
  ASSIGN_OR_RETURN(
      Stmt q, conn_.Prepare(absl::StrCat("SELECT ", kSweepCols, " FROM sweeps ORDER BY sweep_id"),
                            "listing sweeps"));
  std::vector<SweepRecord> out;
  for (;;) {
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row) break;
    out.push_back(ReadSweep(q));
  }
  return out;
}

absl::Status FleetState::CancelSweep(int64_t id) {
  const std::string op = absl::StrCat("cancelling sweep ", id);
  Txn txn(conn_);
  RETURN_IF_ERROR(txn.Begin(op));
  std::string state;
  {
    ASSIGN_OR_RETURN(Stmt q, conn_.Prepare("SELECT state FROM sweeps WHERE sweep_id = ?", op));
    q.Bind(id);
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row) return absl::NotFoundError(absl::StrCat("sweep ", id, " not found"));
    state = q.Text(0);
  }
  if (state == "cancelled") return absl::OkStatus();
  if (state == "done")
    return absl::FailedPreconditionError(
        absl::StrCat("sweep ", id, " is already done; nothing to cancel"));
  {
    ASSIGN_OR_RETURN(Stmt u,
                     conn_.Prepare("UPDATE sweeps SET state = 'cancelled' WHERE sweep_id = ?", op));
    u.Bind(id);
    RETURN_IF_ERROR(u.Run());
  }
  {
    // Leased trials keep leased_to and attempt, so the agent's result is still accepted.
    ASSIGN_OR_RETURN(Stmt u,
                     conn_.Prepare("UPDATE trials SET state = 'cancelled', lease_expires_ms = NULL "
                                   "WHERE sweep_id = ? AND state IN ('queued', 'leased')",
                                   op));
    u.Bind(id);
    RETURN_IF_ERROR(u.Run());
  }
  return txn.Commit(op);
}

absl::StatusOr<std::vector<TrialRecord>> FleetState::QueuedTrials(int limit) {
  if (limit < 0)
    return absl::InvalidArgumentError(absl::StrCat("QueuedTrials: negative limit ", limit));
  ASSIGN_OR_RETURN(Stmt q,
                   conn_.Prepare(absl::StrCat("SELECT ", kTrialCols,
                                              " FROM trials WHERE state = 'queued' "
                                              "ORDER BY priority DESC, created_ms, rowid LIMIT ?"),
                                 "listing queued trials"));
  q.Bind(limit);
  std::vector<TrialRecord> out;
  for (;;) {
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row) break;
    ASSIGN_OR_RETURN(TrialRecord t, ReadTrial(q));
    out.push_back(std::move(t));
  }
  return out;
}

absl::StatusOr<std::vector<Selector>> FleetState::QueuedSelectors(int64_t sweep_id) {
  const std::string op = absl::StrCat("listing the selectors of sweep ", sweep_id, "'s queue");
  ASSIGN_OR_RETURN(Stmt q, conn_.Prepare("SELECT DISTINCT selector_json FROM trials "
                                         "WHERE sweep_id = ? AND state = 'queued'",
                                         op));
  q.Bind(sweep_id);
  std::vector<Selector> out;
  for (;;) {
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row) break;
    ASSIGN_OR_RETURN(Selector s, SelectorFromStoredJson(q.Text(0), op));
    out.push_back(std::move(s));
  }
  return out;
}

absl::StatusOr<TrialCounts> FleetState::CountTrials() {
  ASSIGN_OR_RETURN(Stmt q, conn_.Prepare("SELECT state, COUNT(*) FROM trials GROUP BY state",
                                         "counting trials"));
  TrialCounts counts;
  for (;;) {
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row) break;
    const std::optional<TrialState> state = StateFromName(q.Text(0));
    if (!state) continue;
    switch (*state) {
      case TrialState::kQueued:
        counts.queued = q.Int(1);
        break;
      case TrialState::kLeased:
        counts.leased = q.Int(1);
        break;
      case TrialState::kDone:
        counts.done = q.Int(1);
        break;
      case TrialState::kCancelled:
        counts.cancelled = q.Int(1);
        break;
    }
  }
  return counts;
}

absl::StatusOr<TrialRecord> FleetState::GetTrial(const std::string& trial_id) {
  ASSIGN_OR_RETURN(
      Stmt q, conn_.Prepare(absl::StrCat("SELECT ", kTrialCols, " FROM trials WHERE trial_id = ?"),
                            absl::StrCat("reading trial '", trial_id, "'")));
  q.Bind(trial_id);
  ASSIGN_OR_RETURN(bool row, q.Step());
  if (!row) return absl::NotFoundError(absl::StrCat("trial '", trial_id, "' not found"));
  return ReadTrial(q);
}

std::vector<absl::StatusOr<TrialRecord>> FleetState::LeaseTrials(
    const std::vector<LeaseRequest>& leases) {
  std::vector<absl::StatusOr<TrialRecord>> out;
  out.reserve(leases.size());
  const std::string op = leases.size() == 1 ? absl::StrCat("leasing trial '", leases[0].trial_id,
                                                           "' to agent '", leases[0].agent_id, "'")
                                            : absl::StrCat("leasing ", leases.size(), " trials");
  Txn txn(conn_);
  if (absl::Status s = txn.Begin(op); !s.ok())
    return std::vector<absl::StatusOr<TrialRecord>>(leases.size(), s);
  for (const LeaseRequest& l : leases) out.push_back(LeaseOneLocked(l));
  if (absl::Status s = txn.Commit(op); !s.ok())
    return std::vector<absl::StatusOr<TrialRecord>>(leases.size(), s);
  return out;
}

absl::Status FleetState::RenewLeases(const std::string& agent_id, int64_t expires_unix_ms) {
  const std::string op = absl::StrCat("renewing the leases of agent '", agent_id, "'");
  ASSIGN_OR_RETURN(Stmt u, conn_.Prepare("UPDATE trials SET lease_expires_ms = ? "
                                         "WHERE state = 'leased' AND leased_to = ?",
                                         op));
  u.Bind(expires_unix_ms).Bind(agent_id);
  return u.Run();
}

absl::StatusOr<std::vector<LostLease>> FleetState::RequeueExpired(int64_t now_unix_ms,
                                                                  int max_attempts) {
  const std::string op = "requeueing trials with expired leases";
  Txn txn(conn_);
  RETURN_IF_ERROR(txn.Begin(op));
  std::vector<std::pair<std::string, std::string>> expired;  // trial id, agent id
  {
    ASSIGN_OR_RETURN(
        Stmt q, conn_.Prepare("SELECT trial_id, leased_to FROM trials "
                              "WHERE state = 'leased' AND lease_expires_ms < ? ORDER BY trial_id",
                              op));
    q.Bind(now_unix_ms);
    for (;;) {
      ASSIGN_OR_RETURN(bool row, q.Step());
      if (!row) break;
      expired.emplace_back(q.Text(0), q.Text(1));
    }
  }
  std::vector<LostLease> out;
  for (const auto& [trial_id, agent_id] : expired) {
    ASSIGN_OR_RETURN(LostLease lost,
                     LoseLeaseLocked(trial_id, agent_id, /*attempt=*/-1, max_attempts,
                                     "lease expired without a heartbeat", op));
    out.push_back(std::move(lost));
  }
  RETURN_IF_ERROR(txn.Commit(op));
  return out;
}

absl::StatusOr<LostLease> FleetState::ReleaseLease(const std::string& trial_id,
                                                   const std::string& agent_id, int attempt,
                                                   int max_attempts, const std::string& why) {
  const std::string op = absl::StrCat("releasing the lease of trial '", trial_id, "' attempt ",
                                      attempt, " held by agent '", agent_id, "'");
  Txn txn(conn_);
  RETURN_IF_ERROR(txn.Begin(op));
  ASSIGN_OR_RETURN(LostLease lost,
                   LoseLeaseLocked(trial_id, agent_id, attempt, max_attempts, why, op));
  RETURN_IF_ERROR(txn.Commit(op));
  return lost;
}

absl::StatusOr<TrialRecord> FleetState::LeaseOneLocked(const LeaseRequest& l) {
  const std::string op =
      absl::StrCat("leasing trial '", l.trial_id, "' to agent '", l.agent_id, "'");
  if (l.agent_id.empty()) return absl::InvalidArgumentError(absl::StrCat(op, ": empty agent id"));
  {
    ASSIGN_OR_RETURN(
        Stmt u, conn_.Prepare("UPDATE trials SET state = 'leased', leased_to = ?, "
                              "lease_expires_ms = ?, attempt = attempt + 1, lease_gpu_name = ?, "
                              "lease_sm = ? WHERE trial_id = ? AND state = 'queued'",
                              op));
    u.Bind(l.agent_id)
        .Bind(l.expires_unix_ms)
        .Bind(l.place.gpu_name)
        .Bind(l.place.sm)
        .Bind(l.trial_id);
    RETURN_IF_ERROR(u.Run());
  }
  if (conn_.Changes() == 0) {
    ASSIGN_OR_RETURN(TrialRecord t, GetTrial(l.trial_id));  // NotFound if absent
    std::string holder = t.state == TrialState::kLeased
                             ? absl::StrCat(" (leased to agent '", t.leased_to, "')")
                             : "";
    return absl::FailedPreconditionError(absl::StrCat(
        op, ": the trial is ", kStateNames[static_cast<int>(t.state)], holder, ", not queued"));
  }
  return GetTrial(l.trial_id);
}

absl::StatusOr<LostLease> FleetState::LoseLeaseLocked(const std::string& trial_id,
                                                      const std::string& agent_id, int attempt,
                                                      int max_attempts, const std::string& why,
                                                      const std::string& op) {
  ASSIGN_OR_RETURN(TrialRecord t, GetTrial(trial_id));
  if (t.state != TrialState::kLeased || t.leased_to != agent_id ||
      (attempt >= 0 && t.attempt != attempt))
    return absl::FailedPreconditionError(absl::StrCat(
        op, ": the trial is ", kStateNames[static_cast<int>(t.state)], ", attempt ", t.attempt,
        t.leased_to.empty() ? "" : absl::StrCat(" held by agent '", t.leased_to, "'")));
  LostLease lost;
  lost.trial_id = trial_id;
  lost.agent_id = agent_id;
  lost.attempt = t.attempt;
  if (max_attempts <= 0 || t.attempt < max_attempts) {
    ASSIGN_OR_RETURN(Stmt u, conn_.Prepare("UPDATE trials SET state = 'queued', leased_to = NULL, "
                                           "lease_expires_ms = NULL WHERE trial_id = ?",
                                           op));
    u.Bind(trial_id);
    RETURN_IF_ERROR(u.Run());
    lost.requeued = true;
    return lost;
  }
  // The last allowed attempt is gone too: the trial ends as an ERROR made by the coordinator
  // (agent id ''), filed under the GPU it was last leased for.
  lost.reason = absl::StrCat("lease lost ", t.attempt, " times (attempt cap ", max_attempts,
                             "); the last: agent '", agent_id, "', ", why);
  ResultSubmission sub;
  sub.gpu_name = t.lease_place.gpu_name;
  sub.sm = t.lease_place.sm;
  sub.result.trial_id = trial_id;
  sub.result.attempt = t.attempt;
  sub.result.status = TrialStatus::kError;
  sub.result.reason = lost.reason;
  sub.result.device = ConfigDevice(t.config) == Device::kCpu || t.lease_place.gpu_name.empty()
                          ? "cpu"
                          : t.lease_place.gpu_name;
  sub.result.sm = t.lease_place.sm;
  sub.result.started_unix_ms = sub.result.finished_unix_ms = NowUnixMs();
  RETURN_IF_ERROR(ingest_.RecordOneLocked(sub));
  return lost;
}

absl::Status FleetState::UpsertAgent(const AgentRecord& agent) {
  const std::string op = absl::StrCat("storing agent '", agent.agent_id, "'");
  if (agent.agent_id.empty()) return absl::InvalidArgumentError(absl::StrCat(op, ": empty id"));
  ASSIGN_OR_RETURN(
      Stmt u,
      conn_.Prepare("INSERT INTO agents (agent_id, host, inventory_json, last_seen_ms, "
                    "connected) VALUES (?, ?, ?, ?, ?) ON CONFLICT (agent_id) DO UPDATE SET "
                    "host = excluded.host, inventory_json = excluded.inventory_json, "
                    "last_seen_ms = excluded.last_seen_ms, connected = excluded.connected",
                    op));
  u.Bind(agent.agent_id)
      .Bind(agent.host)
      .Bind(agent.inventory_json)
      .Bind(agent.last_seen_unix_ms)
      .Bind(agent.connected ? 1 : 0);
  return u.Run();
}

absl::Status FleetState::SetAgentConnected(const std::string& agent_id, bool connected,
                                           int64_t now_unix_ms) {
  const std::string op =
      absl::StrCat("marking agent '", agent_id, "' ", connected ? "connected" : "disconnected");
  ASSIGN_OR_RETURN(
      Stmt u,
      conn_.Prepare("UPDATE agents SET connected = ?, last_seen_ms = ? WHERE agent_id = ?", op));
  u.Bind(connected ? 1 : 0).Bind(now_unix_ms).Bind(agent_id);
  RETURN_IF_ERROR(u.Run());
  if (conn_.Changes() == 0)
    return absl::NotFoundError(absl::StrCat("agent '", agent_id, "' not found"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<AgentRecord>> FleetState::ListAgents() {
  ASSIGN_OR_RETURN(Stmt q,
                   conn_.Prepare("SELECT agent_id, host, inventory_json, last_seen_ms, connected "
                                 "FROM agents ORDER BY agent_id",
                                 "listing agents"));
  std::vector<AgentRecord> out;
  for (;;) {
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row) break;
    AgentRecord a;
    a.agent_id = q.Text(0);
    a.host = q.Text(1);
    a.inventory_json = q.Text(2);
    a.last_seen_unix_ms = q.Int(3);
    a.connected = q.Int(4) != 0;
    out.push_back(std::move(a));
  }
  return out;
}

}  // namespace infersweep
