#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <vector>

#include "core/launch_log.h"
#include "core/quant/dequantize.h"
#include "kernels/cpu/parallel.h"

namespace infersweep::cpu {

void DecodeRow(const MatrixRef& w, int64_t r, float* out) {
  if (w.quantized()) {  // exact: the reference sees the quantized weights, not an approximation
    DequantizeRow(w, r, out);
    return;
  }
  const int64_t base = r * w.cols;
  switch (w.dtype) {
    case DType::kBF16: {
      const auto* p = static_cast<const uint16_t*>(w.data) + base;
      for (int64_t k = 0; k < w.cols; ++k) out[k] = Bf16ToFloat(p[k]);
      break;
    }
    case DType::kF16: {
      const auto* p = static_cast<const uint16_t*>(w.data) + base;
      for (int64_t k = 0; k < w.cols; ++k) out[k] = F16ToFloat(p[k]);
      break;
    }
    default: {
      const auto* p = static_cast<const float*>(w.data) + base;
      std::copy(p, p + w.cols, out);
    }
  }
}

namespace {

float Dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  for (int64_t k = 0; k < n; ++k) acc += a[k] * b[k];
  return acc;
}

float BiasAt(const MatrixRef& bias, int64_t n) {
  return bias.empty() ? 0.f : LoadAsFloat(bias.data, bias.dtype, n);
}

// Parallel over output features; each weight row is decoded once and dotted with every input.
void MatmulNaive(const float* x, int64_t rows, const MatrixRef& w, const MatrixRef& bias, float* y) {
  const int64_t out_features = w.rows, k = w.cols;
  ParallelFor(out_features, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wrow(k);
    for (int64_t n = begin; n < end; ++n) {
      DecodeRow(w, n, wrow.data());
      const float b = BiasAt(bias, n);
      for (int64_t r = 0; r < rows; ++r) y[r * out_features + n] = Dot(x + r * k, wrow.data(), k) + b;
    }
  });
}

// Decodes kRowBlock weight rows into a scratch tile, then sweeps all inputs over the tile with
// four independent accumulators (a different summation order than naive: tests hold the two to
// fp32 rounding of each other).
void MatmulBlocked(const float* x, int64_t rows, const MatrixRef& w, const MatrixRef& bias,
                   float* y) {
  constexpr int64_t kRowBlock = 8;
  const int64_t out_features = w.rows, k = w.cols;
  const int64_t blocks = (out_features + kRowBlock - 1) / kRowBlock;
  ParallelFor(blocks, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(kRowBlock * k);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRowBlock, n1 = std::min(out_features, n0 + kRowBlock);
      for (int64_t n = n0; n < n1; ++n) DecodeRow(w, n, tile.data() + (n - n0) * k);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * k;
        for (int64_t n = n0; n < n1; ++n) {
          const float* wr = tile.data() + (n - n0) * k;
          float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
          int64_t i = 0;
          for (; i + 4 <= k; i += 4) {
            a0 += xr[i] * wr[i];
            a1 += xr[i + 1] * wr[i + 1];
            a2 += xr[i + 2] * wr[i + 2];
            a3 += xr[i + 3] * wr[i + 3];
          }
          for (; i < k; ++i) a0 += xr[i] * wr[i];
          y[r * out_features + n] = (a0 + a1) + (a2 + a3) + BiasAt(bias, n);
        }
      }
    }
  });
}

}  // namespace

void Matmul(MatmulVariant variant, const float* x, int64_t rows, const MatrixRef& w,
            const MatrixRef& bias, float* y) {
  // The launch log (core/launch_log.h) names the variant that runs, recorded where it is picked.
  if (variant == MatmulVariant::kBlocked) {
    RecordLaunch("matmul_blocked");
    MatmulBlocked(x, rows, w, bias, y);
  } else {
    RecordLaunch("matmul_naive");
    MatmulNaive(x, rows, w, bias, y);
  }
}

}  // namespace infersweep::cpu
