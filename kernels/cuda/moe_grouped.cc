#include "kernels/cuda/moe_grouped.h"

#include "absl/strings/str_cat.h"
#include "core/launch_log.h"

namespace infersweep::cuda {

absl::StatusOr<std::unique_ptr<CublasGroupedGemm>> CublasGroupedGemm::Create() {
  auto gemm = std::unique_ptr<CublasGroupedGemm>(new CublasGroupedGemm());
  if (const cublasStatus_t s = cublasCreate(&gemm->handle_); s != CUBLAS_STATUS_SUCCESS)
    return absl::InternalError(absl::StrCat("cublasCreate: status ", static_cast<int>(s)));
  return gemm;
}

CublasGroupedGemm::~CublasGroupedGemm() {
  if (device_pointers_) cudaFree(device_pointers_);
  if (handle_) cublasDestroy(handle_);
}

// Column-major view, as in gemm_cublaslt.cc: y_e^T [n, rows] = W_e (k x n column-major,
// transposed) . x_e^T (k x rows column-major). Each expert is its own group of one problem, since
// the row counts differ.
absl::Status CublasGroupedGemm::Run(const std::vector<GroupedProblem>& problems, int n, int k,
                                    cudaStream_t stream) {
  std::vector<const void*> a, b;
  std::vector<void*> c;
  std::vector<int> m_array, n_array, k_array, lda, ldb, ldc, group_size;
  std::vector<cublasOperation_t> transa, transb;
  std::vector<float> alpha, beta;
  for (const GroupedProblem& p : problems) {
    if (p.rows == 0) continue;
    a.push_back(p.w);
    b.push_back(p.x);
    c.push_back(p.y);
    m_array.push_back(n);
    n_array.push_back(p.rows);
    k_array.push_back(k);
    lda.push_back(k);
    ldb.push_back(k);
    ldc.push_back(n);
    group_size.push_back(1);
    transa.push_back(CUBLAS_OP_T);
    transb.push_back(CUBLAS_OP_N);
    alpha.push_back(1.f);
    beta.push_back(0.f);
  }
  const size_t groups = a.size();
  if (groups == 0) return absl::OkStatus();
  if (groups > capacity_) {
    if (device_pointers_) cudaFree(device_pointers_);
    device_pointers_ = nullptr;
    if (cudaMalloc(&device_pointers_, 3 * groups * sizeof(void*)) != cudaSuccess)
      return absl::ResourceExhaustedError("grouped GEMM pointer arrays: cudaMalloc failed");
    capacity_ = groups;
  }
  std::vector<const void*> pointers;
  pointers.reserve(3 * groups);
  pointers.insert(pointers.end(), a.begin(), a.end());
  pointers.insert(pointers.end(), b.begin(), b.end());
  pointers.insert(pointers.end(), c.begin(), c.end());
  // Synchronous from pageable memory: the host vectors die when this returns.
  if (cudaMemcpyAsync(device_pointers_, pointers.data(), pointers.size() * sizeof(void*),
                      cudaMemcpyHostToDevice, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess)
    return absl::InternalError("grouped GEMM pointer upload failed");
  const void* const* a_dev = const_cast<const void* const*>(device_pointers_);
  const void* const* b_dev = a_dev + groups;
  void* const* c_dev = device_pointers_ + 2 * groups;
  cublasSetStream(handle_, stream);
  RecordLaunch("cublas:grouped bf16 gemm");  // the launch log: one per grouped call
  const cublasStatus_t s = cublasGemmGroupedBatchedEx(
      handle_, transa.data(), transb.data(), m_array.data(), n_array.data(), k_array.data(),
      alpha.data(), a_dev, CUDA_R_16BF, lda.data(), b_dev, CUDA_R_16BF, ldb.data(), beta.data(),
      c_dev, CUDA_R_16BF, ldc.data(), static_cast<int>(groups), group_size.data(),
      CUBLAS_COMPUTE_32F);
  if (s != CUBLAS_STATUS_SUCCESS)
    return absl::InternalError(
        absl::StrCat("cublasGemmGroupedBatchedEx (bf16 x bf16 -> bf16, ", groups,
                     " groups): status ", static_cast<int>(s)));
  return absl::OkStatus();
}

}  // namespace infersweep::cuda
