#include "kernels/cuda/gemm_cublaslt.h"

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "core/launch_log.h"
#include "kernels/cuda/check.h"

namespace infersweep::cuda {
namespace {}  // namespace

absl::StatusOr<std::unique_ptr<CublasLtGemm>> CublasLtGemm::Create(size_t workspace_bytes) {
  auto gemm = std::unique_ptr<CublasLtGemm>(new CublasLtGemm());
  RETURN_IF_ERROR(CublasStatus(cublasLtCreate(&gemm->handle_), "cublasLtCreate"));
  RETURN_IF_ERROR(
      CudaStatus(cudaMalloc(&gemm->workspace_, workspace_bytes), "the cuBLASLt workspace"));
  gemm->workspace_bytes_ = workspace_bytes;
  return gemm;
}

CublasLtGemm::~CublasLtGemm() {
  for (auto& [shape, plan] : plans_) {
    cublasLtMatrixLayoutDestroy(plan.a);
    cublasLtMatrixLayoutDestroy(plan.b);
    cublasLtMatrixLayoutDestroy(plan.c);
    cublasLtMatmulDescDestroy(plan.desc);
  }
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

// Column-major view: y^T [N, M] = W [N, K] (stored as K x N column-major, transposed) . x^T
// (x row-major [M, K] is K x M column-major).
absl::StatusOr<CublasLtGemm::Plan*> CublasLtGemm::GetPlan(int M, int N, int K,
                                                          cudaDataType input_type) {
  const auto key = std::make_tuple(M, N, K, static_cast<int>(input_type));
  if (auto it = plans_.find(key); it != plans_.end()) return &it->second;
  Plan plan;
  RETURN_IF_ERROR(CublasStatus(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                               "cublasLtMatmulDescCreate"));
  // Whatever fails below, the descriptors made so far go with the plan (none is cached).
  auto destroy = [&plan] {
    if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
    if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
    if (plan.c) cublasLtMatrixLayoutDestroy(plan.c);
    cublasLtMatmulDescDestroy(plan.desc);
  };
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  // Every setup call's status; the first failure is returned once the descriptors are freed.
  absl::Status setup;
  auto check = [&setup](cublasStatus_t status, const char* what) {
    if (setup.ok()) setup = CublasStatus(status, what);
  };
  check(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa,
                                       sizeof transa),
        "cuBLASLt plan: TRANSA");
  check(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb,
                                       sizeof transb),
        "cuBLASLt plan: TRANSB");
  check(cublasLtMatrixLayoutCreate(&plan.a, input_type, K, N, K), "cuBLASLt plan: layout of W");
  check(cublasLtMatrixLayoutCreate(&plan.b, input_type, K, M, K), "cuBLASLt plan: layout of x");
  check(cublasLtMatrixLayoutCreate(&plan.c, CUDA_R_32F, N, M, N), "cuBLASLt plan: layout of y");
  cublasLtMatmulPreference_t pref = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pref), "cuBLASLt plan: preference");
  check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes_, sizeof workspace_bytes_),
        "cuBLASLt plan: workspace preference");
  if (!setup.ok()) {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    destroy();
    return setup;
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(
      handle_, plan.desc, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
    destroy();
    return absl::UnimplementedError(absl::StrCat(
        "cuBLASLt has no ", input_type == CUDA_R_32F ? "fp32" : "bf16", " algorithm for M=", M,
        " N=", N, " K=", K, " (cublasLtMatmulAlgoGetHeuristic: ", cublasLtGetStatusName(hs), ", ",
        found, " found)"));
  }
  plan.algo = result.algo;
  return &(plans_[key] = plan);
}

absl::Status CublasLtGemm::Probe(int M, int N, int K, cudaDataType input_type) {
  absl::StatusOr<Plan*> plan = GetPlan(M, N, K, input_type);
  return plan.ok() ? absl::OkStatus() : plan.status();
}

absl::Status CublasLtGemm::Run(const uint16_t* x_bf16, int M, const MatrixRef& w, float* y,
                               cudaStream_t stream, float alpha, float beta) {
  if (w.dtype != DType::kBF16)
    return absl::InvalidArgumentError("cuBLASLt path takes bf16 weights");
  ASSIGN_OR_RETURN(auto plan,
                   GetPlan(M, static_cast<int>(w.rows), static_cast<int>(w.cols), CUDA_R_16BF));
  RecordLaunch("cublasLt:bf16 gemm");  // the launch log (core/launch_log.h): one per matmul call
  return CublasStatus(
      cublasLtMatmul(handle_, plan->desc, &alpha, w.data, plan->a, x_bf16, plan->b, &beta, y,
                     plan->c, y, plan->c, &plan->algo, workspace_, workspace_bytes_, stream),
      "cublasLtMatmul (bf16)");
}

absl::Status CublasLtGemm::RunF32(const float* x, int M, const float* w, int N, int K, float* y,
                                  cudaStream_t stream) {
  ASSIGN_OR_RETURN(auto plan, GetPlan(M, N, K, CUDA_R_32F));
  const float alpha = 1.f, beta = 0.f;
  RecordLaunch("cublasLt:fp32 gemm");
  return CublasStatus(
      cublasLtMatmul(handle_, plan->desc, &alpha, w, plan->a, x, plan->b, &beta, y, plan->c, y,
                     plan->c, &plan->algo, workspace_, workspace_bytes_, stream),
      "cublasLtMatmul (fp32)");
}

}  // namespace infersweep::cuda
