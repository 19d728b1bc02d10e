#include "coordinator/services.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "proto/log_line.h"

namespace infersweep::coordinator {

void CoordinatorServices::Log(const std::string& line) const {
  if (options.log) {
    options.log(line);
  } else {
    WriteLogLine("coordinator", line);
  }
}

void CoordinatorServices::ExportResult(const TrialResult& result, const std::string& gpu_name,
                                       int sm) const {
  std::string model = result.model;
  BackendConfig config = result.config;
  if (model.empty() || config.empty()) {
    if (absl::StatusOr<TrialRecord> t = store.GetTrial(result.trial_id); t.ok()) {
      if (model.empty()) model = t->model;
      if (config.empty()) config = t->config;
    }
  }
  metrics.OnResult(model, sm, gpu_name.empty() ? "unknown" : gpu_name, config, result);
}

bool CoordinatorServices::OverRateLimit(RateLimiter& limiter, const std::string& key,
                                        const char* api, std::atomic<int64_t>& refused) const {
  if (limiter.Allow(key)) return false;
  ++refused;
  metrics.CountRateLimited(api);
  return true;
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string RateLimitMessage(const std::string& what, const RateLimit& limit,
                             const std::string& who) {
  return absl::StrCat("rate limit: ", what, " from ", who, " exceed ", limit.rate_per_s,
                      "/s (burst ", limit.burst, "); retry later");
}

}  // namespace infersweep::coordinator
