#include "engine/device_memory.h"

#ifndef INFERSWEEP_HAVE_CUDA
namespace infersweep {

absl::StatusOr<int64_t> CurrentDeviceFreeBytes() {
  return absl::UnimplementedError("device free memory: this build has no CUDA");
}

absl::StatusOr<std::shared_ptr<void>> HoldDeviceMemory(double) {
  return absl::UnimplementedError("hog-gpu-memory: this build has no CUDA");
}

}  // namespace infersweep
#endif
