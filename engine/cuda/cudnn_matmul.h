// qgemm=cudnn: quantized linears through cuDNN's graph API (engine/cuda/cudnn_graph.h).
//
// FP8 (fp8_tensor, fp8_channel weights): activations quantized to E4M3 with one dynamic scale
// per token (kernels/cuda/scaled_quant.h), then one cuDNN graph
//   C = A[M, K] (E4M3) . B[K, N] (E4M3, the weight's [N, K] codes read in place), fp32 math
//   Y = C * a_scale[M, 1] * b_scale[1, N]  (fp32 out; the weight's scale expanded per row)
// which cuDNN fuses into one tensor-core kernel with its epilogue. A plan is kept per (M, N, K);
// a decode batch's are made when the batch starts (PrepareRows), before its graph capture.
// fp8_block128 (128 x 128 weight blocks) has no graph here: UNSUPPORTED, naming the layout.
//
// FP4 (nvfp4, mxfp4): the block-scaled graph (E2M1 codes, E4M3 / E8M0 block scales in cuDNN's
// F8_128x4 tiles, dequantized into the matmul) is what cuDNN runs on sm_100 and newer; on older
// GPUs no engine takes it, and the refusal is cuDNN's own words. On GPUs where cuDNN offers a
// plan, running it (FP4 activations in cuDNN's scale tiles) is not built: UNSUPPORTED, saying so.
//
// Napkin math, H200: q_proj of qwen3-30b-a3b ([4096, 2048], 8.4 MB in FP8) at M = 64 reads the
// codes once, 1.9 us at 4.46 TB/s, for 1.1 GFLOP (under 1 us at FP8's ~1450 TFLOP/s dense); at
// M = 2048 (prefill) 34 GFLOP, ~24 us at FP8 peak.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor_ref.h"
#include "engine/cuda/cudnn_graph.h"
#include "engine/cuda/device_util.h"
#include "kernels/cuda/gemm_scaled.h"

namespace infersweep {

// The oldest cuDNN whose FP8 matmul with vector-scale epilogues, and block-scale dequantize
// operation, this file's graphs use.
constexpr size_t kCudnnMatmulMinVersion = 90700;

// Whether cuDNN takes qgemm=cudnn's graph for a [n, k] weight of `format` on this GPU: OK, or
// Unimplemented with cuDNN's words (the capability probe's question).
absl::Status ProbeCudnnQuantGemm(QuantFormat format, int n, int k);

class CudnnQuantGemm final : public cuda::QuantLinearGemm {
 public:
  // Unimplemented when cuDNN is missing or too old.
  static absl::StatusOr<std::unique_ptr<CudnnQuantGemm>> Create();

  // FP8: the weight's scale per output row; a plan for one row (Unimplemented with cuDNN's
  // words where no engine takes the graph). FP4: the block-scaled graph's answer (above).
  absl::Status Prepare(const MatrixRef& w) override;
  absl::Status Run(const float* x, int rows, const MatrixRef& w, float* y,
                   cudaStream_t stream) override;
  absl::Status PrepareRows(int rows) override;

 private:
  friend absl::Status ProbeCudnnQuantGemm(QuantFormat format, int n, int k);
  struct Weight {
    int n = 0, k = 0;
    DeviceBuffer<float> row_scales;  // [n]
  };
  explicit CudnnQuantGemm(std::unique_ptr<cudnn::Handle> handle) : handle_(std::move(handle)) {}
  absl::StatusOr<const cudnn::Plan*> PlanFor(int m, int n, int k);
  absl::Status Grow(int rows, int k);

  std::unique_ptr<cudnn::Handle> handle_;
  std::map<const void*, Weight> weights_;  // by the weight's code pointer
  std::map<std::tuple<int, int, int>, cudnn::Plan> plans_;
  cudnn::Workspace workspace_;
  DeviceBuffer<uint8_t> codes_;  // the activations' E4M3 codes
  DeviceBuffer<float> scales_;   // their per-token scales
  int64_t scratch_rows_ = 0, scratch_k_ = 0;
};

}  // namespace infersweep
