// Scaled tensor-core GEMMs through cuBLASLt: qgemm=fp8_cublaslt (FP8 E4M3, sm_90) and
// qgemm=native_fp4 (block-scaled E2M1, sm_100 / sm_120). Weights are used as loaded (E4M3 codes;
// packed E2M1), activations are quantized on the device before every GEMM
// (kernels/cuda/scaled_quant.h), accumulation is fp32, and so is the output:
//   y[M, N] = x[M, K] . W[N, K]^T, with W's [N, K] row-major codes read in place as cuBLASLt's
//   column-major A (K x N, transposed) and the quantized x as B (K x M): FP8's required "TN".
//
// weight format          activations (dynamic)              cuBLASLt A (weight) / B (x) scales
// fp8_tensor             E4M3, one scale per row (token)    OUTER_VEC_32F / OUTER_VEC_32F, the
//                                                           weight's one scale broadcast (SCALAR
//                                                           failed every matmul on the H200)
// fp8_channel            E4M3, one scale per row (token)    OUTER_VEC_32F / OUTER_VEC_32F (sm_90
//                                                           only); where cuBLASLt has no
//                                                           algorithm: none, and ScaleOutput
//                                                           applies both
// fp8_block128, K > 128  E4M3, one scale per 1 x 128        BLK128x128_32F / VEC128_32F (sm_90;
//                                                           < 4 rows padded to 4)
// fp8_block128, K <= 128 as fp8_channel: one block along K, so the block scales are per-row ones
// nvfp4                  E2M1, E4M3 per 16 + fp32 global    VEC16_UE4M3 / VEC16_UE4M3; both
//                                                           globals by ScaleOutput
// mxfp4                  E2M1, E8M0 per 32                  VEC32_UE8M0 / VEC32_UE8M0
//
// Napkin math, H200 (4.46 TB/s read, FP8 dense 1452 TFLOP/s measured), Qwen3-30B-A3B:
//   q_proj [4096, 2048] in FP8 is 8.4 MB: decode (M = 1) reads it in 1.9 us against 3.8 us for
//   bf16; 16.8 MFLOP is nothing. Prefill M = 2048: 34 GFLOP, 24 us at FP8 peak (43 us at bf16's
//   794 TFLOP/s). An expert's [768, 2048] is 1.6 MB (0.35 us): decode there is launch-bound,
//   ~2 us for the quantizer launches plus the GEMM's.
// Requirements (FP8, cuBLAS docs): 16-byte aligned pointers and leading dimensions, so K % 16 == 0
// (rows of E4M3 codes) and N % 4 == 0 (rows of fp32 output); FP4: K % 32 == 0. Shapes cuBLASLt
// has no algorithm for are Unimplemented, naming the shape.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "absl/status/statusor.h"
#include "core/tensor_ref.h"
#include "kernels/cuda/cublaslt_plan.h"

namespace infersweep::cuda {

enum class ScaledGemmKind {
  kFp8,  // qgemm=fp8_cublaslt: fp8_tensor, fp8_channel, fp8_block128 weights
  kFp4,  // qgemm=native_fp4: nvfp4, mxfp4 weights
};

// The seam of the quantized linears a library runs from their codes: cuBLASLt's scaled GEMMs
// below, cuDNN's FP8 matmul graph (engine/cuda/cudnn_matmul.h).
class QuantLinearGemm {
 public:
  virtual ~QuantLinearGemm() = default;
  // Once per quantized linear, when a model is built.
  virtual absl::Status Prepare(const MatrixRef& w) = 0;
  // y[rows, w.rows] (fp32, overwritten) = x[rows, w.cols] (fp32) . w^T, w prepared.
  virtual absl::Status Run(const float* x, int rows, const MatrixRef& w, float* y,
                           cudaStream_t stream) = 0;
  // Makes now, outside any graph capture, what runs of `rows` rows need (a decode batch's
  // plans); nothing by default.
  virtual absl::Status PrepareRows(int rows) { return absl::OkStatus(); }
};

class ScaledGemm final : public QuantLinearGemm {
 public:
  static absl::StatusOr<std::unique_ptr<ScaledGemm>> Create(ScaledGemmKind kind,
                                                            size_t workspace_bytes = 32 << 20);
  ~ScaledGemm() override;

  // Once per quantized linear, when a model is built (synchronous): its scales, rearranged into
  // buffers this object owns in the layouts cuBLASLt reads. w holds device pointers; its codes are
  // used in place and must outlive this object. Unimplemented, naming the shape, where this kind
  // cannot take the format or the shape.
  absl::Status Prepare(const MatrixRef& w) override;

  // y[rows, w.rows] (fp32, overwritten) = x[rows, w.cols] (fp32) . w^T, w prepared. Quantizes x
  // into scratch this object owns (grown on demand; growing while `stream` is being captured is
  // an error, not a crash).
  absl::Status Run(const float* x, int rows, const MatrixRef& w, float* y,
                   cudaStream_t stream) override;

 private:
  // fp8_tensor weights run as kFp8Rows (their one scale broadcast; see Prepare).
  enum class Mode { kFp8Rows, kFp8Blocks, kNvfp4, kMxfp4 };
  struct Weight {
    Mode mode;
    void* scales = nullptr;  // device, in the layout of `mode`
    float global = 1.f;      // nvfp4: the weight's scale_2
  };
  struct Plan : LtPlan {
    bool scales_in_epilogue = false;  // fp8 per-row scales: cuBLASLt took no outer vectors
  };

  explicit ScaledGemm(ScaledGemmKind kind) : kind_(kind) {}
  absl::StatusOr<Plan*> GetPlan(Mode mode, int M, int N, int K, const void* a_scale,
                                const void* b_scale);
  absl::StatusOr<Plan> MakePlan(Mode mode, int M, int N, int K, const void* a_scale,
                                const void* b_scale, bool with_scales);
  absl::Status Grow(void** buffer, size_t* capacity, size_t bytes, cudaStream_t stream);

  ScaledGemmKind kind_;
  int sm_ = 0;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<const void*, Weight> weights_;                 // by the weight's code pointer
  std::map<std::tuple<int, int, int, int>, Plan> plans_;  // by (mode, M, N, K)
  // Scratch: x's codes, x's scales, and the slots [amax bits, scale or global scale].
  void* codes_ = nullptr;
  size_t codes_bytes_ = 0;
  void* scales_ = nullptr;
  size_t scales_bytes_ = 0;
  // fp8_block128 below kMinBlockRows rows: x padded with copies of its last row, and the output.
  static constexpr int kMinBlockRows = 4;
  void* pad_x_ = nullptr;
  size_t pad_x_bytes_ = 0;
  void* pad_y_ = nullptr;
  size_t pad_y_bytes_ = 0;
  uint32_t* slots_ = nullptr;
};

}  // namespace infersweep::cuda
