// What the coordinator's parts share. CoordinatorServer::Impl (coordinator/server.cc) owns the
// services and hands them to each part: the agent sessions (coordinator/agent_sessions.h), the
// result committer (coordinator/committer.h), the scheduler (coordinator/scheduler.h) and the
// user API (coordinator/user_api.h). Each part keeps its own state behind its own lock; these
// services are set up before any part runs and stay as they are until every part has stopped.
//
// Private to coordinator/.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "api/trial.h"
#include "coordinator/metrics.h"
#include "coordinator/rate_limit.h"
#include "coordinator/server.h"
#include "storage/store.h"

namespace infersweep::coordinator {

struct CoordinatorServices {
  const CoordinatorOptions& options;  // normalized (heartbeat interval, tick, grace set)
  Store& store;
  CoordinatorMetrics& metrics;
  // Starts a scheduling pass before the next tick: an event (a Hello, a disconnect, stored
  // results, a submit) may have made a queued trial placeable.
  std::function<void()> wake;

  // options.log, or stderr as LogLine("coordinator", line).
  void Log(const std::string& line) const;
  // Exports a stored result (fresh, not a replay) to the metrics, under the trial's model and
  // config when the result names none (as the store files it).
  void ExportResult(const TrialResult& result, const std::string& gpu_name, int sm) const;
  // True when `key` is over `limiter`'s rate: counted in `refused` and by `api` in the metrics.
  bool OverRateLimit(RateLimiter& limiter, const std::string& key, const char* api,
                     std::atomic<int64_t>& refused) const;
};

// Wall-clock milliseconds since the Unix epoch (leases and the store's times are in these).
int64_t NowMs();

// The text of a rate-limit refusal: what was limited, from whom, and the limit.
std::string RateLimitMessage(const std::string& what, const RateLimit& limit,
                             const std::string& who);

}  // namespace infersweep::coordinator
