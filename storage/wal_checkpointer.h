// The Store's WAL checkpointer: a second connection to the database file and a thread that folds
// the WAL into the database in the background, so that the connection that commits results
// never stops to copy it (docs/STORAGE.md "Checkpoints"). Internal to storage/.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "storage/sqlite.h"

namespace infersweep {

// Every kIntervalMs a PASSIVE checkpoint, which never waits for a writer or blocks one. Under
// sustained ingest a writer always has a transaction open when it finishes, so the WAL never
// starts over and grows without end. Past `wal_limit_bytes` (seen by the commit that crosses it,
// through SQLite's WAL hook, so the checkpoint does not wait for the next interval), a RESTART
// checkpoint copies what PASSIVE left while the writers' lock (Connection::mu()) holds the
// store's calls back: the next commit then writes the WAL from its start, and
// journal_size_limit cuts the file back to the limit. A TRUNCATE checkpoint would free the whole
// file under that wait, which costs much more than the copy.
//
// Lock order: Connection::mu() before checkpoint_mu_. The WAL hook runs inside a commit, with
// mu() held, and takes checkpoint_mu_; the loop takes mu() only after it has let checkpoint_mu_
// go.
class WalCheckpointer {
 public:
  static constexpr int kIntervalMs = 250;

  // Turns off the automatic checkpoint of `writer` (a commit that crosses SQLite's threshold
  // would copy the WAL inside the commit) and sets its journal_size_limit to `wal_limit_bytes`,
  // opens the checkpoint connection to `path`, hooks `writer`'s commits and starts the thread.
  // For a database in a file: an in-memory one has no WAL. Call before `writer` is shared.
  static absl::StatusOr<std::unique_ptr<WalCheckpointer>> Start(const std::string& path,
                                                                Connection& writer,
                                                                int64_t wal_limit_bytes);
  WalCheckpointer(const WalCheckpointer&) = delete;
  WalCheckpointer& operator=(const WalCheckpointer&) = delete;
  // Stops the thread, unhooks the writer, runs a last PASSIVE checkpoint and closes the
  // checkpoint connection. Destroy before the writer's Connection.
  ~WalCheckpointer();

 private:
  WalCheckpointer(Connection& writer, sqlite3* checkpointer, int64_t wal_limit_bytes,
                  int64_t page_size);
  static int OnWalCommit(void* self, sqlite3*, const char*, int wal_frames);
  void Loop();

  Connection& writer_;
  sqlite3* const checkpointer_;
  const int64_t wal_limit_bytes_;
  const int64_t page_size_;
  absl::Mutex checkpoint_mu_;
  bool stopping_ ABSL_GUARDED_BY(checkpoint_mu_) = false;
  bool wal_over_limit_ ABSL_GUARDED_BY(checkpoint_mu_) = false;
  std::thread thread_;
};

}  // namespace infersweep
