// The one table of what a quantized linear stores on disk:
// which tensors, their names, shapes and dtypes (docs/QUANTIZATION.md). The tensor table
// (engine/tensor_spec.h), the checkpoint loader and the quantizer all read it from here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/quant/format.h"

namespace infersweep {

// Bytes per weight element including scales, for the roofline (e.g. nvfp4: 0.5 + 1/16).
double QuantBytesPerElement(QuantFormat format, int64_t rows, int64_t cols);

// One stored tensor of a quantized linear `<module>.weight` of logical shape [rows, cols].
struct QuantPartLayout {
  QuantPart part = QuantPart::kData;
  std::string suffix;          // replaces ".weight": ".weight", ".weight_scale", ...
  std::vector<int64_t> shape;  // as written; scale shapes also accepted with size-1 dims
  std::vector<DType> dtypes;   // accepted on load; the first is what the quantizer writes
  bool optional = false;       // may be absent (activation scales)
  std::string rule;            // "for group 16 over K=64": how the shape follows, for messages
};

// The stored tensors of one quantized linear, data first. InvalidArgument when `cols` does not
// divide into the format's groups (nvfp4: 16, mxfp4: 32).
absl::StatusOr<std::vector<QuantPartLayout>> QuantLayout(QuantFormat format, int64_t rows,
                                                         int64_t cols);

}  // namespace infersweep
