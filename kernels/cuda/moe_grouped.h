// cuBLAS grouped GEMM for MoE experts (moe=grouped): one launch computes, for every expert e with
// rows routed to it, y_e[M_e, N] (bf16) = x_e[M_e, K] (bf16) . W_e[N, K]^T (bf16), fp32
// accumulate. (cuBLAS 13 answers NOT_SUPPORTED for a grouped bf16 x bf16 -> fp32 product, seen
// on the H200: hence bf16 outputs, which also feed the next GEMM without a conversion.)
// The group sizes M_e come from the routing, so the host must know them (a sync per layer): not
// capturable in a CUDA graph, unlike moe=fused.
//
// Napkin math, qwen3-30b-a3b batch 64 decode: ~126 of 128 experts are touched per layer, so a
// step reads ~58 GB of expert weights across 48 layers: ~13 ms at 4.46 TB/s (the per-pair GEMV
// kernels of moe=fused re-read an expert for every row routed to it: ~4x that). Prefill of 2048
// tokens: 2 x 3 x 768 x 2048 x 16384 pairs = 155 GFLOP/layer, ~0.2 ms at 794 TFLOP/s.
#pragma once

#include <memory>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"

namespace infersweep::cuda {

struct GroupedProblem {
  const uint16_t* x = nullptr;  // [rows, k] bf16, row-major
  const uint16_t* w = nullptr;  // [n, k] bf16, row-major (an HF linear weight)
  uint16_t* y = nullptr;        // [rows, n] bf16, row-major
  int rows = 0;
};

class CublasGroupedGemm {
 public:
  static absl::StatusOr<std::unique_ptr<CublasGroupedGemm>> Create();
  ~CublasGroupedGemm();

  // Every problem shares n and k. Problems with rows == 0 are skipped.
  absl::Status Run(const std::vector<GroupedProblem>& problems, int n, int k, cudaStream_t stream);

 private:
  cublasHandle_t handle_ = nullptr;
  void** device_pointers_ = nullptr;  // A, B and C pointer arrays for one call
  size_t capacity_ = 0;               // problems the pointer arrays hold
};

}  // namespace infersweep::cuda
