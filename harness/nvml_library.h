// libnvidia-ml.so.1 through dlopen, for the GPU sampler (harness/gpu_sampler.h) and the agent's
// inventory (agent/inventory.h): the binary builds without NVML headers and starts on hosts
// without a driver, where Open() returns null.
#pragma once

#include <memory>

namespace infersweep {

// The few NVML types used, as the NVML API reference defines them (nvml.h is not part of every
// CUDA toolkit install).
namespace nvml {
using Return = int;  // nvmlReturn_t
constexpr Return kSuccess = 0;
using Device = struct DeviceOpaque*;  // nvmlDevice_t
struct Utilization {                  // nvmlUtilization_t
  unsigned int gpu;
  unsigned int memory;
};
struct Memory {  // nvmlMemory_t
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
constexpr int kTemperatureGpu = 0;                       // NVML_TEMPERATURE_GPU
constexpr unsigned kNameBufferSize = 96;                 // NVML_DEVICE_NAME_V2_BUFFER_SIZE
constexpr unsigned kSystemDriverVersionBufferSize = 80;  // NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE
constexpr int kP2PCapsRead = 0;                          // NVML_P2P_CAPS_INDEX_READ
constexpr int kP2PCapsNvlink = 2;                        // NVML_P2P_CAPS_INDEX_NVLINK
constexpr int kP2PStatusOk = 0;                          // NVML_P2P_STATUS_OK
}  // namespace nvml

// The functions below, resolved once, NVML initialised for the object's lifetime (NVML counts
// nvmlInit/nvmlShutdown pairs, so several objects may coexist).
class NvmlLibrary {
 public:
  // Null where the library is missing, lacks a required function, or does not initialise.
  static std::unique_ptr<NvmlLibrary> Open();
  ~NvmlLibrary();
  NvmlLibrary(const NvmlLibrary&) = delete;
  NvmlLibrary& operator=(const NvmlLibrary&) = delete;

  nvml::Return (*init)() = nullptr;
  nvml::Return (*shutdown)() = nullptr;
  nvml::Return (*get_count)(unsigned int*) = nullptr;
  nvml::Return (*get_handle)(unsigned int, nvml::Device*) = nullptr;
  nvml::Return (*get_handle_by_pci)(const char*, nvml::Device*) = nullptr;
  nvml::Return (*get_name)(nvml::Device, char*, unsigned int) = nullptr;
  nvml::Return (*get_power)(nvml::Device, unsigned int*) = nullptr;
  nvml::Return (*get_energy)(nvml::Device, unsigned long long*) = nullptr;
  nvml::Return (*get_util)(nvml::Device, nvml::Utilization*) = nullptr;
  nvml::Return (*get_memory)(nvml::Device, nvml::Memory*) = nullptr;
  nvml::Return (*get_temp)(nvml::Device, int, unsigned int*) = nullptr;
  // Optional: resolved when present, not required to open.
  nvml::Return (*get_driver_version)(char*, unsigned int) = nullptr;
  nvml::Return (*get_p2p_status)(nvml::Device, nvml::Device, int, int*) = nullptr;

 private:
  explicit NvmlLibrary(void* handle) : handle_(handle) {}
  bool Resolve();

  void* handle_;
  bool initialised_ = false;
};

}  // namespace infersweep
