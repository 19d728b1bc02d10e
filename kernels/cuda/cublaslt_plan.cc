#include "kernels/cuda/cublaslt_plan.h"

#include "api/status_macros.h"
#include "kernels/cuda/check.h"

namespace infersweep::cuda {

void LtPlan::Destroy() {
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (c) cublasLtMatrixLayoutDestroy(c);
  if (desc) cublasLtMatmulDescDestroy(desc);
  *this = LtPlan{};
}

absl::StatusOr<LtPlan> MakeLtPlan(cublasLtHandle_t handle, const LtPlanSpec& s) {
  LtPlan plan;
  RETURN_IF_ERROR(CublasStatus(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                               "cublasLtMatmulDescCreate"));
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  // Every setup call's status; the first failure is returned once the descriptors are freed.
  absl::Status setup;
  const LtCheck check = [&setup](cublasStatus_t status, const char* what) {
    if (setup.ok()) setup = CublasStatus(status, what);
  };
  check(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa,
                                       sizeof transa),
        "cuBLASLt plan: TRANSA");
  check(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb,
                                       sizeof transb),
        "cuBLASLt plan: TRANSB");
  if (s.configure) s.configure(plan.desc, check);
  check(cublasLtMatrixLayoutCreate(&plan.a, s.input_type, s.K, s.N, s.K),
        "cuBLASLt plan: layout of W");
  check(cublasLtMatrixLayoutCreate(&plan.b, s.input_type, s.K, s.M, s.K),
        "cuBLASLt plan: layout of x");
  check(cublasLtMatrixLayoutCreate(&plan.c, CUDA_R_32F, s.N, s.M, s.N),
        "cuBLASLt plan: layout of y");
  cublasLtMatmulPreference_t pref = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pref), "cuBLASLt plan: preference");
  check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &s.workspace_bytes, sizeof s.workspace_bytes),
        "cuBLASLt plan: workspace preference");
  if (!setup.ok()) {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    plan.Destroy();
    return setup;
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(
      handle, plan.desc, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
    plan.Destroy();
    return absl::UnimplementedError(s.no_algorithm ? s.no_algorithm(hs)
                                                   : "cuBLASLt has no algorithm for the shape");
  }
  plan.algo = result.algo;
  return plan;
}

}  // namespace infersweep::cuda
