// The SQLite layer under the Store: error mapping, prepared statements, write transactions and
// the connection that owns the statement cache and the lock every Store call holds. Internal to
// storage/: other modules go through storage/store.h.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "api/status_macros.h"

namespace infersweep {

// Maps a SQLite result code to a Status naming the operation and carrying sqlite3_errmsg:
// BUSY/LOCKED -> Unavailable ("database is busy ..."), FULL -> ResourceExhausted ("disk full
// ..."), IOERR from a write refused with ENOSPC, EFBIG (file size limit) or EDQUOT ->
// ResourceExhausted ("disk full ..."), NOMEM -> ResourceExhausted, unique/primary-key violations ->
// AlreadyExists, other constraints -> FailedPrecondition, CORRUPT/NOTADB -> DataLoss,
// READONLY/PERM/CANTOPEN -> FailedPrecondition, anything else -> Internal.
absl::Status SqliteError(sqlite3* db, int rc, absl::string_view operation);

// Runs statements without results or bound values (schema text, BEGIN/COMMIT); errors as above.
absl::Status ExecSql(sqlite3* db, const char* sql, absl::string_view operation);

// A prepared statement borrowed from the connection's cache (or owned, for one-off SQL). Resets
// and clears its bindings on Reset() and when it goes out of scope, so a cached statement never
// keeps a read transaction open. Defined here in full: it is on the path of every row.
class Stmt {
 public:
  Stmt(sqlite3* db, sqlite3_stmt* stmt, bool owned, std::string op)
      : db_(db), stmt_(stmt), owned_(owned), op_(std::move(op)) {}
  Stmt(Stmt&& o) noexcept
      : db_(o.db_),
        stmt_(std::exchange(o.stmt_, nullptr)),
        owned_(o.owned_),
        op_(std::move(o.op_)),
        next_(o.next_),
        bind_error_(std::move(o.bind_error_)) {}
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
      ASSIGN_OR_RETURN(const bool row, Step());
      if (!row) return absl::OkStatus();
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

// The Store's one connection (opened SQLITE_OPEN_NOMUTEX) and the lock that serialises its use:
// every Store call holds mu() for its whole duration, and the WAL checkpointer holds it to keep
// the writers back during a RESTART checkpoint. Owns the prepared-statement cache.
class Connection {
 public:
  // Takes ownership of `db`: the destructor finalizes the cached statements and closes it.
  explicit Connection(sqlite3* db) : db_(db) {}
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  ~Connection();

  absl::Mutex& mu() ABSL_LOCK_RETURNED(mu_) { return mu_; }
  sqlite3* db() const { return db_; }

  // The statement for `sql`, from the cache (prepared the first time; at most
  // kMaxCachedStatements texts are kept, the rest are prepared for one use). `op` names the
  // operation in its errors.
  absl::StatusOr<Stmt> Prepare(const std::string& sql, std::string op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Statements without results or bound values (SAVEPOINT, RELEASE).
  absl::Status Exec(const char* sql, absl::string_view op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ExecSql(db_, sql, op);
  }
  int64_t LastInsertRowid() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return sqlite3_last_insert_rowid(db_);
  }
  // Rows changed by the last INSERT, UPDATE or DELETE.
  int Changes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return sqlite3_changes(db_); }

  // Runs, with mu() held, after every transaction a Txn rolls back: a rollback can take rows
  // with it whose ids a part of the Store keeps (the interned ids of ingest). Set once, before
  // the first call.
  void set_on_rollback(std::function<void()> on_rollback) { on_rollback_ = std::move(on_rollback); }
  void RolledBack() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (on_rollback_) on_rollback_();
  }

 private:
  // Cached statements: at most this many distinct SQL texts (QueryResults makes a few variants).
  static constexpr size_t kMaxCachedStatements = 128;

  sqlite3* const db_;
  absl::Mutex mu_;
  std::unordered_map<std::string, sqlite3_stmt*> cache_ ABSL_GUARDED_BY(mu_);
  std::function<void()> on_rollback_;
};

// A write transaction. BEGIN IMMEDIATE takes the write lock up front, so a busy database fails
// before anything is written. Rolls back unless committed, on every path out, and then tells
// the connection (Connection::RolledBack).
class Txn {
 public:
  explicit Txn(Connection& conn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn.mu()) : conn_(conn) {}
  Txn(const Txn&) = delete;
  Txn& operator=(const Txn&) = delete;
  ~Txn() ABSL_NO_THREAD_SAFETY_ANALYSIS {  // constructed with mu() held, destroyed before it goes
    if (sqlite3_get_autocommit(conn_.db())) return;
    sqlite3_exec(conn_.db(), "ROLLBACK", nullptr, nullptr, nullptr);
    conn_.RolledBack();
  }
  absl::Status Begin(absl::string_view op) {
    return ExecSql(conn_.db(), "BEGIN IMMEDIATE", absl::StrCat(op, " (BEGIN)"));
  }
  absl::Status Commit(absl::string_view op) {
    return ExecSql(conn_.db(), "COMMIT", absl::StrCat(op, " (COMMIT)"));
  }

 private:
  Connection& conn_;
};

}  // namespace infersweep
