// Non-owning views of weight matrices, shared by the engine and the kernels of every device.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/quant/format.h"

namespace infersweep {

// A row-major [rows, cols] matrix (an HF linear weight is [out, in]); a vector has rows == 1.
// A quantized matrix keeps its logical shape here: `data` holds the element codes (dtype kF8E4M3
// or kU8 packed E2M1 pairs) and `quant` points at the scales.
struct MatrixRef {
  const void* data = nullptr;
  DType dtype = DType::kBF16;
  int64_t rows = 0;
  int64_t cols = 0;
  QuantRef quant;

  bool empty() const { return data == nullptr; }
  bool quantized() const { return quant.format != QuantFormat::kNone; }
  int64_t numel() const { return rows * cols; }
};

// Upcasts one element exactly to fp32.
INFERSWEEP_HD float LoadAsFloat(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

}  // namespace infersweep
