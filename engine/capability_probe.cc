#include "engine/capability_probe.h"

#include <fstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "api/model_description.h"
#include "api/status_macros.h"
#include "nlohmann/json.hpp"

namespace infersweep {

#ifndef INFERSWEEP_HAVE_CUDA
namespace {

// A build without CUDA: device=cuda configs are refused by the static preflight already, and
// the CPU's kernels are plain C++ with nothing to ask.
class AcceptingProbe final : public CapabilityProbe {
 public:
  absl::Status Probe(const BackendConfig&, const ModelConfig&, const std::string&) override {
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<CapabilityProbe> MakeDeviceProbe(const LocalDevices&) {
  return std::make_unique<AcceptingProbe>();
}
#endif

std::string ProbeEnvironmentKey(const LocalDevices& d) {
  return absl::StrCat("gpu=", d.gpu_count > 0 ? d.gpu_name : "none", " sm=", d.sm,
                      " cuda_driver=", d.cuda_driver_version, " runtime=", d.cuda_runtime_version,
                      " cublas=", d.cublas_version, " cublaslt=", d.cublaslt_version,
                      " cudnn=", d.cudnn_version);
}

std::string ProbeShapesKey(const ModelConfig& m, const std::string& weight_format) {
  return absl::StrCat(
      m.model_type, " hidden=", m.hidden_size, " layers=", m.num_layers, " heads=", m.num_q_heads,
      "/", m.num_kv_heads, "x", m.head_dim, " inter=", m.intermediate_size,
      " experts=", m.num_experts, "x", m.moe_intermediate_size, " top=", m.num_experts_per_tok,
      " shared=", m.shared_expert_intermediate_size, " vocab=", m.vocab_size,
      " linear=", m.linear_key_dim(), "/", m.linear_value_dim(), " weights=", weight_format);
}

CachedProbe::CachedProbe(std::unique_ptr<CapabilityProbe> inner, std::string environment,
                         std::string cache_path)
    : inner_(std::move(inner)),
      environment_(std::move(environment)),
      cache_path_(std::move(cache_path)) {
  LoadFile();
}

namespace {

// A cache file's answers by key. One JSON object a line: {"key": ..., "supported": bool,
// "reason": ...}. Lines that do not parse (a torn write, another version's format) are skipped:
// the probe asks again.
std::map<std::string, std::pair<bool, std::string>> ReadCacheFile(const std::string& path) {
  std::map<std::string, std::pair<bool, std::string>> answers;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("key") || !j["key"].is_string() || !j.contains("supported") ||
        !j["supported"].is_boolean())
      continue;
    std::string reason;
    if (j.contains("reason") && j["reason"].is_string()) reason = j["reason"].get<std::string>();
    answers[j["key"].get<std::string>()] = {j["supported"].get<bool>(), std::move(reason)};
  }
  return answers;
}

}  // namespace

std::string ProbeCacheKey(const std::string& environment, const BackendConfig& normalized,
                          const ModelConfig& model, const std::string& weight_format) {
  return absl::StrCat(environment, " | ", BackendConfigString(normalized), " | ",
                      ProbeShapesKey(model, weight_format));
}

std::optional<absl::Status> CachedProbeAnswer(const std::string& cache_path,
                                              const std::string& environment,
                                              const BackendConfig& normalized,
                                              const ModelConfig& model,
                                              const std::string& weight_format) {
  if (cache_path.empty()) return std::nullopt;
  const auto answers = ReadCacheFile(cache_path);
  auto it = answers.find(ProbeCacheKey(environment, normalized, model, weight_format));
  if (it == answers.end()) return std::nullopt;
  return it->second.first ? absl::OkStatus() : absl::UnimplementedError(it->second.second);
}

void CachedProbe::LoadFile() {
  if (cache_path_.empty()) return;
  for (auto& [key, answer] : ReadCacheFile(cache_path_))
    answers_[key] = Answer{answer.first, std::move(answer.second)};
}

void CachedProbe::AppendFile(const std::string& key, const Answer& answer) {
  if (cache_path_.empty()) return;
  nlohmann::json j = {{"key", key}, {"supported", answer.supported}, {"reason", answer.reason}};
  // A cache that cannot be written costs a probe per worker, nothing more.
  std::ofstream out(cache_path_, std::ios::app);
  if (out) out << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
}

absl::Status CachedProbe::Probe(const BackendConfig& normalized, const ModelConfig& model,
                                const std::string& weight_format) {
  const std::string key = ProbeCacheKey(environment_, normalized, model, weight_format);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = answers_.find(key); it != answers_.end())
    return it->second.supported ? absl::OkStatus() : absl::UnimplementedError(it->second.reason);
  ++inner_calls_;
  absl::Status s = inner_->Probe(normalized, model, weight_format);
  if (!s.ok() && !absl::IsUnimplemented(s)) return s;  // the probe failed to ask: ask again later
  Answer a{s.ok(), std::string(s.message())};
  AppendFile(key, a);
  answers_[key] = std::move(a);
  return s;
}

int CachedProbe::inner_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return inner_calls_;
}

std::shared_ptr<CapabilityProbe> MakeCachedDeviceProbe(const LocalDevices& devices,
                                                       const std::string& cache_path) {
  return std::make_shared<CachedProbe>(MakeDeviceProbe(devices), ProbeEnvironmentKey(devices),
                                       cache_path);
}

absl::StatusOr<ModelConfig> DescribeModelShapes(const std::string& model, int num_layers_override) {
  ASSIGN_OR_RETURN(ModelDescription description, ParseModelDescription(model));
  const std::string& m = description.model;
  if (absl::StartsWith(m, "preset:")) return PresetConfig(m.substr(7), num_layers_override);
  absl::StatusOr<ModelConfig> config = LoadModelConfig(m);
  if (config.ok() && num_layers_override > 0 && num_layers_override < config->num_layers)
    config->num_layers = num_layers_override;
  return config;
}

}  // namespace infersweep
