// The current device's compute capability, for the paths built for one arch (wgmma on sm_90,
// the scaled GEMMs' layouts), which ask it once, when they are built.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace infersweep {

// 10 * major + minor (90 on an H100 or H200), or FailedPrecondition naming `what` when no device
// answers.
inline absl::StatusOr<int> CurrentComputeCapability(const char* what) {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(what, ": no CUDA device"));
  }
  return 10 * major + minor;
}

}  // namespace infersweep
