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
#include <vector>

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

// `prompt_len` 0: GpuRequest's.
TrialResult RunTrial(const std::string& model, const std::string& config,
                     const std::string& fault = "", int prompt_len = 0) {
  RunnerOptions options;
  options.worker_argv = {WorkerBinary(), "worker"};
  TrialRunner runner(options);
  TrialRequest request = GpuRequest(model, config, fault);
  request.workload.timeout_s = 240;
  if (prompt_len > 0) request.workload.prompt_len = prompt_len;
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

// ep=on at tp=2: each rank holds 4 of the 8 experts whole (the router replicated, so both ranks
// route every token alike) and its MoE leaves out the pairs routed to the other rank's experts;
// the all-reduce adds the two partials. tiny-qwen2-moe adds a shared expert (sharded on its
// intermediate dimension, with its replicated gate) and a dense layer. A 48-token prompt takes
// every expert path of each moe value: batch-1 decode the per-pair GEMVs, batch-4 decode and the
// batch-1 prefill (96 pairs) the grouped mma.sync kernels, the batch-4 prefill (384 pairs, more
// than 16 an expert) cuBLAS's grouped GEMMs under moe=fused on cuBLASLt and wgmma under
// moe=wgmma (sm_90 only). The fp32 config within 1e-4 of the GPU reference at tp=1 with every
// greedy token the same; the bf16 ones OK in their class.
TEST_F(GpuTp, ExpertParallelRanksMatchTpOne) {
  BothRanksOnGpu0 map;
  const bool sm90 = ProbeLocalDevices().sm == 90;
  constexpr int kPrompt = 48;
  const std::string ranks = ",tp=2,ep=on,allreduce=custom";
  for (const char* model : {"preset:tiny-moe", "preset:tiny-qwen2-moe"}) {
    const TrialResult exact = RunTrial(model, "device=cuda" + ranks, "", kPrompt);
    EXPECT_EQ(exact.status, TrialStatus::kOk) << model << ": " << exact.reason << "\n"
                                              << exact.stderr_tail;
    EXPECT_LE(exact.verdict.max_rel_error, 1e-4) << model;
    EXPECT_EQ(exact.verdict.top1_agreement, 1.0) << model;
    EXPECT_FALSE(exact.batches.empty()) << model;
    std::vector<std::string> configs = {
        "device=cuda,gemm=cublaslt,attention=flash,moe=grouped,graphs=off",
        "device=cuda,gemm=cublaslt,attention=flash,moe=fused,graphs=off",
        "device=cuda,gemm=cublaslt,attention=flash,moe=fused,graphs=on",
        "device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=off",
        "device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=on"};
    if (sm90) {
      configs.push_back(
          "device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=wgmma,graphs=off");
      configs.push_back("device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=wgmma,graphs=on");
    }
    for (const std::string& config : configs) {
      const TrialResult r = RunTrial(model, config + ranks, "", kPrompt);
      EXPECT_EQ(r.status, TrialStatus::kOk) << model << " " << config << ": " << r.reason << "\n"
                                            << r.stderr_tail;
      EXPECT_FALSE(r.batches.empty()) << model << " " << config;
    }
  }
}

// ep=on at tp=2 on quantized experts: each rank's expert tables (the codes for w4a16 / w8a16,
// dequant_bf16's copies) hold its own experts, the others' entries null. NVFP4 takes the
// per-pair quantized GEMVs, the grouped quantized mma.sync kernels and (sm_90) wgmma's; FP8
// block-128 the per-pair GEMVs at decode and a bf16 copy of the rank's experts in prefill.
// Needs quantized weights at CUDA tp > 1 (the registry's tp=2 row taking the format): skipped,
// saying so, where it does not.
TEST_F(GpuTp, ExpertParallelQuantizedExpertsMatchTpOne) {
  BothRanksOnGpu0 map;
  const bool sm90 = ProbeLocalDevices().sm == 90;
  const std::string ranks = ",tp=2,ep=on,allreduce=custom";
  struct Case {
    const char* model;
    const char* format;
    std::vector<std::string> configs;
  };
  std::vector<Case> cases = {
      {"preset:tiny-moe@nvfp4",
       "nvfp4",
       {"device=cuda,gemm=fused,attention=flash,moe=fused,graphs=on,qgemm=w4a16",
        "device=cuda,gemm=cublaslt,attention=flash,moe=fused,graphs=off,qgemm=dequant_bf16"}},
      {"preset:tiny-moe@fp8_block128",
       "fp8",
       {"device=cuda,gemm=fused,attention=flash,moe=fused,graphs=on,qgemm=w8a16"}}};
  if (sm90)
    cases[0].configs.push_back(
        "device=cuda,gemm=fused,attention=flash,moe=wgmma,graphs=on,qgemm=w4a16");
  int ran = 0;
  std::string refused;
  for (const Case& c : cases) {
    PreflightTarget target;
    target.has_cuda_build = true;
    target.sm = 90;
    target.gpu_count = 2;
    target.weight_format = c.format;
    const PreflightResult tp2 =
        Preflight(*NormalizeBackendConfig(*ParseBackendConfig("device=cuda" + ranks)), target);
    if (!tp2.supported) {
      std::printf("# skipped %s: %s\n", c.model, tp2.reason.c_str());
      refused += std::string(c.model) + ": " + tp2.reason + "; ";
      continue;
    }
    ++ran;
    for (const std::string& config : c.configs) {
      const TrialResult r = RunTrial(c.model, config + ranks, "", 48);
      EXPECT_EQ(r.status, TrialStatus::kOk) << c.model << " " << config << ": " << r.reason << "\n"
                                            << r.stderr_tail;
      EXPECT_FALSE(r.batches.empty()) << c.model << " " << config;
    }
  }
  if (ran == 0) GTEST_SKIP() << refused;
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
