#include "engine/quant/dequantize.h"

namespace infersweep {

std::vector<float> DequantizeMatrix(const MatrixRef& w) {
  std::vector<float> out(static_cast<size_t>(w.numel()));
  for (int64_t r = 0; r < w.rows; ++r) DequantizeRow(w, r, out.data() + r * w.cols);
  return out;
}

}  // namespace infersweep
