// CUDA launchers that prepare the operands of the scaled tensor-core GEMMs
// (kernels/cuda/gemm_scaled.h): activations quantized on the device before each GEMM, weight
// scales rearranged once into the layouts cuBLASLt reads, and the epilogue that applies the
// scales cuBLASLt cannot. Formulas and index math: kernels/cuda/scaled_layout.h.
//
// Plain functions, asynchronous on `stream`; callers check cudaGetLastError. x is fp32 row-major
// [rows, cols] (cols = K); codes are written row-major: E4M3 [rows, cols], or E2M1 packed two per
// byte [rows, cols / 2] with the low nibble holding the even column. Weights are MatrixRefs of
// device pointers, laid out as on disk (kernels/cuda/quant.h).
//
// Napkin math (H200, 4.46 TB/s read), Qwen3-30B-A3B's hidden 2048: the activation quantizers read
// x twice (the second pass from L2) and write a quarter (FP8) or an eighth (FP4) of its bytes.
// Decode (1 x 2048, 8 KB) is launch-bound: ~2 us a launch, 2-3 launches. Prefill of 2048 tokens
// (16.8 MB of x) takes ~4 us of DRAM time for FP8, against ~24 us for the FP8 GEMM it feeds
// ([2048, 2048] x [4096, 2048]: 34 GFLOP at 1452 TFLOP/s).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/tensor_ref.h"

namespace infersweep::cuda {

// ---- FP8 activations (qgemm=fp8_cublaslt)

// One dynamic scale for the whole of x: *scale = Fp8ActivationScale(amax(|x|)), codes =
// E4M3(x / *scale). `amax_bits` is one uint32 of scratch (zeroed here). Two launches and a memset:
// an amax reduction (atomicMax on the bits of |x|: NaN outranks Inf outranks every finite value),
// then the quantizer.
void QuantizeFp8PerTensor(const float* x, int rows, int cols, uint8_t* codes, float* scale,
                          uint32_t* amax_bits, cudaStream_t stream);

// One dynamic scale per group of `group` columns of each row (the last group may be shorter):
// group 128 gives DeepSeek-V3's 1 x 128 activation blocks (VEC128_32F), group == cols one scale per
// row, i.e. per token (OUTER_VEC_32F). The scale of group g of row m goes to
// scales[Fp8ActivationScaleIndex(rows, m, g)]. One 128-thread block per (row, group).
void QuantizeFp8RowGroups(const float* x, int rows, int cols, int group, uint8_t* codes,
                          float* scales, cudaStream_t stream);

// ---- FP4 activations (qgemm=native_fp4); scales are written straight into cuBLASLt's tiled
// layout (TiledScaleIndex), padding zeroed. cols % 32 == 0.

// NVFP4: *global_scale = Nvfp4GlobalScale(amax(|x|)), E4M3 scales per 16 columns
// (TiledScaleCount(rows, cols / 16) bytes), codes against e4m3(scale) x global. One thread per
// 16-column group.
void QuantizeNvfp4(const float* x, int rows, int cols, uint8_t* codes, uint8_t* tiled_scales,
                   float* global_scale, uint32_t* amax_bits, cudaStream_t stream);
// MXFP4: E8M0 scales per 32 columns, 2^MxScaleExponent(amax_32) (TiledScaleCount(rows, cols / 32)
// bytes). One thread per 32-column group.
void QuantizeMxfp4(const float* x, int rows, int cols, uint8_t* codes, uint8_t* tiled_scales,
                   cudaStream_t stream);

// ---- weight scales, once per linear when a model is built

enum class Fp8ScaleLayout {
  kScalar,  // [1]: fp8_tensor's scale
  kPerRow,  // [N]: the scale each output row uses (fp8_channel; fp8_tensor or fp8_block128
            // expanded, for K <= 128, where a block's scale is a per-row one)
  kBlocks,  // [ceil(N / 128), Fp8BlockScaleLd(K)]: fp8_block128 for BLK128x128_32F
};
// w's scales (fp32, bf16 or f16 as stored) as fp32 in `layout`.
void PrepareFp8WeightScales(const MatrixRef& w, Fp8ScaleLayout layout, float* out,
                            cudaStream_t stream);
// w's NVFP4 (E4M3 per 16) or MXFP4 (E8M0 per 32) scale bytes in the tiled layout,
// TiledScaleCount(N, K / group) bytes.
void TileFp4WeightScales(const MatrixRef& w, uint8_t* out, cudaStream_t stream);

// ---- epilogue
// y[m, n] *= factor x row_scale[m] x col_scale[n] x *scalar, each factor left out when its
// pointer is null. One read and one write of y: 8 bytes per output.
void ScaleOutput(float* y, int rows, int cols, const float* row_scale, const float* col_scale,
                 const float* scalar, float factor, cudaStream_t stream);

}  // namespace infersweep::cuda
