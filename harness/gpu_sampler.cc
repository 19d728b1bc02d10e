#include "harness/gpu_sampler.h"

#include "harness/nvml_library.h"

namespace infersweep {

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
