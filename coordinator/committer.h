// Group commit of agent results: results wait in a queue for the committer's thread, which
// stores all that wait (up to a cap) in one transaction (Store::RecordResultsEach) and then has
// each answered. One durable commit serves many results, and each answer still follows its own
// commit.
//
// Private to coordinator/.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/status/status.h"
#include "coordinator/services.h"
#include "storage/store.h"

namespace infersweep::coordinator {

struct Conn;  // an agent's stream (coordinator/agent_sessions.cc)

// A result checked by its stream and waiting to be stored.
struct PendingResult {
  std::shared_ptr<Conn> conn;  // where the answer goes
  ResultSubmission submission;
  std::chrono::steady_clock::time_point received;
};

class Committer {
 public:
  // Called on the committer's thread for each result once its transaction is over, with what
  // the store said of it.
  using AnswerFn = std::function<void(PendingResult& pending, const absl::Status& stored)>;

  Committer(const CoordinatorServices& services, AnswerFn answer);
  ~Committer();  // Stop()s
  Committer(const Committer&) = delete;
  Committer& operator=(const Committer&) = delete;

  void Start();
  // Queues a result for the next transaction; false once stopping (nothing more is stored).
  bool Submit(PendingResult pending);
  // Stores and answers what waits, then stops the thread. Idempotent.
  void Stop();

 private:
  void Loop();

  const CoordinatorServices& services_;
  const AnswerFn answer_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<PendingResult> queue_;  // guarded by mu_
  bool stopping_ = false;            // guarded by mu_
  std::thread thread_;
};

}  // namespace infersweep::coordinator
