#include "kernels/cuda/gemm_scaled.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "core/launch_log.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/compute_capability.h"
#include "kernels/cuda/scaled_layout.h"
#include "kernels/cuda/scaled_quant.h"

namespace infersweep::cuda {
namespace {

std::string Shape(const MatrixRef& w) { return absl::StrCat("[", w.rows, ", ", w.cols, "]"); }

const char* KindName(ScaledGemmKind kind) {
  return kind == ScaledGemmKind::kFp8 ? "qgemm=fp8_cublaslt" : "qgemm=native_fp4";
}

}  // namespace

absl::StatusOr<std::unique_ptr<ScaledGemm>> ScaledGemm::Create(ScaledGemmKind kind,
                                                               size_t workspace_bytes) {
  auto gemm = std::unique_ptr<ScaledGemm>(new ScaledGemm(kind));
  ASSIGN_OR_RETURN(gemm->sm_, CurrentComputeCapability("scaled GEMM"));
  RETURN_IF_ERROR(CublasStatus(cublasLtCreate(&gemm->handle_), "cublasLtCreate"));
  if (cudaMalloc(&gemm->workspace_, workspace_bytes) != cudaSuccess ||
      cudaMalloc(reinterpret_cast<void**>(&gemm->slots_), 4 * sizeof(uint32_t)) != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError("scaled GEMM: workspace allocation failed");
  }
  gemm->workspace_bytes_ = workspace_bytes;
  return gemm;
}

ScaledGemm::~ScaledGemm() {
  for (auto& [key, plan] : plans_) plan.Destroy();
  for (auto& [data, weight] : weights_) cudaFree(weight.scales);
  for (void* p : {codes_, scales_, pad_x_, pad_y_, workspace_, static_cast<void*>(slots_)})
    if (p) cudaFree(p);
  if (handle_) cublasLtDestroy(handle_);
}

absl::Status ScaledGemm::Prepare(const MatrixRef& w) {
  const QuantFormat format = w.quant.format;
  Weight weight;
  size_t bytes = 0;
  Fp8ScaleLayout layout = Fp8ScaleLayout::kScalar;
  if (kind_ == ScaledGemmKind::kFp8) {
    if (format != QuantFormat::kFp8Tensor && format != QuantFormat::kFp8Channel &&
        format != QuantFormat::kFp8Block128)
      return absl::InvalidArgumentError(
          absl::StrCat("qgemm=fp8_cublaslt takes FP8 weights; weight ", Shape(w), " is not"));
    // 16-byte aligned rows of E4M3 codes (cuBLASLt's FP8 requirement) and of fp32 output.
    if (w.cols % 16 != 0 || w.rows % 4 != 0)
      return absl::UnimplementedError(absl::StrCat(
          "qgemm=fp8_cublaslt needs K % 16 == 0 and N % 4 == 0 (16-byte aligned rows); weight ",
          Shape(w)));
    // fp8_tensor runs as per-row scales with the one scale broadcast: on the H200 (cuBLASLt
    // 13.1), SCALAR_32F-scaled FP8 with fp32 output passed the heuristic and then failed every
    // matmul with NOT_SUPPORTED, while OUTER_VEC_32F ran. Per-token activation scales are also
    // the more accurate recipe.
    if (format == QuantFormat::kFp8Tensor || format == QuantFormat::kFp8Channel ||
        w.cols <= kFp8BlockSize) {
      weight.mode = Mode::kFp8Rows;  // one block along K: its scales are per-row ones
      layout = Fp8ScaleLayout::kPerRow;
    } else {
      weight.mode = Mode::kFp8Blocks;
      layout = Fp8ScaleLayout::kBlocks;
    }
    bytes =
        sizeof(float) * (layout == Fp8ScaleLayout::kScalar   ? 1
                         : layout == Fp8ScaleLayout::kPerRow ? w.rows
                                                             : Fp8BlockScaleCount(w.rows, w.cols));
  } else {
    if (format != QuantFormat::kNvfp4 && format != QuantFormat::kMxfp4)
      return absl::InvalidArgumentError(absl::StrCat(
          "qgemm=native_fp4 takes NVFP4 or MXFP4 weights; weight ", Shape(w), " is not"));
    if (w.cols % 32 != 0 || w.rows % 4 != 0)
      return absl::UnimplementedError(absl::StrCat(
          "qgemm=native_fp4 needs K % 32 == 0 and N % 4 == 0 (16-byte aligned rows); weight ",
          Shape(w)));
    weight.mode = format == QuantFormat::kNvfp4 ? Mode::kNvfp4 : Mode::kMxfp4;
    const int64_t group = format == QuantFormat::kNvfp4 ? kNvfp4GroupSize : kMxfp4GroupSize;
    bytes = TiledScaleCount(w.rows, w.cols / group);
  }
  if (weights_.count(w.data)) return absl::OkStatus();  // the same codes prepared before
  if (cudaMalloc(&weight.scales, bytes) != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("scaled GEMM: ", bytes, " bytes of scales"));
  }
  if (kind_ == ScaledGemmKind::kFp8) {
    PrepareFp8WeightScales(w, layout, static_cast<float*>(weight.scales), nullptr);
  } else {
    TileFp4WeightScales(w, static_cast<uint8_t*>(weight.scales), nullptr);
    if (weight.mode == Mode::kNvfp4 &&
        cudaMemcpy(&weight.global, w.quant.global_scale, sizeof(float), cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
      cudaFree(weight.scales);
      return absl::InternalError("scaled GEMM: reading an NVFP4 weight_scale_2");
    }
  }
  if (absl::Status s = CudaStatus(
          cudaGetLastError(),
          absl::StrCat("scaled GEMM: preparing the scales of weight ", Shape(w)).c_str());
      !s.ok()) {
    cudaFree(weight.scales);
    return s;
  }
  weights_[w.data] = weight;
  return absl::OkStatus();
}

absl::StatusOr<ScaledGemm::Plan> ScaledGemm::MakePlan(Mode mode, int M, int N, int K,
                                                      const void* a_scale, const void* b_scale,
                                                      bool with_scales) {
  int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, b_mode = a_mode;
  const char* modes = "OUTER_VEC_32F";
  switch (mode) {
    case Mode::kFp8Rows:
      a_mode = b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      modes = "OUTER_VEC_32F";
      break;
    case Mode::kFp8Blocks:
      a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      modes = "BLK128x128_32F (weight) and VEC128_32F (activations)";
      break;
    case Mode::kNvfp4:
      a_mode = b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
      modes = "VEC16_UE4M3";
      break;
    case Mode::kMxfp4:
      a_mode = b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
      modes = "VEC32_UE8M0";
      break;
  }
  if (!with_scales) modes = "no scales";
  const bool fp4 = mode == Mode::kNvfp4 || mode == Mode::kMxfp4;
  LtPlanSpec spec;
  spec.input_type = fp4 ? CUDA_R_4F_E2M1 : CUDA_R_8F_E4M3;
  spec.M = M;
  spec.N = N;
  spec.K = K;
  spec.workspace_bytes = workspace_bytes_;
  if (with_scales)
    spec.configure = [&](cublasLtMatmulDesc_t desc, const LtCheck& check) {
      check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode,
                                           sizeof a_mode),
            "cuBLASLt plan: A_SCALE_MODE");
      check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode,
                                           sizeof b_mode),
            "cuBLASLt plan: B_SCALE_MODE");
      check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale,
                                           sizeof a_scale),
            "cuBLASLt plan: A_SCALE_POINTER");
      check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale,
                                           sizeof b_scale),
            "cuBLASLt plan: B_SCALE_POINTER");
    };
  spec.no_algorithm = [&](cublasStatus_t status) {
    return absl::StrCat(KindName(kind_), ": cuBLASLt (", cublasLtGetVersion(), ") has no ",
                        fp4 ? "FP4" : "FP8", " algorithm with ", modes, " for weight [", N, ", ", K,
                        "] and ", M, " rows on sm_", sm_, " (heuristic status ",
                        static_cast<int>(status), ")");
  };
  ASSIGN_OR_RETURN(LtPlan made, MakeLtPlan(handle_, spec));
  Plan plan;
  static_cast<LtPlan&>(plan) = made;
  return plan;
}

absl::StatusOr<ScaledGemm::Plan*> ScaledGemm::GetPlan(Mode mode, int M, int N, int K,
                                                      const void* a_scale, const void* b_scale) {
  const auto key = std::make_tuple(static_cast<int>(mode), M, N, K);
  if (auto it = plans_.find(key); it != plans_.end()) return &it->second;
  auto plan = MakePlan(mode, M, N, K, a_scale, b_scale, /*with_scales=*/true);
  if (!plan.ok() && mode == Mode::kFp8Rows) {
    // Outer-vector scales are sm_90-only in cuBLASLt: elsewhere, an unscaled GEMM and both
    // vectors in the epilogue (the same products, scaled after the fp32 sum instead of in it).
    plan = MakePlan(mode, M, N, K, nullptr, nullptr, /*with_scales=*/false);
    if (plan.ok()) plan->scales_in_epilogue = true;
  }
  if (!plan.ok()) return plan.status();
  return &(plans_[key] = *plan);
}

absl::Status ScaledGemm::Grow(void** buffer, size_t* capacity, size_t bytes, cudaStream_t stream) {
  if (bytes <= *capacity) return absl::OkStatus();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone)
    return absl::FailedPreconditionError(absl::StrCat(
        "scaled GEMM: activation scratch must grow to ", bytes,
        " bytes while the stream is being captured (run a larger batch uncaptured first)"));
  bytes = std::max(bytes, *capacity + *capacity / 2);
  if (*buffer) {
    cudaStreamSynchronize(stream);  // earlier GEMMs may still read it
    cudaFree(*buffer);
  }
  *buffer = nullptr;
  *capacity = 0;
  if (cudaMalloc(buffer, bytes) != cudaSuccess) {
    cudaGetLastError();
    *buffer = nullptr;
    return absl::ResourceExhaustedError(absl::StrCat("scaled GEMM: ", bytes, " bytes of scratch"));
  }
  *capacity = bytes;
  return absl::OkStatus();
}

absl::Status ScaledGemm::Run(const float* x, int rows, const MatrixRef& w, float* y,
                             cudaStream_t stream) {
  const auto it = weights_.find(w.data);
  if (it == weights_.end())
    return absl::FailedPreconditionError(
        absl::StrCat(KindName(kind_), ": weight ", Shape(w), " was not prepared"));
  if (rows <= 0) return absl::OkStatus();
  const Weight& weight = it->second;
  const int N = static_cast<int>(w.rows), K = static_cast<int>(w.cols);
  if (weight.mode == Mode::kFp8Blocks && rows < kMinBlockRows) {
    // cuBLASLt has no 128-block FP8 algorithm for fewer than 4 rows on sm_90 (decode at batch
    // 1-3): pad x to 4 rows with copies of its last row, run, keep the real rows.
    if (LaunchRecording())
      RecordFallback(absl::StrCat(KindName(kind_), ": fp8_block128 weight ", Shape(w), " at ", rows,
                                  " rows: x padded to ", kMinBlockRows,
                                  " rows (no 128-block FP8 algorithm for fewer)"));
    const size_t x_bytes = sizeof(float) * kMinBlockRows * K,
                 y_bytes = sizeof(float) * kMinBlockRows * N;
    RETURN_IF_ERROR(Grow(&pad_x_, &pad_x_bytes_, x_bytes, stream));
    RETURN_IF_ERROR(Grow(&pad_y_, &pad_y_bytes_, y_bytes, stream));
    float* px = static_cast<float*>(pad_x_);
    cudaMemcpyAsync(px, x, sizeof(float) * rows * K, cudaMemcpyDeviceToDevice, stream);
    for (int r = rows; r < kMinBlockRows; ++r)
      cudaMemcpyAsync(px + static_cast<int64_t>(r) * K, x + static_cast<int64_t>(rows - 1) * K,
                      sizeof(float) * K, cudaMemcpyDeviceToDevice, stream);
    float* py = static_cast<float*>(pad_y_);
    RETURN_IF_ERROR(Run(px, kMinBlockRows, w, py, stream));
    cudaMemcpyAsync(y, py, sizeof(float) * rows * N, cudaMemcpyDeviceToDevice, stream);
    return absl::OkStatus();
  }
  const bool fp4 = weight.mode == Mode::kNvfp4 || weight.mode == Mode::kMxfp4;
  size_t scale_bytes = 0;
  switch (weight.mode) {
    case Mode::kFp8Rows:
      scale_bytes = sizeof(float) * rows;
      break;
    case Mode::kFp8Blocks:
      scale_bytes = sizeof(float) * rows * CeilDiv64(K, kFp8ActivationGroup);
      break;
    case Mode::kNvfp4:
      scale_bytes = TiledScaleCount(rows, K / kNvfp4GroupSize);
      break;
    case Mode::kMxfp4:
      scale_bytes = TiledScaleCount(rows, K / kMxfp4GroupSize);
      break;
  }
  const size_t code_bytes = static_cast<size_t>(rows) * (fp4 ? K / 2 : K);
  RETURN_IF_ERROR(Grow(&codes_, &codes_bytes_, code_bytes, stream));
  RETURN_IF_ERROR(Grow(&scales_, &scales_bytes_, scale_bytes, stream));

  uint8_t* codes = static_cast<uint8_t*>(codes_);
  float* slot = reinterpret_cast<float*>(slots_ + 1);  // nvfp4: x's global scale
  const void* x_scales = scales_;
  switch (weight.mode) {
    case Mode::kFp8Rows:
      QuantizeFp8RowGroups(x, rows, K, K, codes, static_cast<float*>(scales_), stream);
      break;
    case Mode::kFp8Blocks:
      QuantizeFp8RowGroups(x, rows, K, kFp8ActivationGroup, codes, static_cast<float*>(scales_),
                           stream);
      break;
    case Mode::kNvfp4:
      QuantizeNvfp4(x, rows, K, codes, static_cast<uint8_t*>(scales_), slot, slots_, stream);
      break;
    case Mode::kMxfp4:
      QuantizeMxfp4(x, rows, K, codes, static_cast<uint8_t*>(scales_), stream);
      break;
  }
  RETURN_IF_ERROR(CudaStatus(
      cudaGetLastError(),
      absl::StrCat(KindName(kind_), ": quantizing activations for weight ", Shape(w)).c_str()));
  ASSIGN_OR_RETURN(auto plan, GetPlan(weight.mode, rows, N, K, weight.scales, x_scales));
  if (!plan->scales_in_epilogue) {  // the pointers differ per weight and per scratch growth
    RETURN_IF_ERROR(CublasStatus(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                       &weight.scales, sizeof weight.scales),
        "cuBLASLt: A_SCALE_POINTER"));
    RETURN_IF_ERROR(CublasStatus(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scales,
                                       sizeof x_scales),
        "cuBLASLt: B_SCALE_POINTER"));
  }
  const float alpha = 1.f, beta = 0.f;
  if (LaunchRecording()) {  // the launch log (core/launch_log.h): one per matmul call
    static const char* const kNames[] = {"cublasLt:fp8 gemm (row scales)",
                                         "cublasLt:fp8 gemm (128-block scales)",
                                         "cublasLt:nvfp4 gemm", "cublasLt:mxfp4 gemm"};
    if (plan->scales_in_epilogue) {
      RecordLaunch("cublasLt:fp8 gemm (unscaled)");
      RecordFallback(absl::StrCat(KindName(kind_), ": weight ", Shape(w), " at ", rows,
                                  " rows: no outer-vector-scaled FP8 algorithm; an unscaled FP8 "
                                  "GEMM, the scales applied by ScaleOutput"));
    } else {
      RecordLaunch(kNames[static_cast<int>(weight.mode)]);
    }
  }
  if (auto s = CublasStatus(
          cublasLtMatmul(handle_, plan->desc, &alpha, w.data, plan->a, codes, plan->b, &beta, y,
                         plan->c, y, plan->c, &plan->algo, workspace_, workspace_bytes_, stream),
          fp4 ? "cublasLtMatmul (FP4)" : "cublasLtMatmul (FP8)");
      !s.ok())
    return absl::InternalError(
        absl::StrCat(s.message(), " (weight ", Shape(w), ", ", rows, " rows)"));
  if (plan->scales_in_epilogue)
    ScaleOutput(y, rows, N, static_cast<const float*>(scales_),
                static_cast<const float*>(weight.scales), nullptr, 1.f, stream);
  if (weight.mode == Mode::kNvfp4)
    ScaleOutput(y, rows, N, nullptr, nullptr, slot, weight.global, stream);
  return absl::OkStatus();
}

}  // namespace infersweep::cuda
