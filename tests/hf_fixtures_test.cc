// The first link of the trust chain: the CPU reference against HF transformers (fp32, eager) on
// tiny checkpoints that transformers itself saved (scripts/gen_hf_fixtures.py).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/cpu_model.h"
#include "engine/npy.h"
#include "engine/safetensors.h"
#include "engine/safetensors_writer.h"
#include "engine/sampler.h"
#include "engine/weights.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

namespace fs = std::filesystem;

const std::string kFixtures = SourceDir() + "/tests/fixtures/hf";

struct Expected {
  std::vector<int32_t> prompt, greedy;
};

Expected ReadExpected(const std::string& dir) {
  std::ifstream in(dir + "/expected.json");
  const auto j = nlohmann::json::parse(in);
  return {j.at("prompt").get<std::vector<int32_t>>(), j.at("greedy").get<std::vector<int32_t>>()};
}

// The hybrid fixtures, generated where transformers has their model classes; absent otherwise.
const std::vector<std::string> kHybridFixtures = {"qwen3_next", "qwen3_5_moe"};

// Every fixture but the hybrids, which HybridFixtureTest runs (or skips when absent).
std::vector<std::string> NonHybridFixtureNames() {
  std::vector<std::string> names = FixtureNames(kFixtures);
  std::erase_if(names, [](const std::string& name) {
    return std::find(kHybridFixtures.begin(), kHybridFixtures.end(), name) != kHybridFixtures.end();
  });
  return names;
}

// Prefill logits within 1e-4 of max|logit| of transformers', and the greedy tokens, decoded one
// at a time through the cache (or recurrent state), identical.
void ExpectMatchesTransformers(const std::string& name, cpu::MatmulVariant variant) {
  const std::string dir = kFixtures + "/" + name;
  const Expected expected = ReadExpected(dir);
  auto ref = ReadNpyFloat32(dir + "/logits.npy");
  ASSERT_TRUE(ref.ok()) << ref.status();

  auto host = LoadHostModel(dir);
  ASSERT_TRUE(host.ok()) << host.status();
  auto model = MakeCpuModel(**host, {variant, 0});
  const int n = static_cast<int>(expected.prompt.size());
  ASSERT_EQ(ref->shape, (std::vector<int64_t>{n, (*host)->config.vocab_size}));

  ASSERT_TRUE(model->StartBatch(1, n + static_cast<int>(expected.greedy.size())).ok());
  std::vector<float> logits;
  ASSERT_TRUE(model->Forward(expected.prompt, n, LogitsMode::kAll, &logits).ok());
  const double rel = RelMaxError(logits, ref->data);
  std::printf("# %s: max|ours - transformers| / max|transformers| = %.3g\n", name.c_str(), rel);
  EXPECT_LE(rel, 1e-4) << name;

  // Greedy continuation through the KV cache, one token per step.
  std::vector<int32_t> generated;
  std::vector<float> last(logits.end() - (*host)->config.vocab_size, logits.end());
  for (size_t step = 0; step < expected.greedy.size(); ++step) {
    const int32_t next = Greedy(last);
    generated.push_back(next);
    ASSERT_TRUE(model->Forward({&next, 1}, 1, LogitsMode::kLast, &last).ok());
  }
  EXPECT_EQ(generated, expected.greedy) << name;
}

class HfFixtureTest : public testing::TestWithParam<std::tuple<std::string, cpu::MatmulVariant>> {};

TEST_P(HfFixtureTest, LogitsAndGreedyMatchTransformers) {
  const auto& [name, variant] = GetParam();
  ExpectMatchesTransformers(name, variant);
}

INSTANTIATE_TEST_SUITE_P(
    AllArchitectures, HfFixtureTest,
    testing::Combine(testing::ValuesIn(NonHybridFixtureNames()),
                     testing::Values(cpu::MatmulVariant::kNaive, cpu::MatmulVariant::kBlocked)),
    [](const auto& info) {
      return std::get<0>(info.param) +
             (std::get<1>(info.param) == cpu::MatmulVariant::kNaive ? "_naive" : "_blocked");
    });

class HybridFixtureTest
    : public testing::TestWithParam<std::tuple<std::string, cpu::MatmulVariant>> {};

TEST_P(HybridFixtureTest, LogitsAndGreedyMatchTransformers) {
  const auto& [name, variant] = GetParam();
  if (!fs::exists(kFixtures + "/" + name + "/expected.json"))
    GTEST_SKIP() << "no fixture " << name << " (scripts/gen_hf_fixtures.py makes it where "
                 << "transformers has the model class)";
  ExpectMatchesTransformers(name, variant);
}

INSTANTIATE_TEST_SUITE_P(
    Hybrids, HybridFixtureTest,
    testing::Combine(testing::ValuesIn(kHybridFixtures),
                     testing::Values(cpu::MatmulVariant::kNaive, cpu::MatmulVariant::kBlocked)),
    [](const auto& info) {
      return std::get<0>(info.param) +
             (std::get<1>(info.param) == cpu::MatmulVariant::kNaive ? "_naive" : "_blocked");
    });

TEST(HfFixtures, EveryArchitectureIsCovered) {
  const auto names = FixtureNames(kFixtures);
  for (const char* arch : {"llama", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"})
    EXPECT_THAT(names, testing::Contains(arch));
  EXPECT_THAT(names, testing::Contains("qwen3_moe_hub_sharded"));
}

// Batched prefill of two different prompts equals running each alone.
TEST(HfFixtures, BatchRowsAreIndependent) {
  const std::string dir = kFixtures + "/qwen2_moe";
  auto host = LoadHostModel(dir);
  ASSERT_TRUE(host.ok()) << host.status();
  const Expected expected = ReadExpected(dir);
  const int n = 16;
  std::vector<int32_t> a(expected.prompt.begin(), expected.prompt.begin() + n);
  std::vector<int32_t> b(expected.prompt.end() - n, expected.prompt.end());
  const int vocab = (*host)->config.vocab_size;
  auto model = MakeCpuModel(**host);
  std::vector<float> alone_a, alone_b, both;
  ASSERT_TRUE(model->StartBatch(1, n).ok());
  ASSERT_TRUE(model->Forward(a, n, LogitsMode::kLast, &alone_a).ok());
  ASSERT_TRUE(model->StartBatch(1, n).ok());
  ASSERT_TRUE(model->Forward(b, n, LogitsMode::kLast, &alone_b).ok());
  std::vector<int32_t> ab = a;
  ab.insert(ab.end(), b.begin(), b.end());
  ASSERT_TRUE(model->StartBatch(2, n).ok());
  ASSERT_TRUE(model->Forward(ab, n, LogitsMode::kLast, &both).ok());
  for (int i = 0; i < vocab; ++i) {
    EXPECT_NEAR(both[i], alone_a[i], 1e-5f);
    EXPECT_NEAR(both[vocab + i], alone_b[i], 1e-5f);
  }
}

TEST(HfFixtures, ForwardRejectsBadTokens) {
  auto host = LoadHostModel(kFixtures + "/qwen3");
  ASSERT_TRUE(host.ok()) << host.status();
  auto model = MakeCpuModel(**host);
  std::vector<float> logits;
  const std::vector<int32_t> bad = {1, 2, 100000};
  EXPECT_FALSE(model->Forward(bad, 3, LogitsMode::kLast, &logits).ok()) << "before StartBatch";
  ASSERT_TRUE(model->StartBatch(1, 8).ok());
  const auto status = model->Forward(bad, 3, LogitsMode::kLast, &logits);
  EXPECT_THAT(status.message(), testing::HasSubstr("100000"));
  const std::vector<int32_t> long_prompt(9, 1);
  EXPECT_EQ(model->Forward(long_prompt, 9, LogitsMode::kLast, &logits).code(),
            absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace infersweep

namespace infersweep {
namespace {

// The CLI contract on bad input: a clear error naming the file (and tensor), a non-zero exit,
// no crash. Runs the real binary on damaged copies of a fixture.
struct CliRun {
  int exit_code;
  std::string output;
};

CliRun RunCli(const std::string& args) {
  CliRun run;
  run.output = RunCommand(WorkerBinary() + " " + args + " 2>&1", &run.exit_code);
  return run;
}

std::string DamagedCopy(const std::string& name) {
  const fs::path dir = fs::path(testing::TempDir()) / ("cli_bad_" + name);
  fs::remove_all(dir);
  fs::copy(kFixtures + "/qwen3", dir);
  return dir;
}

TEST(CliBadInput, TruncatedCheckpointIsAClearError) {
  const std::string dir = DamagedCopy("truncated");
  fs::resize_file(dir + "/model.safetensors", fs::file_size(dir + "/model.safetensors") / 2);
  const CliRun run = RunCli("logits --model " + dir + " --tokens 1,2,3 --out /dev/null");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, testing::HasSubstr("model.safetensors"));
  EXPECT_THAT(run.output, testing::HasSubstr("error:"));
}

TEST(CliBadInput, UnknownArchitectureAndMalformedJsonAreClearErrors) {
  const std::string dir = DamagedCopy("arch");
  std::ofstream(dir + "/config.json") << R"({"model_type": "gpt9", "hidden_size": 64})";
  CliRun run = RunCli("generate --model " + dir + " --tokens 1,2 --max-new-tokens 2");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, testing::HasSubstr("model_type"));
  std::ofstream(dir + "/config.json") << "{\"model_type\": ";
  run = RunCli("generate --model " + dir + " --tokens 1,2 --max-new-tokens 2");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, testing::HasSubstr("config.json"));
}

TEST(CliBadInput, MissingTensorNamesTheTensor) {
  const std::string dir = DamagedCopy("missing");
  auto file = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<SafetensorsTensorToWrite> kept;
  for (const SafetensorsEntry& e : (*file)->header().tensors) {
    if (e.name == "model.layers.1.mlp.down_proj.weight") continue;
    kept.push_back({e.name, e.dtype, e.shape,
                    {(*file)->Data(e), static_cast<size_t>(e.data_end - e.data_begin)}});
  }
  ASSERT_TRUE(WriteSafetensors(dir + "/rewritten.safetensors", kept).ok());
  file->reset();
  fs::rename(dir + "/rewritten.safetensors", dir + "/model.safetensors");
  const CliRun run = RunCli("logits --model " + dir + " --tokens 1 --out /dev/null");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, testing::HasSubstr("model.layers.1.mlp.down_proj.weight"));
}

TEST(CliBadInput, OutOfRangeTokenAndBadBackend) {
  CliRun run = RunCli("logits --model " + kFixtures + "/qwen3 --tokens 1,99999 --out /dev/null");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, testing::HasSubstr("99999"));
  run = RunCli("generate --model preset:tiny-moe --tokens 1 --backend tpu");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, testing::HasSubstr("tpu"));
}

}  // namespace
}  // namespace infersweep
