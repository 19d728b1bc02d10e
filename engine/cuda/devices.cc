#include <cuda_runtime.h>

#include "engine/backends.h"

namespace infersweep {

LocalDevices ProbeLocalDevices() {
  LocalDevices devices;
  devices.has_cuda_build = true;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the (non-sticky) "no device" error
    return devices;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return devices;
  devices.gpu_count = count;
  devices.sm = prop.major * 10 + prop.minor;
  devices.gpu_name = prop.name;
  devices.gpu_memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  return devices;
}

}  // namespace infersweep
