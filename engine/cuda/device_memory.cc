#include "engine/device_memory.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/check.h"

namespace infersweep {

absl::StatusOr<DeviceMemoryInfo> CurrentDeviceMemory() {
  size_t free = 0, total = 0;
  if (absl::Status s = CudaStatus(cudaMemGetInfo(&free, &total), "cudaMemGetInfo"); !s.ok())
    return absl::InternalError(absl::StrCat("device memory: ", s.message()));
  return DeviceMemoryInfo{static_cast<int64_t>(free), static_cast<int64_t>(total)};
}

absl::StatusOr<std::shared_ptr<void>> HoldDeviceMemory(double fraction) {
  if (!(fraction > 0 && fraction < 1))
    return absl::InvalidArgumentError(
        absl::StrCat("hog-gpu-memory:", fraction, ": the fraction of free memory is in (0, 1)"));
  size_t free = 0, total = 0;
  RETURN_IF_CUDA_ERROR(cudaMemGetInfo(&free, &total));
  const size_t bytes = static_cast<size_t>(fraction * static_cast<double>(free));
  void* hog = nullptr;
  if (absl::Status s = CudaStatus(cudaMalloc(&hog, bytes), "cudaMalloc"); !s.ok())
    return absl::Status(s.code(),
                        absl::StrFormat("hog-gpu-memory: %d bytes: %s", bytes, s.message()));
  return std::shared_ptr<void>(hog, [](void* p) { cudaFree(p); });
}

}  // namespace infersweep
