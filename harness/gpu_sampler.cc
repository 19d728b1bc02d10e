#include "harness/gpu_sampler.h"

#include <dlfcn.h>

namespace infersweep {
namespace {

// The few NVML types used here, as the NVML API reference defines them (nvml.h is not part of
// every CUDA toolkit install, and this file must build without one).
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
constexpr int kTemperatureGpu = 0;     // NVML_TEMPERATURE_GPU
constexpr unsigned kNameBufferSize = 96;  // NVML_DEVICE_NAME_V2_BUFFER_SIZE
constexpr unsigned kSystemDriverVersionBufferSize = 80;  // NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE
}  // namespace nvml

// libnvidia-ml.so.1 through dlopen: only the functions below, resolved once, initialised for the
// object's lifetime (NVML counts nvmlInit/nvmlShutdown pairs, so several objects may coexist).
class NvmlLibrary {
 public:
  static std::unique_ptr<NvmlLibrary> Open() {
    void* handle = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) return nullptr;
    auto lib = std::unique_ptr<NvmlLibrary>(new NvmlLibrary(handle));
    if (!lib->Resolve() || lib->init() != nvml::kSuccess) return nullptr;
    lib->initialised_ = true;
    return lib;
  }
  ~NvmlLibrary() {
    if (initialised_) shutdown();
    dlclose(handle_);
  }

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

 private:
  explicit NvmlLibrary(void* handle) : handle_(handle) {}
  template <typename F>
  bool Load(F& fn, const char* symbol) {
    fn = reinterpret_cast<F>(dlsym(handle_, symbol));
    return fn != nullptr;
  }
  bool Resolve() {
    Load(get_driver_version, "nvmlSystemGetDriverVersion");
    return Load(init, "nvmlInit_v2") && Load(shutdown, "nvmlShutdown") &&
           Load(get_count, "nvmlDeviceGetCount_v2") &&
           Load(get_handle, "nvmlDeviceGetHandleByIndex_v2") &&
           Load(get_handle_by_pci, "nvmlDeviceGetHandleByPciBusId_v2") &&
           Load(get_name, "nvmlDeviceGetName") && Load(get_power, "nvmlDeviceGetPowerUsage") &&
           Load(get_energy, "nvmlDeviceGetTotalEnergyConsumption") &&
           Load(get_util, "nvmlDeviceGetUtilizationRates") &&
           Load(get_memory, "nvmlDeviceGetMemoryInfo") &&
           Load(get_temp, "nvmlDeviceGetTemperature");
  }

  void* handle_;
  bool initialised_ = false;
};

}  // namespace

std::string NvidiaDriverVersion() {
  std::unique_ptr<NvmlLibrary> lib = NvmlLibrary::Open();
  if (!lib || lib->get_driver_version == nullptr) return "";
  char version[nvml::kSystemDriverVersionBufferSize] = {};
  if (lib->get_driver_version(version, sizeof(version)) != nvml::kSuccess) return "";
  return version;
}

namespace {

class NoGpuSampler final : public GpuSampler {
 public:
  std::vector<GpuSample> Sample() override { return {}; }
  std::string kind() const override { return "none"; }
};

class NvmlGpuSampler final : public GpuSampler {
 public:
  explicit NvmlGpuSampler(std::unique_ptr<NvmlLibrary> lib) : lib_(std::move(lib)) {}

  std::vector<GpuSample> Sample() override {
    std::vector<GpuSample> out;
    unsigned int count = 0;
    if (lib_->get_count(&count) != nvml::kSuccess) return out;
    for (unsigned int i = 0; i < count; ++i) {
      nvml::Device dev;
      if (lib_->get_handle(i, &dev) != nvml::kSuccess) continue;
      GpuSample g;
      g.index = static_cast<int>(i);
      char name[nvml::kNameBufferSize] = {};
      if (lib_->get_name(dev, name, sizeof(name)) == nvml::kSuccess) g.name = name;
      unsigned int milliwatts = 0;
      if (lib_->get_power(dev, &milliwatts) == nvml::kSuccess) g.power_watts = milliwatts / 1000.0;
      unsigned long long millijoules = 0;
      if (lib_->get_energy(dev, &millijoules) == nvml::kSuccess)
        g.energy_joules = millijoules / 1000.0;
      nvml::Utilization util{};
      if (lib_->get_util(dev, &util) == nvml::kSuccess) g.utilization_ratio = util.gpu / 100.0;
      nvml::Memory mem{};
      if (lib_->get_memory(dev, &mem) == nvml::kSuccess)
        g.memory_used_bytes = static_cast<double>(mem.used);
      unsigned int celsius = 0;
      if (lib_->get_temp(dev, nvml::kTemperatureGpu, &celsius) == nvml::kSuccess)
        g.temperature_celsius = celsius;
      out.push_back(std::move(g));
    }
    return out;
  }
  std::string kind() const override { return "nvml"; }

 private:
  std::unique_ptr<NvmlLibrary> lib_;
};

class NvmlEnergyMeter final : public GpuEnergyMeter {
 public:
  NvmlEnergyMeter(std::unique_ptr<NvmlLibrary> lib, nvml::Device device)
      : lib_(std::move(lib)), device_(device) {}
  std::optional<double> ReadJoules() override {
    unsigned long long millijoules = 0;
    if (lib_->get_energy(device_, &millijoules) != nvml::kSuccess) return std::nullopt;
    return millijoules / 1000.0;
  }

 private:
  std::unique_ptr<NvmlLibrary> lib_;
  nvml::Device device_;
};

}  // namespace

std::unique_ptr<GpuSampler> MakeNoGpuSampler() { return std::make_unique<NoGpuSampler>(); }

std::unique_ptr<GpuSampler> MakeGpuSampler() {
  if (auto lib = NvmlLibrary::Open()) return std::make_unique<NvmlGpuSampler>(std::move(lib));
  return MakeNoGpuSampler();
}

std::unique_ptr<GpuEnergyMeter> OpenGpuEnergyMeter(const std::string& pci_bus_id) {
  auto lib = NvmlLibrary::Open();
  if (!lib || pci_bus_id.empty()) return nullptr;
  nvml::Device device;
  if (lib->get_handle_by_pci(pci_bus_id.c_str(), &device) != nvml::kSuccess) return nullptr;
  auto meter = std::make_unique<NvmlEnergyMeter>(std::move(lib), device);
  if (!meter->ReadJoules()) return nullptr;
  return meter;
}

}  // namespace infersweep
