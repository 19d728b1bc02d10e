// A rank process's context (engine/rank_context.h): the bootstrap bytes as hex lines, the rank
// to GPU map and its TEST ONLY override, INFERSWEEP_RANK_DEVICES, as the preflight counts it.
#include "engine/rank_context.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdlib>
#include <string>
#include <vector>

#include "api/backend_config.h"
#include "engine/backends.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

// INFERSWEEP_RANK_DEVICES for a scope (null: unset), as it was after.
class RankDevicesEnv : public ScopedEnv {
 public:
  explicit RankDevicesEnv(const char* value) : ScopedEnv("INFERSWEEP_RANK_DEVICES", value) {}
};

TEST(RankContext, BootstrapBytesSurviveTheirHexLine) {
  std::array<char, 64> handle;
  for (size_t i = 0; i < handle.size(); ++i) handle[i] = static_cast<char>(i * 37 + 200);
  const std::string hex = HexBytes(handle.data(), handle.size());
  EXPECT_EQ(hex.size(), 128u);
  EXPECT_EQ(hex.substr(0, 4), "c8ed");  // 200, 237
  std::array<char, 64> back{};
  ASSERT_TRUE(BytesFromHex(hex, back.data(), back.size()).ok());
  EXPECT_EQ(back, handle);

  EXPECT_TRUE(absl::IsInvalidArgument(BytesFromHex(hex.substr(2), back.data(), back.size())));
  EXPECT_TRUE(absl::IsInvalidArgument(BytesFromHex(hex + "00", back.data(), back.size())));
  std::string bad = hex;
  bad[7] = 'g';
  EXPECT_TRUE(absl::IsInvalidArgument(BytesFromHex(bad, back.data(), back.size())));
  EXPECT_TRUE(absl::IsInvalidArgument(BytesFromHex("", back.data(), back.size())));
}

TEST(RankContext, RankRRunsOnGpuRUnlessTheTestMapSaysOtherwise) {
  RankDevicesEnv unset(nullptr);
  auto plain = RankDevices(4);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(*plain, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(TestRankDeviceCount(1), 0);
  {
    RankDevicesEnv env("0,0");
    auto mapped = RankDevices(2);
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    EXPECT_EQ(*mapped, (std::vector<int>{0, 0}));
    EXPECT_TRUE(absl::IsInvalidArgument(RankDevices(4).status()));  // 2 GPUs listed for 4 ranks
    EXPECT_EQ(TestRankDeviceCount(1), 2);
    EXPECT_EQ(TestRankDeviceCount(0), 0);  // no GPU 0 here
  }
  {
    RankDevicesEnv env("0,x");
    EXPECT_TRUE(absl::IsInvalidArgument(RankDevices(2).status()));
    EXPECT_EQ(TestRankDeviceCount(8), 0);
  }
}

// Preflight refuses tp beyond the host's GPUs, naming the count, unless the test map places the
// ranks on GPUs it has.
TEST(RankContext, PreflightCountsTheRanksTheTestMapPlaces) {
  LocalDevices one_gpu;
  one_gpu.has_cuda_build = true;
  one_gpu.gpu_count = 1;
  one_gpu.sm = 90;
  auto config = NormalizeBackendConfig(*ParseBackendConfig("device=cuda,tp=2,allreduce=custom"));
  ASSERT_TRUE(config.ok()) << config.status();
  RankDevicesEnv unset(nullptr);
  const PreflightResult refused = Preflight(*config, MakePreflightTarget(one_gpu, nullptr));
  EXPECT_FALSE(refused.supported);
  EXPECT_EQ(refused.reason, "tp=2 needs 2 GPUs of one host; this host has 1");
  RankDevicesEnv env("0,0");
  const PreflightResult mapped = Preflight(*config, MakePreflightTarget(one_gpu, nullptr));
  EXPECT_TRUE(mapped.supported) << mapped.reason;
}

}  // namespace
}  // namespace infersweep
