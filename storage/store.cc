// SqliteStore: the Store on one SQLite connection (C API), serialised by the connection's lock.
// It composes the parts that do the work, each owning its own state:
//   storage/sqlite.h           the connection, its statement cache and lock; statements,
//                              transactions, error mapping
//   storage/wal_checkpointer.h the WAL's background checkpoints (a connection of its own)
//   storage/fleet_state.h      sweeps, trials, leases, agents
//   storage/ingest.h           results in, and the interning of what they share
//   storage/queries.h          results out: queries, Best, counts
//
// Every value reaches SQL through sqlite3_bind_*; the only SQL assembled at run time is made of
// fixed fragments from storage/queries.cc (QueryResults' WHERE clause, Best's column and
// direction).
#include "storage/store.h"

#include <sqlite3.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "api/private_file.h"
#include "api/status_macros.h"
#include "storage/fleet_state.h"
#include "storage/ingest.h"
#include "storage/queries.h"
#include "storage/schema.h"
#include "storage/sqlite.h"
#include "storage/wal_checkpointer.h"

namespace infersweep {
namespace {

// Each call takes the connection's lock for its whole duration and hands it to one part; the
// parts call each other (fleet state records the ERROR of a lease lost for the last time through
// ingest) under that one lock.
class SqliteStore final : public Store {
 public:
  // `checkpointer`: null for in-memory databases.
  SqliteStore(std::unique_ptr<Connection> conn, std::unique_ptr<WalCheckpointer> checkpointer)
      : conn_(std::move(conn)),
        ingest_(*conn_),
        fleet_(*conn_, ingest_),
        queries_(*conn_),
        checkpointer_(std::move(checkpointer)) {
    // A rolled-back transaction can take rows it added with it, and so the ids ingest interned.
    conn_->set_on_rollback([this] {
      conn_->mu().AssertHeld();  // Txn rolls back within a call
      ingest_.ForgetIds();
    });
  }

  absl::StatusOr<int64_t> CreateSweep(const SweepRecord& sweep,
                                      const std::vector<TrialRecord>& trials) override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.CreateSweep(sweep, trials);
  }
  absl::StatusOr<SweepRecord> GetSweep(int64_t id) override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.GetSweep(id);
  }
  absl::StatusOr<std::vector<SweepRecord>> ListSweeps() override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.ListSweeps();
  }
  absl::Status CancelSweep(int64_t id) override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.CancelSweep(id);
  }

  absl::StatusOr<std::vector<TrialRecord>> QueuedTrials(int limit) override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.QueuedTrials(limit);
  }
  absl::StatusOr<TrialCounts> CountTrials() override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.CountTrials();
  }
  absl::StatusOr<std::vector<Selector>> QueuedSelectors(int64_t sweep_id) override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.QueuedSelectors(sweep_id);
  }
  absl::StatusOr<TrialRecord> GetTrial(const std::string& trial_id) override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.GetTrial(trial_id);
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
    absl::MutexLock lock(&conn_->mu());
    return fleet_.LeaseTrials(leases);
  }
  absl::Status RenewLeases(const std::string& agent_id, int64_t expires_unix_ms) override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.RenewLeases(agent_id, expires_unix_ms);
  }
  absl::StatusOr<std::vector<LostLease>> RequeueExpired(int64_t now_unix_ms,
                                                        int max_attempts) override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.RequeueExpired(now_unix_ms, max_attempts);
  }
  absl::StatusOr<LostLease> ReleaseLease(const std::string& trial_id, const std::string& agent_id,
                                         int attempt, int max_attempts,
                                         const std::string& why) override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.ReleaseLease(trial_id, agent_id, attempt, max_attempts, why);
  }

  absl::Status RecordResult(const std::string& agent_id, const std::string& gpu_name, int sm,
                            const TrialResult& result) override {
    return RecordResults({ResultSubmission{agent_id, gpu_name, sm, result}});
  }
  absl::Status RecordResults(const std::vector<ResultSubmission>& results) override {
    absl::MutexLock lock(&conn_->mu());
    return ingest_.RecordResults(results);
  }
  std::vector<absl::Status> RecordResultsEach(
      const std::vector<ResultSubmission>& results) override {
    absl::MutexLock lock(&conn_->mu());
    return ingest_.RecordResultsEach(results);
  }

  absl::StatusOr<std::map<std::string, int64_t>> CountResults(int64_t sweep_id) override {
    absl::MutexLock lock(&conn_->mu());
    return queries_.CountResults(sweep_id);
  }
  absl::StatusOr<std::vector<std::pair<std::string, int>>> ResultModelArchs() override {
    absl::MutexLock lock(&conn_->mu());
    return queries_.ResultModelArchs();
  }
  absl::StatusOr<std::vector<StoredResult>> QueryResults(const ResultQuery& q) override {
    absl::MutexLock lock(&conn_->mu());
    return queries_.Query(q, /*parse=*/true);
  }
  absl::StatusOr<std::vector<StoredResult>> QueryResultRows(const ResultQuery& q) override {
    absl::MutexLock lock(&conn_->mu());
    return queries_.Query(q, /*parse=*/false);
  }
  absl::StatusOr<BestAnswer> Best(const BestQuery& q) override {
    absl::MutexLock lock(&conn_->mu());
    return queries_.Best(q);
  }

  absl::Status UpsertAgent(const AgentRecord& agent) override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.UpsertAgent(agent);
  }
  absl::Status SetAgentConnected(const std::string& agent_id, bool connected,
                                 int64_t now_unix_ms) override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.SetAgentConnected(agent_id, connected, now_unix_ms);
  }
  absl::StatusOr<std::vector<AgentRecord>> ListAgents() override {
    absl::MutexLock lock(&conn_->mu());
    return fleet_.ListAgents();
  }

 private:
  // Destroyed in reverse: the checkpointer stops (and closes its connection) before the parts
  // go, and the connection closes last.
  const std::unique_ptr<Connection> conn_;
  Ingest ingest_;
  FleetState fleet_;
  ResultQueries queries_;
  const std::unique_ptr<WalCheckpointer> checkpointer_;
};

absl::Status Pragma(sqlite3* db, const char* sql, absl::string_view what) {
  return ExecSql(db, sql, absl::StrCat("opening the database: setting ", what));
}

// The pragmas of the store's connection (docs/STORAGE.md "Connection") and its schema.
absl::Status Configure(sqlite3* db, const StoreOptions& options) {
  sqlite3_extended_result_codes(db, 1);
  if (int b = sqlite3_busy_timeout(db, std::max(0, options.busy_timeout_ms)); b != SQLITE_OK)
    return SqliteError(db, b, "setting busy_timeout");
  // 8 KiB pages hold three ~2 KiB result rows where 4 KiB pages hold one (new files only: the
  // page size of an existing file is fixed).
  RETURN_IF_ERROR(Pragma(db, "PRAGMA page_size = 8192", "page_size"));
  RETURN_IF_ERROR(Pragma(db, "PRAGMA foreign_keys = ON", "foreign_keys"));
  // 64 MiB of page cache: index maintenance on a large results table stays in memory.
  RETURN_IF_ERROR(Pragma(db, "PRAGMA cache_size = -65536", "cache_size"));
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
    RETURN_IF_ERROR(s);
    if (mode != "wal" && mode != "memory")
      return absl::FailedPreconditionError(
          absl::StrCat("the file system does not support WAL mode (journal_mode is '", mode, "')"));
  }
  RETURN_IF_ERROR(Pragma(db, "PRAGMA synchronous = NORMAL", "synchronous"));
  return Migrate(db);
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
  auto named = [&path](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("database '", path, "': ", s.message()));
  };
  if (absl::Status s = Configure(db, options); !s.ok()) {
    sqlite3_close_v2(db);
    return named(s);
  }
  auto conn = std::make_unique<Connection>(db);  // closes `db` from here on
  // A WAL database gets its checkpoints from a connection of its own; the connection that
  // commits results never stops to copy the WAL.
  std::unique_ptr<WalCheckpointer> checkpointer;
  if (sqlite3_db_filename(db, "main") != nullptr && *sqlite3_db_filename(db, "main") != '\0') {
    absl::StatusOr<std::unique_ptr<WalCheckpointer>> started =
        WalCheckpointer::Start(path, *conn, options.wal_limit_bytes);
    if (!started.ok()) return named(started.status());
    checkpointer = *std::move(started);
  }
  return std::unique_ptr<Store>(new SqliteStore(std::move(conn), std::move(checkpointer)));
}

}  // namespace infersweep
