// The agent's local spool: results that the coordinator has not acknowledged yet, in one small
// SQLite file. A result is written here before it is sent, removed when the coordinator acks it,
// and every spooled result is sent again after each (re)connect, in the order it was spooled.
//
// Thread-safety: a Spool serialises its own calls.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

struct sqlite3;

namespace infersweep {

struct SpooledResult {
  int64_t seq = 0;          // spool order, assigned by Put
  std::string trial_id;
  int attempt = 1;
  std::string result_json;  // TrialResult JSON, verbatim
  std::vector<int> slots;   // the agent slots that ran it
  int64_t spooled_unix_ms = 0;
};

class Spool {
 public:
  // Opens or creates the spool (":memory:" for a throwaway one). Durable: synchronous=FULL.
  static absl::StatusOr<std::unique_ptr<Spool>> Open(const std::string& path);
  ~Spool();
  Spool(const Spool&) = delete;
  Spool& operator=(const Spool&) = delete;

  // Stores a result keyed by (trial_id, attempt). Putting the same key again replaces the JSON
  // and keeps the original position. Returns the entry's seq.
  absl::StatusOr<int64_t> Put(const SpooledResult& result);
  // Every spooled result, oldest first.
  absl::StatusOr<std::vector<SpooledResult>> All();
  // Removes one result; removing an absent key is OK (acks may repeat).
  absl::Status Remove(const std::string& trial_id, int attempt);
  absl::StatusOr<int64_t> Count();

 private:
  explicit Spool(sqlite3* db) : db_(db) {}
  absl::Status Exec(const char* sql);

  std::mutex mu_;
  sqlite3* db_;
};

}  // namespace infersweep
