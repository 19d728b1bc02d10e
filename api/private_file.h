// Files that hold results or secrets are created owner-only whatever the process umask: the
// coordinator's database, an agent's spool and results log (docs/SECURITY.md "Files and
// permissions"). SQLite gives a database's -wal and -shm files the database file's mode.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace infersweep {

// Creates `path` empty with exactly `mode` (0600, or 0640 for a group reader) when it does not
// exist; leaves an existing file as it is, and SQLite's names that are not files ("",
// ":memory:", "file:" URIs) alone. Errors name the path.
absl::Status CreatePrivateFile(const std::string& path, unsigned mode = 0600);

}  // namespace infersweep
