#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_runtime.h>

#include <string>

#include "engine/backends.h"
#include "engine/cudnn_loader.h"

namespace infersweep {
namespace {

// CUDA's integer versions (1000 * major + 10 * minor) as "13.0".
std::string CudaVersionText(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

// cuBLAS's (10000 * major + 100 * minor + patch) as "13.0.2".
std::string CublasVersionText(size_t v) {
  return std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." +
         std::to_string(v % 100);
}

void ProbeLibraryVersions(LocalDevices& devices) {
  int v = 0;
  if (cudaDriverGetVersion(&v) == cudaSuccess && v > 0)
    devices.cuda_driver_version = CudaVersionText(v);
  if (cudaRuntimeGetVersion(&v) == cudaSuccess && v > 0)
    devices.cuda_runtime_version = CudaVersionText(v);
  int major = 0, minor = 0, patch = 0;
  if (cublasGetProperty(MAJOR_VERSION, &major) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(MINOR_VERSION, &minor) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(PATCH_LEVEL, &patch) == CUBLAS_STATUS_SUCCESS)
    devices.cublas_version =
        std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
  if (const size_t lt = cublasLtGetVersion(); lt > 0)
    devices.cublaslt_version = CublasVersionText(lt);
  if (absl::StatusOr<const CudnnLibrary*> cudnn = ProcessCudnn(); cudnn.ok())
    devices.cudnn_version = CudnnVersionText((*cudnn)->version);
}

}  // namespace

LocalDevices ProbeLocalDevices() {
  LocalDevices devices;
  devices.has_cuda_build = true;
  ProbeLibraryVersions(devices);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the (non-sticky) "no device" error
    return devices;
  }
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) break;
    LocalGpu gpu;
    gpu.name = prop.name;
    gpu.sm = prop.major * 10 + prop.minor;
    gpu.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
    char bus_id[32] = {};
    if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), d) == cudaSuccess) gpu.pci_bus_id = bus_id;
    devices.gpus.push_back(std::move(gpu));
  }
  if (devices.gpus.empty()) return devices;
  devices.gpu_count = static_cast<int>(devices.gpus.size());
  devices.sm = devices.gpus[0].sm;
  devices.gpu_name = devices.gpus[0].name;
  devices.gpu_memory_bytes = devices.gpus[0].memory_bytes;
  devices.gpu_pci_bus_id = devices.gpus[0].pci_bus_id;
  return devices;
}

}  // namespace infersweep
