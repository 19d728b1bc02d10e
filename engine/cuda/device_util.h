// What every file of the CUDA engine uses: dying loudly on a sticky CUDA error, and device
// allocations that report exhaustion as a status.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"

namespace infersweep {

template <typename T>
absl::StatusOr<T*> DeviceAlloc(size_t count) {
  void* p = nullptr;
  if (count == 0) count = 1;
  if (absl::Status s =
          CudaStatus(cudaMalloc(&p, count * sizeof(T)),
                     absl::StrCat("cudaMalloc of ", count * sizeof(T), " bytes").c_str());
      !s.ok())
    return absl::ResourceExhaustedError(s.message());
  return static_cast<T*>(p);
}

// A float buffer of each (pointer, count) pair, 0 counts skipped (the pointer left as it is).
inline absl::Status AllocateFloatBuffers(
    std::initializer_list<std::pair<float**, size_t>> buffers) {
  for (auto [ptr, count] : buffers) {
    if (count == 0) continue;
    auto p = DeviceAlloc<float>(count);
    if (!p.ok()) return p.status();
    *ptr = *p;
  }
  return absl::OkStatus();
}

// Frees each buffer and nulls its pointer.
inline void FreeFloatBuffers(std::initializer_list<float**> buffers) {
  for (float** p : buffers) {
    if (*p) cudaFree(*p);
    *p = nullptr;
  }
}

}  // namespace infersweep
