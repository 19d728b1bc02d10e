#include "agent/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/metrics_http.h"

namespace infersweep {

AgentMetrics::AgentMetrics(std::unique_ptr<GpuSampler> sampler)
    : registry_(std::make_shared<prometheus::Registry>()),
      sampler_(sampler != nullptr ? std::move(sampler) : MakeGpuSampler()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  auto& r = *registry_;
  BuildGauge()
      .Name("infersweep_agent_up")
      .Help("1 while the agent process serves metrics")
      .Register(r)
      .Add({})
      .Set(1);
  power_ = &BuildGauge()
                .Name("infersweep_agent_gpu_power_watts")
                .Help("GPU power draw (NVML), watts")
                .Register(r);
  utilization_ = &BuildGauge()
                      .Name("infersweep_agent_gpu_utilization_ratio")
                      .Help("Fraction of the last sample period the GPU was busy (NVML), 0..1")
                      .Register(r);
  memory_ = &BuildGauge()
                 .Name("infersweep_agent_gpu_memory_used_bytes")
                 .Help("GPU memory in use (NVML), bytes")
                 .Register(r);
  temperature_ = &BuildGauge()
                      .Name("infersweep_agent_gpu_temperature_celsius")
                      .Help("GPU core temperature (NVML), degrees Celsius")
                      .Register(r);
  gpu_info_ = &BuildGauge()
                   .Name("infersweep_agent_gpu_info")
                   .Help("1 per GPU the sampler sees; labels carry its index and name")
                   .Register(r);
  running_ = &BuildGauge()
                  .Name("infersweep_agent_running_trial")
                  .Help("1 while the agent runs the trial (the series is removed when it ends)")
                  .Register(r);
  trials_ = &BuildCounter()
                 .Name("infersweep_agent_trials_total")
                 .Help("Trials this agent finished, by verdict status")
                 .Register(r);
  spool_depth_ = &BuildGauge()
                      .Name("infersweep_agent_spool_depth")
                      .Help("Results in the local spool not yet acknowledged by the coordinator")
                      .Register(r)
                      .Add({});
  BuildGauge()
      .Name("infersweep_agent_gpu_sampler_nvml")
      .Help("1 when GPU readings come from NVML, 0 when there is no GPU sampler")
      .Register(r)
      .Add({})
      .Set(sampler_->kind() == "nvml" ? 1 : 0);
}

AgentMetrics::~AgentMetrics() {
  if (http_ != nullptr) http_->Stop();  // before the families it renders go away
}

absl::StatusOr<int> AgentMetrics::Listen(const std::string& address) {
  std::lock_guard<std::mutex> lock(listen_mu_);
  if (http_ != nullptr) return absl::FailedPreconditionError("metrics: already listening");
  auto http = std::make_unique<MetricsHttpServer>();
  absl::StatusOr<int> port = http->Start(address, [this] { return Serialize(); });
  if (port.ok()) http_ = std::move(http);
  return port;
}

int AgentMetrics::port() const {
  std::lock_guard<std::mutex> lock(listen_mu_);
  return http_ != nullptr ? http_->port() : 0;
}

void AgentMetrics::TrialStarted(const std::string& trial_id, const std::string& config) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = running_series_.find(trial_id);
  if (it != running_series_.end()) {
    running_->Remove(it->second);
    running_series_.erase(it);
  }
  prometheus::Gauge& g = running_->Add({{"trial_id", trial_id}, {"config", config}});
  g.Set(1);
  running_series_[trial_id] = &g;
}

void AgentMetrics::TrialAbandoned(const std::string& trial_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = running_series_.find(trial_id);
  if (it == running_series_.end()) return;
  running_->Remove(it->second);
  running_series_.erase(it);
}

void AgentMetrics::TrialFinished(const std::string& trial_id, TrialStatus status) {
  TrialAbandoned(trial_id);
  const std::string_view name = TrialStatusName(status);
  trials_->Add({{"status", std::string(name.data(), name.size())}}).Increment();
}

void AgentMetrics::SetSpoolDepth(int64_t n) { spool_depth_->Set(static_cast<double>(n)); }

void AgentMetrics::SampleGpus() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const GpuSample& s : sampler_->Sample()) {
    const std::string gpu = absl::StrCat(s.index);
    const prometheus::Labels labels = {{"gpu", gpu}};
    gpu_info_->Add({{"gpu", gpu}, {"name", s.name}}).Set(1);
    if (s.power_watts) power_->Add(labels).Set(*s.power_watts);
    if (s.utilization_ratio) utilization_->Add(labels).Set(*s.utilization_ratio);
    if (s.memory_used_bytes) memory_->Add(labels).Set(*s.memory_used_bytes);
    if (s.temperature_celsius) temperature_->Add(labels).Set(*s.temperature_celsius);
  }
}

std::string AgentMetrics::Serialize() {
  std::ostringstream out;
  SampleGpus();
  prometheus::TextSerializer().Serialize(out, registry_->Collect());
  return out.str();
}

}  // namespace infersweep
