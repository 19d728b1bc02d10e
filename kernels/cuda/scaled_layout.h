// Index math and scalar formulas of the scaled tensor-core GEMMs (qgemm=fp8_cublaslt and
// qgemm=native_fp4, kernels/cuda/gemm_scaled.h), shared by the device kernels
// (kernels/cuda/scaled_quant.cu) and the host tests. Free of CUDA headers: CPU builds compile and
// test it.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/quant/codecs.h"
#include "core/quant/format.h"

namespace infersweep::cuda {

inline constexpr float kE4M3Largest = 448.f;
inline constexpr float kE2M1Largest = 6.f;
inline constexpr int64_t kFp8ActivationGroup = 128;  // 1 x 128: DeepSeek-V3's activation blocks

INFERSWEEP_HD int64_t RoundUp64(int64_t a, int64_t b) { return CeilDiv64(a, b) * b; }

// ---- FP8 (cuBLASLt's scale modes on sm_90)

// The dequantization scale of a group of activations whose largest magnitude is amax: amax / 448,
// so the largest lands on E4M3's largest code. An all-zero group (or one whose amax / 448
// underflows) gets 1. NaN gets 1 as well, so the NaN codes carry the NaN into the output; Inf
// gives an infinite scale, and the output turns NaN too (0 x Inf).
INFERSWEEP_HD float Fp8ActivationScale(float amax) {
  const float s = amax / kE4M3Largest;
  return s > 0 ? s : 1.f;
}

// Activation scales for VEC128_32F, and for OUTER_VEC_32F (one group per row): the scale of
// group g (columns [128 g, 128 g + 128)) of row m is at g * rows + m. "Outer-dim-major": the
// rows' scales of one K-group are contiguous, which is what PyTorch's _scaled_mm requires for its
// 1 x 128 operand of the same cuBLASLt call (stride (1, rows)).
INFERSWEEP_HD int64_t Fp8ActivationScaleIndex(int64_t rows, int64_t m, int64_t g) {
  return g * rows + m;
}

// Weight scales for BLK128x128_32F: fp32 [ceil(N / 128), ld], row-major (one row per 128 output
// features, one column per 128 of K), with ld = ceil(K / 128) rounded up to a multiple of 4 so
// that every row starts 16-byte aligned; the padding holds 0. cuBLASLt takes no leading dimension
// for scale tensors, so the stride is implied: this one is what PyTorch's _scaled_mm requires
// ("near-inner-dim-major, with 16-byte aligned strides") for the same call.
INFERSWEEP_HD int64_t Fp8BlockScaleLd(int64_t cols) {
  return RoundUp64(CeilDiv64(cols, kFp8BlockSize), 4);
}
INFERSWEEP_HD int64_t Fp8BlockScaleCount(int64_t rows, int64_t cols) {
  return CeilDiv64(rows, kFp8BlockSize) * Fp8BlockScaleLd(cols);
}

// ---- FP4 (block-scaled tensor cores, sm_100 / sm_120)

// NVFP4 activations follow the weights' recipe (engine/quant/quantize.cc): a per-tensor fp32
// global scale amax / (6 x 448), an E4M3 scale per 16 along K, E4M3(amax_16 / 6 / global), and
// codes E2M1(x / (e4m3(scale_16) x global)), 0 where that product is 0.
INFERSWEEP_HD float Nvfp4GlobalScale(float amax) {
  const float s = amax / (kE2M1Largest * kE4M3Largest);
  return s > 0 ? s : 1.f;
}
INFERSWEEP_HD uint8_t Nvfp4GroupScaleCode(float amax_group, float global) {
  return FloatToE4M3(amax_group / kE2M1Largest / global);
}

// cuBLASLt's tiled layout of 1D block scales (VEC16_UE4M3 for NVFP4, VEC32_UE8M0 for MXFP4; the
// cuBLAS documentation's "1D Block Scaling Factors Layout"). A scale matrix [outer, inner]
// (outer: N of the weight or M of the activations; inner: K / 16 or K / 32, the scales along K)
// is cut into tiles of 128 outer x 4 inner, 512 bytes each, stored one after another with the
// inner tile index running fastest: tile (to, ti) starts at (to x ceil(inner / 4) + ti) x 512.
// Inside a tile, element (r, c) is at (r % 32) x 16 + (r / 32) x 4 + c: the four 32-row quarters
// interleave, so rows r, r + 32, r + 64 and r + 96 share one 16-byte line. Outer is padded to a
// multiple of 128 and inner to a multiple of 4; the padding holds 0.
INFERSWEEP_HD int64_t TiledScaleCount(int64_t outer, int64_t inner) {
  return RoundUp64(outer, 128) * RoundUp64(inner, 4);
}
INFERSWEEP_HD int64_t TiledScaleIndex(int64_t inner, int64_t r, int64_t c) {
  const int64_t tile = (r / 128) * CeilDiv64(inner, 4) + c / 4;
  return tile * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4;
}

}  // namespace infersweep::cuda
