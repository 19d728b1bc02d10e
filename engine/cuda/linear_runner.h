// The linear layers of a CUDA model's step: GEMM and GEMV dispatch by the gemm and qgemm axes
// (reference, cuBLASLt, the fused GEMV with norm / bias / residual fused in, TMA-streamed
// projections, quantized GEMVs and scaled GEMMs), and the dense MLP. Owns the activations the
// linears share: the normalised input, its bf16 copy, product and MLP scratch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/cuda/device_util.h"
#include "engine/cuda/runner_context.h"
#include "engine/cuda/weight_upload.h"
#include "engine/plan/linear_plan.h"
#include "kernels/cuda/gemm_cublaslt.h"
#include "kernels/cuda/ops.h"

namespace infersweep {

class LinearRunner {
 public:
  // `gemm`: the cuBLASLt handle (gemm=cublaslt, fused, tma), else null. `view`: a quantized
  // model's view of its weights, else null; both outlive the runner.
  LinearRunner(const RunnerContext& context, std::unique_ptr<cuda::CublasLtGemm> gemm,
               const QuantView* view);
  LinearRunner(const LinearRunner&) = delete;
  LinearRunner& operator=(const LinearRunner&) = delete;

  // Scratch for `rows` rows (freed first by FreeScratch).
  absl::Status AllocateScratch(int rows);
  void FreeScratch();

  cuda::CublasLtGemm* cublaslt() const { return gemm_.get(); }
  float* xn() const { return xn_.get(); }         // [rows, hidden]: the normalised input
  uint16_t* bf16() const { return bf16_.get(); }  // bf16 staging of a GEMM's input
  float* o() const { return o_.get(); }           // [rows, hidden]
  float* y() const { return y_.get(); }           // [rows, hidden]
  // Whether the step being enqueued is a prefill chunk (n > 1): quantized linears then run on
  // tensor cores from a bf16 copy (as they do from kQuantBf16CopyMinRows decode rows).
  void set_prefill(bool prefill) { prefill_ = prefill; }

  // y = x . W^T (+ bias) through the configured GEMM. `x_bf16` is x already rounded to bf16
  // (cuBLASLt path), so one conversion serves several GEMMs on the same input.
  absl::Status Gemm(const float* x, const uint16_t* x_bf16, int rows, const MatrixRef& w,
                    const MatrixRef& bias, float* y);
  // y += scale * (x . W^T + bias).
  absl::Status GemmAccumulate(const float* x, const uint16_t* x_bf16, int rows, const MatrixRef& w,
                              const MatrixRef& bias, float scale, float* y);
  // Whether q, k and v run as one GEMM (stored back to back, dense bf16, no biases, cuBLASLt).
  bool QkvContiguous(const LayerWeights& lw) const;
  // x in bf16 for cuBLASLt (bf16()); null without cuBLASLt.
  const uint16_t* PrepareInput(const float* x, int64_t count);
  // xn() = RMSNorm(x) * gain, and its bf16 copy for cuBLASLt in the same launch (PrepareInput's
  // result: null without cuBLASLt).
  const uint16_t* NormAndPrepare(const float* x, int rows, int n, const MatrixRef& gain, float eps);

  // A fused GEMV launch (gemm=fused|tma, decode rows): the kernel's args plus each segment's
  // weights and bias, whose kind picks the kernel (RunGemv).
  struct FusedGemv : cuda::GemvArgs {
    MatrixRef w[cuda::kGemvMaxSegments];
    MatrixRef bias[cuda::kGemvMaxSegments];
  };
  // A GEMV over `rows` rows of x [rows, k], RMS-normalised by `norm` first when it is given.
  static FusedGemv GemvInput(const float* x, int rows, int k, const MatrixRef& norm,
                             float eps = 0.f);
  static void AddSegment(FusedGemv& a, const MatrixRef& w, const MatrixRef& bias, float* y);
  absl::Status RunGemv(const FusedGemv& g, bool projection = false);

  // out += MLP(RMSNorm(x)) for a dense (non-MoE) layer (out: x itself, or a partial that the
  // collective seam reduces first).
  absl::Status DenseMlp(const LayerWeights& lw, int rows, bool gemv, float* x, float* out);
  // Mlp through the fused GEMV (decode rows, GemvSupports): gate and up in one launch, with
  // `extra` (a [n, k] weight, e.g. the shared expert's gate) as a third segment into extra_out
  // when given; down in a second. `in` is the normalised input.
  absl::Status MlpGemv(const ExpertWeights& e, const float* in, int rows, const MatrixRef& extra,
                       float* extra_out, float* y);
  // y = down(silu(gate(x)) * up(x)) over `rows` rows of x.
  absl::Status Mlp(const ExpertWeights& e, const float* in, const uint16_t* in_bf16, int rows,
                   float* y);

  // The gemm axis's value, for the launch log's fallback lines.
  const char* GemmValue() const { return AxisValueName(options_.gemm); }
  // The widest MLP of the model (dense, expert or shared expert).
  int MaxIntermediate() const;

 private:
  // From this many rows a decode batch's quantized linears (qgemm=w4a16|w8a16, with cuBLASLt)
  // take the bf16 copy too. Napkin math: the copy moves ~5 bytes a weight (FP8 codes read, bf16
  // written and read back by cuBLASLt), the quantized GEMV one byte a weight every 4 rows, so
  // from ~20 rows the copy moves fewer bytes; the MMA kernel (GemmQuantMma) reads the codes once
  // a pass and takes decode batches up to kQuantMmaMaxRows rows.
  absl::StatusOr<MatrixRef> QuantBf16Copy(const MatrixRef& w);
  // The plan for y = x . W^T at `rows` rows (engine/plan/linear_plan.h); with `record_fallback`,
  // its fallback line goes to the launch log.
  LinearPlan Plan(const MatrixRef& w, int rows, bool bf16_input, bool record_fallback) const;
  // Grows the bf16 copy to `count` elements (refused inside a stream capture).
  absl::Status ReserveBf16Copy(size_t count);
  size_t LargestQuantizedDense() const;
  void ProjectionGemv(const cuda::GemvArgs& a);

  const ModelConfig& config_;
  const CudaOptions& options_;
  cudaStream_t stream_;
  std::unique_ptr<cuda::CublasLtGemm> gemm_;
  const QuantView* view_;
  bool prefill_ = false;
  bool wgmma_ = false;  // compute capability 9.0: the sm_90a kernels run (LinearStep::wgmma)
  DeviceBuffer<float> xn_, o_, y_, gate_, up_;
  DeviceBuffer<uint16_t> bf16_;
  DeviceBuffer<uint16_t> bf16_copy_;  // QuantBf16Copy
  DeviceBuffer<uint8_t> fp8_codes_;   // qgemm=w8a8: [rows, widest K] E4M3
  DeviceBuffer<float> fp8_scales_;    // qgemm=w8a8: [rows]
  size_t bf16_copy_count_ = 0;
};

}  // namespace infersweep
