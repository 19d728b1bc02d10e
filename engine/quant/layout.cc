#include "engine/quant/layout.h"
#include "api/status_macros.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace infersweep {
namespace {

// fp8 scales are fp32 in ModelOpt and DeepSeek-style checkpoints, bf16 in some others.
const std::vector<DType> kFloatScale = {DType::kF32, DType::kBF16, DType::kF16};

}  // namespace

double QuantBytesPerElement(QuantFormat format, int64_t rows, int64_t cols) {
  const double elements = static_cast<double>(rows) * cols;
  switch (format) {
    case QuantFormat::kNone:
      return 2;
    case QuantFormat::kFp8Tensor:
    case QuantFormat::kFp8Channel:
    case QuantFormat::kFp8Block128:
      return 1 + 4.0 * QuantScaleCount(format, rows, cols) / elements;
    case QuantFormat::kNvfp4:
      return 0.5 + 1.0 / kNvfp4GroupSize + 4 / elements;
    case QuantFormat::kMxfp4:
      return 0.5 + 1.0 / kMxfp4GroupSize;
  }
  return 2;
}

absl::StatusOr<std::vector<QuantPartLayout>> QuantLayout(QuantFormat format, int64_t rows,
                                                         int64_t cols) {
  const auto need_groups = [&](int64_t group) -> absl::Status {
    if (cols % group == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(QuantFormatName(format),
                                                   " needs the input width K to be a multiple of ",
                                                   group, "; K=", cols));
  };
  const std::vector<DType> fp8 = {DType::kF8E4M3};
  const QuantPartLayout fp8_data = {QuantPart::kData,       ".weight", {rows, cols}, fp8, false,
                                    "for E4M3 codes [N, K]"};
  const QuantPartLayout activation = {
      QuantPart::kInputScale, ".input_scale", {},
      {DType::kF32},          true,           "for one fp32 activation scale"};
  switch (format) {
    case QuantFormat::kNone:
      return absl::InvalidArgumentError("QuantLayout: format none has no quantized layout");
    case QuantFormat::kFp8Tensor:
      return std::vector<QuantPartLayout>{
          fp8_data,
          {QuantPart::kScale, ".weight_scale", {}, kFloatScale, false, "for one scale per tensor"},
          activation};
    case QuantFormat::kFp8Channel:
      return std::vector<QuantPartLayout>{fp8_data,
                                          {QuantPart::kScale,
                                           ".weight_scale",
                                           {rows},
                                           kFloatScale,
                                           false,
                                           absl::StrCat("for one scale per output row, N=", rows)},
                                          activation};
    case QuantFormat::kFp8Block128: {
      const int64_t block_rows = CeilDiv64(rows, kFp8BlockSize);
      const int64_t block_cols = CeilDiv64(cols, kFp8BlockSize);
      return std::vector<QuantPartLayout>{
          fp8_data,
          {QuantPart::kScale,
           ".weight_scale_inv",
           {block_rows, block_cols},
           kFloatScale,
           false,
           absl::StrCat("for one scale per 128x128 block of [N, K] = [", rows, ", ", cols, "]")}};
    }
    case QuantFormat::kNvfp4: {
      RETURN_IF_ERROR(need_groups(kNvfp4GroupSize));
      return std::vector<QuantPartLayout>{
          {QuantPart::kData,
           ".weight",
           {rows, cols / 2},
           {DType::kU8},
           false,
           absl::StrCat("for two E2M1 codes per byte over K=", cols)},
          {QuantPart::kScale,
           ".weight_scale",
           {rows, cols / kNvfp4GroupSize},
           {DType::kF8E4M3},
           false,
           absl::StrCat("for group 16 over K=", cols)},
          {QuantPart::kGlobalScale,
           ".weight_scale_2",
           {},
           {DType::kF32},
           false,
           "for one fp32 scale per tensor"},
          activation};
    }
    case QuantFormat::kMxfp4: {
      RETURN_IF_ERROR(need_groups(kMxfp4GroupSize));
      const int64_t blocks = cols / kMxfp4GroupSize;
      return std::vector<QuantPartLayout>{
          {QuantPart::kData,
           ".weight_blocks",
           {rows, blocks, 16},
           {DType::kU8},
           false,
           absl::StrCat("for 16 bytes of E2M1 pairs per block of 32 over K=", cols)},
          {QuantPart::kScale,
           ".weight_scales",
           {rows, blocks},
           {DType::kU8, DType::kF8E8M0},
           false,
           absl::StrCat("for group 32 over K=", cols)}};
    }
  }
  return absl::InternalError("QuantLayout: unknown format");
}

}  // namespace infersweep
