// How results are kept in SQLite (storage/codec.h): deflated against the fixed dictionary, and
// with kernel logs by reference.
#include "storage/codec.h"

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "api/trial.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;

TEST(CodecTest, ResultsRoundTripAndShrink) {
  TrialResult r;
  r.trial_id = "7-3";
  r.status = TrialStatus::kOk;
  r.model = "preset:qwen3-30b-a3b";
  r.config = {{"device", "cuda"}, {"gemm", "fused"}, {"attention", "flash"}};
  r.model_identity = {"preset", "qwen3-30b-a3b", 48, 1, "bf16", ""};
  r.workload = "prompt=128,output=32,warmup=1";
  BatchFigures b;
  b.output_tok_s = {393.51, 392.7, 394.2};
  r.batches = {b};
  const std::string json = ToJson(r).dump();
  const std::string blob = CompressResultJson(json);
  ASSERT_FALSE(blob.empty());
  EXPECT_EQ(blob[0], '\x01');
  EXPECT_LT(blob.size() * 4, json.size()) << blob.size() << " of " << json.size();
  absl::StatusOr<std::string> back = DecompressResultJson(blob);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, json);
  EXPECT_EQ(*DecompressResultJson(CompressResultJson("")), "");
}

TEST(CodecTest, ABadBlobIsDataLossNotAGuess) {
  const std::string blob = CompressResultJson(R"({"status":"OK"})");
  EXPECT_EQ(DecompressResultJson("").status().code(), absl::StatusCode::kDataLoss);
  absl::StatusOr<std::string> tag = DecompressResultJson("\x07" + blob.substr(1));
  EXPECT_EQ(tag.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(tag.status().message(), HasSubstr("unknown codec tag 7"));
  absl::StatusOr<std::string> cut = DecompressResultJson(blob.substr(0, blob.size() - 3));
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kDataLoss);
  std::string flipped = blob;
  flipped[blob.size() / 2] ^= 0x5a;
  EXPECT_FALSE(DecompressResultJson(flipped).ok());
}

TEST(CodecTest, KernelLogReferencesExpandAndStrip) {
  const std::map<int64_t, std::string> logs = {{3, R"({"decode":{"graph":true}})"},
                                               {12, R"({"prefill":null})"}};
  auto log = [&](int64_t id) -> absl::StatusOr<std::string> {
    auto it = logs.find(id);
    if (it == logs.end())
      return absl::DataLossError(absl::StrCat("kernel log ", id, " is missing"));
    return it->second;
  };
  const std::string text =
      R"({"batches":[{"batch":1,"kernels_ref":3,"x":1},{"batch":8,"kernels_ref":12}],)"
      R"("reason":"\"kernels_ref\":9 in a string"})";
  absl::StatusOr<std::string> expanded = ExpandKernelLogRefs(text, log);
  ASSERT_TRUE(expanded.ok()) << expanded.status();
  EXPECT_EQ(*expanded,
            R"({"batches":[{"batch":1,"kernels":{"decode":{"graph":true}},"x":1},)"
            R"({"batch":8,"kernels":{"prefill":null}}],"reason":"\"kernels_ref\":9 in a string"})");
  EXPECT_EQ(
      StripKernelLogRefs(text),
      R"({"batches":[{"batch":1,"x":1},{"batch":8}],"reason":"\"kernels_ref\":9 in a string"})");
  EXPECT_FALSE(ExpandKernelLogRefs(R"({"kernels_ref":4})", log).ok());
  EXPECT_EQ(StripKernelLogRefs(R"({"a":1})"), R"({"a":1})");
}

}  // namespace
}  // namespace infersweep
