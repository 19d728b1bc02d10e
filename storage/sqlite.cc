#include "storage/sqlite.h"

#include <cerrno>
#include <cstring>

namespace infersweep {

absl::Status SqliteError(sqlite3* db, int rc, absl::string_view operation) {
  // The errno of the failed system call, before anything here can change it: SQLite 3.40's
  // sqlite3_system_errno() stays 0 for a refused WAL write, but errno still says why.
  const int call_errno = errno;
  const char* msg = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  const std::string detail = absl::StrCat(operation, ": ", msg, " (sqlite code ", rc, ")");
  switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return absl::UnavailableError(
          absl::StrCat("database is busy (another connection holds a "
                       "lock; retry later) during ",
                       detail));
    case SQLITE_FULL:
      return absl::ResourceExhaustedError(absl::StrCat("disk full during ", detail));
    case SQLITE_IOERR: {
      // A write the file system refused for lack of space or over a size limit or quota is a
      // full disk too (SQLite reports only ENOSPC as SQLITE_FULL).
      int err = db != nullptr ? sqlite3_system_errno(db) : 0;
      if (err == 0) err = call_errno;
      if (err == ENOSPC || err == EFBIG || err == EDQUOT)
        return absl::ResourceExhaustedError(
            absl::StrCat("disk full during ", detail, ": ", std::strerror(err)));
      return absl::InternalError(detail);
    }
    case SQLITE_NOMEM:
      return absl::ResourceExhaustedError(absl::StrCat("out of memory during ", detail));
    case SQLITE_CONSTRAINT:
      if (rc == SQLITE_CONSTRAINT_UNIQUE || rc == SQLITE_CONSTRAINT_PRIMARYKEY)
        return absl::AlreadyExistsError(detail);
      return absl::FailedPreconditionError(detail);
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return absl::DataLossError(detail);
    case SQLITE_READONLY:
    case SQLITE_PERM:
    case SQLITE_CANTOPEN:
      return absl::FailedPreconditionError(detail);
    default:
      return absl::InternalError(detail);
  }
}

absl::Status ExecSql(sqlite3* db, const char* sql, absl::string_view operation) {
  const int rc = sqlite3_exec(db, sql, nullptr, nullptr, nullptr);
  if (rc != SQLITE_OK) return SqliteError(db, rc, operation);
  return absl::OkStatus();
}

Connection::~Connection() {
  for (auto& [sql, stmt] : cache_) sqlite3_finalize(stmt);
  sqlite3_close_v2(db_);
}

absl::StatusOr<Stmt> Connection::Prepare(const std::string& sql, std::string op) {
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

}  // namespace infersweep
