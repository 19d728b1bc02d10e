// Host emulation of the scaled GEMMs' activation quantizers (kernels/cuda/scaled_quant.h), built
// from the formulas the device kernels use (kernels/cuda/scaled_layout.h). The CPU test holds it
// to the weight quantizer (the same recipe); the GPU test holds the device kernels to it bit for
// bit and computes its emulated GEMM reference from it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/quant/codecs.h"
#include "kernels/cuda/scaled_layout.h"

namespace infersweep {

struct HostQuantized {
  int rows = 0, cols = 0, group = 0;
  std::vector<uint8_t> codes;        // E4M3 [rows, cols], or E2M1 pairs [rows, cols / 2]
  std::vector<float> scales;         // the value of each group's scale, row-major [rows, groups]
  std::vector<uint8_t> scale_codes;  // FP4: the scale bytes, row-major [rows, groups]
  float global = 1.f;                // NVFP4's per-tensor scale

  int groups() const { return (cols + group - 1) / group; }
  // x as the GEMM sees it: code x scale (x global).
  float Value(int m, int k) const {
    const float scale = scales[static_cast<size_t>(m) * groups() + k / group];
    if (scale_codes.empty()) return E4M3ToFloat(codes[static_cast<size_t>(m) * cols + k]) * scale;
    const uint8_t pair = codes[(static_cast<size_t>(m) * cols + k) / 2];
    return E2M1ToFloat((k & 1) ? pair >> 4 : pair & 0x0f) * scale;
  }
};

inline uint32_t HostAbsBits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u & 0x7fffffffu;
}
inline float HostFromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// The largest |x| over [r0, r1) x [k0, k1), NaN first, as the device's max over bits.
inline float HostAmax(const float* x, int cols, int r0, int r1, int k0, int k1) {
  uint32_t bits = 0;
  for (int r = r0; r < r1; ++r)
    for (int k = k0; k < k1; ++k) bits = std::max(bits, HostAbsBits(x[r * cols + k]));
  return HostFromBits(bits);
}

// group 0: one scale for the tensor (QuantizeFp8PerTensor); else per `group` columns of each row
// (QuantizeFp8RowGroups).
inline HostQuantized HostQuantizeFp8(const float* x, int rows, int cols, int group) {
  HostQuantized q;
  q.rows = rows;
  q.cols = cols;
  q.group = group > 0 ? group : cols;
  q.codes.resize(static_cast<size_t>(rows) * cols);
  const float tensor_scale = cuda::Fp8ActivationScale(HostAmax(x, cols, 0, rows, 0, cols));
  for (int m = 0; m < rows; ++m)
    for (int k0 = 0; k0 < cols; k0 += q.group) {
      const int k1 = std::min(cols, k0 + q.group);
      const float scale =
          group > 0 ? cuda::Fp8ActivationScale(HostAmax(x, cols, m, m + 1, k0, k1)) : tensor_scale;
      q.scales.push_back(scale);
      for (int k = k0; k < k1; ++k) q.codes[m * cols + k] = FloatToE4M3(x[m * cols + k] / scale);
    }
  return q;
}

inline HostQuantized HostQuantizeNvfp4(const float* x, int rows, int cols) {
  HostQuantized q;
  q.rows = rows;
  q.cols = cols;
  q.group = static_cast<int>(kNvfp4GroupSize);
  q.codes.assign(static_cast<size_t>(rows) * cols / 2, 0);
  q.global = cuda::Nvfp4GlobalScale(HostAmax(x, cols, 0, rows, 0, cols));
  for (int m = 0; m < rows; ++m)
    for (int k0 = 0; k0 < cols; k0 += q.group) {
      const uint8_t code =
          cuda::Nvfp4GroupScaleCode(HostAmax(x, cols, m, m + 1, k0, k0 + q.group), q.global);
      const float scale = E4M3ToFloat(code) * q.global;
      q.scale_codes.push_back(code);
      q.scales.push_back(scale);
      for (int k = k0; k < k0 + q.group; ++k) {
        const uint8_t c = scale > 0 ? FloatToE2M1(x[m * cols + k] / scale) : 0;
        q.codes[(m * cols + k) / 2] |= static_cast<uint8_t>(c << (4 * (k & 1)));
      }
    }
  return q;
}

inline HostQuantized HostQuantizeMxfp4(const float* x, int rows, int cols) {
  HostQuantized q;
  q.rows = rows;
  q.cols = cols;
  q.group = static_cast<int>(kMxfp4GroupSize);
  q.codes.assign(static_cast<size_t>(rows) * cols / 2, 0);
  for (int m = 0; m < rows; ++m)
    for (int k0 = 0; k0 < cols; k0 += q.group) {
      const float amax = HostAmax(x, cols, m, m + 1, k0, k0 + q.group);
      const int e = MxScaleExponent(amax);
      const float scale = std::ldexp(1.0f, e);
      q.scale_codes.push_back(std::isnan(amax) ? 0xff : static_cast<uint8_t>(e + 127));
      q.scales.push_back(scale);
      for (int k = k0; k < k0 + q.group; ++k) {
        const uint8_t c = scale > 0 ? FloatToE2M1(x[m * cols + k] / scale) : 0;
        q.codes[(m * cols + k) / 2] |= static_cast<uint8_t>(c << (4 * (k & 1)));
      }
    }
  return q;
}

}  // namespace infersweep
