// The capability probe: after the registry's static preflight (api/backend_config.h) and before
// any weights load, asks the driver and the libraries whether they take what a config will
// launch on this GPU for this model's shapes. The registry knows arch ranges as declared; the
// probe asks what the binary and the libraries on this machine actually hold: a kernel with no
// image for the GPU (cudaFuncGetAttributes), a cuBLASLt heuristic with no algorithm for a shape,
// a library too old or missing. A refusal is UNSUPPORTED with the library's message and the
// shape; the trial then loads nothing and builds no model.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "api/backend_config.h"
#include "api/model_config.h"
#include "engine/backends.h"

namespace infersweep {

class CapabilityProbe {
 public:
  virtual ~CapabilityProbe() = default;
  // OK: the driver and the libraries take every probed kernel and shape of `normalized` on
  // `model`'s shapes with `weight_format` weights. Unimplemented: refused, the message naming
  // the library, its words and the shape. Any other error: the probe itself could not ask (not
  // cached; the trial is ERROR).
  virtual absl::Status Probe(const BackendConfig& normalized, const ModelConfig& model,
                             const std::string& weight_format) = 0;
};

// What a probe's answer depends on besides the config and the model: the GPU (name and arch),
// the driver and the library versions this process runs on.
std::string ProbeEnvironmentKey(const LocalDevices& devices);
// The model's shapes a probe looks at (and the weight format), as one string.
std::string ProbeShapesKey(const ModelConfig& model, const std::string& weight_format);

// The cache's key of one question: environment, config and shapes.
std::string ProbeCacheKey(const std::string& environment, const BackendConfig& normalized,
                          const ModelConfig& model, const std::string& weight_format);

// The answer a cache file at `cache_path` holds for the question (OK, or Unimplemented with the
// probe's words); nullopt when it holds none, or there is no such file. The agent's side reads it
// before it hands a trial to a worker, so a config refused once never reaches a worker again.
std::optional<absl::Status> CachedProbeAnswer(const std::string& cache_path,
                                              const std::string& environment,
                                              const BackendConfig& normalized,
                                              const ModelConfig& model,
                                              const std::string& weight_format);

// Caches an inner probe's answers (OK and Unimplemented) per (environment, config, shapes), in
// memory and, with a `cache_path`, in a JSON-lines file that outlives the process (the agent
// keeps it in its state folder, so a refused config is answered from the file by every later
// worker). Thread-safe.
class CachedProbe final : public CapabilityProbe {
 public:
  CachedProbe(std::unique_ptr<CapabilityProbe> inner, std::string environment,
              std::string cache_path = "");
  absl::Status Probe(const BackendConfig& normalized, const ModelConfig& model,
                     const std::string& weight_format) override;
  // How many questions reached the inner probe (the rest came from the cache).
  int inner_calls() const;

 private:
  struct Answer {
    bool supported = true;
    std::string reason;
  };
  void LoadFile();
  void AppendFile(const std::string& key, const Answer& answer);

  std::unique_ptr<CapabilityProbe> inner_;
  const std::string environment_;
  const std::string cache_path_;
  mutable std::mutex mu_;  // guards answers_, inner_calls_ and the file
  std::map<std::string, Answer> answers_;
  int inner_calls_ = 0;
};

// This build's probe on this machine: a CUDA build asks the driver and the libraries
// (engine/cuda/capability_probe.cc) about device=cuda configs; a build without CUDA has nothing
// to ask. CPU configs pass.
std::unique_ptr<CapabilityProbe> MakeDeviceProbe(const LocalDevices& devices);
// MakeDeviceProbe behind a CachedProbe keyed by ProbeEnvironmentKey(devices), its file at
// `cache_path` (empty: memory only).
std::shared_ptr<CapabilityProbe> MakeCachedDeviceProbe(const LocalDevices& devices,
                                                       const std::string& cache_path);

// A model description's shapes without loading its weights: a preset's table (with
// `num_layers_override`), or a checkpoint folder's config.json.
absl::StatusOr<ModelConfig> DescribeModelShapes(const std::string& model, int num_layers_override);

}  // namespace infersweep
