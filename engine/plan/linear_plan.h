// The dense linears' plan: for one weight at one step, which kernel computes y = x . W^T under
// the gemm and qgemm axes. One pure function decides; LinearRunner::Gemm switches on its answer
// and the launch log's fallback comes from it. Host code: built and tested without CUDA.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/quant/format.h"
#include "engine/options.h"

namespace infersweep {

// From this many decode rows, quantized dense linears under qgemm=w4a16|w8a16 run on tensor
// cores: up to kQuantMmaMaxRows on the codes (GemmQuantMma, FP4 from its 8 rows), beyond that
// (and on FP8 block-128, and on prefill chunks) from a bf16 copy of the weight.
constexpr int kQuantBf16CopyMinRows = 16;
// The most decode rows whose quantized dense linears read the codes (GemmQuantMma). Past it
// the kernel's blocks of 16 features read 4x the inputs from L2 of a 64-feature block (n / 16 x
// rows x K x 2 bytes: 64 MB for a 4096 x 2048 projection at 64 rows), and the bf16 copy's one
// write and re-read of the weight costs less.
constexpr int kQuantMmaMaxRows = 32;
// From this many decode rows (and on every prefill chunk), qgemm=w8a8's dense linears take E4M3
// wgmma on sm_90a: a 128-row tile is one pass over the weight.
constexpr int kFp8WgmmaMinRows = 64;

enum class LinearPath {
  kScaledGemm,      // qgemm=fp8_cublaslt|native_fp4|cudnn: the scaled GEMM on the codes
  kQuantReference,  // qgemm=reference: the exact dequantizing reference GEMM
  kQuantBf16Copy,   // the weight dequantized into a bf16 copy, then cuBLASLt
  kQuantMma,        // FP4 codes decoded in registers onto mma.sync (decode batches)
  kQuantFp8Mma,     // qgemm=w8a8: rows quantized to E4M3 onto E4M3 x E4M3 mma.sync
  kQuantFp8Wgmma,   // qgemm=w8a8 on sm_90a: the same rows onto E4M3 wgmma (GemmFp8Wgmma)
  kQuantGemvFp4,    // qgemm=w4a16's GEMV
  kQuantGemvFp8,    // qgemm=w8a16's GEMV
  kCublasLt,        // a bf16 weight on cuBLASLt
  kReference,       // the reference GEMM: no cuBLASLt, or a weight that is not bf16
  kRefused,         // no kernel takes this weight (LinearPlan::refusal says why)
};

// One weight as the runner finds it.
struct LinearWeightFacts {
  DType dtype = DType::kBF16;
  QuantFormat format = QuantFormat::kNone;  // kNone: dense
  int64_t rows = 0, cols = 0;
  bool codes_aligned = true;  // the codes start on a 16-byte boundary
};

// What the runner was built with, and the step.
struct LinearStep {
  bool cublaslt = false;  // the runner holds cuBLASLt (gemm=cublaslt|fused|tma)
  int rows = 0;
  bool prefill = false;
  bool bf16_input = false;  // x is also staged in bf16
  bool wgmma = false;       // the device runs the sm_90a kernels (compute capability 9.0)
};

struct LinearPlan {
  LinearPath path = LinearPath::kReference;
  std::string refusal;  // with kRefused
};

LinearPlan PlanLinear(const CudaOptions& options, const LinearWeightFacts& weight,
                      const LinearStep& step);

// The launch log's fallback line for `plan`, or "" when the plan is the configured path.
std::string LinearFallback(const CudaOptions& options, const LinearPlan& plan,
                           const LinearWeightFacts& weight, const LinearStep& step);

}  // namespace infersweep
