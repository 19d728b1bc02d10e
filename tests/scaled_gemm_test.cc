// The scaled tensor-core GEMMs (qgemm=fp8_cublaslt, qgemm=native_fp4) on the CPU: their registry
// rows and preflight judgements, the fp8 and fp4 verdict classes against the noise their
// activation quantization was measured to add (docs/VERDICTS.md), cuBLASLt's tiled block-scale
// layout against the documentation's description, and the activation quantizers' formulas
// against the weight quantizer they copy. The GPU side: tests/gpu_scaled_gemm_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "api/backend_config.h"
#include "engine/backends.h"
#include "engine/quant/quantize.h"
#include "harness/executor.h"
#include "harness/verdict.h"
#include "kernels/cuda/scaled_layout.h"
#include "tests/gpu_trial.h"
#include "tests/scaled_reference.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;

BackendConfig Cuda(const BackendConfig& axes) {
  BackendConfig config = axes;
  config["device"] = "cuda";
  auto normalized = NormalizeBackendConfig(config);
  EXPECT_TRUE(normalized.ok()) << normalized.status();
  return *normalized;
}

// ---- registry and preflight

TEST(ScaledGemmPreflight, Fp8CublasLtTakesFp8WeightsOnSm90AndNewer) {
  const BackendConfig config = Cuda({{"gemm", "cublaslt"}, {"qgemm", "fp8_cublaslt"}});
  PreflightResult r = Preflight(config, {true, 90, 1, "fp8"});
  EXPECT_TRUE(r.supported) << r.reason;
  EXPECT_EQ(r.precision, PrecisionClass::kFp8) << "the loosest class: fp8 activations";
  for (int sm : {100, 120}) EXPECT_TRUE(Preflight(config, {true, sm, 1, "fp8"}).supported) << sm;
  EXPECT_EQ(Preflight(config, {true, 89, 1, "fp8"}).reason,
            "qgemm=fp8_cublaslt needs sm_90 or newer; the GPU is sm_89");
  EXPECT_EQ(Preflight(config, {true, 90, 1, "nvfp4"}).reason,
            "qgemm=fp8_cublaslt does not take nvfp4 weights (takes fp8)");
  EXPECT_THAT(Preflight(config, {true, 90, 1, "bf16"}).reason,
              HasSubstr("does not take bf16 weights"));
  EXPECT_FALSE(Preflight(config, {false, 90, 1, "fp8"}).supported) << "a build without CUDA";
  // With the reference GEMM for the dense linears, too.
  EXPECT_EQ(Preflight(Cuda({{"qgemm", "fp8_cublaslt"}}), {true, 90, 1, "fp8"}).precision,
            PrecisionClass::kFp8);
}

TEST(ScaledGemmPreflight, FusedAndGroupedMoeRunnersDoNotTakeTheScaledGemms) {
  // An unknown weight format skips the format checks, so the conflicts themselves answer.
  const PreflightTarget h200{true, 90, 1, ""};
  const PreflightTarget b200{true, 100, 1, ""};
  EXPECT_EQ(
      Preflight(Cuda({{"gemm", "cublaslt"}, {"moe", "fused"}, {"qgemm", "fp8_cublaslt"}}), h200)
          .reason,
      "qgemm=fp8_cublaslt cannot be combined with moe=fused: it runs the linears' GEMMs; the fused "
      "and grouped MoE "
      "runners run the experts through their own kernels, which would bypass it");
  EXPECT_EQ(
      Preflight(Cuda({{"gemm", "cublaslt"}, {"moe", "grouped"}, {"qgemm", "fp8_cublaslt"}}), h200)
          .reason,
      "qgemm=fp8_cublaslt cannot be combined with moe=grouped: it runs the linears' GEMMs; the "
      "fused and grouped MoE "
      "runners run the experts through their own kernels, which would bypass it");
  EXPECT_EQ(Preflight(Cuda({{"gemm", "cublaslt"}, {"moe", "fused"}, {"qgemm", "native_fp4"}}), b200)
                .reason,
            "qgemm=native_fp4 cannot be combined with moe=fused: it runs the linears' GEMMs; the "
            "fused and grouped MoE "
            "runners run the experts through their own kernels, which would bypass it");
  EXPECT_TRUE(
      Preflight(Cuda({{"gemm", "cublaslt"}, {"moe", "loop"}, {"qgemm", "fp8_cublaslt"}}), h200)
          .supported);
}

TEST(ScaledGemmPreflight, NativeFp4NeedsBlackwell) {
  const BackendConfig config = Cuda({{"gemm", "cublaslt"}, {"qgemm", "native_fp4"}});
  EXPECT_EQ(Preflight(config, {true, 90, 1, "nvfp4"}).reason,
            "qgemm=native_fp4 needs sm_100 or newer; the GPU is sm_90");
  for (const char* format : {"nvfp4", "mxfp4"})
    for (int sm : {100, 120}) {
      const PreflightResult r = Preflight(config, {true, sm, 1, format});
      EXPECT_TRUE(r.supported) << format << " sm_" << sm << ": " << r.reason;
      EXPECT_EQ(r.precision, PrecisionClass::kFp4);
    }
  EXPECT_EQ(Preflight(config, {true, 100, 1, "fp8"}).reason,
            "qgemm=native_fp4 does not take fp8 weights (takes nvfp4, mxfp4)");
}

TrialRequest Request(const std::string& model, const std::string& config) {
  auto parsed = TrialRequestFromJson(
      {{"trial_id", "s"},
       {"model", model},
       {"layers", 2},
       {"config", *ParseBackendConfig(config)},
       {"workload", {{"prompt_len", 8}, {"output_len", 4}, {"repeats", 1}, {"warmup", 0}}}});
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  return *parsed;
}

// The executor judges from the model description ("@nvfp4") before any weight loads.
TEST(ScaledGemmPreflight, ExecutorJudgesBeforeLoading) {
  TrialExecutor executor(SimulatedH200());
  for (const auto& [model, config, reason] : std::vector<std::array<std::string, 3>>{
           {"preset:tiny-moe@nvfp4", "device=cuda,qgemm=native_fp4",
            "qgemm=native_fp4 needs sm_100 or newer; the GPU is sm_90"},
           {"preset:tiny-moe@nvfp4", "device=cuda,qgemm=fp8_cublaslt",
            "qgemm=fp8_cublaslt does not take nvfp4 weights (takes fp8)"},
           {"preset:tiny-moe", "device=cuda,qgemm=fp8_cublaslt",
            "qgemm=fp8_cublaslt does not take bf16 weights (takes fp8)"}}) {
    const TrialResult r = executor.Execute(Request(model, config));
    EXPECT_EQ(r.status, TrialStatus::kUnsupported) << model << " " << config << ": " << r.reason;
    EXPECT_EQ(r.reason, reason);
    EXPECT_EQ(r.load_seconds, 0);
  }
}

// ---- verdict classes (docs/VERDICTS.md has the measurements these encode)

TEST(ScaledGemmVerdict, LooserClassesNeverTighten) {
  const PrecisionClass order[] = {PrecisionClass::kFp32, PrecisionClass::kBf16,
                                  PrecisionClass::kFp8, PrecisionClass::kFp4};
  for (int i = 1; i < 4; ++i) {
    const Thresholds tight = ThresholdsFor(order[i - 1]), loose = ThresholdsFor(order[i]);
    SCOPED_TRACE(PrecisionClassName(order[i]));
    EXPECT_GE(loose.max_rel_error, tight.max_rel_error);
    EXPECT_LE(loose.min_top1, tight.min_top1);
    EXPECT_GE(loose.max_kl_mean, tight.max_kl_mean);
    EXPECT_GE(loose.max_kl, tight.max_kl);
  }
}

bool Passes(const Thresholds& t, double top1, double kl_mean, double kl_max) {
  return top1 >= t.min_top1 && kl_mean <= t.max_kl_mean && kl_max <= t.max_kl;
}

// Activation quantization emulated on the CPU over the tiny presets (2 and 4 layers, seeds 1-4):
// the worst a correct config showed must pass; a model with unrelated weights (top-1 0, KL 1 nat)
// and the injected faults that fp8 noise does not drown must not.
TEST(ScaledGemmVerdict, Fp8AndFp4ClassesFitTheMeasuredActivationNoise) {
  const Thresholds fp8 = ThresholdsFor(PrecisionClass::kFp8);
  EXPECT_TRUE(Passes(fp8, 0.641, 0.0392, 0.434)) << "E4M3 activations, worst seen";
  EXPECT_FALSE(Passes(fp8, 0.0, 1.0, 1.0)) << "unrelated weights";
  EXPECT_FALSE(Passes(fp8, 0.648, 0.0534, 0.40)) << "zero-expert, mildest seen on tiny-moe";
  EXPECT_FALSE(Passes(fp8, 0.352, 0.187, 0.622)) << "bad-quant-scale:16, tiny-qwen2-moe";
  const Thresholds fp4 = ThresholdsFor(PrecisionClass::kFp4);
  EXPECT_TRUE(Passes(fp4, 0.289, 0.156, 0.519)) << "E2M1 activations, worst seen";
  EXPECT_FALSE(Passes(fp4, 0.0, 1.0, 1.0)) << "unrelated weights";
}

// ---- cuBLASLt's tiled layout of 1D block scales

// The documentation's description, transcribed as the order in which the bytes are written:
// tiles of 128 x 4 with the inner tile index fastest; inside a tile, 32 lines of 16 bytes, line i
// holding rows i, i + 32, i + 64, i + 96 (4 bytes each, the 4 inner scales in order).
std::vector<int64_t> DocumentedTiledOffsets(int64_t outer, int64_t inner) {
  const int64_t outer_tiles = (outer + 127) / 128, inner_tiles = (inner + 3) / 4;
  std::vector<int64_t> offset(static_cast<size_t>(outer * inner), -1);
  int64_t next = 0;
  for (int64_t to = 0; to < outer_tiles; ++to)
    for (int64_t ti = 0; ti < inner_tiles; ++ti)
      for (int64_t line = 0; line < 32; ++line)
        for (int64_t quarter = 0; quarter < 4; ++quarter)
          for (int64_t c = 0; c < 4; ++c, ++next) {
            const int64_t r = to * 128 + quarter * 32 + line, col = ti * 4 + c;
            if (r < outer && col < inner) offset[r * inner + col] = next;
          }
  return offset;
}

TEST(ScaledLayout, TiledScaleIndexIsTheDocumentedLayout) {
  // (outer, inner): one whole tile; NVFP4 with K = 32 (2 scales: padded to 4); ragged both ways;
  // an expert's [768, 2048] in NVFP4 and MXFP4.
  const std::pair<int64_t, int64_t> shapes[] = {{128, 4}, {1, 2},     {200, 6},
                                                {300, 9}, {768, 128}, {768, 64}};
  for (const auto& [outer, inner] : shapes) {
    SCOPED_TRACE(std::to_string(outer) + " x " + std::to_string(inner));
    const std::vector<int64_t> want = DocumentedTiledOffsets(outer, inner);
    std::set<int64_t> seen;
    for (int64_t r = 0; r < outer; ++r)
      for (int64_t c = 0; c < inner; ++c) {
        const int64_t at = cuda::TiledScaleIndex(inner, r, c);
        ASSERT_EQ(at, want[r * inner + c]) << "(" << r << ", " << c << ")";
        ASSERT_LT(at, cuda::TiledScaleCount(outer, inner));
        seen.insert(at);
      }
    EXPECT_EQ(seen.size(), static_cast<size_t>(outer * inner)) << "one byte per scale";
  }
  // A few by hand (inner 8: two tiles per 128 rows).
  EXPECT_EQ(cuda::TiledScaleIndex(8, 0, 0), 0);
  EXPECT_EQ(cuda::TiledScaleIndex(8, 1, 0), 16);
  EXPECT_EQ(cuda::TiledScaleIndex(8, 32, 0), 4);
  EXPECT_EQ(cuda::TiledScaleIndex(8, 33, 1), 21);
  EXPECT_EQ(cuda::TiledScaleIndex(8, 127, 3), 511);
  EXPECT_EQ(cuda::TiledScaleIndex(8, 0, 4), 512);
  EXPECT_EQ(cuda::TiledScaleIndex(8, 128, 0), 1024);
  EXPECT_EQ(cuda::TiledScaleCount(1, 2), 512);
  EXPECT_EQ(cuda::TiledScaleCount(200, 6), 256 * 8);
}

TEST(ScaledLayout, Fp8ScaleLayouts) {
  EXPECT_EQ(cuda::Fp8BlockScaleLd(64), 4);
  EXPECT_EQ(cuda::Fp8BlockScaleLd(129), 4);
  EXPECT_EQ(cuda::Fp8BlockScaleLd(640), 8) << "5 blocks along K, padded to 16 bytes";
  EXPECT_EQ(cuda::Fp8BlockScaleLd(2048), 16);
  EXPECT_EQ(cuda::Fp8BlockScaleCount(320, 640), 3 * 8);
  EXPECT_EQ(cuda::Fp8ActivationScaleIndex(5, 2, 3), 17) << "outer-dim-major";
  EXPECT_EQ(cuda::Fp8ActivationScale(448.f), 1.f);
  EXPECT_EQ(cuda::Fp8ActivationScale(896.f), 2.f);
  EXPECT_EQ(cuda::Fp8ActivationScale(0.f), 1.f);
  EXPECT_EQ(cuda::Fp8ActivationScale(1e-44f), 1.f) << "amax / 448 underflows";
  EXPECT_EQ(cuda::Fp8ActivationScale(NAN), 1.f) << "the NaN codes carry it";
  EXPECT_EQ(FloatToE4M3(3.5f / cuda::Fp8ActivationScale(3.5f)), 0x7e) << "amax -> 448";
}

// ---- the activation quantizers' formulas are the weight quantizer's (the same recipe)

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  v[3] = 0.f;  // a zero and a large outlier
  v[n / 2] = 40.f;
  return v;
}

std::vector<float> Floats(const std::vector<uint8_t>& bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

TEST(ScaledQuantRecipe, Fp8ActivationsAreQuantizedLikeFp8Weights) {
  const int rows = 5, cols = 96;
  const std::vector<float> x = Random(rows * cols, 3);
  const MatrixRef dense{x.data(), DType::kF32, rows, cols};
  auto tensor = QuantizeMatrix(QuantFormat::kFp8Tensor, dense);
  auto channel = QuantizeMatrix(QuantFormat::kFp8Channel, dense);
  ASSERT_TRUE(tensor.ok() && channel.ok());
  const HostQuantized per_tensor = HostQuantizeFp8(x.data(), rows, cols, 0);
  EXPECT_EQ(per_tensor.codes, tensor->parts[0]);
  EXPECT_EQ(per_tensor.scales[0], Floats(tensor->parts[1])[0]);
  const HostQuantized per_row = HostQuantizeFp8(x.data(), rows, cols, cols);
  EXPECT_EQ(per_row.codes, channel->parts[0]);
  EXPECT_EQ(per_row.scales, Floats(channel->parts[1]));
  // 1 x 128 over K = 320: three groups a row, the last of 64.
  const std::vector<float> wide = Random(2 * 320, 4);
  const HostQuantized blocks = HostQuantizeFp8(wide.data(), 2, 320, 128);
  ASSERT_EQ(blocks.scales.size(), 6u);
  EXPECT_EQ(blocks.scales[2], cuda::Fp8ActivationScale(HostAmax(wide.data(), 320, 0, 1, 256, 320)));
  for (int k = 0; k < 320; ++k)
    EXPECT_LE(std::fabs(blocks.Value(1, k) - wide[320 + k]), std::fabs(wide[320 + k]) / 16 + 1e-6)
        << k;
}

TEST(ScaledQuantRecipe, Fp4ActivationsAreQuantizedLikeFp4Weights) {
  const int rows = 64, cols = 256;
  const std::vector<float> x = Random(rows * cols, 5);
  const MatrixRef dense{x.data(), DType::kF32, rows, cols};
  auto nvfp4 = QuantizeMatrix(QuantFormat::kNvfp4, dense);
  auto mxfp4 = QuantizeMatrix(QuantFormat::kMxfp4, dense);
  ASSERT_TRUE(nvfp4.ok() && mxfp4.ok());
  const HostQuantized nv = HostQuantizeNvfp4(x.data(), rows, cols);
  EXPECT_EQ(nv.codes, nvfp4->parts[0]);
  EXPECT_EQ(nv.scale_codes, nvfp4->parts[1]);
  EXPECT_EQ(nv.global, Floats(nvfp4->parts[2])[0]);
  const HostQuantized mx = HostQuantizeMxfp4(x.data(), rows, cols);
  EXPECT_EQ(mx.codes, mxfp4->parts[0]);
  EXPECT_EQ(mx.scale_codes, mxfp4->parts[1]);
}

}  // namespace
}  // namespace infersweep
