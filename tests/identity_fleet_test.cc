// The fleet's answers compare like with like: one preset run at two layer counts and two
// workloads by a real coordinator and agent (trials in `infersweep worker` children on the CPU),
// then `best`, `compare` and `regressions` through the CLI over gRPC. None of them ranks or
// judges across model identities or workloads; `best` lists the choices instead.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agent/agent.h"
#include "coordinator/client.h"
#include "coordinator/server.h"
#include "api/trial.h"
#include "storage/store.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// One sweep: tiny-moe at `layers`, prompt `prompt`, two configs. The agent says sm_90 so that
// queries read like a GPU fleet's; the trials run on the CPU.
std::string Sweep(int layers, int prompt) {
  return absl::StrCat("name: identity-", layers, "-", prompt, R"(
model: preset:tiny-moe
layers: )",
                      layers, R"(
matrix:
  device: [cpu]
  matmul: [naive, blocked]
  threads: ["1"]
workload: {prompt: )",
                      prompt, R"(, output: 4, batch: [1], repeats: 1, warmup: 0}
)");
}

std::string Key(int layers) {
  return absl::StrCat("preset:tiny-moe layers=", layers, " seed=1 weights=bf16");
}
std::string Workload(int prompt) { return absl::StrCat("prompt=", prompt, ",output=4,warmup=0"); }

class IdentityFleet : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(MakeTempDir("identity-fleet"));
    ASSERT_FALSE(dir_->empty());
    CoordinatorOptions o;
    o.lease_ms = 20'000;
    o.tick_ms = 50;
    o.log = [](const std::string&) {};
    server_ = new CoordinatorServer(o);
    absl::StatusOr<int> port = server_->Start("127.0.0.1:0", *dir_ + "/c.db");
    ASSERT_TRUE(port.ok()) << port.status();
    address_ = new std::string(absl::StrCat("127.0.0.1:", *port));
    AgentOptions a;
    a.coordinator = *address_;
    a.agent_id = "h200";
    a.spool_path = *dir_ + "/h200.spool.db";
    a.test_fake_gpus = {"NVIDIA H200:90:141"};
    a.worker_argv = {WorkerBinary(), "worker"};
    a.initial_backoff_ms = 50;
    a.max_backoff_ms = 300;
    a.log = [](const std::string&) {};
    agent_ = new Agent(a);
    ASSERT_TRUE(agent_->Start().ok());
    ServiceClient client(*address_);
    // Layers 1 then 2, each at prompts 8 and 16: four (model identity, workload) groups. The
    // layer-1 sweeps run twice, so each of their series has a history.
    for (auto [layers, prompt] :
         std::vector<std::pair<int, int>>{{1, 8}, {1, 16}, {1, 8}, {1, 16}, {2, 8}, {2, 16}}) {
      auto submitted = client.SubmitSweep(Sweep(layers, prompt), "identity.yaml");
      ASSERT_TRUE(submitted.ok()) << submitted.status();
      sweeps_.push_back(submitted->sweep_id());
      ASSERT_TRUE(WaitFor(
          [&] {
            auto s = client.GetSweep(submitted->sweep_id());
            return s.ok() && s->state() == "done";
          },
          60));
    }
  }
  static void TearDownTestSuite() {
    delete agent_;
    if (server_) server_->Stop();
    delete server_;
    std::filesystem::remove_all(*dir_);
    delete dir_;
    delete address_;
  }

  // Runs the CLI against the coordinator; stdout and stderr together.
  std::string Cli(const std::string& args, int* code) {
    return RunCommand(
        absl::StrCat(WorkerBinary(), " ", args, " --coordinator ", *address_, " 2>&1"), code);
  }

  // The fastest OK result at batch 1 of one group, from the store.
  std::string FastestConfig(int layers, int prompt) {
    ResultQuery q;
    q.model_key = Key(layers);
    q.workload = Workload(prompt);
    q.status = TrialStatus::kOk;
    absl::StatusOr<std::vector<StoredResult>> rows = server_->store()->QueryResults(q);
    EXPECT_TRUE(rows.ok());
    std::string best;
    double best_tok_s = -1;
    for (const StoredResult& r : *rows)
      if (r.result.batches.at(0).output_tok_s.median > best_tok_s) {
        best_tok_s = r.result.batches[0].output_tok_s.median;
        best = BackendConfigString(r.result.config);
      }
    return best;
  }

  static std::string* dir_;
  static std::string* address_;
  static CoordinatorServer* server_;
  static Agent* agent_;
  static std::vector<int64_t> sweeps_;
};

std::string* IdentityFleet::dir_ = nullptr;
std::string* IdentityFleet::address_ = nullptr;
CoordinatorServer* IdentityFleet::server_ = nullptr;
Agent* IdentityFleet::agent_ = nullptr;
std::vector<int64_t> IdentityFleet::sweeps_;

TEST_F(IdentityFleet, BestWithoutAWorkloadListsTheChoicesAndRanksWithinOne) {
  int code = -1;
  std::string out = Cli("best --model preset:tiny-moe --sm-arch sm_90", &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_THAT(out, HasSubstr("spans 4 (model identity, workload) groups"));
  for (int layers : {1, 2})
    for (int prompt : {8, 16})
      EXPECT_THAT(out, ::testing::ContainsRegex(absl::StrCat(Key(layers), " +", Workload(prompt))))
          << out;

  out = Cli("best --model preset:tiny-moe --sm-arch sm_90 --layers 2", &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_THAT(out, HasSubstr("spans 2 (model identity, workload) groups"));
  EXPECT_THAT(out, Not(HasSubstr(Key(1))));

  out =
      Cli("best --model preset:tiny-moe --sm-arch sm_90 --layers 2 --workload prompt=16,output=4,"
          "warmup=0",
          &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("ranked within: model ", Key(2), ", workload ",
                                          Workload(16), " (2 OK results")));
  EXPECT_THAT(out, HasSubstr(FastestConfig(2, 16)));
  // One sweep is one group: it needs no more.
  out = Cli(absl::StrCat("best --sweep ", sweeps_[0], " --sm-arch 90"), &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("model ", Key(1), ", workload ", Workload(8))));
  // A workload in any spelling ParseWorkload takes; a bad one names the field.
  out =
      Cli("best --model preset:tiny-moe --sm-arch 90 --layers 1 --workload output=4,prompt=8,"
          "warmup=0,repeats=9",
          &code);
  EXPECT_EQ(code, 0) << out;
  out = Cli("best --model preset:tiny-moe --sm-arch 90 --workload prompt=x", &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_THAT(out, HasSubstr("--workload: workload field 'prompt'"));
}

TEST_F(IdentityFleet, CompareStaysWithinOneGroup) {
  int code = -1;
  const std::string base =
      "compare --model preset:tiny-moe --sm-arch 90 --config matmul=naive --config matmul=blocked";
  std::string out = Cli(base, &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_THAT(out, HasSubstr("spans 4 (model identity, workload) groups"));
  out = Cli(base + " --layers 1 --workload prompt=8,output=4,warmup=0", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("# within: model ", Key(1), ", workload ", Workload(8))));
  EXPECT_THAT(out, HasSubstr("matmul=naive"));
  EXPECT_THAT(out, HasSubstr("matmul=blocked"));
}

TEST_F(IdentityFleet, RegressionsJudgeEachIdentityAndWorkloadApart) {
  int code = -1;
  // One history point is enough to be judged: the mixed series of the old key would compare the
  // 2-layer runs with the 1-layer history and flag them.
  const std::string out =
      Cli("regressions --min-history 1 --window 5 --min-change-pct 0 --z 0.0001 --model "
          "preset:tiny-moe",
          &code);
  EXPECT_EQ(code, 0) << out;
  std::vector<std::string> series;
  for (absl::string_view line : absl::StrSplit(out, '\n'))
    if (absl::StartsWith(line, " preset:tiny-moe")) series.emplace_back(line);
  ASSERT_EQ(series.size(), 8u) << out;  // 4 groups x 2 configs
  for (const std::string& line : series) {
    if (absl::StrContains(line, "layers=2")) {
      EXPECT_THAT(line, HasSubstr("too-few-points")) << line;
    } else {
      EXPECT_THAT(line, Not(HasSubstr("too-few-points"))) << line;  // judged, against its own
    }
  }
  EXPECT_THAT(out, HasSubstr("# 8 series"));
}

// What ran is visible: `results --show-kernels` lists each phase's launches, and `compare` says
// when two results with the same config string ran different kernels.
TEST_F(IdentityFleet, ResultsShowTheKernelsAndCompareNamesADifference) {
  int code = -1;
  std::string out = Cli(absl::StrCat("results --sweep ", sweeps_[0], " --show-kernels"), &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("matmul_naive"));
  EXPECT_THAT(out, HasSubstr("matmul_blocked"));
  EXPECT_THAT(out, HasSubstr("decode"));

  // Two stored results of one config on two arches, one of which fell back to another kernel.
  Store* store = server_->store();
  SweepRecord sweep;
  sweep.name = "same-config";
  sweep.model = "preset:tiny-moe";
  std::vector<TrialRecord> trials(2);
  for (TrialRecord& t : trials) {
    t.model = "preset:tiny-moe";
    t.layers = 7;
    t.config = *ParseBackendConfig("device=cpu,matmul=naive,threads=1");
    t.selector.device = Device::kCpu;
  }
  absl::StatusOr<int64_t> id = store->CreateSweep(sweep, trials);
  ASSERT_TRUE(id.ok()) << id.status();
  for (int i = 0; i < 2; ++i) {
    TrialResult r;
    r.trial_id = absl::StrCat(*id, "-", i);
    r.attempt = 1;
    r.status = TrialStatus::kOk;
    r.model = "preset:tiny-moe";
    r.config = trials[i].config;
    r.model_identity = {"preset", "tiny-moe", 7, 1, "bf16", ""};
    BatchFigures b;
    b.output_tok_s = {100, 100, 100};
    PhaseKernels decode;
    decode.kernels = {{"matmul_naive", 21}, {"attention", 7}};
    if (i == 1) {
      decode.kernels[0] = {"matmul_blocked", 21};
      decode.fallbacks = {"matmul=naive: handed to matmul_blocked (test)"};
    }
    b.decode_kernels = decode;
    b.prefill_kernels = PhaseKernels{};
    r.batches = {b};
    ASSERT_TRUE(store->RecordResult("", "NVIDIA H200", i == 0 ? 90 : 120, r).ok());
  }
  out =
      Cli("compare --model preset:tiny-moe --layers 7 --config matmul=naive --sm-arch 90 "
          "--sm-arch 120",
          &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("A and B have the same config string but ran different kernels"));
  EXPECT_THAT(out, HasSubstr("matmul_naive"));
  EXPECT_THAT(out, HasSubstr("matmul_blocked"));
  EXPECT_THAT(out, HasSubstr("handed to matmul_blocked"));
}

}  // namespace
}  // namespace infersweep
