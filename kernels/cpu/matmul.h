// y[r, n] = sum_k x[r, k] * W[n, k] (+ bias[n]) in fp32, with W upcast exactly from its dtype
// (quantized W dequantized exactly: core/quant/dequantize.h).
#pragma once

#include <cstdint>

#include "core/tensor_ref.h"

namespace infersweep::cpu {

enum class MatmulVariant {
  kNaive,    // one dot product per output, weights decoded per row: the reference
  kBlocked,  // decodes a block of weight rows once and reuses it across a block of inputs
};

// x: [rows, w.cols] fp32; y: [rows, w.rows] fp32 (overwritten); bias: [w.rows] or empty.
void Matmul(MatmulVariant variant, const float* x, int64_t rows, const MatrixRef& w,
            const MatrixRef& bias, float* y);

// Decodes row `r` of `w` into `out` (w.cols floats), dense or quantized.
void DecodeRow(const MatrixRef& w, int64_t r, float* out);

}  // namespace infersweep::cpu
