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
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), 0) == cudaSuccess) devices.gpu_pci_bus_id = bus_id;
  return devices;
}

}  // namespace infersweep
