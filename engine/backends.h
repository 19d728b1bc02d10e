// Turns a normalized backend config into a running Model on host weights: the one place that
// maps registry entries to implementations.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "api/backend_config.h"
#include "engine/fault_injection.h"
#include "engine/model.h"
#include "engine/options.h"
#include "engine/weights.h"

namespace infersweep {

// One CUDA device, as this process numbers it (CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER apply).
struct LocalGpu {
  std::string name;
  int sm = 0;
  int64_t memory_bytes = 0;
  std::string pci_bus_id;  // "0000:3b:00.0": the device in NVML, whatever CUDA's numbering
};

// What this process can offer: whether CUDA backends were compiled in, its GPUs, and the first
// GPU's facts on their own (what a trial's worker, which sees its slot's GPUs alone, runs on).
struct LocalDevices {
  bool has_cuda_build = false;
  int gpu_count = 0;
  int sm = 0;
  std::string gpu_name;
  int64_t gpu_memory_bytes = 0;
  std::string gpu_pci_bus_id;  // of CUDA device 0, e.g. "0000:3b:00.0" (finds it in NVML)
  std::vector<LocalGpu> gpus;  // every CUDA device, by ordinal (gpus[0] is the fields above)
  // The libraries this build runs on, as they report their versions ("13.0", "13.0.0"); empty
  // without CUDA. The NVIDIA driver's own version comes from NVML (harness/gpu_sampler.h).
  std::string cuda_driver_version;  // the CUDA version the driver supports
  std::string cuda_runtime_version;
  std::string cublas_version;
  std::string cublaslt_version;
  // cuDNN as loaded at run time (engine/cuda/cudnn_loader.h), e.g. "9.10.2"; empty when no
  // libcudnn.so.9 was found.
  std::string cudnn_version;
};
LocalDevices ProbeLocalDevices();

// "bf16", "f16" or "f32": the stored dtype of the model's linear weights; "fp8", "nvfp4" or
// "mxfp4" when they are quantized.
std::string WeightFormat(const HostModel& model);

PreflightTarget MakePreflightTarget(const LocalDevices& devices, const HostModel* model);
// Before loading: the weight format a model description declares (DeclaredWeightFormat).
PreflightTarget MakePreflightTarget(const LocalDevices& devices, const std::string& model);

// The reference a config is judged against: the CPU reference for cpu configs, the GPU reference
// (gemm=reference, attention=naive, moe=loop, graphs=off) for cuda configs.
BackendConfig ReferenceConfigFor(const BackendConfig& normalized);

// A yardstick of a device's reference config: the reference with its GEMM inputs rounded as a
// class of configs rounds them (CudaOptions::yardstick, engine/options.h). Its distance from the
// reference is what that rounding alone costs on a model; the verdict widens the class's
// ceilings to it where a model is more sensitive than they assume (harness/verdict.h).
// Unimplemented on the CPU, and for Yardstick::kNone.
absl::StatusOr<std::unique_ptr<Model>> CreateYardstick(HostModel& host,
                                                       const BackendConfig& reference,
                                                       Yardstick yardstick);

// The yardstick a normalized config is measured by: E4M3 where its quantized linears take E4M3
// activations (qgemm=w8a8, fp8_cublaslt, cudnn), else bf16.
Yardstick YardstickFor(const BackendConfig& normalized);

// `host` must outlive the model; CPU models generate its host copy if it has none yet.
// `fault` is TEST ONLY.
absl::StatusOr<std::unique_ptr<Model>> CreateModel(HostModel& host, const BackendConfig& normalized,
                                                   const FaultInjection& fault = {});

}  // namespace infersweep
