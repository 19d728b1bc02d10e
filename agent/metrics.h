// The agent's Prometheus metrics (docs/OBSERVABILITY.md lists every one): liveness
// (infersweep_agent_up, always 1 while the process serves), the trials it runs now, its spool,
// the trials it finished by status, and per-GPU power, utilization, memory and temperature read
// by a GpuSampler at each scrape (none without NVML: see harness/gpu_sampler.h).
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "harness/gpu_sampler.h"
#include "api/trial.h"

namespace prometheus {
class Counter;
class Gauge;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace infersweep {

class MetricsHttpServer;

class AgentMetrics {
 public:
  // `sampler` reads the GPUs at each scrape; null means MakeGpuSampler().
  explicit AgentMetrics(std::unique_ptr<GpuSampler> sampler = nullptr);
  ~AgentMetrics();
  AgentMetrics(const AgentMetrics&) = delete;
  AgentMetrics& operator=(const AgentMetrics&) = delete;

  // Serves GET /metrics on `address` ("127.0.0.1:9465"; port 0 picks a free one; see
  // proto/metrics_http.h). Returns the bound port. Fails (Unavailable) when the address
  // cannot be bound, FailedPrecondition if already listening.
  absl::StatusOr<int> Listen(const std::string& address);
  int port() const;

  // infersweep_agent_running_trial{trial_id, config} is 1 from TrialStarted until TrialFinished
  // or TrialAbandoned, then the series is removed (so at most one series per slot exists).
  void TrialStarted(const std::string& trial_id, const std::string& config);
  // Ends the running series and counts the trial in infersweep_agent_trials_total{status}.
  void TrialFinished(const std::string& trial_id, TrialStatus status);
  // Ends the running series without counting (the trial was cancelled or the agent stops).
  void TrialAbandoned(const std::string& trial_id);
  void SetSpoolDepth(int64_t n);

  // Reads the GPUs into the gauges now (every scrape does this first).
  void SampleGpus();
  // The text exposition (what GET /metrics returns, GPUs sampled first).
  std::string Serialize();

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<GpuSampler> sampler_;
  std::unique_ptr<MetricsHttpServer> http_;

  prometheus::Family<prometheus::Gauge>* power_ = nullptr;
  prometheus::Family<prometheus::Gauge>* utilization_ = nullptr;
  prometheus::Family<prometheus::Gauge>* memory_ = nullptr;
  prometheus::Family<prometheus::Gauge>* temperature_ = nullptr;
  prometheus::Family<prometheus::Gauge>* gpu_info_ = nullptr;
  prometheus::Family<prometheus::Gauge>* running_ = nullptr;
  prometheus::Family<prometheus::Counter>* trials_ = nullptr;
  prometheus::Gauge* spool_depth_ = nullptr;

  mutable std::mutex mu_;  // guards running_series_ and the sampler
  mutable std::mutex listen_mu_;  // guards http_
  std::map<std::string, prometheus::Gauge*> running_series_;  // by trial id
};

}  // namespace infersweep
