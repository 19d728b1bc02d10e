#include "storage/wal_checkpointer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "api/status_macros.h"

namespace infersweep {

absl::StatusOr<std::unique_ptr<WalCheckpointer>> WalCheckpointer::Start(const std::string& path,
                                                                        Connection& writer,
                                                                        int64_t wal_limit_bytes) {
  sqlite3* const db = writer.db();
  RETURN_IF_ERROR(ExecSql(db, "PRAGMA wal_autocheckpoint = 0",
                          "opening the database: setting wal_autocheckpoint"));
  // A WAL that starts over is cut back to the limit, not left at its largest.
  const std::string limit =
      absl::StrCat("PRAGMA journal_size_limit = ", std::max<int64_t>(0, wal_limit_bytes));
  RETURN_IF_ERROR(ExecSql(db, limit.c_str(), "opening the database: setting journal_size_limit"));
  sqlite3* checkpointer = nullptr;
  if (sqlite3_open_v2(path.c_str(), &checkpointer, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX,
                      nullptr) != SQLITE_OK) {
    absl::Status s =
        SqliteError(checkpointer, SQLITE_CANTOPEN, "opening the database's checkpoint connection");
    sqlite3_close_v2(checkpointer);
    return s;
  }
  sqlite3_busy_timeout(checkpointer, 1000);
  // A connection learns that the file is in WAL mode when it first reads it; until then a
  // checkpoint is a silent no-op.
  if (absl::Status s = ExecSql(checkpointer, "PRAGMA journal_mode = WAL",
                               "opening the database: setting the checkpointer's WAL");
      !s.ok()) {
    sqlite3_close_v2(checkpointer);
    return s;
  }
  int64_t page_size = 4096;
  {
    sqlite3_stmt* stmt = nullptr;
    if (sqlite3_prepare_v2(db, "PRAGMA page_size", -1, &stmt, nullptr) == SQLITE_OK &&
        sqlite3_step(stmt) == SQLITE_ROW)
      page_size = sqlite3_column_int64(stmt, 0);
    sqlite3_finalize(stmt);
  }
  return std::unique_ptr<WalCheckpointer>(
      new WalCheckpointer(writer, checkpointer, wal_limit_bytes, page_size));
}

WalCheckpointer::WalCheckpointer(Connection& writer, sqlite3* checkpointer, int64_t wal_limit_bytes,
                                 int64_t page_size)
    : writer_(writer),
      checkpointer_(checkpointer),
      wal_limit_bytes_(wal_limit_bytes),
      page_size_(page_size) {
  sqlite3_wal_hook(writer_.db(), &WalCheckpointer::OnWalCommit, this);
  thread_ = std::thread([this] { Loop(); });
}

WalCheckpointer::~WalCheckpointer() {
  {
    absl::MutexLock lock(&checkpoint_mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  sqlite3_wal_hook(writer_.db(), nullptr, nullptr);
  sqlite3_wal_checkpoint_v2(checkpointer_, nullptr, SQLITE_CHECKPOINT_PASSIVE, nullptr, nullptr);
  sqlite3_close_v2(checkpointer_);
}

int WalCheckpointer::OnWalCommit(void* self, sqlite3*, const char*, int wal_frames) {
  auto* c = static_cast<WalCheckpointer*>(self);
  if (static_cast<int64_t>(wal_frames) * c->page_size_ > c->wal_limit_bytes_) {
    absl::MutexLock lock(&c->checkpoint_mu_);
    c->wal_over_limit_ = true;
  }
  return SQLITE_OK;
}

void WalCheckpointer::Loop() {
  auto wake = [this] {
    checkpoint_mu_.AssertReaderHeld();
    return stopping_ || wal_over_limit_;
  };
  for (;;) {
    {
      absl::MutexLock lock(&checkpoint_mu_);
      checkpoint_mu_.AwaitWithTimeout(absl::Condition(&wake), absl::Milliseconds(kIntervalMs));
      if (stopping_) return;
      wal_over_limit_ = false;
    }
    int wal_frames = 0;
    const int rc = sqlite3_wal_checkpoint_v2(checkpointer_, nullptr, SQLITE_CHECKPOINT_PASSIVE,
                                             &wal_frames, nullptr);
    if (rc == SQLITE_OK && wal_frames * page_size_ > wal_limit_bytes_) {
      // The writers' lock holds the store's writers back meanwhile: SQLite queues nobody, so a
      // writer that commits back to back would otherwise starve the checkpoint.
      absl::MutexLock writers(&writer_.mu());
      sqlite3_wal_checkpoint_v2(checkpointer_, nullptr, SQLITE_CHECKPOINT_RESTART, nullptr,
                                nullptr);
    }
  }
}

}  // namespace infersweep
