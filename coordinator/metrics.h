// The coordinator's Prometheus metrics (docs/OBSERVABILITY.md lists every one): fleet state
// (agents, queue, leases), ingestion latency, and the latest figures and verdict of every
// (model, sm_arch, gpu, config, batch) the fleet has measured, for the Grafana dashboards in
// dashboards/ and the alerts in deploy/prometheus/alerts.yml.
//
// Serving results export the same per config and load point (model, sm_arch, gpu, config,
// load_point): output tok/s, tok/s per user, p99 TTFT and TPOT, goodput, and the load itself.
//
// Cardinality: backend configs are label values, so the per-config series grow with the sweeps.
// At most `max_config_series` distinct keys are exported per keyed family (see
// CoordinatorMetricsOptions); a result whose key would be new beyond the cap is not exported and
// is counted in infersweep_metrics_series_dropped_total. Existing keys keep updating.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

#include "absl/status/statusor.h"
#include "api/backend_config.h"
#include "api/trial.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace infersweep {

class MetricsHttpServer;

struct CoordinatorMetricsOptions {
  // Cap on distinct (model, sm_arch, gpu, config, batch) keys of the figure gauges (and
  // separately (model, sm_arch, gpu, config, load_point) keys of the serving gauges), and
  // separately on distinct (model, sm_arch, config) keys of infersweep_config_status and
  // (model, sm_arch) keys of infersweep_trials_total.
  size_t max_config_series = 5000;
};

// "sm_90" for 90; "cpu" for 0 (CPU results have no SM architecture).
std::string SmArchLabel(int sm);

class CoordinatorMetrics {
 public:
  explicit CoordinatorMetrics(CoordinatorMetricsOptions options = {});
  ~CoordinatorMetrics();
  CoordinatorMetrics(const CoordinatorMetrics&) = delete;
  CoordinatorMetrics& operator=(const CoordinatorMetrics&) = delete;

  // Serves GET /metrics on `address` ("127.0.0.1:9464"; port 0 picks a free one; see
  // proto/metrics_http.h). Returns the bound port. Fails (Unavailable) when the address
  // cannot be bound, FailedPrecondition if already listening.
  absl::StatusOr<int> Listen(const std::string& address);
  // The bound port; 0 before Listen.
  int port() const;

  // A stored result: counts it, and updates the latest figures and status of its config.
  // `gpu` is the GPU's name ("cpu" for CPU results); `model` and `config` as stored.
  void OnResult(const std::string& model, int sm, const std::string& gpu,
                const BackendConfig& config, const TrialResult& r);
  // Exports infersweep_trials_total for every status of (model, sm) at 0 unless it exists, so
  // that increase() over a range counts the first result too (OpenMetrics: a counter's series
  // should exist before its first increment). Within the (model, sm_arch) cap.
  void DeclareTrialSeries(const std::string& model, int sm);
  void SetAgentsConnected(int n);
  void SetQueueDepth(int64_t n);
  void SetLeasedTrials(int64_t n);
  void ObserveIngestSeconds(double seconds);
  void ObserveCommitGroup(double results);
  // A call, stream or agent message refused by a rate limit; `api` is "user", "connect" or
  // "agent" (docs/SECURITY.md "Limits").
  void CountRateLimited(const std::string& api);
  // A call or agent stream refused for missing or invalid credentials (UNAUTHENTICATED); `api`
  // is "user" (SweepService calls) or "agent" (AgentService streams).
  void CountAuthFailure(const std::string& api);
  // A lost lease: requeued, or the trial ended as ERROR at the attempt cap.
  void CountLeaseLost(bool requeued);
  // An agent stream refused because its credentials do not prove the agent id it names
  // (`reason` "certificate"), or because another credential holds that id's stream ("conflict").
  void CountAgentIdentityRefused(const std::string& reason);
  // An agent result refused because its (trial, attempt) is stored with other content.
  void CountResultConflict();

  // The text exposition of every metric (what GET /metrics returns), for tests and debugging.
  std::string Serialize() const;
  // Results left out of the keyed families because of the cardinality cap (what the dropped
  // counter holds).
  int64_t dropped_series() const;

 private:
  using SeriesKey = std::tuple<std::string, std::string, std::string, std::string, int>;
  using ConfigKey = std::tuple<std::string, std::string, std::string>;
  // (model, sm_arch, gpu, config, load point)
  using ServingKey = std::tuple<std::string, std::string, std::string, std::string, std::string>;

  CoordinatorMetricsOptions options_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> http_;

  prometheus::Family<prometheus::Gauge>* output_tok_s_ = nullptr;
  prometheus::Family<prometheus::Gauge>* ttft_ = nullptr;
  prometheus::Family<prometheus::Gauge>* tpot_ = nullptr;
  prometheus::Family<prometheus::Gauge>* roofline_ = nullptr;
  prometheus::Family<prometheus::Gauge>* serving_load_ = nullptr;
  prometheus::Family<prometheus::Gauge>* serving_output_tok_s_ = nullptr;
  prometheus::Family<prometheus::Gauge>* serving_tok_s_per_user_ = nullptr;
  prometheus::Family<prometheus::Gauge>* serving_ttft_p99_ = nullptr;
  prometheus::Family<prometheus::Gauge>* serving_tpot_p99_ = nullptr;
  prometheus::Family<prometheus::Gauge>* serving_goodput_ = nullptr;
  prometheus::Family<prometheus::Counter>* trials_ = nullptr;
  prometheus::Family<prometheus::Gauge>* config_status_ = nullptr;
  prometheus::Family<prometheus::Gauge>* memory_verdict_ = nullptr;
  prometheus::Gauge* agents_connected_ = nullptr;
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* leased_ = nullptr;
  prometheus::Histogram* ingest_ = nullptr;
  prometheus::Histogram* commit_group_ = nullptr;
  prometheus::Counter* dropped_ = nullptr;
  prometheus::Family<prometheus::Counter>* rate_limited_ = nullptr;
  prometheus::Family<prometheus::Counter>* auth_failures_ = nullptr;
  prometheus::Counter* lease_requeued_ = nullptr;
  prometheus::Counter* lease_exhausted_ = nullptr;
  prometheus::Family<prometheus::Counter>* identity_refused_ = nullptr;
  prometheus::Counter* result_conflicts_ = nullptr;
  prometheus::Gauge* series_ = nullptr;

  mutable std::mutex mu_;  // guards the key sets and Listen
  std::set<SeriesKey> series_keys_;
  std::set<SeriesKey> memory_verdict_keys_;  // keys with infersweep_batch_memory_verdict series
  std::set<ConfigKey> config_keys_;
  std::set<ServingKey> serving_keys_;
  std::set<std::pair<std::string, std::string>> trial_keys_;
};

}  // namespace infersweep
