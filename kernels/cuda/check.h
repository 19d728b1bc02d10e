// The one way CUDA-side calls are checked, in kernels, the engine, the harness and the benches:
//  - CUDA_OR_DIE(expr) / CHECK_LAUNCH(): a sticky CUDA error loses the context, so the process
//    dies loudly, naming the call and where (the harness reports CRASHED with that line);
//  - CudaStatus / CublasStatus: a call whose failure the caller can answer (an allocation, a
//    library's refusal of a shape) as an absl::Status naming the call (NCCL's NcclStatus, in
//    engine/cuda/communicator.cc, and cuDNN's, through its run-time loader in
//    engine/cuda/cudnn_graph.cc, have the same shape: the kernels link neither library);
//  - RETURN_IF_CUDA_ERROR(expr): CudaStatus, returned when it is not OK.
#pragma once

#include <cublas_api.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/unreachable.h"

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

namespace infersweep {

// OK, or Internal naming `what` and CUDA's error; a non-sticky error is cleared.
inline absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  const absl::StatusCode code = e == cudaErrorMemoryAllocation
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(code,
                      absl::StrCat(what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

// OK, or Internal naming `what` and cuBLAS's status (cuBLASLt shares the codes).
inline absl::Status CublasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const absl::StatusCode code = s == CUBLAS_STATUS_NOT_SUPPORTED ? absl::StatusCode::kUnimplemented
                                : s == CUBLAS_STATUS_ALLOC_FAILED
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": cuBLAS status ", static_cast<int>(s)));
}

}  // namespace infersweep

#define RETURN_IF_CUDA_ERROR(expr)                                                     \
  do {                                                                                 \
    if (absl::Status _status = ::infersweep::CudaStatus((expr), #expr); !_status.ok()) \
      return _status;                                                                  \
  } while (0)
