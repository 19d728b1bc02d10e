#include "harness/nvml_library.h"

#include <dlfcn.h>

namespace infersweep {
namespace {

template <typename F>
bool Load(void* handle, F& fn, const char* symbol) {
  fn = reinterpret_cast<F>(dlsym(handle, symbol));
  return fn != nullptr;
}

}  // namespace

std::unique_ptr<NvmlLibrary> NvmlLibrary::Open() {
  void* handle = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return nullptr;
  auto lib = std::unique_ptr<NvmlLibrary>(new NvmlLibrary(handle));
  if (!lib->Resolve() || lib->init() != nvml::kSuccess) return nullptr;
  lib->initialised_ = true;
  return lib;
}

NvmlLibrary::~NvmlLibrary() {
  if (initialised_) shutdown();
  dlclose(handle_);
}

bool NvmlLibrary::Resolve() {
  Load(handle_, get_driver_version, "nvmlSystemGetDriverVersion");
  Load(handle_, get_p2p_status, "nvmlDeviceGetP2PStatus");
  return Load(handle_, init, "nvmlInit_v2") && Load(handle_, shutdown, "nvmlShutdown") &&
         Load(handle_, get_count, "nvmlDeviceGetCount_v2") &&
         Load(handle_, get_handle, "nvmlDeviceGetHandleByIndex_v2") &&
         Load(handle_, get_handle_by_pci, "nvmlDeviceGetHandleByPciBusId_v2") &&
         Load(handle_, get_name, "nvmlDeviceGetName") &&
         Load(handle_, get_power, "nvmlDeviceGetPowerUsage") &&
         Load(handle_, get_energy, "nvmlDeviceGetTotalEnergyConsumption") &&
         Load(handle_, get_util, "nvmlDeviceGetUtilizationRates") &&
         Load(handle_, get_memory, "nvmlDeviceGetMemoryInfo") &&
         Load(handle_, get_temp, "nvmlDeviceGetTemperature");
}

}  // namespace infersweep
