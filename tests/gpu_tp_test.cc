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
#include <string>

#include "api/backend_config.h"
#include "engine/backends.h"
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

}  // namespace
}  // namespace infersweep
