// Quantized weight formats and the view of a quantized matrix's scales (docs/QUANTIZATION.md).
// Header-only and free of Abseil, so CUDA sources include it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/dtype.h"

namespace infersweep {

// How a linear layer's weight [N, K] is stored. Every format dequantizes exactly to fp32
// (core/quant/dequantize.h); the element codes and scale layouts are:
enum class QuantFormat : uint8_t {
  kNone,         // dense bf16 / f16 / f32
  kFp8Tensor,    // E4M3 [N, K] x one scale for the tensor
  kFp8Channel,   // E4M3 [N, K] x one scale per output row [N]
  kFp8Block128,  // E4M3 [N, K] x one scale per 128x128 block [ceil(N/128), ceil(K/128)]
  kNvfp4,        // E2M1 pairs [N, K/2] x E4M3 scale per 16 along K [N, K/16] x fp32 scale_2
  kMxfp4,        // E2M1 pairs [N, K/32, 16] x E8M0 scale per 32 along K [N, K/32]
};

// "none", "fp8_tensor", "fp8_channel", "fp8_block128", "nvfp4", "mxfp4".
inline std::string QuantFormatName(QuantFormat format) {
  switch (format) {
    case QuantFormat::kNone:
      return "none";
    case QuantFormat::kFp8Tensor:
      return "fp8_tensor";
    case QuantFormat::kFp8Channel:
      return "fp8_channel";
    case QuantFormat::kFp8Block128:
      return "fp8_block128";
    case QuantFormat::kNvfp4:
      return "nvfp4";
    case QuantFormat::kMxfp4:
      return "mxfp4";
  }
  return "?";
}

// The E2M1 formats: two codes a byte, a scale per 16 (NVFP4) or 32 (MXFP4) along K.
constexpr bool IsFp4(QuantFormat f) { return f == QuantFormat::kNvfp4 || f == QuantFormat::kMxfp4; }

inline constexpr QuantFormat kQuantFormats[] = {
    QuantFormat::kNone,        QuantFormat::kFp8Tensor, QuantFormat::kFp8Channel,
    QuantFormat::kFp8Block128, QuantFormat::kNvfp4,     QuantFormat::kMxfp4};

// QuantFormatName read back.
inline std::optional<QuantFormat> QuantFormatFromName(std::string_view name) {
  for (QuantFormat f : kQuantFormats)
    if (QuantFormatName(f) == name) return f;
  return std::nullopt;
}

// The formats --quantize takes, for messages: "fp8_tensor, fp8_channel, ...".
inline std::string QuantFormatNames() {
  std::string names;
  for (QuantFormat f : kQuantFormats) {
    if (f == QuantFormat::kNone) continue;
    if (!names.empty()) names += ", ";
    names += QuantFormatName(f);
  }
  return names;
}

// The weight format preflight judges by (PreflightTarget::weight_format): "fp8" for the three FP8
// layouts, "nvfp4", "mxfp4"; empty for kNone.
inline std::string QuantFormatFamily(QuantFormat format) {
  switch (format) {
    case QuantFormat::kNone:
      return "";
    case QuantFormat::kFp8Tensor:
    case QuantFormat::kFp8Channel:
    case QuantFormat::kFp8Block128:
      return "fp8";
    default:
      return QuantFormatName(format);
  }
}

inline constexpr int64_t kNvfp4GroupSize = 16;
inline constexpr int64_t kMxfp4GroupSize = 32;
inline constexpr int64_t kFp8BlockSize = 128;

// Which stored tensor of a quantized linear a tensor spec is.
enum class QuantPart : uint8_t {
  kData,         // the element codes (fp8 bytes or packed E2M1 pairs)
  kScale,        // the per-tensor / per-row / per-block / per-group scales
  kGlobalScale,  // nvfp4 weight_scale_2: fp32 scalar multiplying every group scale
  kInputScale,   // static activation scale: validated and kept for W8A8/W4A4 kernels;
                 // the reference ignores it (activations stay fp32)
};

// The scales of a quantized matrix, as pointers only: a device copy binds the same way, and
// nothing here is read on the host until an element is dequantized.
struct QuantRef {
  QuantFormat format = QuantFormat::kNone;
  const void* scale = nullptr;  // layout by format (above); dtype below
  DType scale_dtype = DType::kF32;
  const void* global_scale = nullptr;  // nvfp4 only: one fp32
  const void* input_scale = nullptr;   // optional: one fp32
};

INFERSWEEP_HD int64_t CeilDiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Index into the scale tensor of the scale that element (r, k) of a [rows, cols] matrix uses.
INFERSWEEP_HD int64_t QuantScaleIndex(QuantFormat format, int64_t cols, int64_t r, int64_t k) {
  switch (format) {
    case QuantFormat::kFp8Channel:
      return r;
    case QuantFormat::kFp8Block128:
      return (r / kFp8BlockSize) * CeilDiv64(cols, kFp8BlockSize) + k / kFp8BlockSize;
    case QuantFormat::kNvfp4:
      return r * (cols / kNvfp4GroupSize) + k / kNvfp4GroupSize;
    case QuantFormat::kMxfp4:
      return r * (cols / kMxfp4GroupSize) + k / kMxfp4GroupSize;
    default:  // kFp8Tensor: one scale
      return 0;
  }
}

// Elements of the scale tensor of a [rows, cols] matrix.
INFERSWEEP_HD int64_t QuantScaleCount(QuantFormat format, int64_t rows, int64_t cols) {
  switch (format) {
    case QuantFormat::kNone:
      return 0;
    case QuantFormat::kFp8Tensor:
      return 1;
    case QuantFormat::kFp8Channel:
      return rows;
    case QuantFormat::kFp8Block128:
      return CeilDiv64(rows, kFp8BlockSize) * CeilDiv64(cols, kFp8BlockSize);
    case QuantFormat::kNvfp4:
      return rows * (cols / kNvfp4GroupSize);
    case QuantFormat::kMxfp4:
      return rows * (cols / kMxfp4GroupSize);
  }
  return 0;
}

}  // namespace infersweep
