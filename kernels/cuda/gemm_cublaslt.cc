#include "kernels/cuda/gemm_cublaslt.h"

#include "absl/strings/str_cat.h"
#include "core/launch_log.h"

namespace infersweep::cuda {
namespace {

absl::Status Check(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuBLASLt ", what, ": status ", static_cast<int>(s)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CublasLtGemm>> CublasLtGemm::Create(size_t workspace_bytes) {
  auto gemm = std::unique_ptr<CublasLtGemm>(new CublasLtGemm());
  if (auto s = Check(cublasLtCreate(&gemm->handle_), "create"); !s.ok()) return s;
  if (cudaMalloc(&gemm->workspace_, workspace_bytes) != cudaSuccess)
    return absl::ResourceExhaustedError("cuBLASLt workspace allocation failed");
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
  if (auto s = Check(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
      !s.ok())
    return s;
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa);
  cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb);
  cublasLtMatrixLayoutCreate(&plan.a, input_type, K, N, K);
  cublasLtMatrixLayoutCreate(&plan.b, input_type, K, M, K);
  cublasLtMatrixLayoutCreate(&plan.c, CUDA_R_32F, N, M, N);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                       &workspace_bytes_, sizeof workspace_bytes_);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle_, plan.desc, plan.a, plan.b,
                                                            plan.c, plan.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs != CUBLAS_STATUS_SUCCESS || found == 0)
    return absl::UnimplementedError(absl::StrCat(
        "cuBLASLt has no ", input_type == CUDA_R_32F ? "fp32" : "bf16", " algorithm for M=", M,
        " N=", N, " K=", K, " (cublasLtMatmulAlgoGetHeuristic: ", cublasLtGetStatusName(hs), ", ",
        found, " found)"));
  plan.algo = result.algo;
  return &(plans_[key] = plan);
}

absl::Status CublasLtGemm::Probe(int M, int N, int K, cudaDataType input_type) {
  absl::StatusOr<Plan*> plan = GetPlan(M, N, K, input_type);
  return plan.ok() ? absl::OkStatus() : plan.status();
}

absl::Status CublasLtGemm::Run(const uint16_t* x_bf16, int M, const MatrixRef& w, float* y,
                               cudaStream_t stream, float alpha, float beta) {
  if (w.dtype != DType::kBF16) return absl::InvalidArgumentError("cuBLASLt path takes bf16 weights");
  auto plan = GetPlan(M, static_cast<int>(w.rows), static_cast<int>(w.cols), CUDA_R_16BF);
  if (!plan.ok()) return plan.status();
  RecordLaunch("cublasLt:bf16 gemm");  // the launch log (core/launch_log.h): one per matmul call
  return Check(cublasLtMatmul(handle_, (*plan)->desc, &alpha, w.data, (*plan)->a, x_bf16,
                              (*plan)->b, &beta, y, (*plan)->c, y, (*plan)->c, &(*plan)->algo,
                              workspace_, workspace_bytes_, stream),
               "matmul");
}

absl::Status CublasLtGemm::RunF32(const float* x, int M, const float* w, int N, int K, float* y,
                                  cudaStream_t stream) {
  auto plan = GetPlan(M, N, K, CUDA_R_32F);
  if (!plan.ok()) return plan.status();
  const float alpha = 1.f, beta = 0.f;
  RecordLaunch("cublasLt:fp32 gemm");
  return Check(cublasLtMatmul(handle_, (*plan)->desc, &alpha, w, (*plan)->a, x, (*plan)->b, &beta,
                              y, (*plan)->c, y, (*plan)->c, &(*plan)->algo, workspace_,
                              workspace_bytes_, stream),
               "fp32 matmul");
}

}  // namespace infersweep::cuda
