#include "engine/plan/linear_plan.h"

#include "absl/strings/str_cat.h"
#include "core/unreachable.h"
#include "kernels/cuda/limits.h"

namespace infersweep {

LinearPlan PlanLinear(const CudaOptions& o, const LinearWeightFacts& w, const LinearStep& s) {
  LinearPlan plan;
  const bool quantized = w.format != QuantFormat::kNone;
  if (!quantized) {
    plan.path =
        s.cublaslt && w.dtype == DType::kBF16 ? LinearPath::kCublasLt : LinearPath::kReference;
    return plan;
  }
  if (UsesScaledGemm(o.qgemm)) {
    plan.path = LinearPath::kScaledGemm;
  } else if (!KeepsQuantCodes(o.qgemm)) {
    plan.path = LinearPath::kRefused;
    plan.refusal = absl::StrCat("qgemm=", AxisValueName(o.qgemm),
                                " replaces the codes at load, but a ", QuantFormatName(w.format),
                                " weight [", w.rows, ", ", w.cols, "] reached a linear");
    return plan;
  } else if (o.qgemm == QGemm::kReference) {
    plan.path = LinearPath::kQuantReference;
  } else if (QuantizesActivationsFp8(o.qgemm) && s.wgmma &&
             (s.prefill || s.rows >= kFp8WgmmaMinRows) &&
             cuda::Fp8WgmmaShapeSupports(w.format, w.rows, w.cols) && w.codes_aligned) {
    plan.path = LinearPath::kQuantFp8Wgmma;
  } else if (QuantizesActivationsFp8(o.qgemm) && (s.prefill || s.rows >= cuda::kQuantMmaMinRows) &&
             cuda::Fp8MmaShapeSupports(w.format, w.rows, w.cols) && w.codes_aligned) {
    // Prefill chunks and decode batches of 8+ rows; fewer rows keep the GEMV (below).
    plan.path = LinearPath::kQuantFp8Mma;
  } else if (s.bf16_input && !s.prefill && s.rows <= kQuantMmaMaxRows &&
             s.rows >= (IsFp4(w.format) ? cuda::kQuantMmaMinRows : kQuantBf16CopyMinRows) &&
             cuda::QuantMmaShapeSupports(w.format, w.rows, w.cols) && w.codes_aligned) {
    // Decode batches on the codes: each weight byte read once, K split across a block's warps.
    // FP8 keeps the GEMV below 16 rows, where its cheaper decode makes the re-reads pay.
    plan.path = LinearPath::kQuantMma;
  } else if ((s.prefill || s.rows >= kQuantBf16CopyMinRows) && s.cublaslt && s.bf16_input) {
    plan.path = LinearPath::kQuantBf16Copy;
  } else if (s.bf16_input && s.rows >= cuda::kQuantMmaMinRows && IsFp4(w.format) &&
             cuda::QuantMmaShapeSupports(w.format, w.rows, w.cols) && w.codes_aligned) {
    // Without cuBLASLt, FP4 batches and chunks of every size stay on the codes.
    plan.path = LinearPath::kQuantMma;
  } else if (IsFp4(w.format)) {
    plan.path = LinearPath::kQuantGemvFp4;
    if (!cuda::W4A16ShapeSupports(w.format, w.cols) || !w.codes_aligned)
      plan.path = LinearPath::kRefused;
  } else {
    plan.path = LinearPath::kQuantGemvFp8;
    if (!cuda::QuantGemvShapeSupports(w.format, w.rows, w.cols) || !w.codes_aligned)
      plan.path = LinearPath::kRefused;
  }
  if (plan.path == LinearPath::kRefused)
    plan.refusal =
        absl::StrCat("qgemm=", AxisValueName(o.qgemm),
                     " needs K % 32 == 0 (FP4) or % 16 == 0 (FP8) (", w.rows, " x ", w.cols, ")");
  return plan;
}

std::string LinearFallback(const CudaOptions& o, const LinearPlan& plan, const LinearWeightFacts& w,
                           const LinearStep& s) {
  switch (plan.path) {
    case LinearPath::kQuantBf16Copy:
      return absl::StrCat("qgemm=", AxisValueName(o.qgemm), ": ",
                          s.prefill ? "prefill chunk" : "decode batch", " of ", s.rows,
                          " rows: quantized linears dequantized to bf16, then cuBLASLt");
    case LinearPath::kReference:
      if (!s.cublaslt) return "";
      return absl::StrCat("gemm=", AxisValueName(o.gemm), ": ", std::string(DTypeName(w.dtype)),
                          " weight [", w.rows, ", ", w.cols,
                          "]: the reference GEMM (cuBLASLt takes bf16 weights)");
    case LinearPath::kScaledGemm:
    case LinearPath::kQuantReference:
    case LinearPath::kQuantMma:
    case LinearPath::kQuantFp8Mma:
    case LinearPath::kQuantFp8Wgmma:
    case LinearPath::kQuantGemvFp4:
    case LinearPath::kQuantGemvFp8:
    case LinearPath::kCublasLt:
    case LinearPath::kRefused:
      return "";
  }
  Unreachable("LinearFallback: a path outside LinearPath");
}

}  // namespace infersweep
