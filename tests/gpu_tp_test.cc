// Tensor parallelism on the CUDA engine, through the trial runner as `run` and the agent call
// it: tp=2 runs as two rank processes (harness/rank_supervisor.h), each its shard of the model,
// joined by the custom all-reduce over CUDA IPC. On one GPU the TEST ONLY map
// INFERSWEEP_RANK_DEVICES=0,0 puts both ranks there (NCCL takes one rank a GPU, so nccl is
// refused there). The ranks' logits are judged against the GPU reference at tp=1; a killed rank
// makes the trial CRASHED naming it. Skipped (not failed) on machines without a GPU: CI compiles
// it, the GPU machine runs it (scripts/gpu.sh stage tp).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/backend_config.h"
#include "api/serve_spec.h"
#include "engine/backends.h"
#include "engine/npy.h"
#include "harness/runner.h"
#include "tests/gpu_trial.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using testing::HasSubstr;

class GpuTp : public testing::Test {
 public:
  void SetUp() override {
    if (ProbeLocalDevices().gpu_count == 0) GTEST_SKIP() << "no GPU on this machine";
  }
};

// Both ranks on GPU 0 for one test, and the variable unset after it.
class BothRanksOnGpu0 {
 public:
  BothRanksOnGpu0() { setenv("INFERSWEEP_RANK_DEVICES", "0,0", 1); }
  ~BothRanksOnGpu0() { unsetenv("INFERSWEEP_RANK_DEVICES"); }
};

TrialResult RunTrial(const std::string& model, const std::string& config,
                     const std::string& fault = "") {
  RunnerOptions options;
  options.worker_argv = {WorkerBinary(), "worker"};
  TrialRunner runner(options);
  TrialRequest request = GpuRequest(model, config, fault);
  request.workload.timeout_s = 240;
  const TrialResult r = runner.Run(request);
  std::printf("# %s %-75s %-11s top1 %.3f max_rel %.2g %s\n", model.c_str(), config.c_str(),
              std::string(TrialStatusName(r.status)).c_str(), r.verdict.top1_agreement,
              r.verdict.max_rel_error, r.reason.c_str());
  return r;
}

// tp=2 (fp32 kernels) against the GPU reference at tp=1: the shards' partial sums and the
// gathered vocabulary leave the logits within 1e-4 relative and every greedy token the same.
// The fast kernels at tp=2 (bf16 GEMMs, flash attention, the fused MoE, CUDA graphs replaying
// the cross-process all-reduce) are OK in their precision class.
TEST_F(GpuTp, TwoRanksOnOneGpuMatchTpOne) {
  BothRanksOnGpu0 map;
  for (const char* model : {"preset:tiny-moe", "preset:tiny-dense"}) {
    const TrialResult exact = RunTrial(model, "device=cuda,tp=2,allreduce=custom");
    EXPECT_EQ(exact.status, TrialStatus::kOk) << model << ": " << exact.reason << "\n"
                                              << exact.stderr_tail;
    EXPECT_LE(exact.verdict.max_rel_error, 1e-4) << model;
    EXPECT_EQ(exact.verdict.top1_agreement, 1.0) << model;
    EXPECT_FALSE(exact.batches.empty()) << model;
    const TrialResult fast =
        RunTrial(model,
                 "device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=on,tp=2,"
                 "allreduce=custom");
    EXPECT_EQ(fast.status, TrialStatus::kOk) << model << ": " << fast.reason << "\n"
                                             << fast.stderr_tail;
  }
}

// A rank SIGKILLed mid-trial (its first step): CRASHED naming rank 1, the other rank (waiting
// in the all-reduce) killed and reaped by the supervisor.
TEST_F(GpuTp, AKilledRankIsCrashedNamingIt) {
  BothRanksOnGpu0 map;
  const TrialResult r =
      RunTrial("preset:tiny-moe", "device=cuda,tp=2,allreduce=custom", "rank-kill:1");
  EXPECT_EQ(r.status, TrialStatus::kCrashed) << r.reason;
  EXPECT_THAT(r.reason, HasSubstr("rank 1 killed by signal 9"));
}

// NCCL refuses two ranks on one GPU: UNSUPPORTED saying so, before any rank waits on another.
// Without the map, tp beyond the host's GPUs is UNSUPPORTED naming the count.
TEST_F(GpuTp, WhatOneGpuCannotRunIsUnsupported) {
  {
    BothRanksOnGpu0 map;
    const TrialResult nccl = RunTrial("preset:tiny-moe", "device=cuda,tp=2,allreduce=nccl");
    EXPECT_EQ(nccl.status, TrialStatus::kUnsupported) << nccl.reason;
    EXPECT_THAT(nccl.reason, HasSubstr("allreduce=nccl takes one rank a GPU"));
  }
  const int gpus = ProbeLocalDevices().gpu_count;
  if (gpus < 2) {
    const TrialResult r = RunTrial("preset:tiny-moe", "device=cuda,tp=2,allreduce=custom");
    EXPECT_EQ(r.status, TrialStatus::kUnsupported) << r.reason;
    EXPECT_THAT(r.reason, HasSubstr("tp=2 needs 2 GPUs of one host; this host has 1"));
  }
}

// Serving at tp=2 over two rank processes: rank 0's clock plans every step, so both ranks run the
// same ragged steps (the all-reduces between them); the served tokens are judged as at tp=1, for a
// MoE and a hybrid (Gated DeltaNet states per slot on each rank's heads), eager and with graphs
// per decode bucket. A rank killed mid-serve is CRASHED naming it.
TEST_F(GpuTp, TwoRanksServeTheSameSteps) {
  BothRanksOnGpu0 map;
  auto serving = [](const std::string& model, const std::string& config,
                    const std::string& fault = "") {
    TrialRequest request = GpuRequest(model, config, fault);
    auto spec = ParseServeSpec("concurrency=1:4,isl=8-30,osl=4-10,requests=8,chunk=6");
    EXPECT_TRUE(spec.ok()) << spec.status();
    request.workload.serve = *spec;
    request.workload.timeout_s = 240;
    RunnerOptions options;
    options.worker_argv = {WorkerBinary(), "worker"};
    TrialRunner runner(options);
    return runner.Run(request);
  };
  for (const char* model : {"preset:tiny-moe", "preset:tiny-hybrid"})
    for (const char* config :
         {"device=cuda,tp=2,allreduce=custom",
          "device=cuda,gemm=fused,attention=naive,moe=fused,graphs=on,tp=2,allreduce=custom"}) {
      const TrialResult r = serving(model, config);
      std::printf("# served %s %s: %s %s\n", model, config,
                  std::string(TrialStatusName(r.status)).c_str(), r.reason.c_str());
      ASSERT_EQ(r.status, TrialStatus::kOk) << model << " " << config << ": " << r.reason << "\n"
                                            << r.stderr_tail;
      ASSERT_EQ(r.serving.size(), 2u) << model << " " << config;
      for (const ServingPoint& p : r.serving) {
        EXPECT_EQ(p.verdict, TrialStatus::kOk)
            << model << " " << config << ": " << p.reason << p.first_mismatch;
        EXPECT_EQ(p.completed, 8) << model << " " << config;
      }
    }
  const TrialResult killed =
      serving("preset:tiny-hybrid", "device=cuda,tp=2,allreduce=custom", "rank-kill:1");
  EXPECT_EQ(killed.status, TrialStatus::kCrashed) << killed.reason;
  EXPECT_THAT(killed.reason, HasSubstr("rank 1 killed by signal 9"));
}

// The external oracle at tp=2: `infersweep logits` over two rank processes (the CLI starts them
// as a trial's runner does), on every transformers fixture the model's heads split over two
// ranks: within 1e-4 of max|logit| of transformers' fp32 logits and the same greedy pick at every
// position, the bar tp=1 meets (Gpu.ReferenceMatchesCpuAndTransformersOnFixtures).
TEST_F(GpuTp, LogitsAtTpTwoMatchTransformersOnFixtures) {
  BothRanksOnGpu0 map;
  const std::string root = SourceDir() + "/tests/fixtures/hf";
  const std::string dir = MakeTempDir("infersweep-tp-logits");
  ASSERT_FALSE(dir.empty());
  int compared = 0;
  for (const std::string& name : FixtureNames(root)) {
    const std::string fixture = root + "/" + name;
    std::ifstream in(fixture + "/expected.json");
    const auto prompt = nlohmann::json::parse(in).at("prompt").get<std::vector<int32_t>>();
    auto expected = ReadNpyFloat32(fixture + "/logits.npy");
    ASSERT_TRUE(expected.ok()) << expected.status();
    const std::string out = dir + "/" + name + ".npy";
    const std::string command =
        absl::StrCat(WorkerBinary(), " logits --model ", fixture,
                     " --backend cuda --config tp=2,allreduce=custom --tokens ",
                     absl::StrJoin(prompt, ","), " --out ", out, " 2>&1");
    int rc = 0;
    const std::string output = RunCommand(command, &rc);
    if (output.find("UNSUPPORTED") != std::string::npos) {
      std::printf("# %s at tp=2: %s", name.c_str(), output.c_str());
      continue;
    }
    ASSERT_EQ(rc, 0) << name << ": " << output;
    auto got = ReadNpyFloat32(out);
    ASSERT_TRUE(got.ok()) << name << ": " << got.status();
    ASSERT_EQ(got->data.size(), expected->data.size()) << name;
    const int64_t vocab = got->shape.back();
    int same_pick = 0;
    const int positions = static_cast<int>(prompt.size());
    for (int t = 0; t < positions; ++t) {
      auto row = [&](const std::vector<float>& v) {
        return std::max_element(v.begin() + t * vocab, v.begin() + (t + 1) * vocab) - v.begin();
      };
      same_pick += row(got->data) == row(expected->data);
    }
    const double error = RelMaxError(got->data, expected->data);
    std::printf("# %s at tp=2 vs transformers: %.3g of max|logit|, greedy %d/%d\n", name.c_str(),
                error, same_pick, positions);
    EXPECT_LE(error, 1e-4) << name;
    EXPECT_EQ(same_pick, positions) << name;
    ++compared;
  }
  std::filesystem::remove_all(dir);
  EXPECT_GE(compared, 5);
}

}  // namespace
}  // namespace infersweep
