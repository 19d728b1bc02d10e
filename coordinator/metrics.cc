#include "coordinator/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/metrics_http.h"

namespace infersweep {
namespace {

constexpr TrialStatus kAllStatuses[] = {TrialStatus::kOk,      TrialStatus::kIncorrect,
                                        TrialStatus::kCrashed, TrialStatus::kUnsupported,
                                        TrialStatus::kTimeout, TrialStatus::kError};

std::string StatusLabel(TrialStatus s) {
  const std::string_view name = TrialStatusName(s);
  return std::string(name.data(), name.size());
}

}  // namespace

std::string SmArchLabel(int sm) { return sm <= 0 ? std::string("cpu") : absl::StrCat("sm_", sm); }

CoordinatorMetrics::CoordinatorMetrics(CoordinatorMetricsOptions options)
    : options_(options), registry_(std::make_shared<prometheus::Registry>()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  auto& r = *registry_;
  output_tok_s_ = &BuildGauge()
                       .Name("infersweep_output_tokens_per_second")
                       .Help(
                           "Output token throughput of the latest result of a config at one "
                           "batch size (median over repeats), tokens per second")
                       .Register(r);
  ttft_ = &BuildGauge()
               .Name("infersweep_ttft_seconds")
               .Help(
                   "Time to first token of the latest result of a config at one batch size "
                   "(median over repeats), seconds")
               .Register(r);
  tpot_ = &BuildGauge()
               .Name("infersweep_tpot_seconds")
               .Help(
                   "Time per output token after the first, latest result of a config at one "
                   "batch size (median over repeats), seconds")
               .Register(r);
  roofline_ = &BuildGauge()
                   .Name("infersweep_roofline_ratio")
                   .Help(
                       "Fraction of its roofline the latest result of a config at one batch "
                       "size reached (median over repeats): kind=decode, the memory roofline "
                       "of a decode step; kind=prefill, the compute roofline of the prefill "
                       "(docs/METRICS.md). Absent where the device's read bandwidth or tensor "
                       "rate is not known")
                   .Register(r);
  serving_load_ = &BuildGauge()
                       .Name("infersweep_serving_load")
                       .Help(
                           "The load of a serving load point: requests in flight (mode "
                           "closed_loop) or Poisson arrivals per second (mode poisson)")
                       .Register(r);
  serving_output_tok_s_ = &BuildGauge()
                               .Name("infersweep_serving_output_tokens_per_second")
                               .Help(
                                   "Output token throughput of the latest OK serving result "
                                   "of a config at one load point, tokens per second")
                               .Register(r);
  serving_tok_s_per_user_ =
      &BuildGauge()
           .Name("infersweep_serving_output_tokens_per_second_per_user")
           .Help(
               "Output tokens per second each request saw (mean over requests of 1 / TPOT) in "
               "the latest OK serving result of a config at one load point")
           .Register(r);
  serving_ttft_p99_ = &BuildGauge()
                           .Name("infersweep_serving_ttft_p99_seconds")
                           .Help(
                               "99th percentile time to first token over the requests of the "
                               "latest OK serving result of a config at one load point, "
                               "seconds")
                           .Register(r);
  serving_tpot_p99_ = &BuildGauge()
                           .Name("infersweep_serving_tpot_p99_seconds")
                           .Help(
                               "99th percentile time per output token over the requests of "
                               "the latest OK serving result of a config at one load point, "
                               "seconds")
                           .Register(r);
  serving_goodput_ = &BuildGauge()
                          .Name("infersweep_serving_goodput_requests_per_second")
                          .Help(
                              "Requests per second that met every bound of the workload's "
                              "SLO, latest OK serving result of a config at one load point "
                              "(absent without an SLO)")
                          .Register(r);
  trials_ = &BuildCounter()
                 .Name("infersweep_trials_total")
                 .Help("Trial results stored by the coordinator, by verdict status")
                 .Register(r);
  config_status_ = &BuildGauge()
                        .Name("infersweep_config_status")
                        .Help(
                            "1 for the status of the latest result of a config on an SM "
                            "architecture, 0 for its other statuses")
                        .Register(r);
  memory_verdict_ = &BuildGauge()
                         .Name("infersweep_batch_memory_verdict")
                         .Help(
                             "1 when the latest result of a config at a batch size on a GPU "
                             "has that memory verdict (DOES_NOT_FIT: refused by the memory "
                             "plan; OUT_OF_MEMORY: an allocation failed as it ran), else 0")
                         .Register(r);
  agents_connected_ = &BuildGauge()
                           .Name("infersweep_agents_connected")
                           .Help("Agents with an open stream to the coordinator")
                           .Register(r)
                           .Add({});
  queue_depth_ = &BuildGauge()
                      .Name("infersweep_queue_depth")
                      .Help("Trials queued and not yet leased to an agent")
                      .Register(r)
                      .Add({});
  leased_ = &BuildGauge()
                 .Name("infersweep_leased_trials")
                 .Help("Trials leased to an agent (running or about to run)")
                 .Register(r)
                 .Add({});
  // 0.5 ms .. ~8 s: a result waits for its group's SQLite commit, normally a few milliseconds.
  prometheus::Histogram::BucketBoundaries buckets;
  for (double b = 0.0005; b < 10; b *= 2) buckets.push_back(b);
  ingest_ = &BuildHistogram()
                 .Name("infersweep_ingest_latency_seconds")
                 .Help("Time from receiving an agent's result to having stored it, seconds")
                 .Register(r)
                 .Add({}, buckets);
  // 1 .. 512: how many results one group commit stored.
  prometheus::Histogram::BucketBoundaries group_buckets;
  for (double b = 1; b <= 512; b *= 2) group_buckets.push_back(b);
  commit_group_ = &BuildHistogram()
                       .Name("infersweep_commit_group_results")
                       .Help("Results stored by one group commit (one SQLite transaction)")
                       .Register(r)
                       .Add({}, group_buckets);
  dropped_ = &BuildCounter()
                  .Name("infersweep_metrics_series_dropped_total")
                  .Help(
                      "New label sets not exported because of the cardinality cap (one per "
                      "capped family and result; see infersweep_metrics_config_series_limit)")
                  .Register(r)
                  .Add({});
  rate_limited_ = &BuildCounter()
                       .Name("infersweep_rate_limited_total")
                       .Help(
                           "Calls, streams and agent messages refused by a rate limit, by api "
                           "(user: SweepService calls; connect: agent streams; agent: "
                           "messages on an agent stream)")
                       .Register(r);
  for (const char* api : {"user", "connect", "agent"}) rate_limited_->Add({{"api", api}});
  auth_failures_ = &BuildCounter()
                        .Name("infersweep_auth_failures_total")
                        .Help(
                            "Calls and streams refused for missing or invalid credentials "
                            "(UNAUTHENTICATED), by api (user: SweepService calls; agent: agent "
                            "streams)")
                        .Register(r);
  for (const char* api : {"user", "agent"}) auth_failures_->Add({{"api", api}});
  auto& lease_lost = BuildCounter()
                         .Name("infersweep_leases_lost_total")
                         .Help(
                             "Leases that ended without a result (expired, or the agent came "
                             "back without the trial), by outcome: requeued, or the trial "
                             "stored as ERROR at the attempt cap (attempts_exhausted)")
                         .Register(r);
  lease_requeued_ = &lease_lost.Add({{"outcome", "requeued"}});
  lease_exhausted_ = &lease_lost.Add({{"outcome", "attempts_exhausted"}});
  identity_refused_ = &BuildCounter()
                           .Name("infersweep_agent_identity_refused_total")
                           .Help(
                               "Agent streams refused by reason (certificate: the client "
                               "certificate does not name the agent id of the Hello; conflict: "
                               "the id is connected with another credential)")
                           .Register(r);
  for (const char* reason : {"certificate", "conflict"})
    identity_refused_->Add({{"reason", reason}});
  result_conflicts_ = &BuildCounter()
                           .Name("infersweep_result_conflicts_total")
                           .Help(
                               "Agent results refused because their (trial, attempt) is stored "
                               "with other content (a byte-identical replay is acknowledged)")
                           .Register(r)
                           .Add({});
  series_ = &BuildGauge()
                 .Name("infersweep_metrics_config_series")
                 .Help(
                     "Distinct (model, sm_arch, gpu, config, batch) keys exported now; new "
                     "keys are dropped once it reaches infersweep_metrics_config_series_limit")
                 .Register(r)
                 .Add({});
  BuildGauge()
      .Name("infersweep_metrics_config_series_limit")
      .Help("The cap on distinct (model, sm_arch, gpu, config, batch) keys")
      .Register(r)
      .Add({})
      .Set(static_cast<double>(options_.max_config_series));
}

CoordinatorMetrics::~CoordinatorMetrics() {
  if (http_ != nullptr) http_->Stop();  // before the families it renders go away
}

absl::StatusOr<int> CoordinatorMetrics::Listen(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  if (http_ != nullptr) return absl::FailedPreconditionError("metrics: already listening");
  auto http = std::make_unique<MetricsHttpServer>();
  absl::StatusOr<int> port = http->Start(address, [this] { return Serialize(); });
  if (port.ok()) http_ = std::move(http);
  return port;
}

int CoordinatorMetrics::port() const {
  std::lock_guard<std::mutex> lock(mu_);
  return http_ != nullptr ? http_->port() : 0;
}

void CoordinatorMetrics::OnResult(const std::string& model, int sm, const std::string& gpu,
                                  const BackendConfig& config, const TrialResult& r) {
  const std::string arch = SmArchLabel(sm);
  const std::string config_string = BackendConfigString(config);
  const std::string status = StatusLabel(r.status);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t cap = options_.max_config_series;

  // Trials by status: keyed by (model, sm_arch); every status of a key is one series.
  const auto trial_key = std::make_pair(model, arch);
  if (trial_keys_.count(trial_key) != 0 || trial_keys_.size() < cap) {
    if (trial_keys_.insert(trial_key).second) {
      for (TrialStatus s : kAllStatuses)
        trials_->Add({{"status", StatusLabel(s)}, {"sm_arch", arch}, {"model", model}});
    }
    trials_->Add({{"status", status}, {"sm_arch", arch}, {"model", model}}).Increment();
  } else {
    dropped_->Increment();
  }

  // Latest status of the config: 1 on its status, 0 on the others.
  const ConfigKey config_key{model, arch, config_string};
  if (config_keys_.count(config_key) != 0 || config_keys_.size() < cap) {
    config_keys_.insert(config_key);
    for (TrialStatus s : kAllStatuses) {
      const std::string name = StatusLabel(s);
      config_status_
          ->Add({{"model", model}, {"sm_arch", arch}, {"config", config_string}, {"status", name}})
          .Set(s == r.status ? 1 : 0);
    }
  } else {
    dropped_->Increment();
  }

  // Latest figures per batch size, or its memory verdict.
  for (const BatchFigures& b : r.batches) {
    const SeriesKey key{model, arch, gpu, config_string, b.batch};
    if (series_keys_.count(key) == 0) {
      if (series_keys_.size() >= cap) {
        dropped_->Increment();
        continue;
      }
      series_keys_.insert(key);
    }
    const prometheus::Labels labels = {{"model", model},
                                       {"sm_arch", arch},
                                       {"gpu", gpu},
                                       {"config", config_string},
                                       {"batch", absl::StrCat(b.batch)}};
    // The verdict's series exist from a key's first verdict on; a later measured result of the
    // key sets them to 0.
    if (b.memory_verdict || memory_verdict_keys_.count(key) != 0) {
      memory_verdict_keys_.insert(key);
      for (BatchMemoryVerdict v :
           {BatchMemoryVerdict::kDoesNotFit, BatchMemoryVerdict::kOutOfMemory}) {
        prometheus::Labels with_verdict = labels;
        with_verdict["verdict"] = std::string(BatchMemoryVerdictName(v));
        memory_verdict_->Add(with_verdict).Set(b.memory_verdict == v ? 1 : 0);
      }
    }
    if (!b.measured()) continue;  // a memory verdict: no figures to show
    output_tok_s_->Add(labels).Set(b.output_tok_s.median);
    ttft_->Add(labels).Set(b.ttft_ms.median / 1000.0);
    tpot_->Add(labels).Set(b.tpot_ms.median / 1000.0);
    for (const auto& [kind, fraction] : {std::pair{"decode", b.roofline_fraction},
                                         std::pair{"prefill", b.prefill_roofline_fraction}}) {
      if (!fraction) continue;
      prometheus::Labels with_kind = labels;
      with_kind["kind"] = kind;
      roofline_->Add(with_kind).Set(*fraction);
    }
  }
  series_->Set(static_cast<double>(series_keys_.size()));

  // Latest figures per serving load point, of OK results (an INCORRECT point's figures are not
  // a serving figure).
  if (r.status != TrialStatus::kOk) return;
  for (const ServingPoint& p : r.serving) {
    if (p.verdict != TrialStatus::kOk) continue;  // refused by the memory plan: nothing served
    const std::string load_point = LoadPointName(p.point);
    const ServingKey key{model, arch, gpu, config_string, load_point};
    if (serving_keys_.count(key) == 0) {
      if (serving_keys_.size() >= cap) {
        dropped_->Increment();
        continue;
      }
      serving_keys_.insert(key);
    }
    const prometheus::Labels labels = {{"model", model},
                                       {"sm_arch", arch},
                                       {"gpu", gpu},
                                       {"config", config_string},
                                       {"load_point", load_point},
                                       {"mode", p.point.open_loop ? "poisson" : "closed_loop"}};
    serving_load_->Add(labels).Set(p.point.open_loop ? p.point.rate : p.point.concurrency);
    serving_output_tok_s_->Add(labels).Set(p.output_throughput);
    serving_tok_s_per_user_->Add(labels).Set(p.output_tok_s_per_user);
    serving_ttft_p99_->Add(labels).Set(p.ttft_ms.p99 / 1000.0);
    serving_tpot_p99_->Add(labels).Set(p.tpot_ms.p99 / 1000.0);
    if (p.request_goodput) serving_goodput_->Add(labels).Set(*p.request_goodput);
  }
}

void CoordinatorMetrics::DeclareTrialSeries(const std::string& model, int sm) {
  const std::string arch = SmArchLabel(sm);
  std::lock_guard<std::mutex> lock(mu_);
  const auto key = std::make_pair(model, arch);
  if (trial_keys_.count(key) != 0 || trial_keys_.size() >= options_.max_config_series) return;
  trial_keys_.insert(key);
  for (TrialStatus s : kAllStatuses)
    trials_->Add({{"status", StatusLabel(s)}, {"sm_arch", arch}, {"model", model}});
}

void CoordinatorMetrics::SetAgentsConnected(int n) { agents_connected_->Set(n); }
void CoordinatorMetrics::SetQueueDepth(int64_t n) { queue_depth_->Set(static_cast<double>(n)); }
void CoordinatorMetrics::SetLeasedTrials(int64_t n) { leased_->Set(static_cast<double>(n)); }
void CoordinatorMetrics::ObserveIngestSeconds(double seconds) { ingest_->Observe(seconds); }
void CoordinatorMetrics::ObserveCommitGroup(double results) { commit_group_->Observe(results); }
void CoordinatorMetrics::CountRateLimited(const std::string& api) {
  rate_limited_->Add({{"api", api}}).Increment();
}
void CoordinatorMetrics::CountAuthFailure(const std::string& api) {
  auth_failures_->Add({{"api", api}}).Increment();
}
void CoordinatorMetrics::CountLeaseLost(bool requeued) {
  (requeued ? lease_requeued_ : lease_exhausted_)->Increment();
}

void CoordinatorMetrics::CountAgentIdentityRefused(const std::string& reason) {
  identity_refused_->Add({{"reason", reason}}).Increment();
}
void CoordinatorMetrics::CountResultConflict() { result_conflicts_->Increment(); }

std::string CoordinatorMetrics::Serialize() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, registry_->Collect());
  return out.str();
}

int64_t CoordinatorMetrics::dropped_series() const {
  return static_cast<int64_t>(dropped_->Value());
}

}  // namespace infersweep
