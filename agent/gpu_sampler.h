// Samples each local GPU's power, utilization, memory and temperature for the agent's metrics
// (agent/metrics.h). With NVML (INFERSWEEP_HAVE_NVML, set by agent/CMakeLists.txt when the CUDA
// toolkit ships nvml.h) the driver's libnvidia-ml.so.1 is loaded at run time with dlopen, so the
// binary still starts on hosts without a driver; there, and in builds without NVML, the sampler
// reports no GPUs.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace infersweep {

struct GpuSample {
  int index = 0;
  std::string name;
  // Each reading is absent when the device does not support it.
  std::optional<double> power_watts;
  std::optional<double> utilization_ratio;  // 0..1, busy fraction of the last sample period
  std::optional<double> memory_used_bytes;
  std::optional<double> temperature_celsius;
};

class GpuSampler {
 public:
  virtual ~GpuSampler() = default;
  // One reading per GPU; empty when there are none (or no way to read them).
  virtual std::vector<GpuSample> Sample() = 0;
  // "nvml" or "none", for logs.
  virtual std::string kind() const = 0;
};

// The NVML sampler when it is compiled in and NVML initialises; otherwise one that samples
// nothing.
std::unique_ptr<GpuSampler> MakeGpuSampler();
std::unique_ptr<GpuSampler> MakeNoGpuSampler();

}  // namespace infersweep
