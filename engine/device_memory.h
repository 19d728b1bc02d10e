// The current CUDA device's free memory, asked of the driver, for the memory verdict
// (harness/memory_verdict.h); and the TEST ONLY hog-gpu-memory fault's allocation. The header
// builds without CUDA: there both answer Unimplemented.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace infersweep {

// The current CUDA device's memory as the driver sees it, every process's allocations counted.
struct DeviceMemoryInfo {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
  int64_t used_bytes() const { return total_bytes - free_bytes; }
};

// The current CUDA device's free and total bytes (cudaMemGetInfo; a rank process has made its
// rank's GPU current). Creates the device's context if none exists yet, so the figures are after
// it. Unimplemented in a build without CUDA; Internal, with CUDA's words, where the call fails.
absl::StatusOr<DeviceMemoryInfo> CurrentDeviceMemory();

// TEST ONLY (hog-gpu-memory:F): allocates `fraction` (0 < F < 1) of the current device's free
// memory and holds it until the returned handle is destroyed. InvalidArgument for a fraction
// outside (0, 1); ResourceExhausted where the allocation fails; Unimplemented without CUDA.
absl::StatusOr<std::shared_ptr<void>> HoldDeviceMemory(double fraction);

}  // namespace infersweep
