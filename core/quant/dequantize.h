// Exact dequantization: every quantized element becomes the fp32 nearest to code x scales.
//
//   fp8 (all three layouts): e4m3(code) * scale            one rounding (none for bf16 scales)
//   nvfp4:                   (e2m1(code) * e4m3(s16)) * s2  the inner product is exact (at most
//                                                           6 significant bits), so one rounding
//   mxfp4:                   e2m1(code) * 2^(e8m0 - 127)    exact
//
// One formula serves the CPU reference (kernels/cpu/matmul.cc) and the CUDA dequant kernels
// (kernels/cuda/quant.cu), so both devices see bit-identical weights.
#pragma once

#include <cstdint>
#include <vector>

#include "core/quant/codecs.h"
#include "core/tensor_ref.h"

namespace infersweep {

// Element (r, k) of a quantized matrix.
INFERSWEEP_HD float DequantizeElement(const MatrixRef& w, int64_t r, int64_t k) {
  const QuantRef& q = w.quant;
  const auto* bytes = static_cast<const uint8_t*>(w.data);
  const int64_t s = QuantScaleIndex(q.format, w.cols, r, k);
  switch (q.format) {
    case QuantFormat::kNvfp4:
    case QuantFormat::kMxfp4: {
      const uint8_t pair = bytes[r * (w.cols / 2) + k / 2];
      const float code = E2M1ToFloat((k & 1) ? pair >> 4 : pair & 0x0f);  // low nibble: even k
      const uint8_t scale = static_cast<const uint8_t*>(q.scale)[s];
      if (q.format == QuantFormat::kMxfp4) return code * E8M0ToFloat(scale);
      const float global = *static_cast<const float*>(q.global_scale);
      return (code * E4M3ToFloat(scale)) * global;
    }
    default:  // the fp8 layouts
      return E4M3ToFloat(bytes[r * w.cols + k]) * LoadAsFloat(q.scale, q.scale_dtype, s);
  }
}

// Row r of a quantized matrix into out[0, cols).
inline void DequantizeRow(const MatrixRef& w, int64_t r, float* out) {
  for (int64_t k = 0; k < w.cols; ++k) out[k] = DequantizeElement(w, r, k);
}

// The whole matrix, row-major [rows, cols] (host memory only).
inline std::vector<float> DequantizeMatrix(const MatrixRef& w) {
  std::vector<float> out(static_cast<size_t>(w.numel()));
  for (int64_t r = 0; r < w.rows; ++r) DequantizeRow(w, r, out.data() + r * w.cols);
  return out;
}

}  // namespace infersweep
