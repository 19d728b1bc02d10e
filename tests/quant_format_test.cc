// The quantized formats' core: exhaustive codec tables, encoder rounding against a brute-force
// search, the on-disk byte layouts (nibble order, scale indexing), quantize -> dequantize error
// bounds, and the parsing of checkpoints' quantization declarations.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/quant/codecs.h"
#include "core/quant/dequantize.h"
#include "engine/quant/layout.h"
#include "engine/quant/quantize.h"
#include "engine/quant/scheme.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;

constexpr QuantFormat kAllFormats[] = {QuantFormat::kFp8Tensor, QuantFormat::kFp8Channel,
                                       QuantFormat::kFp8Block128, QuantFormat::kNvfp4,
                                       QuantFormat::kMxfp4};

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// ---- decoders, every code, against the definitions evaluated in double with ldexp

TEST(QuantCodecs, E2M1AllSixteenCodes) {
  const double magnitudes[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int code = 0; code < 16; ++code) {
    const double want = (code & 8 ? -1 : 1) * magnitudes[code & 7];
    EXPECT_EQ(E2M1ToFloat(static_cast<uint8_t>(code)), want) << code;
    EXPECT_EQ(std::signbit(E2M1ToFloat(static_cast<uint8_t>(code))), (code & 8) != 0) << code;
  }
  // Only the low nibble counts.
  EXPECT_EQ(E2M1ToFloat(0xf7), 6.0f);
}

// The CUDA kernels' two-at-a-time decode (fp16 bit patterns, 2^-14 of each value): every pair of
// codes, in every nibble position of a word, against the scalar decoder.
TEST(QuantCodecs, E2M1PairsToF16x2MatchTheScalarDecoder) {
  for (uint32_t lo = 0; lo < 16; ++lo)
    for (uint32_t hi = 0; hi < 16; ++hi)
      for (int s = 0; s < 4; ++s) {
        // Codes lo and hi in nibbles s and s + 4 of a word whose other nibbles are all ones.
        uint32_t word = 0xffffffffu;
        word &= ~(0xfu << (4 * s)) & ~(0xfu << (4 * (s + 4)));
        word |= (lo << (4 * s)) | (hi << (4 * (s + 4)));
        const uint32_t bits = E2M1PairToF16x2Bits(word >> (4 * s));
        const float got_lo = F16ToFloat(static_cast<uint16_t>(bits & 0xffffu)) * kE2M1F16Scale;
        const float got_hi = F16ToFloat(static_cast<uint16_t>(bits >> 16)) * kE2M1F16Scale;
        ASSERT_TRUE(SameBits(got_lo, E2M1ToFloat(static_cast<uint8_t>(lo))))
            << "lo " << lo << " hi " << hi << " nibble " << s;
        ASSERT_TRUE(SameBits(got_hi, E2M1ToFloat(static_cast<uint8_t>(hi))))
            << "lo " << lo << " hi " << hi << " nibble " << s;
      }
}

TEST(QuantCodecs, E4M3All256Codes) {
  int nans = 0;
  for (int code = 0; code < 256; ++code) {
    const float got = E4M3ToFloat(static_cast<uint8_t>(code));
    const int exponent = (code >> 3) & 15, mantissa = code & 7;
    if (exponent == 15 && mantissa == 7) {
      EXPECT_TRUE(std::isnan(got)) << code;
      ++nans;
      continue;
    }
    const double magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0, -6)
                                           : std::ldexp(1 + mantissa / 8.0, exponent - 7);
    EXPECT_EQ(got, (code & 0x80 ? -1 : 1) * magnitude) << code;
    EXPECT_EQ(std::signbit(got), (code & 0x80) != 0) << code;
  }
  EXPECT_EQ(nans, 2);  // 0x7f and 0xff: e4m3fn has no Inf
  EXPECT_EQ(E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
}

TEST(QuantCodecs, E8M0All256Codes) {
  for (int code = 0; code < 255; ++code)
    EXPECT_TRUE(SameBits(E8M0ToFloat(static_cast<uint8_t>(code)),
                         static_cast<float>(std::ldexp(1.0, code - 127))))
        << code;
  EXPECT_TRUE(std::isnan(E8M0ToFloat(0xff)));
  EXPECT_EQ(E8M0ToFloat(127), 1.0f);
  EXPECT_GT(E8M0ToFloat(0), 0.0f);  // 2^-127: an fp32 subnormal, not zero
}

// ---- encoders: nearest, ties to the even code, saturating; against a brute-force search

// The code whose value is nearest to x (ties: even code), among codes [0, count) with a
// non-negative value, by exhaustive search in double.
template <typename Decode>
int BruteForceNearest(double x, int count, Decode decode) {
  int best = -1;
  double best_diff = INFINITY;
  for (int c = 0; c < count; ++c) {
    const double v = decode(static_cast<uint8_t>(c));
    if (std::isnan(v) || std::signbit(v)) continue;
    const double diff = std::fabs(std::fabs(x) - v);
    if (diff < best_diff || (diff == best_diff && c % 2 == 0)) {
      best = c;
      best_diff = diff;
    }
  }
  return best;
}

TEST(QuantCodecs, EncodersMatchBruteForceOnRandomAndTieValues) {
  std::mt19937 rng(7);
  std::vector<float> values;
  for (int i = 0; i < 20000; ++i) {
    std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
    std::uniform_int_distribution<int> exponent(-14, 10);
    values.push_back(std::ldexp(mantissa(rng), exponent(rng)) * (i % 2 ? -1.0f : 1.0f));
  }
  // Every midpoint between neighbouring codes (exact in fp32) and its two neighbours.
  for (int c = 0; c + 1 < 0x7f; ++c) {
    const float mid =
        (E4M3ToFloat(static_cast<uint8_t>(c)) + E4M3ToFloat(static_cast<uint8_t>(c + 1))) / 2;
    values.insert(values.end(), {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)});
  }
  for (int c = 0; c + 1 < 8; ++c) {
    const float mid =
        (E2M1ToFloat(static_cast<uint8_t>(c)) + E2M1ToFloat(static_cast<uint8_t>(c + 1))) / 2;
    values.insert(values.end(), {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f), -mid});
  }
  for (float x : values) {
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    const int e4m3 = std::fabs(x) > 448 ? 0x7e : BruteForceNearest(x, 0x7f, E4M3ToFloat);
    ASSERT_EQ(FloatToE4M3(x), sign | e4m3) << x;
    const int e2m1 = std::fabs(x) > 6 ? 7 : BruteForceNearest(x, 8, E2M1ToFloat);
    ASSERT_EQ(FloatToE2M1(x), (sign >> 4) | e2m1) << x;
  }
}

TEST(QuantCodecs, EncodersRoundTripEveryCodeAndSaturate) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    EXPECT_EQ(FloatToE4M3(E4M3ToFloat(static_cast<uint8_t>(code))), code) << code;
  }
  for (int code = 0; code < 16; ++code)
    EXPECT_EQ(FloatToE2M1(E2M1ToFloat(static_cast<uint8_t>(code))), code) << code;
  EXPECT_EQ(FloatToE4M3(1e30f), 0x7e);
  EXPECT_EQ(FloatToE4M3(-INFINITY), 0xfe);
  EXPECT_EQ(FloatToE4M3(464.0f), 0x7e);  // would round to 480, which e4m3fn lacks
  EXPECT_EQ(FloatToE4M3(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
  EXPECT_EQ(FloatToE4M3(1e-30f), 0x00);
  EXPECT_EQ(FloatToE2M1(100.0f), 0x7);
  EXPECT_EQ(FloatToE2M1(-100.0f), 0xf);
  EXPECT_EQ(FloatToE2M1(5.0f), 0x6);   // tie between 4 and 6: the even code, 4
  EXPECT_EQ(FloatToE2M1(0.25f), 0x0);  // tie between 0 and 0.5: 0
  EXPECT_EQ(FloatToE2M1(0.75f), 0x2);  // tie between 0.5 and 1: 1
}

// ---- byte layouts, built by hand

TEST(QuantLayouts, Nvfp4LowNibbleIsTheEvenElement) {
  // One row of 32: byte 0 = 0x21 holds element 0 = code 1 (0.5) and element 1 = code 2 (1.0).
  std::vector<uint8_t> codes(16, 0);
  codes[0] = 0x21;
  codes[15] = 0xf9;  // element 30 = code 9 (-0.5), element 31 = code 15 (-6)
  const std::vector<uint8_t> scales = {0x38, 0x40};  // e4m3 1.0 (group 0), 2.0 (group 1)
  const float scale_2 = 0.5f;
  MatrixRef w{codes.data(), DType::kU8, 1, 32};
  w.quant = {QuantFormat::kNvfp4, scales.data(), DType::kF8E4M3, &scale_2, nullptr};
  const std::vector<float> dq = DequantizeMatrix(w);
  EXPECT_EQ(dq[0], 0.5f * 1.0f * 0.5f);
  EXPECT_EQ(dq[1], 1.0f * 1.0f * 0.5f);
  EXPECT_EQ(dq[2], 0.0f);
  EXPECT_EQ(dq[30], -0.5f * 2.0f * 0.5f);
  EXPECT_EQ(dq[31], -6.0f * 2.0f * 0.5f);
}

TEST(QuantLayouts, Mxfp4BlocksAndPowerOfTwoScales) {
  // Two rows of 64 = [2, 2 blocks, 16 bytes]; scales [2, 2] E8M0.
  std::vector<uint8_t> codes(64, 0);
  codes[16] = 0x70;  // row 0, block 1, elements 32 (code 0) and 33 (code 7: 6)
  codes[32] = 0x0b;  // row 1, block 0, element 0: code 11 (-1.5)
  const std::vector<uint8_t> scales = {127, 130, 120, 127};  // 1, 8 | 2^-7, 1
  MatrixRef w{codes.data(), DType::kU8, 2, 64};
  w.quant = {QuantFormat::kMxfp4, scales.data(), DType::kU8, nullptr, nullptr};
  EXPECT_EQ(DequantizeElement(w, 0, 32), 0.0f);
  EXPECT_EQ(DequantizeElement(w, 0, 33), 48.0f);
  EXPECT_EQ(DequantizeElement(w, 1, 0), -1.5f * std::ldexp(1.0f, -7));
}

TEST(QuantLayouts, Fp8BlockScalesIndexByRowAndColumnBlock) {
  // [130, 260]: scale blocks [2, 3]; element (r, k) uses scale[(r/128)*3 + k/128].
  const int64_t rows = 130, cols = 260;
  std::vector<uint8_t> codes(rows * cols, 0x38);  // every code 1.0
  std::vector<float> scales = {1, 2, 3, 4, 5, 6};
  MatrixRef w{codes.data(), DType::kF8E4M3, rows, cols};
  w.quant = {QuantFormat::kFp8Block128, scales.data(), DType::kF32, nullptr, nullptr};
  EXPECT_EQ(DequantizeElement(w, 0, 0), 1);
  EXPECT_EQ(DequantizeElement(w, 127, 255), 2);
  EXPECT_EQ(DequantizeElement(w, 0, 259), 3);
  EXPECT_EQ(DequantizeElement(w, 128, 0), 4);
  EXPECT_EQ(DequantizeElement(w, 129, 200), 5);
  EXPECT_EQ(DequantizeElement(w, 129, 256), 6);
  // Per channel: scale per row; bf16 scales upcast exactly.
  const std::vector<uint16_t> bf16_scales = {FloatToBf16(0.5f), FloatToBf16(3.0f)};
  MatrixRef c{codes.data(), DType::kF8E4M3, 2, 4};
  c.quant = {QuantFormat::kFp8Channel, bf16_scales.data(), DType::kBF16, nullptr, nullptr};
  EXPECT_EQ(DequantizeElement(c, 0, 3), 0.5f);
  EXPECT_EQ(DequantizeElement(c, 1, 0), 3.0f);
}

TEST(QuantLayouts, ShapesDtypesAndDivisibility) {
  auto nvfp4 = QuantLayout(QuantFormat::kNvfp4, 64, 64);
  ASSERT_TRUE(nvfp4.ok());
  ASSERT_EQ(nvfp4->size(), 4u);
  EXPECT_EQ((*nvfp4)[0].shape, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ((*nvfp4)[1].suffix, ".weight_scale");
  EXPECT_EQ((*nvfp4)[1].shape, (std::vector<int64_t>{64, 4}));
  EXPECT_EQ((*nvfp4)[1].rule, "for group 16 over K=64");
  EXPECT_EQ((*nvfp4)[2].suffix, ".weight_scale_2");
  EXPECT_TRUE((*nvfp4)[3].optional);
  auto mxfp4 = QuantLayout(QuantFormat::kMxfp4, 8, 96);
  ASSERT_TRUE(mxfp4.ok());
  EXPECT_EQ((*mxfp4)[0].suffix, ".weight_blocks");
  EXPECT_EQ((*mxfp4)[0].shape, (std::vector<int64_t>{8, 3, 16}));
  EXPECT_EQ((*mxfp4)[1].shape, (std::vector<int64_t>{8, 3}));
  auto block = QuantLayout(QuantFormat::kFp8Block128, 130, 260);
  ASSERT_TRUE(block.ok());
  EXPECT_EQ((*block)[1].suffix, ".weight_scale_inv");
  EXPECT_EQ((*block)[1].shape, (std::vector<int64_t>{2, 3}));
  const auto bad = QuantLayout(QuantFormat::kMxfp4, 8, 48);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("multiple of 32; K=48"));
  for (QuantFormat f : kAllFormats) EXPECT_EQ(QuantFormatFromName(QuantFormatName(f)), f);
  EXPECT_EQ(QuantFormatFamily(QuantFormat::kFp8Block128), "fp8");
  EXPECT_FALSE(QuantFormatFromName("int4").has_value());
}

// ---- quantize -> dequantize

std::vector<float> RandomMatrix(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> w(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float row_scale = std::ldexp(1.0f, static_cast<int>(r % 7) - 3);  // rows of varied range
    for (int64_t k = 0; k < cols; ++k) w[r * cols + k] = normal(rng) * row_scale;
  }
  w[5] = 0;
  return w;
}

// The largest rounding error the format may make on x, given the fp32 scale its group uses.
double AllowedError(QuantFormat format, double x, double scale) {
  const double t = std::fabs(x) / scale;
  if (format == QuantFormat::kNvfp4 || format == QuantFormat::kMxfp4) {
    const double half_step = t <= 2 ? 0.25 : t <= 4 ? 0.5 : 1.0;
    return (half_step + std::max(0.0, t - 6)) * scale * (1 + 1e-6);  // saturation beyond 6
  }
  // E4M3: half an ulp, 2^-4 relative for normals, 2^-10 absolute below 2^-6.
  return std::max(std::fabs(x) * 0.0625, std::ldexp(scale, -10)) * (1 + 1e-6);
}

struct Shape {
  int64_t rows, cols;
};

TEST(QuantRoundTrip, ErrorsStayWithinHalfAStepOfEachGroupScale) {
  for (QuantFormat format : kAllFormats) {
    for (Shape shape : {Shape{1, 64}, Shape{37, 96}, Shape{130, 160}, Shape{200, 320}}) {
      SCOPED_TRACE(QuantFormatName(format) + " " + std::to_string(shape.rows) + "x" +
                   std::to_string(shape.cols));
      const std::vector<float> w = RandomMatrix(shape.rows, shape.cols, 11);
      const MatrixRef dense{w.data(), DType::kF32, shape.rows, shape.cols};
      auto q = QuantizeMatrix(format, dense);
      ASSERT_TRUE(q.ok()) << q.status();
      const MatrixRef view = q->View();
      ASSERT_EQ(view.rows, shape.rows);
      const std::vector<float> dq = DequantizeMatrix(view);
      double err2 = 0, ref2 = 0;
      for (int64_t r = 0; r < shape.rows; ++r)
        for (int64_t k = 0; k < shape.cols; ++k) {
          const int64_t i = r * shape.cols + k;
          // The fp32 scale this element's group uses: its dequantized value per unit code.
          double scale = 0;
          const int64_t s = QuantScaleIndex(format, shape.cols, r, k);
          if (format == QuantFormat::kNvfp4) {
            scale = E4M3ToFloat(static_cast<const uint8_t*>(view.quant.scale)[s]) *
                    *static_cast<const float*>(view.quant.global_scale);
          } else if (format == QuantFormat::kMxfp4) {
            scale = E8M0ToFloat(static_cast<const uint8_t*>(view.quant.scale)[s]);
          } else {
            scale = static_cast<const float*>(view.quant.scale)[s];
          }
          ASSERT_LE(std::fabs(dq[i] - w[i]), AllowedError(format, w[i], scale))
              << "at [" << r << ", " << k << "]: " << w[i] << " -> " << dq[i];
          err2 += (dq[i] - w[i]) * (dq[i] - w[i]);
          ref2 += w[i] * w[i];
        }
      // Gaussian weights: FP8 keeps ~2-3% relative RMS error, FP4 ~10-15%.
      const bool fp4 = format == QuantFormat::kNvfp4 || format == QuantFormat::kMxfp4;
      EXPECT_LT(std::sqrt(err2 / ref2), fp4 ? 0.2 : 0.04);
    }
  }
}

TEST(QuantRoundTrip, ScalesFollowTheAmaxRules) {
  const std::vector<float> w = RandomMatrix(4, 64, 3);
  float amax = 0;
  for (float v : w) amax = std::max(amax, std::fabs(v));
  auto nvfp4 = QuantizeMatrix(QuantFormat::kNvfp4, {w.data(), DType::kF32, 4, 64});
  ASSERT_TRUE(nvfp4.ok());
  EXPECT_EQ(*static_cast<const float*>(nvfp4->View().quant.global_scale), amax / (6 * 448.0f));
  auto tensor = QuantizeMatrix(QuantFormat::kFp8Tensor, {w.data(), DType::kF32, 4, 64});
  ASSERT_TRUE(tensor.ok());
  EXPECT_EQ(*static_cast<const float*>(tensor->View().quant.scale), amax / 448.0f);
  // mxfp4: the smallest power of two with 6 * 2^e >= the group amax, so nothing saturates.
  auto mx = QuantizeMatrix(QuantFormat::kMxfp4, {w.data(), DType::kF32, 4, 64});
  ASSERT_TRUE(mx.ok());
  const auto* scales = static_cast<const uint8_t*>(mx->View().quant.scale);
  for (int g = 0; g < 8; ++g) {
    float group_amax = 0;
    for (int k = 0; k < 32; ++k) group_amax = std::max(group_amax, std::fabs(w[g * 32 + k]));
    const double scale = E8M0ToFloat(scales[g]);
    EXPECT_GE(6 * scale, group_amax);
    EXPECT_LT(3 * scale, group_amax);
  }
}

TEST(QuantRoundTrip, RepresentableWeightsComeBackExactlyAndZerosStayZero) {
  // Every group spans the whole E2M1 grid times a scale the format represents exactly: mxfp4
  // 2^-2; nvfp4 448 (E4M3) * 2^-10 (scale_2 = amax / 2688 = 2.625 / 2688).
  const float grid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (auto [format, scale] :
       {std::pair{QuantFormat::kMxfp4, 0.25f}, std::pair{QuantFormat::kNvfp4, 448.0f / 1024}}) {
    std::vector<float> w(2 * 64);
    for (size_t i = 0; i < w.size(); ++i) w[i] = (i % 2 ? -1 : 1) * grid[i % 8] * scale;
    auto q = QuantizeMatrix(format, {w.data(), DType::kF32, 2, 64});
    ASSERT_TRUE(q.ok());
    EXPECT_EQ(DequantizeMatrix(q->View()), w) << QuantFormatName(format);
  }
  const std::vector<float> zeros(2 * 64, 0.f);
  for (QuantFormat format : kAllFormats) {
    auto q = QuantizeMatrix(format, {zeros.data(), DType::kF32, 2, 64});
    ASSERT_TRUE(q.ok());
    EXPECT_EQ(DequantizeMatrix(q->View()), zeros) << QuantFormatName(format);
  }
}

TEST(QuantRoundTrip, RejectsNonFiniteAndIndivisibleWeights) {
  std::vector<float> w(64, 1.f);
  w[9] = NAN;
  auto q = QuantizeMatrix(QuantFormat::kFp8Tensor, {w.data(), DType::kF32, 1, 64});
  ASSERT_FALSE(q.ok());
  EXPECT_THAT(q.status().message(), HasSubstr("[0, 9]"));
  w[9] = 1;
  q = QuantizeMatrix(QuantFormat::kNvfp4, {w.data(), DType::kF32, 2, 32 - 8});
  ASSERT_FALSE(q.ok());
  EXPECT_THAT(q.status().message(), HasSubstr("multiple of 16"));
}

// ---- quantization declarations

TEST(QuantScheme, ModelOptHfQuantConfigWithExclusions) {
  const auto scheme = ParseQuantScheme(R"({"model_type": "qwen3_moe"})", R"({
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16,
                     "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "*self_attn*"]}})");
  ASSERT_TRUE(scheme.ok()) << scheme.status();
  EXPECT_EQ(scheme->format, QuantFormat::kNvfp4);
  EXPECT_EQ(scheme->source, "hf_quant_config.json");
  EXPECT_TRUE(scheme->Quantizes({"model.layers.3.mlp.experts.7.up_proj"}));
  EXPECT_FALSE(scheme->Quantizes({"model.layers.3.self_attn.q_proj"}));
  EXPECT_FALSE(scheme->Quantizes({"model.layers.0.mlp.gate"}));
  EXPECT_THAT(scheme->Describe(), HasSubstr("nvfp4 (hf_quant_config.json; excluded: lm_head"));
}

TEST(QuantScheme, ConfigJsonQuantizationConfigStyles) {
  struct Case {
    const char* config;
    QuantFormat format;
    const char* quantized;
    const char* not_quantized;
  };
  const Case cases[] = {
      {R"({"quantization_config": {"quant_method": "mxfp4",
          "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}})",
       QuantFormat::kMxfp4, "model.layers.0.mlp.experts.1.down_proj",
       "model.layers.0.self_attn.o_proj"},
      {R"({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128], "modules_to_not_convert": ["mlp.gate"]}})",
       QuantFormat::kFp8Block128, "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.gate"},
      {R"({"quantization_config": {"quant_method": "fbgemm_fp8"}})", QuantFormat::kFp8Channel,
       "model.layers.0.self_attn.k_proj", ""},
      {R"({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
          "ignore": ["lm_head"]}})",
       QuantFormat::kFp8Tensor, "model.layers.1.self_attn.v_proj", "lm_head"},
      {R"({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8,
          "type": "float", "strategy": "channel", "symmetric": true}}},
          "ignore": ["lm_head", "re:.*mlp\\.gate$"]}})",
       QuantFormat::kFp8Channel, "model.layers.0.mlp.experts.0.gate_proj",
       "model.layers.0.mlp.gate"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.config);
    auto scheme = ParseQuantScheme(c.config, std::nullopt);
    ASSERT_TRUE(scheme.ok()) << scheme.status();
    EXPECT_EQ(scheme->format, c.format);
    EXPECT_TRUE(scheme->Quantizes({c.quantized}));
    if (*c.not_quantized) {
      EXPECT_FALSE(scheme->Quantizes({c.not_quantized}));
    }
  }
  auto dense = ParseQuantScheme(R"({"model_type": "llama"})", std::nullopt);
  ASSERT_TRUE(dense.ok());
  EXPECT_FALSE(dense->quantized());
}

TEST(QuantScheme, UnsupportedAndMalformedDeclarationsAreClearErrors) {
  struct Case {
    const char* config;
    const char* hf;
    absl::StatusCode code;
    const char* message;
  };
  const Case cases[] = {
      {R"({"quantization_config": {"quant_method": "gptq", "bits": 4}})", nullptr,
       absl::StatusCode::kUnimplemented, "quant_method 'gptq' is not supported"},
      {R"({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})",
       nullptr, absl::StatusCode::kUnimplemented, "weight_block_size [64,64] (only [128, 128])"},
      {"{}", R"({"quantization": {"quant_algo": "NVFP4", "group_size": 32}})",
       absl::StatusCode::kUnimplemented, "group_size 32"},
      {"{}", R"({"quantization": {"quant_algo": "W4A16_AWQ"}})", absl::StatusCode::kUnimplemented,
       "quant_algo 'W4A16_AWQ'"},
      {"{}", R"({"producer": {}})", absl::StatusCode::kInvalidArgument,
       "hf_quant_config.json: missing the \"quantization\" object"},
      {R"({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}})",
       nullptr, absl::StatusCode::kInvalidArgument, "must be a list of module names"},
      {"{}", "{not json", absl::StatusCode::kInvalidArgument,
       "hf_quant_config.json: not valid JSON"},
      {R"j({"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": ["re:(x"]}})j",
       nullptr, absl::StatusCode::kInvalidArgument,
       "\"modules_to_not_convert\"[0] 're:(x': not a valid regular expression"},
      {R"j({"quantization_config": {"quant_method": "fp8", "modules_to_not_convert":
          ["lm_head", "re:((((((((((((((((((a))))))))))))))))))"]}})j",
       nullptr, absl::StatusCode::kInvalidArgument,
       "\"modules_to_not_convert\"[1] 're:((((((((((((((((((a))))))))))))))))))': the pattern "
       "nests groups 18 deep; the limit is 16"},
  };
  for (const Case& c : cases) {
    auto scheme =
        ParseQuantScheme(c.config, c.hf ? std::optional<std::string_view>(c.hf) : std::nullopt);
    ASSERT_FALSE(scheme.ok()) << c.message;
    EXPECT_EQ(scheme.status().code(), c.code) << scheme.status();
    EXPECT_THAT(scheme.status().message(), HasSubstr(c.message));
  }
}

TEST(QuantScheme, ModulePatterns) {
  EXPECT_TRUE(ModulePatternMatches("lm_head", "lm_head"));
  EXPECT_TRUE(ModulePatternMatches("mlp.gate", "model.layers.2.mlp.gate"));
  EXPECT_FALSE(ModulePatternMatches("mlp.gate", "model.layers.2.mlp.gate_proj"));
  EXPECT_TRUE(ModulePatternMatches("model.layers.*.self_attn", "model.layers.2.self_attn.q_proj"));
  EXPECT_TRUE(ModulePatternMatches("model.layers.1", "model.layers.1.mlp.up_proj"));
  EXPECT_FALSE(ModulePatternMatches("model.layers.1", "model.layers.10.mlp.up_proj"));
  EXPECT_TRUE(
      ModulePatternMatches("re:.*experts\\.[0-3]\\.", "model.layers.0.mlp.experts.2.up_proj"));
  EXPECT_FALSE(ModulePatternMatches("re:(unclosed", "anything"));
}

}  // namespace
}  // namespace infersweep
