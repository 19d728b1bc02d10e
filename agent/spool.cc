#include "agent/spool.h"
#include "api/status_macros.h"

#include <sqlite3.h>

#include <chrono>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "api/private_file.h"
#include "core/wall_clock.h"

namespace infersweep {
namespace {

constexpr int kSchemaVersion = 1;

// A prepared statement that finalizes itself.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) : db_(db) {
    rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr);
  }
  ~Stmt() { sqlite3_finalize(stmt_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  absl::Status Prepared() const {
    if (rc_ == SQLITE_OK) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("spool: prepare: ", sqlite3_errmsg(db_)));
  }
  void Bind(int i, const std::string& s) {
    sqlite3_bind_text(stmt_, i, s.data(), static_cast<int>(s.size()), SQLITE_TRANSIENT);
  }
  void Bind(int i, int64_t v) { sqlite3_bind_int64(stmt_, i, v); }
  // SQLITE_ROW, SQLITE_DONE or an error code.
  int Step() { return sqlite3_step(stmt_); }
  absl::Status Error(const char* what) const {
    return absl::InternalError(absl::StrCat("spool: ", what, ": ", sqlite3_errmsg(db_)));
  }
  int64_t Int(int col) { return sqlite3_column_int64(stmt_, col); }
  std::string Text(int col) {
    const unsigned char* p = sqlite3_column_text(stmt_, col);
    return p ? std::string(reinterpret_cast<const char*>(p),
                           static_cast<size_t>(sqlite3_column_bytes(stmt_, col)))
             : std::string();
  }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  int rc_;
};

std::string SlotsText(const std::vector<int>& slots) { return absl::StrJoin(slots, ","); }

std::vector<int> SlotsFromText(const std::string& text) {
  std::vector<int> slots;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int v;
    if (absl::SimpleAtoi(part, &v)) slots.push_back(v);
  }
  return slots;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Spool>> Spool::Open(const std::string& path) {
  // Owner-only whatever the umask: unacknowledged results (docs/SECURITY.md).
  if (absl::Status s = CreatePrivateFile(path, 0600); !s.ok())
    return absl::UnavailableError(absl::StrCat("spool ", path, ": ", s.message()));
  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(path.c_str(), &db,
                                 SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                                 nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    sqlite3_close(db);
    return absl::UnavailableError(absl::StrCat("spool ", path, ": ", msg));
  }
  sqlite3_busy_timeout(db, 5000);
  std::unique_ptr<Spool> spool(new Spool(db));
  for (const char* sql : {"PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL"}) {
    RETURN_IF_ERROR(spool->Exec(sql));
  }
  int64_t version = 0;
  {
    Stmt st(db, "PRAGMA user_version");
    RETURN_IF_ERROR(st.Prepared());
    if (st.Step() == SQLITE_ROW) version = st.Int(0);
  }
  if (version > kSchemaVersion)
    return absl::FailedPreconditionError(
        absl::StrCat("spool ", path, ": schema version ", version, " is newer than this agent (",
                     kSchemaVersion, ")"));
  if (version < 1) {
    auto s = spool->Exec(
        "BEGIN;"
        "CREATE TABLE IF NOT EXISTS spooled_results ("
        "  seq INTEGER PRIMARY KEY AUTOINCREMENT,"
        "  trial_id TEXT NOT NULL,"
        "  attempt INTEGER NOT NULL,"
        "  result_json TEXT NOT NULL,"
        "  slots TEXT NOT NULL DEFAULT '',"
        "  spooled_unix_ms INTEGER NOT NULL,"
        "  UNIQUE (trial_id, attempt));"
        "PRAGMA user_version = 1;"
        "COMMIT;");
    if (!s.ok()) {
      (void)spool->Exec("ROLLBACK");
      return s;
    }
  }
  return spool;
}

Spool::~Spool() { sqlite3_close(db_); }

absl::Status Spool::Exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : sqlite3_errmsg(db_);
    sqlite3_free(err);
    return absl::InternalError(absl::StrCat("spool: ", msg));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Spool::Put(const SpooledResult& result) {
  if (result.trial_id.empty()) return absl::InvalidArgumentError("spool: empty trial_id");
  std::lock_guard<std::mutex> lock(mu_);
  Stmt st(db_,
          "INSERT INTO spooled_results (trial_id, attempt, result_json, slots, spooled_unix_ms) "
          "VALUES (?1, ?2, ?3, ?4, ?5) "
          "ON CONFLICT (trial_id, attempt) DO UPDATE SET result_json = excluded.result_json, "
          "slots = excluded.slots "
          "RETURNING seq");
  RETURN_IF_ERROR(st.Prepared());
  st.Bind(1, result.trial_id);
  st.Bind(2, static_cast<int64_t>(result.attempt));
  st.Bind(3, result.result_json);
  st.Bind(4, SlotsText(result.slots));
  st.Bind(5, result.spooled_unix_ms ? result.spooled_unix_ms : NowUnixMs());
  if (st.Step() != SQLITE_ROW) return st.Error("put");
  const int64_t seq = st.Int(0);
  if (st.Step() != SQLITE_DONE) return st.Error("put");
  return seq;
}

absl::StatusOr<std::vector<SpooledResult>> Spool::All() {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt st(db_,
          "SELECT seq, trial_id, attempt, result_json, slots, spooled_unix_ms "
          "FROM spooled_results ORDER BY seq");
  RETURN_IF_ERROR(st.Prepared());
  std::vector<SpooledResult> out;
  int rc;
  while ((rc = st.Step()) == SQLITE_ROW) {
    SpooledResult r;
    r.seq = st.Int(0);
    r.trial_id = st.Text(1);
    r.attempt = static_cast<int>(st.Int(2));
    r.result_json = st.Text(3);
    r.slots = SlotsFromText(st.Text(4));
    r.spooled_unix_ms = st.Int(5);
    out.push_back(std::move(r));
  }
  if (rc != SQLITE_DONE) return st.Error("read");
  return out;
}

absl::Status Spool::Remove(const std::string& trial_id, int attempt) {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt st(db_, "DELETE FROM spooled_results WHERE trial_id = ?1 AND attempt = ?2");
  RETURN_IF_ERROR(st.Prepared());
  st.Bind(1, trial_id);
  st.Bind(2, static_cast<int64_t>(attempt));
  if (st.Step() != SQLITE_DONE) return st.Error("remove");
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Spool::Count() {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt st(db_, "SELECT COUNT(*) FROM spooled_results");
  RETURN_IF_ERROR(st.Prepared());
  if (st.Step() != SQLITE_ROW) return st.Error("count");
  return st.Int(0);
}

}  // namespace infersweep
