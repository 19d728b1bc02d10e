#include "engine/device_memory.h"

#ifndef INFERSWEEP_HAVE_CUDA
namespace infersweep {

absl::StatusOr<DeviceMemoryInfo> CurrentDeviceMemory() {
  return absl::UnimplementedError("device memory: this build has no CUDA");
}

absl::StatusOr<std::shared_ptr<void>> HoldDeviceMemory(double) {
  return absl::UnimplementedError("hog-gpu-memory: this build has no CUDA");
}

}  // namespace infersweep
#endif
