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

namespace infersweep {

// CUDA errors other than allocation failures are sticky: the context is lost, so the worker dies
// loudly (the harness reports CRASHED with this line in the stderr tail).
#define CUDA_OR_DIE(expr)                                                             \
  do {                                                                                \
    const cudaError_t _e = (expr);                                                    \
    if (_e != cudaSuccess) {                                                          \
      std::fprintf(stderr, "CUDA error %s (%s) at %s:%d: %s\n", cudaGetErrorName(_e), \
                   cudaGetErrorString(_e), __FILE__, __LINE__, #expr);                \
      std::abort();                                                                   \
    }                                                                                 \
  } while (0)
#define CHECK_LAUNCH() CUDA_OR_DIE(cudaGetLastError())

template <typename T>
absl::StatusOr<T*> DeviceAlloc(size_t count) {
  void* p = nullptr;
  if (count == 0) count = 1;
  const cudaError_t e = cudaMalloc(&p, count * sizeof(T));
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", count * sizeof(T), " bytes: ", cudaGetErrorString(e)));
  }
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
