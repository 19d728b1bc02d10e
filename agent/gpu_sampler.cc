#include "agent/gpu_sampler.h"

#ifdef INFERSWEEP_HAVE_NVML
#include <dlfcn.h>
#include <nvml.h>
#endif

namespace infersweep {
namespace {

class NoGpuSampler final : public GpuSampler {
 public:
  std::vector<GpuSample> Sample() override { return {}; }
  std::string kind() const override { return "none"; }
};

#ifdef INFERSWEEP_HAVE_NVML
// NVML through dlopen: only the functions below, resolved once. nvml.h gives their types.
class NvmlGpuSampler final : public GpuSampler {
 public:
  static std::unique_ptr<NvmlGpuSampler> Create() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return nullptr;
    auto s = std::unique_ptr<NvmlGpuSampler>(new NvmlGpuSampler(lib));
    if (!s->Resolve() || s->init_() != NVML_SUCCESS) return nullptr;
    s->initialised_ = true;
    return s;
  }
  ~NvmlGpuSampler() override {
    if (initialised_) shutdown_();
    dlclose(lib_);
  }

  std::vector<GpuSample> Sample() override {
    std::vector<GpuSample> out;
    unsigned int count = 0;
    if (get_count_(&count) != NVML_SUCCESS) return out;
    for (unsigned int i = 0; i < count; ++i) {
      nvmlDevice_t dev;
      if (get_handle_(i, &dev) != NVML_SUCCESS) continue;
      GpuSample g;
      g.index = static_cast<int>(i);
      char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = {};
      if (get_name_(dev, name, sizeof(name)) == NVML_SUCCESS) g.name = name;
      unsigned int milliwatts = 0;
      if (get_power_(dev, &milliwatts) == NVML_SUCCESS) g.power_watts = milliwatts / 1000.0;
      nvmlUtilization_t util{};
      if (get_util_(dev, &util) == NVML_SUCCESS) g.utilization_ratio = util.gpu / 100.0;
      nvmlMemory_t mem{};
      if (get_memory_(dev, &mem) == NVML_SUCCESS)
        g.memory_used_bytes = static_cast<double>(mem.used);
      unsigned int celsius = 0;
      if (get_temp_(dev, NVML_TEMPERATURE_GPU, &celsius) == NVML_SUCCESS)
        g.temperature_celsius = celsius;
      out.push_back(std::move(g));
    }
    return out;
  }
  std::string kind() const override { return "nvml"; }

 private:
  explicit NvmlGpuSampler(void* lib) : lib_(lib) {}

  template <typename F>
  bool Load(F& fn, const char* symbol) {
    fn = reinterpret_cast<F>(dlsym(lib_, symbol));
    return fn != nullptr;
  }
  bool Resolve() {
    return Load(init_, "nvmlInit_v2") && Load(shutdown_, "nvmlShutdown") &&
           Load(get_count_, "nvmlDeviceGetCount_v2") &&
           Load(get_handle_, "nvmlDeviceGetHandleByIndex_v2") &&
           Load(get_name_, "nvmlDeviceGetName") && Load(get_power_, "nvmlDeviceGetPowerUsage") &&
           Load(get_util_, "nvmlDeviceGetUtilizationRates") &&
           Load(get_memory_, "nvmlDeviceGetMemoryInfo") &&
           Load(get_temp_, "nvmlDeviceGetTemperature");
  }

  void* lib_;
  bool initialised_ = false;
  nvmlReturn_t (*init_)() = nullptr;
  nvmlReturn_t (*shutdown_)() = nullptr;
  nvmlReturn_t (*get_count_)(unsigned int*) = nullptr;
  nvmlReturn_t (*get_handle_)(unsigned int, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*get_name_)(nvmlDevice_t, char*, unsigned int) = nullptr;
  nvmlReturn_t (*get_power_)(nvmlDevice_t, unsigned int*) = nullptr;
  nvmlReturn_t (*get_util_)(nvmlDevice_t, nvmlUtilization_t*) = nullptr;
  nvmlReturn_t (*get_memory_)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*get_temp_)(nvmlDevice_t, nvmlTemperatureSensors_t, unsigned int*) = nullptr;
};
#endif

}  // namespace

std::unique_ptr<GpuSampler> MakeNoGpuSampler() { return std::make_unique<NoGpuSampler>(); }

std::unique_ptr<GpuSampler> MakeGpuSampler() {
#ifdef INFERSWEEP_HAVE_NVML
  if (auto nvml = NvmlGpuSampler::Create()) return nvml;
#endif
  return MakeNoGpuSampler();
}

}  // namespace infersweep
