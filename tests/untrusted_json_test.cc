// JSON from other processes and files (api/untrusted_json.h): the nesting bound, its pre-scan,
// and the parsers that take such JSON through it.
#include "api/untrusted_json.h"

#include <string>

#include "api/model_config.h"
#include "api/trial.h"
#include "engine/checkpoint.h"
#include "engine/quant/scheme.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace infersweep {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string Nested(int depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(UntrustedJson, DepthUpToTheLimitParses) {
  absl::StatusOr<nlohmann::json> j = ParseUntrustedJson(Nested(kMaxJsonDepth), "doc");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_TRUE(CheckJsonDepth("{\"a\": [{\"b\": [1]}]}", "doc", 4).ok());
  EXPECT_FALSE(CheckJsonDepth("{\"a\": [{\"b\": [1]}]}", "doc", 3).ok());
}

TEST(UntrustedJson, DeeperIsRefusedNamingDepthPositionAndLimit) {
  absl::StatusOr<nlohmann::json> j = ParseUntrustedJson(Nested(kMaxJsonDepth + 1), "result_json");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(j.status()),
            "result_json: JSON nested deeper than 64 levels (at byte 64); the limit is 64");
  // Objects count as arrays do.
  std::string objects;
  for (int i = 0; i < 100; ++i) objects += "{\"a\":";
  EXPECT_THAT(Message(CheckJsonDepth(objects, "doc")), HasSubstr("deeper than 64 levels"));
}

// 4 MiB of '[' (the gRPC message cap) is refused by the pre-scan, before any parser recursion.
TEST(UntrustedJson, FourMebibytesOfBracketsAreRefusedCheaply) {
  const std::string deep = Nested(2 << 20, "");
  EXPECT_THAT(Message(ParseUntrustedJson(deep, "doc").status()), HasSubstr("nested deeper"));
}

TEST(UntrustedJson, BracketsInStringsDoNotCount) {
  const std::string text = "{\"a\": \"" + std::string(100, '[') + "\\\"" + std::string(100, '{') +
                           "\", \"b\": [\"]]]]\"]}";
  absl::StatusOr<nlohmann::json> j = ParseUntrustedJson(text, "doc");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ((*j)["b"][0], "]]]]");
}

TEST(UntrustedJson, NotJsonNamesTheDocument) {
  EXPECT_THAT(Message(ParseUntrustedJson("{\"a\": ", "doc").status()),
              AllOf(HasSubstr("doc: not valid JSON: "), HasSubstr("parse error")));
  // nlohmann reports a number that overflows a double as out_of_range, not a parse error.
  EXPECT_THAT(Message(ParseUntrustedJson("[1e400]", "doc").status()),
              HasSubstr("doc: not valid JSON: number overflow parsing '1e400'"));
}

TEST(UntrustedJson, AgentResultsAreBounded) {
  absl::StatusOr<TrialResult> r = TrialResultFromJsonText(
      "{\"status\": \"OK\", \"trial_id\": \"1-0\", \"config\": " + Nested(100) + "}",
      "result_json");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(Message(r.status()), HasSubstr("result_json: JSON nested deeper than 64 levels"));
  r = TrialResultFromJsonText("{\"status\": \"NOPE\"}", "result_json");
  EXPECT_EQ(Message(r.status()), "result_json: result.status: unknown 'NOPE'");
  absl::StatusOr<TrialRequest> q = TrialRequestFromJsonText(Nested(1000), "request_json");
  EXPECT_THAT(Message(q.status()), HasSubstr("request_json: JSON nested deeper"));
}

// config.json's messages quote values through dump(), which recurses once per level: a
// megabyte of '[' would overflow the stack.
TEST(UntrustedJson, ModelConfigRefusesDeepNestingBeforeQuotingIt) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(Nested(1 << 20), "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(Message(c.status()), HasSubstr("config.json: JSON nested deeper than 64 levels"));
  c = ParseModelConfig("{\"model_type\": \"qwen3\", \"hidden_size\": " + Nested(65) + "}",
                       "config.json");
  EXPECT_THAT(Message(c.status()), HasSubstr("nested deeper"));
}

// compressed-tensors fields of an unexpected type read as unsupported (json::value would throw
// type_error); JSON errors of any kind name the file.
TEST(UntrustedJson, QuantizationConfigsNeverThrow) {
  absl::StatusOr<QuantScheme> s = ParseQuantScheme(
      R"({"quantization_config": {"quant_method": "compressed-tensors", "config_groups":
          {"g": {"targets": ["Linear"], "weights": {"num_bits": [8], "type": 1, "strategy": {}}}}}})",
      std::nullopt);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(Message(s.status()), HasSubstr("are not supported"));
  s = ParseQuantScheme("{}", R"({"quantization": {"quant_algo": "NVFP4", "group_size": 1e400}})");
  EXPECT_THAT(Message(s.status()),
              HasSubstr("hf_quant_config.json: not valid JSON: number overflow"));
  s = ParseQuantScheme("{\"quantization_config\": " + Nested(1 << 20) + "}", std::nullopt);
  EXPECT_THAT(Message(s.status()), HasSubstr("config.json: JSON nested deeper"));
}

TEST(UntrustedJson, ShardIndexErrorsNameTheFile) {
  auto index = ParseSafetensorsIndex(R"({"weight_map": {"a": "x.safetensors"}, "n": 1e999})",
                                     "model.safetensors.index.json");
  EXPECT_THAT(Message(index.status()),
              HasSubstr("model.safetensors.index.json: not valid JSON: number overflow"));
  index = ParseSafetensorsIndex(Nested(100), "model.safetensors.index.json");
  EXPECT_THAT(Message(index.status()), HasSubstr("nested deeper"));
}

}  // namespace
}  // namespace infersweep
