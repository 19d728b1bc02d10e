// cuBLASLt bf16 GEMM: y[M, N] (fp32) = x[M, K] (bf16) . W[N, K]^T (bf16), fp32 accumulate.
// Plans (descriptors + heuristic algo) are cached per shape; capturable in CUDA graphs (the
// workspace is preallocated).
#pragma once

#include <map>
#include <memory>
#include <tuple>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "engine/tensor_ref.h"

namespace infersweep::cuda {

class CublasLtGemm {
 public:
  static absl::StatusOr<std::unique_ptr<CublasLtGemm>> Create(size_t workspace_bytes = 32 << 20);
  ~CublasLtGemm();

  absl::Status Run(const uint16_t* x_bf16, int M, const MatrixRef& w, float* y, cudaStream_t stream);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  absl::StatusOr<Plan*> GetPlan(int M, int N, int K);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int, int, int>, Plan> plans_;
};

}  // namespace infersweep::cuda
