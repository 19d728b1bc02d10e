// Schema of the coordinator's SQLite file and its migrations (docs/STORAGE.md). Internal to
// storage/: other modules go through storage/store.h.
#pragma once

#include <string>
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

}  // namespace infersweep
