// Quantizing dense weights into any QuantFormat (`--quantize`): round to nearest even into
// E4M3 / E2M1, scales from the amax of each tensor, row, block or group (docs/QUANTIZATION.md).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/quant/layout.h"
#include "core/tensor_ref.h"

namespace infersweep {

// A quantized matrix that owns its bytes: the parts of QuantLayout(format, rows, cols) that are
// not optional, in layout order, each as the raw little-endian bytes of its first dtype.
struct QuantizedMatrix {
  QuantFormat format = QuantFormat::kNone;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<QuantPartLayout> layout;  // parallel to parts
  std::vector<std::vector<uint8_t>> parts;

  // The view the forward pass reads; points into `parts`.
  MatrixRef View() const;
};

// Scales:
//   fp8_tensor / fp8_channel / fp8_block128: amax / 448 of the tensor / row / 128x128 block;
//   nvfp4: scale_2 = amax_tensor / (6 * 448), group scale = E4M3(amax_group / 6 / scale_2);
//   mxfp4: the smallest power of two 2^e with 6 * 2^e >= amax_group (no element saturates).
// An all-zero tensor, row, block or group gets scale 1 (2^-127 for mxfp4). `dense` is bf16, f16
// or f32; non-finite weights are an error. `scratch` (optional) holds the fp32 copy of `dense`
// the quantizer works on: a caller quantizing many matrices on one thread passes the same one,
// so each copy reuses the last one's pages instead of faulting in fresh ones.
absl::StatusOr<QuantizedMatrix> QuantizeMatrix(QuantFormat format, const MatrixRef& dense,
                                               std::vector<float>* scratch = nullptr);

}  // namespace infersweep
