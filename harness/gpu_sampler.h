// Readings of the local GPUs through NVML: power, energy counter, utilization, memory and
// temperature, for the agent's metrics (agent/metrics.h) and a trial's energy figures
// (harness/measure.h). The driver's libnvidia-ml.so.1 is loaded at run time with dlopen, so the
// binary builds without NVML headers and still starts on hosts without a driver; there the
// sampler reports no GPUs and the energy meter does not open.
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
  std::optional<double> energy_joules;  // total since the driver loaded (Volta and later)
};

class GpuSampler {
 public:
  virtual ~GpuSampler() = default;
  // One reading per GPU; empty when there are none (or no way to read them).
  virtual std::vector<GpuSample> Sample() = 0;
  // "nvml" or "none", for logs.
  virtual std::string kind() const = 0;
};

// The NVML sampler when NVML loads and initialises; otherwise one that samples nothing.
std::unique_ptr<GpuSampler> MakeGpuSampler();
std::unique_ptr<GpuSampler> MakeNoGpuSampler();

// The energy counter of one GPU, the one a CUDA device ordinal runs on, found by PCI bus id
// (cudaDeviceGetPCIBusId's "0000:3b:00.0"; NVML maps it to its own numbering).
class GpuEnergyMeter {
 public:
  virtual ~GpuEnergyMeter() = default;
  // Joules since the driver loaded; nullopt when the reading fails.
  virtual std::optional<double> ReadJoules() = 0;
};

// The NVIDIA driver's version ("580.65.06"); "" without NVML.
std::string NvidiaDriverVersion();

// Null when NVML is missing or the device has no energy counter (pre-Volta).
std::unique_ptr<GpuEnergyMeter> OpenGpuEnergyMeter(const std::string& pci_bus_id);

}  // namespace infersweep
