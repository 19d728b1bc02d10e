// One cuBLASLt matmul plan, shared by the bf16 / fp32 GEMMs (gemm_cublaslt) and the scaled FP8 /
// FP4 GEMMs (gemm_scaled): y [M, N] (fp32) = x [M, K] . W [N, K]^T, both row-major, computed in
// cuBLASLt's column-major view y^T [N, M] = W (K x N, transposed) . x^T (K x M); fp32 compute.
// Every setup call is checked; whatever fails, the descriptors made so far are freed.
#pragma once

#include <cublasLt.h>

#include <functional>
#include <string>

#include "absl/status/statusor.h"

namespace infersweep::cuda {

struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  void Destroy();  // frees the descriptors made (a plan is destroyed once, by its owner)
};

// Records the first failing setup call's status (`what` names it).
using LtCheck = std::function<void(cublasStatus_t status, const char* what)>;

struct LtPlanSpec {
  cudaDataType_t input_type = CUDA_R_16BF;  // W's and x's element type
  int M = 0, N = 0, K = 0;                  // leading dimensions in elements (FP4 counts nibbles)
  size_t workspace_bytes = 0;               // the heuristic's bound
  // Extra attributes of the descriptor (scale modes and pointers), or none.
  std::function<void(cublasLtMatmulDesc_t desc, const LtCheck& check)> configure;
  // Unimplemented's message when the heuristic finds no algorithm (its status given).
  std::function<std::string(cublasStatus_t heuristic_status)> no_algorithm;
};

absl::StatusOr<LtPlan> MakeLtPlan(cublasLtHandle_t handle, const LtPlanSpec& spec);

}  // namespace infersweep::cuda
