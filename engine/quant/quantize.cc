#include "engine/quant/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "core/quant/codecs.h"

namespace infersweep {
namespace {

constexpr float kE4M3Max = 448.0f;
constexpr float kE2M1Max = 6.0f;

// amax / max_code, or 1 for an all-zero range (any scale encodes zeros exactly).
float AmaxScale(float amax, float max_code) { return amax > 0 ? amax / max_code : 1.0f; }

template <typename T>
void AppendBytes(std::vector<uint8_t>& out, const T& value) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

// amax over rows [r0, r1) x cols [k0, k1) of a row-major fp32 matrix of finite values. Eight
// running maxima, not one: one would be a chain of dependent max instructions, a few cycles a
// weight; the max of non-negative finite values is the same in any order.
float Amax(const std::vector<float>& w, int64_t cols, int64_t r0, int64_t r1, int64_t k0,
           int64_t k1) {
  constexpr int kLanes = 8;
  float lane[kLanes] = {};
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = w.data() + r * cols;
    int64_t k = k0;
    for (; k + kLanes <= k1; k += kLanes)
      for (int j = 0; j < kLanes; ++j) lane[j] = std::max(lane[j], std::fabs(row[k + j]));
    for (; k < k1; ++k) lane[0] = std::max(lane[0], std::fabs(row[k]));
  }
  float amax = 0;
  for (float m : lane) amax = std::max(amax, m);
  return amax;
}

// E4M3 codes of w / scale(r, k) with one fp32 scale per element's tensor, row or block. The
// scale is looked up once per run of elements that share it (a row's 128-wide block at most).
std::vector<uint8_t> Fp8Codes(const std::vector<float>& w, int64_t rows, int64_t cols,
                              QuantFormat format, const std::vector<float>& scales) {
  std::vector<uint8_t> codes(w.size());
  const int64_t run = format == QuantFormat::kFp8Block128 ? kFp8BlockSize : cols;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k0 = 0; k0 < cols; k0 += run) {
      const float scale = scales[QuantScaleIndex(format, cols, r, k0)];
      const int64_t k1 = std::min(cols, k0 + run);
      for (int64_t k = k0; k < k1; ++k) codes[r * cols + k] = FloatToE4M3(w[r * cols + k] / scale);
    }
  return codes;
}

// Packs E2M1 codes of w[r, k] / group_scale(r, k), two per byte, low nibble = even k. Groups
// (16 or 32) are even, so a byte's two elements share a scale. A group's codes are formed in one
// fixed-length loop, then paired, so the compiler can run the divisions and the encoder's
// comparisons several weights at a time.
template <int kGroup>
void PackE2M1Groups(const std::vector<float>& w, int64_t rows, int64_t cols, QuantFormat format,
                    const std::vector<float>& group_scales, uint8_t* packed) {
  uint8_t codes[kGroup];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k0 = 0; k0 < cols; k0 += kGroup) {
      const float scale = group_scales[QuantScaleIndex(format, cols, r, k0)];
      const float* in = w.data() + r * cols + k0;
      uint8_t* out = packed + (r * cols + k0) / 2;
      if (!(scale > 0)) {
        std::fill(out, out + kGroup / 2, uint8_t{0});
        continue;
      }
      for (int k = 0; k < kGroup; ++k) codes[k] = FloatToE2M1(in[k] / scale);
      for (int k = 0; k < kGroup / 2; ++k)
        out[k] = static_cast<uint8_t>(codes[2 * k] | (codes[2 * k + 1] << 4));
    }
}

std::vector<uint8_t> PackE2M1(const std::vector<float>& w, int64_t rows, int64_t cols,
                              QuantFormat format, const std::vector<float>& group_scales) {
  std::vector<uint8_t> packed(static_cast<size_t>(rows * cols / 2));
  if (format == QuantFormat::kNvfp4)
    PackE2M1Groups<kNvfp4GroupSize>(w, rows, cols, format, group_scales, packed.data());
  else
    PackE2M1Groups<kMxfp4GroupSize>(w, rows, cols, format, group_scales, packed.data());
  return packed;
}

}  // namespace

MatrixRef QuantizedMatrix::View() const {
  MatrixRef ref;
  ref.data = parts[0].data();
  ref.dtype = layout[0].dtypes.front();
  ref.rows = rows;
  ref.cols = cols;
  ref.quant.format = format;
  for (size_t i = 1; i < parts.size(); ++i) {
    switch (layout[i].part) {
      case QuantPart::kScale:
        ref.quant.scale = parts[i].data();
        ref.quant.scale_dtype = layout[i].dtypes.front();
        break;
      case QuantPart::kGlobalScale:
        ref.quant.global_scale = parts[i].data();
        break;
      case QuantPart::kInputScale:
        ref.quant.input_scale = parts[i].data();
        break;
      case QuantPart::kData:
        break;
    }
  }
  return ref;
}

absl::StatusOr<QuantizedMatrix> QuantizeMatrix(QuantFormat format, const MatrixRef& dense,
                                               std::vector<float>* scratch) {
  if (dense.quantized())
    return absl::InvalidArgumentError("QuantizeMatrix: the matrix is already quantized");
  if (dense.dtype != DType::kBF16 && dense.dtype != DType::kF16 && dense.dtype != DType::kF32)
    return absl::InvalidArgumentError(absl::StrCat(
        "QuantizeMatrix: dense dtype ", DTypeName(dense.dtype).data(), " (bf16, f16 or f32 only)"));
  ASSIGN_OR_RETURN(auto layout, QuantLayout(format, dense.rows, dense.cols));
  const int64_t rows = dense.rows, cols = dense.cols;
  std::vector<float> own;
  std::vector<float>& w = scratch ? *scratch : own;
  w.resize(static_cast<size_t>(rows * cols));  // every element is written below
  const int64_t n = rows * cols;
  switch (dense.dtype) {  // one loop per dtype: no per-element dispatch
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i)
        w[i] = Bf16ToFloat(static_cast<const uint16_t*>(dense.data)[i]);
      break;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i)
        w[i] = F16ToFloat(static_cast<const uint16_t*>(dense.data)[i]);
      break;
    default:
      std::memcpy(w.data(), dense.data, static_cast<size_t>(n) * sizeof(float));
  }
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) finite &= std::isfinite(w[i]);
  if (!finite)
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(w[i]))
        return absl::InvalidArgumentError(absl::StrCat("cannot quantize a non-finite weight at [",
                                                       i / cols, ", ", i % cols, "]"));

  QuantizedMatrix q;
  q.format = format;
  q.rows = rows;
  q.cols = cols;
  for (const QuantPartLayout& part : layout)
    if (!part.optional) q.layout.push_back(part);

  const int64_t scale_count = QuantScaleCount(format, rows, cols);
  std::vector<float> scales(static_cast<size_t>(scale_count));  // fp32 value each group uses
  std::vector<uint8_t> scale_bytes;
  switch (format) {
    case QuantFormat::kFp8Tensor:
      scales[0] = AmaxScale(Amax(w, cols, 0, rows, 0, cols), kE4M3Max);
      break;
    case QuantFormat::kFp8Channel:
      for (int64_t r = 0; r < rows; ++r)
        scales[r] = AmaxScale(Amax(w, cols, r, r + 1, 0, cols), kE4M3Max);
      break;
    case QuantFormat::kFp8Block128:
      for (int64_t r0 = 0; r0 < rows; r0 += kFp8BlockSize)
        for (int64_t k0 = 0; k0 < cols; k0 += kFp8BlockSize)
          scales[QuantScaleIndex(format, cols, r0, k0)] =
              AmaxScale(Amax(w, cols, r0, std::min(rows, r0 + kFp8BlockSize), k0,
                             std::min(cols, k0 + kFp8BlockSize)),
                        kE4M3Max);
      break;
    case QuantFormat::kNvfp4: {
      const float scale_2 = AmaxScale(Amax(w, cols, 0, rows, 0, cols), kE2M1Max * kE4M3Max);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k0 = 0; k0 < cols; k0 += kNvfp4GroupSize) {
          const float amax = Amax(w, cols, r, r + 1, k0, k0 + kNvfp4GroupSize);
          const uint8_t code = FloatToE4M3(amax / kE2M1Max / scale_2);
          scale_bytes.push_back(code);
          // The same product the dequantizer forms: (e2m1 * s16) * s2 = e2m1 * (s16 * s2) up to
          // one rounding, so codes are chosen against the group's effective scale.
          scales[QuantScaleIndex(format, cols, r, k0)] = E4M3ToFloat(code) * scale_2;
        }
      q.parts.push_back(PackE2M1(w, rows, cols, format, scales));
      q.parts.push_back(std::move(scale_bytes));
      q.parts.emplace_back();
      AppendBytes(q.parts.back(), scale_2);
      return q;
    }
    case QuantFormat::kMxfp4: {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k0 = 0; k0 < cols; k0 += kMxfp4GroupSize) {
          const int e = MxScaleExponent(Amax(w, cols, r, r + 1, k0, k0 + kMxfp4GroupSize));
          scale_bytes.push_back(static_cast<uint8_t>(e + 127));
          scales[QuantScaleIndex(format, cols, r, k0)] = std::ldexp(1.0f, e);
        }
      q.parts.push_back(PackE2M1(w, rows, cols, format, scales));
      q.parts.push_back(std::move(scale_bytes));
      return q;
    }
    case QuantFormat::kNone:
      return absl::InvalidArgumentError("QuantizeMatrix: format none");
  }
  // The fp8 layouts: E4M3 codes, then the fp32 scales.
  q.parts.push_back(Fp8Codes(w, rows, cols, format, scales));
  q.parts.emplace_back();
  for (float s : scales) AppendBytes(q.parts.back(), s);
  return q;
}

}  // namespace infersweep
