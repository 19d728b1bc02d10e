// SqliteStore: the Store on one SQLite connection (C API), serialised by a mutex.
//
// Every value reaches SQL through sqlite3_bind_*; the only SQL assembled at run time is made of
// fixed fragments from this file and storage/schema.cc (QueryResults' WHERE clause, Best's
// column and direction).
#include "storage/store.h"

#include <sqlite3.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api/digest.h"
#include "api/private_file.h"
#include "api/status_macros.h"
#include "api/untrusted_json.h"
#include "storage/codec.h"
#include "storage/schema.h"

namespace infersweep {
namespace {

using nlohmann::json;


int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

constexpr const char* kStateNames[] = {"queued", "leased", "done", "cancelled"};

std::optional<TrialState> StateFromName(absl::string_view name) {
  for (int i = 0; i < 4; ++i)
    if (name == kStateNames[i]) return static_cast<TrialState>(i);
  return std::nullopt;
}

// A prepared statement borrowed from the connection's cache (or owned, for one-off SQL). Resets
// and clears its bindings on Reset() and when it goes out of scope, so a cached statement never
// keeps a read transaction open.
class Stmt {
 public:
  Stmt(sqlite3* db, sqlite3_stmt* stmt, bool owned, std::string op)
      : db_(db), stmt_(stmt), owned_(owned), op_(std::move(op)) {}
  Stmt(Stmt&& o) noexcept
      : db_(o.db_), stmt_(std::exchange(o.stmt_, nullptr)), owned_(o.owned_),
        op_(std::move(o.op_)), next_(o.next_), bind_error_(std::move(o.bind_error_)) {}
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;
  Stmt& operator=(Stmt&&) = delete;
  ~Stmt() {
    if (stmt_ == nullptr) return;
    Reset();
    if (owned_) sqlite3_finalize(stmt_);
  }

  // Ready to bind and run again.
  void Reset() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
    next_ = 0;
    bind_error_ = absl::OkStatus();
  }

  // Binds the next parameter; the first failure is kept and reported by Step().
  Stmt& Bind(int64_t v) { return Check(sqlite3_bind_int64(stmt_, ++next_, v)); }
  Stmt& Bind(int v) { return Bind(static_cast<int64_t>(v)); }
  Stmt& Bind(double v) { return Check(sqlite3_bind_double(stmt_, ++next_, v)); }
  Stmt& Bind(absl::string_view v) {
    return Check(
        sqlite3_bind_text64(stmt_, ++next_, v.data(), v.size(), SQLITE_TRANSIENT, SQLITE_UTF8));
  }
  Stmt& Bind(std::string_view v) { return Bind(absl::string_view(v.data(), v.size())); }
  Stmt& Bind(const std::string& v) { return Bind(absl::string_view(v)); }
  Stmt& Bind(const char* v) { return Bind(absl::string_view(v)); }
  Stmt& BindNull() { return Check(sqlite3_bind_null(stmt_, ++next_)); }
  Stmt& Bind(const std::optional<double>& v) { return v ? Bind(*v) : BindNull(); }
  Stmt& Bind(const std::optional<std::string>& v) { return v ? Bind(*v) : BindNull(); }
  Stmt& Bind(const std::optional<int64_t>& v) { return v ? Bind(*v) : BindNull(); }
  Stmt& BindBlob(std::string_view v) {
    return Check(sqlite3_bind_blob64(stmt_, ++next_, v.data(), v.size(), SQLITE_TRANSIENT));
  }
  // NULL for an empty value.
  Stmt& BindBlobOrNull(std::string_view v) { return v.empty() ? BindNull() : BindBlob(v); }

  // true: a row is ready; false: done.
  absl::StatusOr<bool> Step() {
    if (!bind_error_.ok()) return bind_error_;
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    return SqliteError(db_, rc, op_);
  }
  // Runs a statement to completion, ignoring any rows.
  absl::Status Run() {
    for (;;) {
      absl::StatusOr<bool> row = Step();
      if (!row.ok()) return row.status();
      if (!*row) return absl::OkStatus();
    }
  }

  bool IsNull(int col) const { return sqlite3_column_type(stmt_, col) == SQLITE_NULL; }
  int64_t Int(int col) const { return sqlite3_column_int64(stmt_, col); }
  std::string_view Blob(int col) const {
    const void* p = sqlite3_column_blob(stmt_, col);
    if (p == nullptr) return {};
    return {static_cast<const char*>(p), static_cast<size_t>(sqlite3_column_bytes(stmt_, col))};
  }
  std::string Text(int col) const {
    const unsigned char* p = sqlite3_column_text(stmt_, col);
    if (p == nullptr) return {};
    return std::string(reinterpret_cast<const char*>(p),
                       static_cast<size_t>(sqlite3_column_bytes(stmt_, col)));
  }
  const std::string& op() const { return op_; }

 private:
  Stmt& Check(int rc) {
    if (rc != SQLITE_OK && bind_error_.ok())
      bind_error_ = SqliteError(db_, rc, absl::StrCat(op_, " (binding parameter ", next_, ")"));
    return *this;
  }

  sqlite3* db_;
  sqlite3_stmt* stmt_;
  bool owned_;
  std::string op_;
  int next_ = 0;
  absl::Status bind_error_;
};

// A best query's group row from column `first` on: model key, workload, its OK results, first
// and last sweep, last finish time.
ResultGroup ReadResultGroup(Stmt& g, int first) {
  ResultGroup group;
  group.model_key = g.Text(first);
  group.workload = g.Text(first + 1);
  group.ok_results = g.Int(first + 2);
  group.first_sweep = g.Int(first + 3);
  group.last_sweep = g.Int(first + 4);
  group.last_finished_unix_ms = g.Int(first + 5);
  return group;
}

// Newest first: the group a fleet measured last leads the list a user chooses from; ties in
// name order.
bool NewerGroupFirst(const ResultGroup& a, const ResultGroup& b) {
  return std::tie(b.last_sweep, b.last_finished_unix_ms, a.model_key, a.workload, a.load_point) <
         std::tie(a.last_sweep, a.last_finished_unix_ms, b.model_key, b.workload, b.load_point);
}

// A write transaction. BEGIN IMMEDIATE takes the write lock up front, so a busy database fails
// before anything is written. Rolls back unless committed, on every path out.
class Txn {
 public:
  // `on_rollback` runs when the transaction is rolled back (the store forgets cached ids of rows
  // the transaction may have added).
  Txn(sqlite3* db, std::function<void()> on_rollback)
      : db_(db), on_rollback_(std::move(on_rollback)) {}
  Txn(const Txn&) = delete;
  Txn& operator=(const Txn&) = delete;
  ~Txn() {
    if (sqlite3_get_autocommit(db_)) return;
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    if (on_rollback_) on_rollback_();
  }
  absl::Status Begin(absl::string_view op) {
    return ExecSql(db_, "BEGIN IMMEDIATE", absl::StrCat(op, " (BEGIN)"));
  }
  absl::Status Commit(absl::string_view op) {
    return ExecSql(db_, "COMMIT", absl::StrCat(op, " (COMMIT)"));
  }

 private:
  sqlite3* db_;
  std::function<void()> on_rollback_;
};

json SelectorJson(const Selector& s) {
  return {{"sm", s.sm_archs},
          {"gpu_name", s.gpu_name_regex},
          {"min_memory_bytes", s.min_memory_bytes},
          {"gpus", s.gpus_needed},
          {"p2p", s.needs_p2p},
          {"device", s.device}};
}

absl::StatusOr<json> ParseStoredJson(const std::string& text, absl::string_view what) {
  absl::StatusOr<json> j = ParseUntrustedJson(text, absl::StrCat("stored ", what));
  if (!j.ok()) return absl::DataLossError(j.status().message());
  return j;
}

// SelectorJson's text back; DataLoss naming `where` when it is damaged.
absl::StatusOr<Selector> SelectorFromStoredJson(const std::string& text, const std::string& where) {
  absl::StatusOr<json> selector = ParseStoredJson(text, where + " selector");
  if (!selector.ok()) return selector.status();
  Selector s;
  try {
    s.sm_archs = selector->value("sm", std::vector<int>{});
    s.gpu_name_regex = selector->value("gpu_name", std::string());
    s.min_memory_bytes = selector->value("min_memory_bytes", int64_t{0});
    s.gpus_needed = selector->value("gpus", 1);
    s.needs_p2p = selector->value("p2p", false);
    s.device = selector->value("device", std::string("cuda"));
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat(where, ": stored JSON is malformed: ", e.what()));
  }
  return s;
}

// The N of " layers=N" in a ModelIdentityKey; 0 when it names none.
int ModelKeyLayers(const std::string& key) {
  const size_t at = key.find(" layers=");
  if (at == std::string::npos) return 0;
  return std::atoi(key.c_str() + at + 8);
}

const BatchFigures* FindBatch(const TrialResult& r, int batch) {
  for (const BatchFigures& b : r.batches)
    if (b.batch == batch) return &b;
  return nullptr;
}

constexpr char kTrialCols[] =
    "trial_id, sweep_id, model, layers, seed, "
    "(SELECT config_string FROM configs AS c WHERE c.config_id = trials.config_id), "
    "workload_json, selector_json, "
    "priority, state, attempt, leased_to, lease_expires_ms, lease_gpu_name, lease_sm, model_key";
constexpr char kSweepCols[] =
    "sweep_id, name, spec_yaml, model, priority, state, created_ms, trials_total, trials_done";
// The same columns as kResultCols in schema.cc, which the Best queries select.
constexpr char kResultCols[] =
    "sweep_id, agent_id, gpu_name, sm, result_json, result_id, result_blob, model_key, workload, "
    "engine_version, software";

struct MetricInfo {
  const char* name;
  const char* batch_column;  // its result_batches column
  bool higher_is_better;
};
constexpr MetricInfo kMetrics[] = {
    {"output_tok_s", "output_tok_s", true},
    {"ttft_ms", "ttft_ms", false},
    {"tpot_ms", "tpot_ms", false},
    {"prefill_tok_s", "prefill_tok_s", true},
};

// Serving metrics: their serving_points column. Goodput and the percentiles exist only for
// serving points, so naming one ranks serving points.
struct ServingMetricInfo {
  const char* name;
  const char* column;
  bool higher_is_better;
  bool serving_only;
};
constexpr ServingMetricInfo kServingMetrics[] = {
    {"goodput", "request_goodput", true, true},
    {"output_tok_s", "output_throughput", true, false},
    {"output_tok_s_per_user", "output_tok_s_per_user", true, true},
    {"p99_ttft_ms", "p99_ttft_ms", false, true},
    {"p99_tpot_ms", "p99_tpot_ms", false, true},
};

// Cached statements: at most this many distinct SQL texts (QueryResults makes a few variants).
constexpr size_t kMaxCachedStatements = 128;

class SqliteStore final : public Store {
 public:
  // `checkpointer`: a second connection to the same file that folds the WAL into the database
  // in the background (null for in-memory databases).
  SqliteStore(sqlite3* db, sqlite3* checkpointer, int64_t wal_limit_bytes, int64_t page_size)
      : db_(db),
        checkpointer_(checkpointer),
        wal_limit_bytes_(wal_limit_bytes),
        page_size_(page_size) {
    if (checkpointer_ != nullptr) {
      sqlite3_wal_hook(db_, &SqliteStore::OnWalCommit, this);
      checkpoint_thread_ = std::thread([this] { CheckpointLoop(); });
    }
  }
  ~SqliteStore() override {
    {
      absl::MutexLock lock(&checkpoint_mu_);
      stopping_ = true;
    }
    if (checkpoint_thread_.joinable()) checkpoint_thread_.join();
    if (checkpointer_ != nullptr) {
      sqlite3_wal_checkpoint_v2(checkpointer_, nullptr, SQLITE_CHECKPOINT_PASSIVE, nullptr,
                                nullptr);
      sqlite3_close_v2(checkpointer_);
    }
    for (auto& [sql, stmt] : cache_) sqlite3_finalize(stmt);
    sqlite3_close_v2(db_);
  }

  // ---------------------------------------------------------------------------------- sweeps

  absl::StatusOr<int64_t> CreateSweep(const SweepRecord& sweep,
                                      const std::vector<TrialRecord>& trials) override {
    absl::MutexLock lock(&mu_);
    const std::string op = absl::StrCat("creating sweep '", sweep.name, "'");
    Txn txn(db_, [this] { id_cache_.Clear(); });
    RETURN_IF_ERROR(txn.Begin(op));
    const int64_t created = sweep.created_unix_ms != 0 ? sweep.created_unix_ms : NowMs();
    int64_t id = 0;
    {
      ASSIGN_OR_RETURN(
          Stmt insert,
          Prepare("INSERT INTO sweeps (sweep_id, name, spec_yaml, model, priority, state, "
                  "created_ms, trials_total, trials_done) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
                  op));
      if (sweep.id != 0) {
        insert.Bind(sweep.id);
      } else {
        insert.BindNull();
      }
      insert.Bind(sweep.name).Bind(sweep.spec_yaml).Bind(sweep.model).Bind(sweep.priority)
          .Bind(trials.empty() ? "done" : "active").Bind(created)
          .Bind(static_cast<int64_t>(trials.size()));
      absl::Status s = insert.Run();
      if (absl::IsAlreadyExists(s))
        return absl::AlreadyExistsError(absl::StrCat(op, ": sweep id ", sweep.id, " is taken"));
      RETURN_IF_ERROR(s);
      id = sqlite3_last_insert_rowid(db_);
    }
    ASSIGN_OR_RETURN(
        Stmt insert,
        Prepare("INSERT INTO trials (trial_id, sweep_id, model, layers, seed, config_id, "
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
                             ConfigIdLocked(t.config, BackendConfigString(t.config), op));
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

  absl::StatusOr<SweepRecord> GetSweep(int64_t id) override {
    absl::MutexLock lock(&mu_);
    const std::string op = absl::StrCat("reading sweep ", id);
    ASSIGN_OR_RETURN(
        Stmt q, Prepare(absl::StrCat("SELECT ", kSweepCols, " FROM sweeps WHERE sweep_id = ?"), op));
    q.Bind(id);
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row) return absl::NotFoundError(absl::StrCat("sweep ", id, " not found"));
    return ReadSweep(q);
  }

  absl::StatusOr<std::vector<SweepRecord>> ListSweeps() override {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(
        Stmt q, Prepare(absl::StrCat("SELECT ", kSweepCols, " FROM sweeps ORDER BY sweep_id"),
                        "listing sweeps"));
    std::vector<SweepRecord> out;
    for (;;) {
      ASSIGN_OR_RETURN(bool row, q.Step());
      if (!row) break;
      out.push_back(ReadSweep(q));
    }
    return out;
  }

  absl::Status CancelSweep(int64_t id) override {
    absl::MutexLock lock(&mu_);
    const std::string op = absl::StrCat("cancelling sweep ", id);
    Txn txn(db_, [this] { id_cache_.Clear(); });
    RETURN_IF_ERROR(txn.Begin(op));
    std::string state;
    {
      ASSIGN_OR_RETURN(Stmt q, Prepare("SELECT state FROM sweeps WHERE sweep_id = ?", op));
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
      ASSIGN_OR_RETURN(
          Stmt u, Prepare("UPDATE sweeps SET state = 'cancelled' WHERE sweep_id = ?", op));
      u.Bind(id);
      RETURN_IF_ERROR(u.Run());
    }
    {
      // Leased trials keep leased_to and attempt, so the agent's result is still accepted.
      ASSIGN_OR_RETURN(
          Stmt u, Prepare("UPDATE trials SET state = 'cancelled', lease_expires_ms = NULL "
                          "WHERE sweep_id = ? AND state IN ('queued', 'leased')",
                          op));
      u.Bind(id);
      RETURN_IF_ERROR(u.Run());
    }
    return txn.Commit(op);
  }

  // ---------------------------------------------------------------------------------- trials

  absl::StatusOr<std::vector<TrialRecord>> QueuedTrials(int limit) override {
    absl::MutexLock lock(&mu_);
    if (limit < 0)
      return absl::InvalidArgumentError(absl::StrCat("QueuedTrials: negative limit ", limit));
    ASSIGN_OR_RETURN(
        Stmt q, Prepare(absl::StrCat("SELECT ", kTrialCols,
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

  absl::StatusOr<std::vector<Selector>> QueuedSelectors(int64_t sweep_id) override {
    absl::MutexLock lock(&mu_);
    const std::string op = absl::StrCat("listing the selectors of sweep ", sweep_id, "'s queue");
    ASSIGN_OR_RETURN(Stmt q, Prepare("SELECT DISTINCT selector_json FROM trials "
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

  absl::StatusOr<TrialCounts> CountTrials() override {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(
        Stmt q, Prepare("SELECT state, COUNT(*) FROM trials GROUP BY state", "counting trials"));
    TrialCounts counts;
    for (;;) {
      ASSIGN_OR_RETURN(bool row, q.Step());
      if (!row) break;
      const std::optional<TrialState> state = StateFromName(q.Text(0));
      if (!state) continue;
      switch (*state) {
        case TrialState::kQueued: counts.queued = q.Int(1); break;
        case TrialState::kLeased: counts.leased = q.Int(1); break;
        case TrialState::kDone: counts.done = q.Int(1); break;
        case TrialState::kCancelled: counts.cancelled = q.Int(1); break;
      }
    }
    return counts;
  }

  absl::StatusOr<TrialRecord> GetTrial(const std::string& trial_id) override {
    absl::MutexLock lock(&mu_);
    return GetTrialLocked(trial_id);
  }

  using Store::LeaseTrial;
  absl::StatusOr<TrialRecord> LeaseTrial(const std::string& trial_id, const std::string& agent_id,
                                         int64_t expires_unix_ms,
                                         const LeasePlace& place) override {
    std::vector<absl::StatusOr<TrialRecord>> leased =
        LeaseTrials({LeaseRequest{trial_id, agent_id, expires_unix_ms, place}});
    return std::move(leased[0]);
  }

  std::vector<absl::StatusOr<TrialRecord>> LeaseTrials(
      const std::vector<LeaseRequest>& leases) override {
    absl::MutexLock lock(&mu_);
    std::vector<absl::StatusOr<TrialRecord>> out;
    out.reserve(leases.size());
    const std::string op = leases.size() == 1
                               ? absl::StrCat("leasing trial '", leases[0].trial_id, "' to agent '",
                                              leases[0].agent_id, "'")
                               : absl::StrCat("leasing ", leases.size(), " trials");
    Txn txn(db_, [this] { id_cache_.Clear(); });
    if (absl::Status s = txn.Begin(op); !s.ok())
      return std::vector<absl::StatusOr<TrialRecord>>(leases.size(), s);
    for (const LeaseRequest& l : leases) out.push_back(LeaseOneLocked(l));
    if (absl::Status s = txn.Commit(op); !s.ok())
      return std::vector<absl::StatusOr<TrialRecord>>(leases.size(), s);
    return out;
  }

  absl::Status RenewLeases(const std::string& agent_id, int64_t expires_unix_ms) override {
    absl::MutexLock lock(&mu_);
    const std::string op = absl::StrCat("renewing the leases of agent '", agent_id, "'");
    ASSIGN_OR_RETURN(
        Stmt u, Prepare("UPDATE trials SET lease_expires_ms = ? "
                        "WHERE state = 'leased' AND leased_to = ?",
                        op));
    u.Bind(expires_unix_ms).Bind(agent_id);
    return u.Run();
  }

  absl::StatusOr<std::vector<LostLease>> RequeueExpired(int64_t now_unix_ms,
                                                        int max_attempts) override {
    absl::MutexLock lock(&mu_);
    const std::string op = "requeueing trials with expired leases";
    Txn txn(db_, [this] { id_cache_.Clear(); });
    RETURN_IF_ERROR(txn.Begin(op));
    std::vector<std::pair<std::string, std::string>> expired;  // trial id, agent id
    {
      ASSIGN_OR_RETURN(
          Stmt q, Prepare("SELECT trial_id, leased_to FROM trials "
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

  absl::StatusOr<LostLease> ReleaseLease(const std::string& trial_id, const std::string& agent_id,
                                         int attempt, int max_attempts,
                                         const std::string& why) override {
    absl::MutexLock lock(&mu_);
    const std::string op = absl::StrCat("releasing the lease of trial '", trial_id, "' attempt ",
                                        attempt, " held by agent '", agent_id, "'");
    Txn txn(db_, [this] { id_cache_.Clear(); });
    RETURN_IF_ERROR(txn.Begin(op));
    ASSIGN_OR_RETURN(LostLease lost,
                           LoseLeaseLocked(trial_id, agent_id, attempt, max_attempts, why, op));
    RETURN_IF_ERROR(txn.Commit(op));
    return lost;
  }

  // --------------------------------------------------------------------------------- results

  absl::Status RecordResult(const std::string& agent_id, const std::string& gpu_name, int sm,
                            const TrialResult& result) override {
    return RecordResults({ResultSubmission{agent_id, gpu_name, sm, result}});
  }

  absl::Status RecordResults(const std::vector<ResultSubmission>& results) override {
    absl::MutexLock lock(&mu_);
    const std::string op = results.size() == 1
                               ? absl::StrCat("recording the result of trial '",
                                              results[0].result.trial_id, "' attempt ",
                                              results[0].result.attempt)
                               : absl::StrCat("recording ", results.size(), " results");
    Txn txn(db_, [this] { id_cache_.Clear(); });
    RETURN_IF_ERROR(txn.Begin(op));
    for (const ResultSubmission& r : results) RETURN_IF_ERROR(RecordOneLocked(r));
    return txn.Commit(op);
  }

  std::vector<absl::Status> RecordResultsEach(
      const std::vector<ResultSubmission>& results) override {
    absl::MutexLock lock(&mu_);
    const std::string op = absl::StrCat("recording ", results.size(), " results (group commit)");
    std::vector<absl::Status> out(results.size());
    Txn txn(db_, [this] { id_cache_.Clear(); });
    if (absl::Status s = txn.Begin(op); !s.ok()) {
      std::fill(out.begin(), out.end(), s);
      return out;
    }
    for (size_t i = 0; i < results.size(); ++i) {
      // A savepoint per result: a refused one (wrong agent, unknown trial) rolls back alone.
      if (absl::Status s = ExecSql(db_, "SAVEPOINT one_result", op); !s.ok()) {
        std::fill(out.begin(), out.end(), s);
        return out;
      }
      out[i] = RecordOneLocked(results[i]);
      if (!out[i].ok()) id_cache_.Clear();  // the rollback below may take rows it added
      const char* end =
          out[i].ok() ? "RELEASE one_result" : "ROLLBACK TO one_result; RELEASE one_result";
      if (absl::Status s = ExecSql(db_, end, op); !s.ok()) {
        std::fill(out.begin(), out.end(), s);
        return out;
      }
    }
    if (absl::Status s = txn.Commit(op); !s.ok()) std::fill(out.begin(), out.end(), s);
    return out;
  }

  absl::StatusOr<std::map<std::string, int64_t>> CountResults(int64_t sweep_id) override {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(
        Stmt q, Prepare("SELECT status, COUNT(*) FROM results WHERE sweep_id = ? GROUP BY status",
                        absl::StrCat("counting the results of sweep ", sweep_id)));
    q.Bind(sweep_id);
    std::map<std::string, int64_t> out;
    for (;;) {
      ASSIGN_OR_RETURN(bool row, q.Step());
      if (!row) break;
      out[q.Text(0)] = q.Int(1);
    }
    return out;
  }

  absl::StatusOr<std::vector<std::pair<std::string, int>>> ResultModelArchs() override {
    absl::MutexLock lock(&mu_);
    // A scan of the results_best index, (model, sm) first.
    ASSIGN_OR_RETURN(Stmt q, Prepare("SELECT DISTINCT model, sm FROM results",
                                     "listing the (model, sm) of stored results"));
    std::vector<std::pair<std::string, int>> out;
    for (;;) {
      ASSIGN_OR_RETURN(bool row, q.Step());
      if (!row) break;
      out.emplace_back(q.Text(0), static_cast<int>(q.Int(1)));
    }
    return out;
  }

  absl::StatusOr<std::vector<StoredResult>> QueryResults(const ResultQuery& q) override {
    return Query(q, /*parse=*/true);
  }

  absl::StatusOr<std::vector<StoredResult>> QueryResultRows(const ResultQuery& q) override {
    return Query(q, /*parse=*/false);
  }

  absl::StatusOr<BestAnswer> Best(const BestQuery& q) override {
    absl::MutexLock lock(&mu_);
    const ServingMetricInfo* serving = nullptr;
    for (const ServingMetricInfo& m : kServingMetrics)
      if (q.metric == m.name) serving = &m;
    if (q.serving || q.load_point || (serving != nullptr && serving->serving_only)) {
      if (serving == nullptr)
        return absl::InvalidArgumentError(absl::StrCat(
            "Best: unknown serving metric '", q.metric,
            "' (known: goodput, output_tok_s, output_tok_s_per_user, p99_ttft_ms, p99_tpot_ms)"));
      return BestServingLocked(q, *serving);
    }
    const MetricInfo* info = nullptr;
    for (const MetricInfo& m : kMetrics)
      if (q.metric == m.name) info = &m;
    if (info == nullptr)
      return absl::InvalidArgumentError(absl::StrCat("Best: unknown metric '", q.metric,
                                                     "' (known: output_tok_s, ttft_ms, tpot_ms, "
                                                     "prefill_tok_s)"));
    if (q.batch < 1 || q.batch > kMaxBatchSize)
      return absl::InvalidArgumentError(
          absl::StrCat("Best: batch ", q.batch, " must lie in [1, ", kMaxBatchSize, "]"));
    const std::string op = absl::StrCat("finding the best ", q.metric, " at batch ", q.batch,
                                        " for ", q.model, " on sm ", q.sm);
    BestAnswer answer;
    std::vector<int64_t> group_ids;  // parallel to answer.groups
    {
      // The groups with OK figures: the kept counts, or (within one sweep) the sweep's own rows
      // of each group, one key range each.
      std::string sql =
          q.sweep_id ? "SELECT g.group_id, g.model_key, g.workload, COUNT(*), MIN(b.sweep_id), "
                       "MAX(b.sweep_id), MAX(r.finished_ms) FROM result_groups AS g "
                       "JOIN result_batches AS b ON b.group_id = g.group_id AND b.sweep_id = ? "
                       "JOIN results AS r ON r.result_id = b.result_id "
                       "WHERE g.model = ? AND g.sm = ? AND g.batch = ? AND b.ok = 1"
                     : "SELECT g.group_id, g.model_key, g.workload, g.ok_results, g.first_sweep, "
                       "g.last_sweep, g.last_finished_ms FROM result_groups AS g "
                       "WHERE g.model = ? AND g.sm = ? AND g.batch = ? AND g.ok_results > 0";
      if (q.model_key) absl::StrAppend(&sql, " AND g.model_key = ?");
      if (q.workload) absl::StrAppend(&sql, " AND g.workload = ?");
      if (q.sweep_id) absl::StrAppend(&sql, " GROUP BY g.group_id");
      ASSIGN_OR_RETURN(Stmt g, Prepare(sql, op));
      if (q.sweep_id) g.Bind(*q.sweep_id);
      g.Bind(q.model).Bind(q.sm).Bind(q.batch);
      if (q.model_key) g.Bind(*q.model_key);
      if (q.workload) g.Bind(*q.workload);
      std::vector<std::pair<ResultGroup, int64_t>> found;
      for (;;) {
        ASSIGN_OR_RETURN(bool row, g.Step());
        if (!row) break;
        ResultGroup group = ReadResultGroup(g, 1);
        if (q.layers && ModelKeyLayers(group.model_key) != *q.layers) continue;
        found.emplace_back(std::move(group), g.Int(0));
      }
      std::sort(found.begin(), found.end(),
                [](const auto& x, const auto& y) { return NewerGroupFirst(x.first, y.first); });
      for (auto& [group, id] : found) {
        answer.groups.push_back(std::move(group));
        group_ids.push_back(id);
      }
    }
    if (answer.groups.size() != 1) return answer;
    ASSIGN_OR_RETURN(
        Stmt p,
        Prepare(BestInGroupSql(info->batch_column, info->higher_is_better, q.sweep_id.has_value()),
                op));
    p.Bind(group_ids[0]);
    if (q.sweep_id) p.Bind(*q.sweep_id);
    ASSIGN_OR_RETURN(bool row, p.Step());
    if (!row) return answer;
    ASSIGN_OR_RETURN(StoredResult r, ReadResult(p, /*parse=*/true));
    answer.best = std::move(r);
    return answer;
  }

  // Best over serving load points: the groups are (model identity, workload, load point) of one
  // model and sm; a lockstep batch is never among the rows (result_batches is not read).
  absl::StatusOr<BestAnswer> BestServingLocked(const BestQuery& q, const ServingMetricInfo& info)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::string op = absl::StrCat("finding the best serving ", q.metric,
                                        q.load_point ? absl::StrCat(" at ", *q.load_point) : "",
                                        " for ", q.model, " on sm ", q.sm);
    std::string sql =
        "SELECT model_key, workload, COUNT(*), MIN(sweep_id), MAX(sweep_id), MAX(finished_ms), "
        "load_point FROM serving_points WHERE model = ? AND sm = ? AND ok = 1";
    if (q.sweep_id) absl::StrAppend(&sql, " AND sweep_id = ?");
    if (q.load_point) absl::StrAppend(&sql, " AND load_point = ?");
    if (q.model_key) absl::StrAppend(&sql, " AND model_key = ?");
    if (q.workload) absl::StrAppend(&sql, " AND workload = ?");
    absl::StrAppend(&sql, " GROUP BY model_key, workload, load_point");
    BestAnswer answer;
    {
      ASSIGN_OR_RETURN(Stmt g, Prepare(sql, op));
      g.Bind(q.model).Bind(q.sm);
      if (q.sweep_id) g.Bind(*q.sweep_id);
      if (q.load_point) g.Bind(*q.load_point);
      if (q.model_key) g.Bind(*q.model_key);
      if (q.workload) g.Bind(*q.workload);
      for (;;) {
        ASSIGN_OR_RETURN(bool row, g.Step());
        if (!row) break;
        ResultGroup group = ReadResultGroup(g, 0);
        group.load_point = g.Text(6);
        if (q.layers && ModelKeyLayers(group.model_key) != *q.layers) continue;
        answer.groups.push_back(std::move(group));
      }
    }
    std::sort(answer.groups.begin(), answer.groups.end(), NewerGroupFirst);
    if (answer.groups.size() != 1) return answer;
    const ResultGroup& group = answer.groups[0];
    ASSIGN_OR_RETURN(Stmt p, Prepare(BestServingPointSql(info.column, info.higher_is_better,
                                                         q.sweep_id.has_value()),
                                     op));
    p.Bind(q.model).Bind(q.sm).Bind(group.load_point).Bind(group.model_key).Bind(group.workload);
    if (q.sweep_id) p.Bind(*q.sweep_id);
    ASSIGN_OR_RETURN(bool row, p.Step());
    if (!row) return answer;
    ASSIGN_OR_RETURN(StoredResult r, ReadResult(p, /*parse=*/true));
    answer.best = std::move(r);
    return answer;
  }

  // ---------------------------------------------------------------------------------- agents

  absl::Status UpsertAgent(const AgentRecord& agent) override {
    absl::MutexLock lock(&mu_);
    const std::string op = absl::StrCat("storing agent '", agent.agent_id, "'");
    if (agent.agent_id.empty()) return absl::InvalidArgumentError(absl::StrCat(op, ": empty id"));
    ASSIGN_OR_RETURN(
        Stmt u, Prepare("INSERT INTO agents (agent_id, host, inventory_json, last_seen_ms, "
                        "connected) VALUES (?, ?, ?, ?, ?) ON CONFLICT (agent_id) DO UPDATE SET "
                        "host = excluded.host, inventory_json = excluded.inventory_json, "
                        "last_seen_ms = excluded.last_seen_ms, connected = excluded.connected",
                        op));
    u.Bind(agent.agent_id).Bind(agent.host).Bind(agent.inventory_json)
        .Bind(agent.last_seen_unix_ms).Bind(agent.connected ? 1 : 0);
    return u.Run();
  }

  absl::Status SetAgentConnected(const std::string& agent_id, bool connected,
                                 int64_t now_unix_ms) override {
    absl::MutexLock lock(&mu_);
    const std::string op = absl::StrCat("marking agent '", agent_id, "' ",
                                        connected ? "connected" : "disconnected");
    ASSIGN_OR_RETURN(
        Stmt u, Prepare("UPDATE agents SET connected = ?, last_seen_ms = ? WHERE agent_id = ?", op));
    u.Bind(connected ? 1 : 0).Bind(now_unix_ms).Bind(agent_id);
    RETURN_IF_ERROR(u.Run());
    if (sqlite3_changes(db_) == 0)
      return absl::NotFoundError(absl::StrCat("agent '", agent_id, "' not found"));
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<AgentRecord>> ListAgents() override {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(
        Stmt q, Prepare("SELECT agent_id, host, inventory_json, last_seen_ms, connected "
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

 private:
  absl::StatusOr<Stmt> Prepare(const std::string& sql, std::string op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (auto it = cache_.find(sql); it != cache_.end())
      return Stmt(db_, it->second, /*owned=*/false, std::move(op));
    sqlite3_stmt* stmt = nullptr;
    const bool cache = cache_.size() < kMaxCachedStatements;
    const int rc = sqlite3_prepare_v3(db_, sql.c_str(), static_cast<int>(sql.size() + 1),
                                      cache ? SQLITE_PREPARE_PERSISTENT : 0, &stmt, nullptr);
    if (rc != SQLITE_OK) {
      sqlite3_finalize(stmt);
      return SqliteError(db_, rc, absl::StrCat(op, " (preparing SQL)"));
    }
    if (cache) cache_.emplace(sql, stmt);
    return Stmt(db_, stmt, /*owned=*/!cache, std::move(op));
  }

  static SweepRecord ReadSweep(const Stmt& q) {
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
  static absl::StatusOr<TrialRecord> ReadTrial(const Stmt& q) {
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

  absl::StatusOr<std::vector<StoredResult>> Query(const ResultQuery& q, bool parse) {
    absl::MutexLock lock(&mu_);
    if (q.limit < 1)
      return absl::InvalidArgumentError(
          absl::StrCat("QueryResults: limit must be >= 1, got ", q.limit));
    std::string sql = absl::StrCat("SELECT ", kResultCols, " FROM results WHERE 1");
    if (q.sm) absl::StrAppend(&sql, " AND sm = ?");
    if (q.gpu_name) absl::StrAppend(&sql, " AND gpu_name = ?");
    if (q.model) absl::StrAppend(&sql, " AND model = ?");
    if (q.model_key)
      absl::StrAppend(&sql, q.model_key->empty() ? " AND model_key IS NULL" : " AND model_key = ?");
    if (q.workload) absl::StrAppend(&sql, " AND workload = ?");
    if (q.layers) absl::StrAppend(&sql, " AND model_layers = ?");
    if (q.sweep_id) absl::StrAppend(&sql, " AND sweep_id = ?");
    if (q.status) absl::StrAppend(&sql, " AND status = ?");
    // Each axis narrows the configs (a few thousand rows at most), not the results.
    for (size_t i = 0; i < q.axis_values.size(); ++i)
      absl::StrAppend(&sql,
                      " AND config_id IN (SELECT config_id FROM config_axes "
                      "WHERE axis = ? AND value = ?)");
    if (q.since_unix_ms) absl::StrAppend(&sql, " AND finished_ms >= ?");
    if (q.until_unix_ms) absl::StrAppend(&sql, " AND finished_ms < ?");
    absl::StrAppend(&sql, " ORDER BY finished_ms DESC, result_id DESC LIMIT ?");

    ASSIGN_OR_RETURN(Stmt s, Prepare(sql, "querying results"));
    if (q.sm) s.Bind(*q.sm);
    if (q.gpu_name) s.Bind(*q.gpu_name);
    if (q.model) s.Bind(*q.model);
    if (q.model_key && !q.model_key->empty()) s.Bind(*q.model_key);
    if (q.workload) s.Bind(*q.workload);
    if (q.layers) s.Bind(*q.layers);
    if (q.sweep_id) s.Bind(*q.sweep_id);
    if (q.status) s.Bind(TrialStatusName(*q.status));
    for (const auto& [axis, value] : q.axis_values) s.Bind(axis).Bind(value);
    if (q.since_unix_ms) s.Bind(*q.since_unix_ms);
    if (q.until_unix_ms) s.Bind(*q.until_unix_ms);
    s.Bind(q.limit);
    std::vector<StoredResult> out;
    for (;;) {
      ASSIGN_OR_RETURN(bool row, s.Step());
      if (!row) break;
      ASSIGN_OR_RETURN(StoredResult r, ReadResult(s, parse, q.with_kernels));
      out.push_back(std::move(r));
    }
    return out;
  }

  // Columns as kResultCols; `parse` fills StoredResult::result from the JSON.
  absl::StatusOr<StoredResult> ReadResult(const Stmt& q, bool parse, bool with_kernels = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    StoredResult r;
    r.sweep_id = q.Int(0);
    r.agent_id = q.Text(1);
    r.gpu_name = q.Text(2);
    r.sm = static_cast<int>(q.Int(3));
    r.result_id = q.Int(5);
    const std::string where = absl::StrCat("result row ", r.result_id);
    if (q.IsNull(6)) {
      r.result_json = q.Text(4);  // stored before results were compressed
    } else {
      absl::StatusOr<std::string> text = DecompressResultJson(q.Blob(6));
      if (!text.ok())
        return absl::DataLossError(absl::StrCat(where, ": ", text.status().message()));
      if (!with_kernels) {
        r.result_json = StripKernelLogRefs(*std::move(text));
      } else {
        ASSIGN_OR_RETURN(
            r.result_json,
            ExpandKernelLogRefs(*std::move(text), [&](int64_t id) -> absl::StatusOr<std::string> {
              ASSIGN_OR_RETURN(const std::string* log, KernelLogLocked(id, where));
              return *log;
            }));
      }
    }
    auto optional_text = [&q](int col) -> std::optional<std::string> {
      if (q.IsNull(col)) return std::nullopt;
      return q.Text(col);
    };
    r.model_key = optional_text(7);
    r.workload = optional_text(8);
    r.engine_version = optional_text(9);
    r.software = optional_text(10);
    if (!parse) return r;
    ASSIGN_OR_RETURN(json j, ParseStoredJson(r.result_json, where));
    absl::StatusOr<TrialResult> result = TrialResultFromJson(j);
    if (!result.ok())
      return absl::DataLossError(absl::StrCat(where, ": ", result.status().message()));
    r.result = std::move(*result);
    // The columns are the identity of record: old results' JSON lacks what the migration derived.
    if (r.result.workload.empty() && r.workload) r.result.workload = *r.workload;
    return r;
  }

  // One lease inside the caller's transaction: queued -> leased, attempt + 1.
  absl::StatusOr<TrialRecord> LeaseOneLocked(const LeaseRequest& l)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::string op =
        absl::StrCat("leasing trial '", l.trial_id, "' to agent '", l.agent_id, "'");
    if (l.agent_id.empty()) return absl::InvalidArgumentError(absl::StrCat(op, ": empty agent id"));
    {
      ASSIGN_OR_RETURN(
          Stmt u, Prepare("UPDATE trials SET state = 'leased', leased_to = ?, "
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
    if (sqlite3_changes(db_) == 0) {
      ASSIGN_OR_RETURN(TrialRecord t, GetTrialLocked(l.trial_id));  // NotFound if absent
      std::string holder = t.state == TrialState::kLeased
                               ? absl::StrCat(" (leased to agent '", t.leased_to, "')")
                               : "";
      return absl::FailedPreconditionError(absl::StrCat(
          op, ": the trial is ", kStateNames[static_cast<int>(t.state)], holder, ", not queued"));
    }
    return GetTrialLocked(l.trial_id);
  }

  absl::StatusOr<TrialRecord> GetTrialLocked(const std::string& trial_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ASSIGN_OR_RETURN(
        Stmt q, Prepare(absl::StrCat("SELECT ", kTrialCols, " FROM trials WHERE trial_id = ?"),
                        absl::StrCat("reading trial '", trial_id, "'")));
    q.Bind(trial_id);
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row) return absl::NotFoundError(absl::StrCat("trial '", trial_id, "' not found"));
    return ReadTrial(q);
  }

  // One lost lease inside the caller's transaction: requeue it, or finish it with an ERROR when
  // it has had max_attempts attempts. `attempt` < 0 accepts the current attempt.
  absl::StatusOr<LostLease> LoseLeaseLocked(const std::string& trial_id,
                                            const std::string& agent_id, int attempt,
                                            int max_attempts, const std::string& why,
                                            const std::string& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ASSIGN_OR_RETURN(TrialRecord t, GetTrialLocked(trial_id));
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
      ASSIGN_OR_RETURN(Stmt u,
                             Prepare("UPDATE trials SET state = 'queued', leased_to = NULL, "
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
    sub.result.device = ConfigDevice(t.config) == "cpu" || t.lease_place.gpu_name.empty()
                            ? "cpu"
                            : t.lease_place.gpu_name;
    sub.result.sm = t.lease_place.sm;
    sub.result.started_unix_ms = sub.result.finished_unix_ms = NowMs();
    RETURN_IF_ERROR(RecordOneLocked(sub));
    return lost;
  }

  // One result inside the caller's transaction.
  absl::Status RecordOneLocked(const ResultSubmission& sub) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const TrialResult& result = sub.result;
    const std::string op = absl::StrCat("recording the result of trial '", result.trial_id,
                                        "' attempt ", result.attempt);
    if (result.trial_id.empty())
      return absl::InvalidArgumentError("recording a result: empty trial id");
    // What a duplicate of an agent's result must repeat: its content as sent, canonical JSON.
    // The first 16 bytes of its SHA-256 are kept (a 2^-128 chance that other content matches).
    const std::string digest =
        sub.agent_id.empty() ? "" : Sha256(ToJson(result).dump()).substr(0, 16);

    int64_t sweep_id = 0;
    std::string model, config_string, state, leased_to, workload_key, trial_model_key;
    int64_t attempt = 0, trial_layers = 0;
    {
      ASSIGN_OR_RETURN(
          Stmt q, Prepare("SELECT sweep_id, model, (SELECT config_string FROM configs AS c "
                          "WHERE c.config_id = trials.config_id), state, attempt, leased_to, "
                          "workload_key, model_key, layers FROM trials WHERE trial_id = ?",
                          op));
      q.Bind(result.trial_id);
      ASSIGN_OR_RETURN(bool row, q.Step());
      if (!row)
        return absl::NotFoundError(
            absl::StrCat(op, ": no trial '", result.trial_id, "' in this database"));
      sweep_id = q.Int(0);
      model = q.Text(1);
      config_string = q.Text(2);
      state = q.Text(3);
      attempt = q.Int(4);
      leased_to = q.Text(5);
      workload_key = q.Text(6);
      trial_model_key = q.Text(7);
      trial_layers = q.Int(8);
    }
    {
      ASSIGN_OR_RETURN(Stmt q, Prepare("SELECT agent_id, status, result_digest FROM results "
                                       "WHERE trial_id = ? AND attempt = ?",
                                       op));
      q.Bind(result.trial_id).Bind(result.attempt);
      ASSIGN_OR_RETURN(bool row, q.Step());
      if (row) {
        // Already stored: a replay of the same content is idempotent. Other content for the same
        // attempt is refused, so the stored row and the agent's own log cannot silently
        // disagree (rows stored before digests existed have none and stay idempotent). When the
        // coordinator stored that attempt itself (its lease was lost for the last time), the
        // agent's late result is refused, not acknowledged and dropped.
        if (sub.agent_id.empty()) return absl::OkStatus();
        if (q.Text(0) == sub.agent_id) {
          if (q.IsNull(2) || q.Blob(2) == digest) return absl::OkStatus();
          return absl::AlreadyExistsError(absl::StrCat(
              op, " from agent '", sub.agent_id, "' refused: that attempt is stored as ", q.Text(1),
              " with other content (a replay must be identical; sha256 ",
              HexOf(digest.substr(0, 6)), " against the stored ", HexOf(q.Blob(2).substr(0, 6)),
              ")"));
        }
        return absl::PermissionDeniedError(
            absl::StrCat(op, " from agent '", sub.agent_id,
                         "' rejected: that attempt is already recorded as ", q.Text(1),
                         q.Text(0).empty() ? " by the coordinator"
                                           : absl::StrCat(" by agent '", q.Text(0), "'")));
      }
    }
    if (!sub.agent_id.empty() && (leased_to != sub.agent_id || attempt != result.attempt)) {
      std::string holder;
      if (leased_to.empty()) {
        holder = absl::StrCat("the trial is ", state, " and held by no agent");
      } else {
        holder = absl::StrCat("the trial is ", state, ", attempt ", attempt, " held by agent '",
                              leased_to, "'");
      }
      return absl::PermissionDeniedError(absl::StrCat(op, " from agent '", sub.agent_id,
                                                      "' rejected: ", holder));
    }

    // What the result describes: fill what coordinator-made results leave out from the trial.
    TrialResult stored = result;
    if (stored.model.empty()) stored.model = model;
    if (stored.config.empty()) {
      absl::StatusOr<BackendConfig> config = ParseBackendConfig(config_string);
      if (!config.ok())
        return absl::DataLossError(
            absl::StrCat(op, ": stored trial config: ", config.status().message()));
      stored.config = *std::move(config);
    }
    // The identity (docs/STORAGE.md "Identity"). The workload is the trial's: what was asked
    // for is what ran. The model's is the result's own, else what the trial knew at submit.
    stored.workload = workload_key;
    // Serving figures belong to serving trials and batch figures to lockstep ones: a result
    // that mixes them up is refused, so neither ranking ever holds the other's rows.
    const bool serving_trial = absl::StartsWith(workload_key, kServeWorkloadKeyPrefix);
    if (!stored.serving.empty() && !serving_trial)
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": result.serving: ", stored.serving.size(),
                       " load point(s) for a lockstep trial (workload ", workload_key, ")"));
    if (!stored.batches.empty() && serving_trial)
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": result.batches: ", stored.batches.size(),
                       " lockstep batch(es) for a serving trial (workload ", workload_key, ")"));
    std::optional<std::string> model_key;
    std::optional<int64_t> model_layers;
    if (std::string key = ModelIdentityKey(stored.model_identity); !key.empty()) {
      model_key = std::move(key);
      if (stored.model_identity.layers > 0) model_layers = stored.model_identity.layers;
    } else if (!trial_model_key.empty()) {
      model_key = trial_model_key;
      if (trial_layers > 0) model_layers = trial_layers;
    }
    std::optional<std::string> engine_version;
    if (!stored.engine_version.empty()) engine_version = stored.engine_version;
    // A result that says nothing of its model was made by a build that did not record the stack
    // either: unknown, not "none".
    std::optional<std::string> software;
    if (!stored.model_identity.source.empty()) software = SoftwareStackKey(stored.software);
    const std::string result_config = BackendConfigString(stored.config);
    ASSIGN_OR_RETURN(int64_t config_id, ConfigIdLocked(stored.config, result_config, op));

    const int64_t finished = stored.finished_unix_ms != 0 ? stored.finished_unix_ms : NowMs();
    std::optional<double> tok_s_b1, ttft_b1, tpot_b1, tok_s_max;
    std::optional<int64_t> max_batch;
    if (const BatchFigures* b1 = FindBatch(stored, 1)) {
      tok_s_b1 = b1->output_tok_s.median;
      ttft_b1 = b1->ttft_ms.median;
      tpot_b1 = b1->tpot_ms.median;
    }
    const BatchFigures* largest = nullptr;
    for (const BatchFigures& b : stored.batches)
      if (largest == nullptr || b.batch > largest->batch) largest = &b;
    if (largest != nullptr) {
      tok_s_max = largest->output_tok_s.median;
      max_batch = largest->batch;
    }
    // Each batch's kernel log is stored once for the whole database (kernel_logs): results of
    // one config repeat it. The result keeps its id ("kernels_ref"); reads put the log back.
    std::vector<std::optional<int64_t>> log_ids;
    TrialResult slim = stored;
    for (BatchFigures& b : slim.batches) {
      log_ids.emplace_back();
      if (!b.prefill_kernels && !b.decode_kernels) continue;
      ASSIGN_OR_RETURN(log_ids.back(), KernelLogIdLocked(b, op));
      b.prefill_kernels.reset();
      b.decode_kernels.reset();
    }
    json stored_json = ToJson(slim);
    for (size_t i = 0; i < log_ids.size(); ++i)
      if (log_ids[i]) stored_json["batches"][i]["kernels_ref"] = *log_ids[i];
    const std::string blob = CompressResultJson(stored_json.dump());
    if (blob.empty()) return absl::InternalError(absl::StrCat(op, ": compressing the result"));
    int64_t result_id = 0;
    {
      ASSIGN_OR_RETURN(
          Stmt ins,
          Prepare(
              "INSERT INTO results (trial_id, attempt, sweep_id, agent_id, gpu_name, sm, "
              "model, status, config_string, result_json, output_tok_s, "
              "output_tok_s_max_batch, max_batch, ttft_ms_p50, tpot_ms, finished_ms, "
              "config_id, model_key, model_layers, workload, engine_version, software, "
              "result_blob, result_digest) "
              "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, '', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
              op));
      ins.Bind(stored.trial_id)
          .Bind(stored.attempt)
          .Bind(sweep_id)
          .Bind(sub.agent_id)
          .Bind(sub.gpu_name)
          .Bind(sub.sm)
          .Bind(model)
          .Bind(TrialStatusName(stored.status))
          .Bind(result_config)
          .Bind(tok_s_b1)
          .Bind(tok_s_max)
          .Bind(max_batch)
          .Bind(ttft_b1)
          .Bind(tpot_b1)
          .Bind(finished)
          .Bind(config_id)
          .Bind(model_key)
          .Bind(model_layers)
          .Bind(stored.workload)
          .Bind(engine_version)
          .Bind(software)
          .BindBlob(blob)
          .BindBlobOrNull(digest);
      RETURN_IF_ERROR(ins.Run());
      result_id = sqlite3_last_insert_rowid(db_);
    }
    const bool ok = stored.status == TrialStatus::kOk;
    const std::string group_key = model_key.value_or("");
    {  // one row per batch size (the first entry of a size wins), for Best at any batch
      ASSIGN_OR_RETURN(
          Stmt ins, Prepare("INSERT OR IGNORE INTO result_batches (group_id, sweep_id, result_id, "
                            "ok, output_tok_s, ttft_ms, tpot_ms, prefill_tok_s) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            op + ": batches"));
      ASSIGN_OR_RETURN(Stmt count,
                             Prepare("UPDATE result_groups SET ok_results = ok_results + 1, "
                                     "first_sweep = MIN(COALESCE(first_sweep, ?1), ?1), "
                                     "last_sweep = MAX(COALESCE(last_sweep, ?1), ?1), "
                                     "last_finished_ms = MAX(COALESCE(last_finished_ms, ?2), ?2) "
                                     "WHERE group_id = ?3",
                                     op + ": groups"));
      for (const BatchFigures& b : stored.batches) {
        ASSIGN_OR_RETURN(int64_t group_id, GroupIdLocked(model, sub.sm, b.batch, group_key,
                                                               stored.workload, op));
        ins.Reset();
        ins.Bind(group_id)
            .Bind(sweep_id)
            .Bind(result_id)
            .Bind(ok ? 1 : 0)
            .Bind(b.output_tok_s.median)
            .Bind(b.ttft_ms.median)
            .Bind(b.tpot_ms.median)
            .Bind(b.prefill_tok_s.median);
        RETURN_IF_ERROR(ins.Run());
        if (!ok || sqlite3_changes(db_) == 0) continue;
        count.Reset();
        count.Bind(sweep_id).Bind(finished).Bind(group_id);
        RETURN_IF_ERROR(count.Run());
      }
    }
    if (!stored.serving.empty()) {  // one row per load point, for Best over serving points
      ASSIGN_OR_RETURN(
          Stmt ins,
          Prepare("INSERT INTO serving_points (result_id, point_index, sweep_id, model, sm, "
                  "model_key, workload, load_point, mode, concurrency, request_rate, verdict, ok, "
                  "completed, duration_s, request_throughput, output_throughput, "
                  "total_token_throughput, output_tok_s_per_user, median_ttft_ms, p99_ttft_ms, "
                  "median_tpot_ms, p99_tpot_ms, p99_itl_ms, p99_e2el_ms, request_goodput, "
                  "meets_slo, finished_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                  "?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  op + ": serving points"));
      for (size_t i = 0; i < stored.serving.size(); ++i) {
        const ServingPoint& point = stored.serving[i];
        ins.Reset();
        ins.Bind(result_id)
            .Bind(static_cast<int64_t>(i))
            .Bind(sweep_id)
            .Bind(model)
            .Bind(sub.sm)
            .Bind(group_key)
            .Bind(stored.workload)
            .Bind(LoadPointName(point.point))
            .Bind(point.point.open_loop ? "poisson" : "closed_loop")
            .Bind(point.point.concurrency)
            .Bind(point.point.open_loop ? std::optional<double>(point.point.rate) : std::nullopt)
            .Bind(TrialStatusName(point.verdict))
            .Bind(ok && point.verdict == TrialStatus::kOk ? 1 : 0)
            .Bind(point.completed)
            .Bind(point.duration_s)
            .Bind(point.request_throughput)
            .Bind(point.output_throughput)
            .Bind(point.total_token_throughput)
            .Bind(point.output_tok_s_per_user)
            .Bind(point.ttft_ms.median)
            .Bind(point.ttft_ms.p99)
            .Bind(point.tpot_ms.median)
            .Bind(point.tpot_ms.p99)
            .Bind(point.itl_ms.p99)
            .Bind(point.e2el_ms.p99)
            .Bind(point.request_goodput);
        if (point.meets_slo) {
          ins.Bind(*point.meets_slo ? 1 : 0);
        } else {
          ins.BindNull();
        }
        ins.Bind(finished);
        RETURN_IF_ERROR(ins.Run());
      }
    }
    if (state != "done") {
      {
        ASSIGN_OR_RETURN(
            Stmt u, Prepare("UPDATE trials SET state = 'done', lease_expires_ms = NULL "
                            "WHERE trial_id = ?",
                            op));
        u.Bind(stored.trial_id);
        RETURN_IF_ERROR(u.Run());
      }
      ASSIGN_OR_RETURN(
          Stmt u, Prepare("UPDATE sweeps SET trials_done = trials_done + 1, "
                          "state = CASE WHEN state = 'active' AND trials_done + 1 >= trials_total "
                          "THEN 'done' ELSE state END WHERE sweep_id = ?",
                          op));
      u.Bind(sweep_id);
      RETURN_IF_ERROR(u.Run());
    }
    return absl::OkStatus();
  }

  // The id of a (model, sm, batch, model identity, workload) group, added the first time.
  absl::StatusOr<int64_t> GroupIdLocked(const std::string& model, int sm, int batch,
                                        const std::string& model_key, const std::string& workload,
                                        const std::string& op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::string key = absl::StrCat(model.size(), ":", model, sm, ":", batch, ":", model_key.size(),
                                   ":", model_key, workload);
    if (auto it = id_cache_.groups.find(key); it != id_cache_.groups.end()) return it->second;
    int64_t id = 0;
    {
      ASSIGN_OR_RETURN(
          Stmt q, Prepare("SELECT group_id FROM result_groups WHERE model = ? AND sm = ? AND "
                          "batch = ? AND model_key = ? AND workload = ?",
                          op));
      q.Bind(model).Bind(sm).Bind(batch).Bind(model_key).Bind(workload);
      ASSIGN_OR_RETURN(bool row, q.Step());
      if (row) id = q.Int(0);
    }
    if (id == 0) {
      ASSIGN_OR_RETURN(Stmt ins,
                             Prepare("INSERT INTO result_groups (model, sm, batch, model_key, "
                                     "workload) VALUES (?, ?, ?, ?, ?)",
                                     op));
      ins.Bind(model).Bind(sm).Bind(batch).Bind(model_key).Bind(workload);
      RETURN_IF_ERROR(ins.Run());
      id = sqlite3_last_insert_rowid(db_);
    }
    id_cache_.groups.emplace(std::move(key), id);
    return id;
  }

  // The id of a batch's kernel log (KernelsJson's text) in `kernel_logs`, added the first time
  // it is seen. Known logs are found by a key made from the figures themselves, without
  // building their JSON.
  absl::StatusOr<int64_t> KernelLogIdLocked(const BatchFigures& b, const std::string& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::string key;
    for (const std::optional<PhaseKernels>* phase : {&b.prefill_kernels, &b.decode_kernels}) {
      // Length-prefixed, so no two logs share a key whatever their names hold.
      auto add = [&key](const std::string& text) { absl::StrAppend(&key, text.size(), ":", text); };
      if (!*phase) {
        key += '-';
        continue;
      }
      key += (*phase)->graph ? 'G' : 'g';
      absl::StrAppend(&key, (*phase)->kernels.size(), "k");
      for (const KernelCount& k : (*phase)->kernels) {
        add(k.name);
        absl::StrAppend(&key, k.count, ";");
      }
      absl::StrAppend(&key, (*phase)->fallbacks.size(), "f");
      for (const std::string& f : (*phase)->fallbacks) add(f);
    }
    if (auto it = id_cache_.kernel_logs.find(key); it != id_cache_.kernel_logs.end())
      return it->second;
    const std::string log = KernelsJson(b).dump();
    int64_t id = 0;
    {
      ASSIGN_OR_RETURN(Stmt q,
                             Prepare("SELECT kernel_log_id FROM kernel_logs WHERE log = ?", op));
      q.Bind(log);
      ASSIGN_OR_RETURN(bool row, q.Step());
      if (row) id = q.Int(0);
    }
    if (id == 0) {
      ASSIGN_OR_RETURN(Stmt ins, Prepare("INSERT INTO kernel_logs (log) VALUES (?)", op));
      ins.Bind(log);
      RETURN_IF_ERROR(ins.Run());
      id = sqlite3_last_insert_rowid(db_);
    }
    id_cache_.kernel_logs.emplace(std::move(key), id);
    return id;
  }

  // A kernel log by id; committed logs never change, so they are cached once read.
  absl::StatusOr<const std::string*> KernelLogLocked(int64_t id, const std::string& where)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (auto it = kernel_logs_.find(id); it != kernel_logs_.end()) return &it->second;
    ASSIGN_OR_RETURN(Stmt q,
                           Prepare("SELECT log FROM kernel_logs WHERE kernel_log_id = ?", where));
    q.Bind(id);
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row) return absl::DataLossError(absl::StrCat(where, ": kernel log ", id, " is missing"));
    return &(kernel_logs_[id] = q.Text(0));
  }

  // The id of a config in `configs`, added with its axes the first time it is seen.
  absl::StatusOr<int64_t> ConfigIdLocked(const BackendConfig& config,
                                         const std::string& config_string, const std::string& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (auto it = id_cache_.configs.find(config_string); it != id_cache_.configs.end())
      return it->second;
    ASSIGN_OR_RETURN(int64_t id, FindOrAddConfigLocked(config, config_string, op));
    id_cache_.configs.emplace(config_string, id);
    return id;
  }

  absl::StatusOr<int64_t> FindOrAddConfigLocked(const BackendConfig& config,
                                                const std::string& config_string,
                                                const std::string& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    {
      ASSIGN_OR_RETURN(Stmt q,
                             Prepare("SELECT config_id FROM configs WHERE config_string = ?", op));
      q.Bind(config_string);
      ASSIGN_OR_RETURN(bool row, q.Step());
      if (row) return q.Int(0);
    }
    int64_t id = 0;
    {
      ASSIGN_OR_RETURN(Stmt ins,
                             Prepare("INSERT INTO configs (config_string) VALUES (?)", op));
      ins.Bind(config_string);
      RETURN_IF_ERROR(ins.Run());
      id = sqlite3_last_insert_rowid(db_);
    }
    ASSIGN_OR_RETURN(
        Stmt axes,
        Prepare("INSERT OR IGNORE INTO config_axes (axis, value, config_id) VALUES (?, ?, ?)",
                op + ": config axes"));
    for (const auto& [axis, value] : config) {
      axes.Reset();
      axes.Bind(axis).Bind(value).Bind(id);
      RETURN_IF_ERROR(axes.Run());
    }
    return id;
  }

  // The WAL is checkpointed here, every kCheckpointIntervalMs, not by the commit that crosses
  // SQLite's page threshold: a commit never pays for copying the WAL (the ingest p99). PASSIVE
  // never waits for a writer or blocks one, but under sustained ingest a writer always has a
  // transaction open when the checkpoint finishes, so the WAL never starts over and grows
  // without end. Past wal_limit_bytes_ (seen by the commit that crosses it, through the WAL
  // hook, so the checkpoint does not wait for the next interval), a RESTART checkpoint copies
  // what PASSIVE left while this store's calls wait for it (a few ms): the next commit then
  // writes the WAL from its start, and journal_size_limit cuts the file back to the limit.
  // (TRUNCATE would free the whole file under the wait, tens of ms at 32 MiB.)
  static constexpr int kCheckpointIntervalMs = 250;
  static int OnWalCommit(void* store, sqlite3*, const char*, int wal_frames) {
    auto* self = static_cast<SqliteStore*>(store);
    if (static_cast<int64_t>(wal_frames) * self->page_size_ > self->wal_limit_bytes_) {
      absl::MutexLock lock(&self->checkpoint_mu_);
      self->wal_over_limit_ = true;
    }
    return SQLITE_OK;
  }
  void CheckpointLoop() {
    auto wake = [this] {
      checkpoint_mu_.AssertReaderHeld();
      return stopping_ || wal_over_limit_;
    };
    for (;;) {
      {
        absl::MutexLock lock(&checkpoint_mu_);
        checkpoint_mu_.AwaitWithTimeout(absl::Condition(&wake),
                                        absl::Milliseconds(kCheckpointIntervalMs));
        if (stopping_) return;
        wal_over_limit_ = false;
      }
      int wal_frames = 0;
      const int rc = sqlite3_wal_checkpoint_v2(checkpointer_, nullptr, SQLITE_CHECKPOINT_PASSIVE,
                                               &wal_frames, nullptr);
      if (rc == SQLITE_OK && wal_frames * page_size_ > wal_limit_bytes_) {
        // The store's own lock holds this store's writers back meanwhile: SQLite queues nobody,
        // so a writer that commits back to back would otherwise starve the checkpoint. (The WAL
        // hook takes checkpoint_mu_ under mu_; this takes mu_ without checkpoint_mu_.)
        absl::MutexLock writers(&mu_);
        sqlite3_wal_checkpoint_v2(checkpointer_, nullptr, SQLITE_CHECKPOINT_RESTART, nullptr,
                                  nullptr);
      }
    }
  }

  sqlite3* const db_;
  sqlite3* const checkpointer_;
  const int64_t wal_limit_bytes_;
  const int64_t page_size_;
  absl::Mutex checkpoint_mu_;
  bool stopping_ ABSL_GUARDED_BY(checkpoint_mu_) = false;
  bool wal_over_limit_ ABSL_GUARDED_BY(checkpoint_mu_) = false;
  std::thread checkpoint_thread_;
  absl::Mutex mu_;
  std::unordered_map<std::string, sqlite3_stmt*> cache_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<int64_t, std::string> kernel_logs_ ABSL_GUARDED_BY(mu_);
  // Ids of rows that are only ever added (configs, result groups, kernel logs), by their keys:
  // the write path's lookups. A rolled-back transaction can take rows it added with it, so every
  // rollback clears the cache (Txn's and RecordResultsEach's).
  struct IdCache {
    std::unordered_map<std::string, int64_t> configs, groups, kernel_logs;
    void Clear() {
      configs.clear();
      groups.clear();
      kernel_logs.clear();
    }
  };
  IdCache id_cache_ ABSL_GUARDED_BY(mu_);
};

absl::Status Pragma(sqlite3* db, const char* sql, absl::string_view what) {
  return ExecSql(db, sql, absl::StrCat("opening the database: setting ", what));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& path) {
  return Open(path, StoreOptions());
}

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& path,
                                                   const StoreOptions& options) {
  // Every result, owner-only whatever the umask (group-read for a dashboard's reader when asked).
  if (absl::Status s = CreatePrivateFile(path, options.file_mode); !s.ok())
    return absl::FailedPreconditionError(
        absl::StrCat("opening database '", path, "': ", s.message()));
  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(
      path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    absl::Status s = SqliteError(db, rc, absl::StrCat("opening database '", path, "'"));
    sqlite3_close_v2(db);
    return s;
  }
  auto fail = [&](absl::Status s) {
    sqlite3_close_v2(db);
    return absl::Status(s.code(), absl::StrCat("database '", path, "': ", s.message()));
  };
  sqlite3_extended_result_codes(db, 1);
  if (int b = sqlite3_busy_timeout(db, std::max(0, options.busy_timeout_ms)); b != SQLITE_OK)
    return fail(SqliteError(db, b, "setting busy_timeout"));
  // 8 KiB pages hold three ~2 KiB result rows where 4 KiB pages hold one (new files only: the
  // page size of an existing file is fixed).
  if (absl::Status s = Pragma(db, "PRAGMA page_size = 8192", "page_size"); !s.ok()) return fail(s);
  if (absl::Status s = Pragma(db, "PRAGMA foreign_keys = ON", "foreign_keys"); !s.ok())
    return fail(s);
  // 64 MiB of page cache: index maintenance on a large results table stays in memory.
  if (absl::Status s = Pragma(db, "PRAGMA cache_size = -65536", "cache_size"); !s.ok())
    return fail(s);
  // journal_mode answers with the mode it ended up in: in-memory databases cannot be WAL.
  {
    sqlite3_stmt* stmt = nullptr;
    int r = sqlite3_prepare_v2(db, "PRAGMA journal_mode = WAL", -1, &stmt, nullptr);
    if (r == SQLITE_OK) r = sqlite3_step(stmt);
    std::string mode;
    if (r == SQLITE_ROW) {
      const unsigned char* text = sqlite3_column_text(stmt, 0);
      mode = text != nullptr ? reinterpret_cast<const char*>(text) : "";
    }
    absl::Status s = r == SQLITE_ROW ? absl::OkStatus()
                                     : SqliteError(db, r, "opening the database: setting WAL");
    sqlite3_finalize(stmt);
    if (!s.ok()) return fail(s);
    if (mode != "wal" && mode != "memory")
      return fail(absl::FailedPreconditionError(
          absl::StrCat("the file system does not support WAL mode (journal_mode is '", mode, "')")));
  }
  if (absl::Status s = Pragma(db, "PRAGMA synchronous = NORMAL", "synchronous"); !s.ok())
    return fail(s);
  if (absl::Status s = Migrate(db); !s.ok()) return fail(s);
  // A WAL database gets its checkpoints from a connection of its own (SqliteStore); the
  // connection that commits results never stops to copy the WAL.
  sqlite3* checkpointer = nullptr;
  if (sqlite3_db_filename(db, "main") != nullptr && *sqlite3_db_filename(db, "main") != '\0') {
    if (absl::Status s = Pragma(db, "PRAGMA wal_autocheckpoint = 0", "wal_autocheckpoint"); !s.ok())
      return fail(s);
    // A WAL that starts over is cut back to the limit, not left at its largest.
    const std::string limit =
        absl::StrCat("PRAGMA journal_size_limit = ", std::max<int64_t>(0, options.wal_limit_bytes));
    if (absl::Status s = Pragma(db, limit.c_str(), "journal_size_limit"); !s.ok()) return fail(s);
    if (sqlite3_open_v2(path.c_str(), &checkpointer, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX,
                        nullptr) != SQLITE_OK) {
      absl::Status s = SqliteError(checkpointer, SQLITE_CANTOPEN,
                                   "opening the database's checkpoint connection");
      sqlite3_close_v2(checkpointer);
      return fail(s);
    }
    sqlite3_busy_timeout(checkpointer, 1000);
    // A connection learns that the file is in WAL mode when it first reads it; until then a
    // checkpoint is a silent no-op.
    if (absl::Status s =
            Pragma(checkpointer, "PRAGMA journal_mode = WAL", "the checkpointer's WAL");
        !s.ok()) {
      sqlite3_close_v2(checkpointer);
      return fail(s);
    }
  }
  int64_t page_size = 4096;
  {
    sqlite3_stmt* stmt = nullptr;
    if (sqlite3_prepare_v2(db, "PRAGMA page_size", -1, &stmt, nullptr) == SQLITE_OK &&
        sqlite3_step(stmt) == SQLITE_ROW)
      page_size = sqlite3_column_int64(stmt, 0);
    sqlite3_finalize(stmt);
  }
  return std::unique_ptr<Store>(
      new SqliteStore(db, checkpointer, options.wal_limit_bytes, page_size));
}

}  // namespace infersweep
