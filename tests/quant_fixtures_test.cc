// The first link of the trust chain for quantized weights: checkpoints written in each format's
// HF layout by scripts/gen_quant_fixtures.py, dequantized there by an independent torch
// implementation and run by transformers. Our loader must dequantize every quantized linear to
// torch's fp32 values (exactly, or within one ulp) and the CPU reference must reproduce
// transformers' logits. Skipped while tests/fixtures/quant is absent (the script needs torch).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/test_util.h"
#include <nlohmann/json.hpp>

#include "engine/cpu_model.h"
#include "engine/npy.h"
#include "core/quant/dequantize.h"
#include "engine/quant/layout.h"
#include "engine/safetensors.h"
#include "engine/weights.h"

namespace infersweep {
namespace {

namespace fs = std::filesystem;

const std::string kFixtures = SourceDir() + "/tests/fixtures/quant";

#define REQUIRE_FIXTURES(names)                   \
  if ((names).empty())                            \
  GTEST_SKIP() << kFixtures                       \
               << " is absent: generate it with " \
                  "scripts/gen_quant_fixtures.py where torch and transformers are installed"

// Units in the last place between two floats (0 when equal, including +0 and -0).
int64_t UlpDistance(float a, float b) {
  if (a == b) return 0;
  if (std::isnan(a) || std::isnan(b)) return INT64_MAX;
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  // Map sign-magnitude to a monotonic integer line.
  const int64_t la = ia < 0 ? -static_cast<int64_t>(ia & 0x7fffffff) : ia;
  const int64_t lb = ib < 0 ? -static_cast<int64_t>(ib & 0x7fffffff) : ib;
  return std::llabs(la - lb);
}

TEST(QuantFixtures, DequantizedWeightsMatchTorch) {
  const std::vector<std::string> names = FixtureNames(kFixtures);
  REQUIRE_FIXTURES(names);
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const std::string dir = kFixtures + "/" + name;
    std::ifstream in(dir + "/expected.json");
    const auto expected = nlohmann::json::parse(in);
    auto host = LoadHostModel(dir);
    ASSERT_TRUE(host.ok()) << host.status();
    EXPECT_EQ(QuantFormatName((*host)->quant_format), expected.at("format").get<std::string>());

    auto torch = SafetensorsFile::Open(dir + "/dequantized.safetensors");
    ASSERT_TRUE(torch.ok()) << torch.status();
    int64_t compared = 0, inexact = 0;
    for (const SafetensorsEntry& entry : (*torch)->header().tensors) {
      auto ours = FindWeight(**host, entry.name);
      ASSERT_TRUE(ours.ok()) << ours.status();
      ASSERT_TRUE(ours->quantized()) << entry.name << " is quantized in torch's fixture";
      ASSERT_EQ(entry.dtype, DType::kF32);
      ASSERT_EQ(entry.shape, (std::vector<int64_t>{ours->rows, ours->cols})) << entry.name;
      const std::vector<float> dq = DequantizeMatrix(*ours);
      const float* want = reinterpret_cast<const float*>((*torch)->Data(entry));
      for (size_t i = 0; i < dq.size(); ++i) {
        float w;
        std::memcpy(&w, want + i, 4);  // the mapped data is only as aligned as the file
        const int64_t ulps = UlpDistance(dq[i], w);
        ASSERT_LE(ulps, 1) << entry.name << "[" << i << "]: ours " << dq[i] << ", torch " << w;
        inexact += ulps != 0;
      }
      ++compared;
    }
    // Every quantized linear of ours is one torch dequantized too.
    int64_t quantized = 0;
    for (const TensorSpec& spec : (*host)->specs)
      quantized += spec.quant != QuantFormat::kNone && spec.part == QuantPart::kData;
    EXPECT_EQ(compared, quantized);
    std::printf("# %s: %lld quantized linears, %lld elements 1 ulp from torch\n", name.c_str(),
                static_cast<long long>(compared), static_cast<long long>(inexact));
  }
}

TEST(QuantFixtures, CpuReferenceLogitsMatchTransformers) {
  const std::vector<std::string> names = FixtureNames(kFixtures);
  REQUIRE_FIXTURES(names);
  for (const std::string& name : names) {
    for (cpu::MatmulVariant variant : {cpu::MatmulVariant::kNaive, cpu::MatmulVariant::kBlocked}) {
      SCOPED_TRACE(name);
      const std::string dir = kFixtures + "/" + name;
      std::ifstream in(dir + "/expected.json");
      const auto prompt = nlohmann::json::parse(in).at("prompt").get<std::vector<int32_t>>();
      auto ref = ReadNpyFloat32(dir + "/logits.npy");
      ASSERT_TRUE(ref.ok()) << ref.status();
      auto host = LoadHostModel(dir);
      ASSERT_TRUE(host.ok()) << host.status();
      auto model = MakeCpuModel(**host, {variant, 0});
      const int n = static_cast<int>(prompt.size());
      ASSERT_TRUE(model->StartBatch(1, n).ok());
      std::vector<float> logits;
      ASSERT_TRUE(model->Forward(prompt, n, LogitsMode::kAll, &logits).ok());
      ASSERT_EQ(logits.size(), ref->data.size());
      double max_diff = 0, max_ref = 0;
      for (size_t i = 0; i < logits.size(); ++i) {
        const double d = std::fabs(static_cast<double>(logits[i]) - ref->data[i]);
        max_diff = std::isnan(d) ? INFINITY : std::max(max_diff, d);
        max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref->data[i])));
      }
      const double rel = max_diff / max_ref;
      std::printf("# %s (%s): max|ours - transformers| / max|transformers| = %.3g\n", name.c_str(),
                  variant == cpu::MatmulVariant::kNaive ? "naive" : "blocked", rel);
      EXPECT_LE(rel, 1e-4);
    }
  }
}

TEST(QuantFixtures, EveryFormatIsCovered) {
  const std::vector<std::string> names = FixtureNames(kFixtures);
  REQUIRE_FIXTURES(names);
  std::vector<std::string> formats;
  for (const std::string& name : names) {
    std::ifstream in(kFixtures + "/" + name + "/expected.json");
    formats.push_back(nlohmann::json::parse(in).at("format").get<std::string>());
  }
  for (const char* format : {"fp8_tensor", "fp8_channel", "fp8_block128", "nvfp4", "mxfp4"})
    EXPECT_THAT(formats, testing::Contains(format));
}

}  // namespace
}  // namespace infersweep
