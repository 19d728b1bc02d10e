// Schema of the coordinator's SQLite file and its migrations (docs/STORAGE.md), plus the small
// SQLite helpers shared by storage/store.cc and the tests. Internal to storage/: other modules go
// through storage/store.h.
#pragma once

#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct sqlite3;

namespace infersweep {

// One schema step. Migrations()[i] takes a database from user_version i to i + 1.
struct Migration {
  std::string description;
  std::string sql;  // one or more statements, no values from outside
};

const std::vector<Migration>& Migrations();
inline int LatestSchemaVersion() { return static_cast<int>(Migrations().size()); }

// Reads PRAGMA user_version.
absl::StatusOr<int> SchemaVersion(sqlite3* db);

// Brings `db` to LatestSchemaVersion(): each pending step runs in its own BEGIN IMMEDIATE
// transaction that also bumps user_version, so a failure leaves the file at the last complete
// version. A file newer than this build is a FailedPrecondition naming both versions.
absl::Status Migrate(sqlite3* db);

// Maps a SQLite result code to a Status naming the operation and carrying sqlite3_errmsg:
// BUSY/LOCKED -> Unavailable ("database is busy ..."), FULL -> ResourceExhausted ("disk full
// ..."), IOERR from a write refused with ENOSPC, EFBIG (file size limit) or EDQUOT ->
// ResourceExhausted ("disk full ..."), NOMEM -> ResourceExhausted, unique/primary-key violations ->
// AlreadyExists, other constraints -> FailedPrecondition, CORRUPT/NOTADB -> DataLoss,
// READONLY/PERM/CANTOPEN -> FailedPrecondition, anything else -> Internal.
absl::Status SqliteError(sqlite3* db, int rc, absl::string_view operation);

// Runs statements without results or bound values (schema text, BEGIN/COMMIT); errors as above.
absl::Status ExecSql(sqlite3* db, const char* sql, absl::string_view operation);

// The text of the hot query, so tests can check its plan with EXPLAIN QUERY PLAN: the best
// result by a result_batches metric `column` (from a fixed table in store.cc, never from
// callers) within one result group, optionally one sweep's rows of it. Binds (group_id[,
// sweep_id]).
std::string BestInGroupSql(absl::string_view column, bool higher_is_better, bool in_sweep);
// The same for a serving metric: the best serving_points row by `column` (a fixed table in
// store.cc) of one (model, sm, load point, model identity, workload), optionally one sweep's.
// Binds (model, sm, load_point, model_key, workload[, sweep_id]).
std::string BestServingPointSql(absl::string_view column, bool higher_is_better, bool in_sweep);

}  // namespace infersweep
