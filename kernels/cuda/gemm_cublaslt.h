// cuBLASLt bf16 GEMM: y[M, N] (fp32) = x[M, K] (bf16) . W[N, K]^T (bf16), fp32 accumulate.
// Plans (descriptors + heuristic algo) are cached per shape; capturable in CUDA graphs (the
// workspace is preallocated).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <tuple>

#include "absl/status/statusor.h"
#include "core/tensor_ref.h"
#include "kernels/cuda/cublaslt_plan.h"

namespace infersweep::cuda {

class CublasLtGemm {
 public:
  static absl::StatusOr<std::unique_ptr<CublasLtGemm>> Create(size_t workspace_bytes = 32 << 20);
  ~CublasLtGemm();

  // y = alpha * x . W^T + beta * y: beta = 1 adds the product into y (the residual stream).
  absl::Status Run(const uint16_t* x_bf16, int M, const MatrixRef& w, float* y, cudaStream_t stream,
                   float alpha = 1.f, float beta = 0.f);
  // All fp32, fp32 math (no TF32): y[M, N] = x[M, K] . W[N, K]^T. The MoE router of long prefill
  // chunks, which stays fp32 on every config (faster there than router.cu's kernel).
  absl::Status RunF32(const float* x, int M, const float* w, int N, int K, float* y,
                      cudaStream_t stream);
  // The heuristic query alone (cublasLtMatmulAlgoGetHeuristic) for the plan Run (bf16) or
  // RunF32 (fp32) would make for this shape; the plan is kept. Unimplemented naming the shape
  // and cuBLASLt's status when it returns no algorithm (the capability probe's question).
  absl::Status Probe(int M, int N, int K, cudaDataType input_type);

 private:
  using Plan = LtPlan;
  absl::StatusOr<Plan*> GetPlan(int M, int N, int K, cudaDataType input_type);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int, int, int, int>, Plan> plans_;
};

}  // namespace infersweep::cuda
