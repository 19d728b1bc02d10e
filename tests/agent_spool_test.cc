// The agent's result spool: durable across reopen, replayed in spool order, emptied by acks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/inventory.h"
#include "agent/spool.h"
#include "engine/backends.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class SpoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "spool-test-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/spool.db";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static SpooledResult Make(const std::string& trial, int attempt, const std::string& json,
                            std::vector<int> slots = {0}) {
    SpooledResult r;
    r.trial_id = trial;
    r.attempt = attempt;
    r.result_json = json;
    r.slots = std::move(slots);
    return r;
  }

  std::string dir_, path_;
};

TEST_F(SpoolTest, SurvivesReopenInSpoolOrder) {
  {
    auto spool = Spool::Open(path_);
    ASSERT_TRUE(spool.ok()) << spool.status();
    // Trial ids deliberately out of alphabetical order: order is spool order, not key order.
    ASSERT_TRUE((*spool)->Put(Make("7-2", 1, R"({"a":1})", {1, 2})).ok());
    ASSERT_TRUE((*spool)->Put(Make("7-0", 1, R"({"b":2})")).ok());
    ASSERT_TRUE((*spool)->Put(Make("3-9", 2, R"({"c":3})")).ok());
  }
  auto spool = Spool::Open(path_);
  ASSERT_TRUE(spool.ok()) << spool.status();
  auto all = (*spool)->All();
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 3u);
  EXPECT_EQ((*all)[0].trial_id, "7-2");
  EXPECT_EQ((*all)[0].result_json, R"({"a":1})");
  EXPECT_EQ((*all)[0].slots, (std::vector<int>{1, 2}));
  EXPECT_EQ((*all)[1].trial_id, "7-0");
  EXPECT_EQ((*all)[2].trial_id, "3-9");
  EXPECT_EQ((*all)[2].attempt, 2);
  EXPECT_LT((*all)[0].seq, (*all)[1].seq);
  EXPECT_LT((*all)[1].seq, (*all)[2].seq);
  EXPECT_GT((*all)[0].spooled_unix_ms, 0);
}

TEST_F(SpoolTest, PutSameKeyReplacesAndKeepsPosition) {
  auto spool = Spool::Open(path_);
  ASSERT_TRUE(spool.ok());
  ASSERT_TRUE((*spool)->Put(Make("1-0", 1, "old")).ok());
  ASSERT_TRUE((*spool)->Put(Make("1-1", 1, "x")).ok());
  ASSERT_TRUE((*spool)->Put(Make("1-0", 1, "new")).ok());
  // Another attempt of the same trial is a different entry.
  ASSERT_TRUE((*spool)->Put(Make("1-0", 2, "second attempt")).ok());
  auto all = (*spool)->All();
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 3u);
  EXPECT_EQ((*all)[0].trial_id, "1-0");
  EXPECT_EQ((*all)[0].attempt, 1);
  EXPECT_EQ((*all)[0].result_json, "new");
  EXPECT_EQ((*all)[1].trial_id, "1-1");
  EXPECT_EQ((*all)[2].attempt, 2);
}

TEST_F(SpoolTest, AckRemovesOnlyThatAttemptAndSurvivesReopen) {
  {
    auto spool = Spool::Open(path_);
    ASSERT_TRUE(spool.ok());
    ASSERT_TRUE((*spool)->Put(Make("2-0", 1, "a")).ok());
    ASSERT_TRUE((*spool)->Put(Make("2-1", 1, "b")).ok());
    ASSERT_TRUE((*spool)->Put(Make("2-1", 2, "c")).ok());
    ASSERT_TRUE((*spool)->Remove("2-1", 1).ok());
    // Acks may repeat, or name something never spooled.
    ASSERT_TRUE((*spool)->Remove("2-1", 1).ok());
    ASSERT_TRUE((*spool)->Remove("nope", 1).ok());
    auto n = (*spool)->Count();
    ASSERT_TRUE(n.ok());
    EXPECT_EQ(*n, 2);
  }
  auto spool = Spool::Open(path_);
  ASSERT_TRUE(spool.ok());
  auto all = (*spool)->All();
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].trial_id, "2-0");
  EXPECT_EQ((*all)[1].trial_id, "2-1");
  EXPECT_EQ((*all)[1].attempt, 2);
  ASSERT_TRUE((*spool)->Remove("2-0", 1).ok());
  ASSERT_TRUE((*spool)->Remove("2-1", 2).ok());
  EXPECT_EQ(*(*spool)->Count(), 0);
}

TEST_F(SpoolTest, RejectsEmptyTrialAndUnopenablePath) {
  auto spool = Spool::Open(path_);
  ASSERT_TRUE(spool.ok());
  EXPECT_FALSE((*spool)->Put(Make("", 1, "x")).ok());
  EXPECT_FALSE(Spool::Open(dir_ + "/no/such/dir/spool.db").ok());
}

TEST(InventoryTest, SmArchForms) {
  EXPECT_EQ(*ParseSmArch("sm_90"), 90);
  EXPECT_EQ(*ParseSmArch("90"), 90);
  EXPECT_EQ(*ParseSmArch("sm_90a"), 90);
  EXPECT_EQ(*ParseSmArch("sm_120"), 120);
  EXPECT_EQ(*ParseSmArch("sm_100f"), 100);
  EXPECT_EQ(*ParseSmArch("cpu"), 0);
  EXPECT_FALSE(ParseSmArch("").ok());
  EXPECT_FALSE(ParseSmArch("sm_").ok());
  EXPECT_FALSE(ParseSmArch("hopper").ok());
  EXPECT_FALSE(ParseSmArch("-90").ok());
}

// The whole word is the arch, spelt one way: sm_ and the SM number with at most one suffix
// letter (a or f), the bare number, or cpu. Anything else is refused with an error naming the
// text, never read as its digits.
TEST(InventoryTest, SmArchIsTheWholeWord) {
  for (const char* bad :
       {"+90", "90x", "sm_90zzz", "120abc", "sm90a1", "sm_90af", "90 a", "9 0", "sm_-90", "sm_+90",
        "0x5a", "1001", "99999999999", "sm_", "a", "cpu0", "sm_cpu", "0090", "sm_9"}) {
    absl::StatusOr<int> sm = ParseSmArch(bad);
    EXPECT_FALSE(sm.ok()) << "'" << bad << "' read as " << *sm;
    if (!sm.ok()) {
      EXPECT_NE(sm.status().message().find(absl::StrCat("'", bad, "'")), std::string::npos)
          << sm.status();
    }
  }
}

// Whitespace, another case, a missing '_' or a suffix on the bare number: refused too, with the
// accepted spelling as a hint.
TEST(InventoryTest, SmArchNearMissesAreRefusedWithAHint) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" 90", "sm_90"},    {"90 ", "sm_90"},       {"SM_90", "sm_90"},    {"Sm_90A", "sm_90a"},
      {"sm90", "sm_90"},   {"SM120", "sm_120"},    {"sm100f", "sm_100f"}, {"90a", "sm_90a"},
      {"sm_ 90", "sm_90"}, {"\tsm_90\n", "sm_90"}, {"CPU", "cpu"},        {" cpu", "cpu"},
  };
  for (const auto& [text, hint] : cases) {
    absl::StatusOr<int> sm = ParseSmArch(text);
    ASSERT_FALSE(sm.ok()) << "'" << text << "' read as " << *sm;
    EXPECT_THAT(std::string(sm.status().message()),
                HasSubstr(absl::StrCat("'", text, "' is not an SM architecture: did you mean ",
                                       hint, "?")));
  }
  // Without a near miss there is no hint.
  EXPECT_THAT(std::string(ParseSmArch("hopper").status().message()),
              Not(HasSubstr("did you mean")));
}

// Where the command takes no CPU (a fake GPU's SM), cpu is no SM.
TEST(InventoryTest, SmArchWithoutCpu) {
  EXPECT_EQ(*ParseSmArch("sm_90", /*allow_cpu=*/false), 90);
  absl::StatusOr<int> cpu = ParseSmArch("cpu", /*allow_cpu=*/false);
  ASSERT_FALSE(cpu.ok());
  EXPECT_THAT(std::string(cpu.status().message()), Not(HasSubstr("or cpu")));
  EXPECT_FALSE(ParseFakeGpu("NVIDIA H200:cpu:141").ok());
}

TEST(InventoryTest, FakeGpuLabel) {
  auto g = ParseFakeGpu("NVIDIA H200:90:141");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->name, "NVIDIA H200");
  EXPECT_EQ(g->sm, 90);
  EXPECT_EQ(g->memory_bytes, int64_t{141} * 1024 * 1024 * 1024);
  EXPECT_TRUE(g->test_fake);
  auto colon = ParseFakeGpu("Weird: Name:sm_120a:96");
  ASSERT_TRUE(colon.ok()) << colon.status();
  EXPECT_EQ(colon->name, "Weird: Name");
  EXPECT_EQ(colon->sm, 120);
  EXPECT_FALSE(ParseFakeGpu("NVIDIA H200").ok());
  EXPECT_FALSE(ParseFakeGpu("NVIDIA H200:90").ok());
  EXPECT_FALSE(ParseFakeGpu(":90:141").ok());
  EXPECT_FALSE(ParseFakeGpu("H200:ninety:141").ok());
  EXPECT_FALSE(ParseFakeGpu("H200:90:-1").ok());
}

// A fake GPU's link kind sets its peers: nvlink pairs reach each other by NVLink and peer access,
// p2p ones by peer access, pcie ones by neither; without a kind nothing is known.
TEST(InventoryTest, FakeGpuTopology) {
  auto nvlink = ParseFakeGpu("NVIDIA H200:90:141:nvlink");
  ASSERT_TRUE(nvlink.ok()) << nvlink.status();
  EXPECT_EQ(nvlink->name, "NVIDIA H200");
  EXPECT_EQ(nvlink->memory_bytes, int64_t{141} * 1024 * 1024 * 1024);
  EXPECT_EQ(nvlink->test_fake_link, "nvlink");
  EXPECT_FALSE(ParseFakeGpu("NVIDIA H200:90:nvlink").ok());
  auto inventory = DetectInventory(
      {"A:90:80:nvlink", "A:90:80:nvlink", "A:90:80:p2p", "A:90:80:pcie", "A:90:80"});
  ASSERT_TRUE(inventory.ok()) << inventory.status();
  const std::vector<GpuInfo>& gpus = inventory->gpus;
  ASSERT_EQ(gpus.size(), 5u);
  EXPECT_EQ(gpus[0].p2p_peers, (std::vector<int>{1, 2}));
  EXPECT_EQ(gpus[0].nvlink_peers, (std::vector<int>{1}));
  EXPECT_EQ(gpus[2].p2p_peers, (std::vector<int>{0, 1}));
  EXPECT_TRUE(gpus[2].nvlink_peers.empty());
  EXPECT_TRUE(gpus[3].p2p_peers.empty());
  EXPECT_TRUE(gpus[4].p2p_peers.empty());
}

// A host of mixed GPUs offers each as what it is: a slot per CUDA device with that device's name,
// SM, memory and PCI bus id, the driver's versions on each; TEST ONLY slots past the devices
// (a rank device map sharing GPUs) copy GPU 0; no devices, no slots.
TEST(InventoryTest, EachGpuIsOfferedAsWhatItIs) {
  LocalDevices devices;
  devices.has_cuda_build = true;
  devices.cuda_driver_version = "13.0";
  devices.gpus = {{"NVIDIA H200", 90, int64_t{141} << 30, "00000000:19:00.0"},
                  {"NVIDIA L40S", 89, int64_t{48} << 30, "00000000:3B:00.0"}};
  std::vector<GpuInfo> gpus = GpusOf(devices, "580.95.05", 2);
  ASSERT_EQ(gpus.size(), 2u);
  EXPECT_EQ(gpus[0].name, "NVIDIA H200");
  EXPECT_EQ(gpus[0].sm, 90);
  EXPECT_EQ(gpus[0].memory_bytes, int64_t{141} << 30);
  EXPECT_EQ(gpus[1].index, 1);
  EXPECT_EQ(gpus[1].name, "NVIDIA L40S");
  EXPECT_EQ(gpus[1].sm, 89);
  EXPECT_EQ(gpus[1].memory_bytes, int64_t{48} << 30);
  EXPECT_EQ(gpus[1].pci_bus_id, "00000000:3B:00.0");
  for (const GpuInfo& g : gpus) {
    EXPECT_EQ(g.driver_version, "580.95.05");
    EXPECT_EQ(g.cuda_version, "13.0");
    EXPECT_FALSE(g.test_fake);
  }
  gpus = GpusOf(devices, "580.95.05", 3);
  ASSERT_EQ(gpus.size(), 3u);
  EXPECT_EQ(gpus[2].index, 2);
  EXPECT_EQ(gpus[2].name, "NVIDIA H200");
  EXPECT_EQ(gpus[2].pci_bus_id, gpus[0].pci_bus_id);
  EXPECT_TRUE(GpusOf(LocalDevices{}, "580.95.05", 2).empty());
}

// Peers are set over every ordered pair of different GPUs: slots that share a PCI bus id (one
// GPU offered twice under a rank device map) are no peers of each other.
TEST(InventoryTest, TopologyPairsDifferentGpusOnly) {
  std::vector<GpuInfo> gpus(3);
  for (int i = 0; i < 3; ++i) gpus[i].index = i;
  gpus[0].pci_bus_id = gpus[2].pci_bus_id = "00000000:19:00.0";
  gpus[1].pci_bus_id = "00000000:3B:00.0";
  std::vector<std::pair<int, int>> asked;
  SetTopology(gpus, [&](const GpuInfo& a, const GpuInfo& b) {
    asked.emplace_back(a.index, b.index);
    return PeerLink{true, a.index + b.index == 1};
  });
  EXPECT_THAT(asked, testing::UnorderedElementsAre(std::pair{0, 1}, std::pair{1, 0},
                                                   std::pair{1, 2}, std::pair{2, 1}));
  EXPECT_EQ(gpus[0].p2p_peers, (std::vector<int>{1}));
  EXPECT_EQ(gpus[0].nvlink_peers, (std::vector<int>{1}));
  EXPECT_EQ(gpus[1].p2p_peers, (std::vector<int>{0, 2}));
  EXPECT_EQ(gpus[1].nvlink_peers, (std::vector<int>{0}));
  EXPECT_EQ(gpus[2].p2p_peers, (std::vector<int>{1}));
  EXPECT_TRUE(gpus[2].nvlink_peers.empty());
}

}  // namespace
}  // namespace infersweep
