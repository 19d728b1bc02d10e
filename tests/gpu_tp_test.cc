// Tensor parallelism on the CUDA engine, through the trial runner as `run` and the agent call
// it: tp=2 runs as two rank processes (harness/rank_supervisor.h), each its shard of the model,
// joined by the custom all-reduce over CUDA IPC. On one GPU the TEST ONLY map
// INFERSWEEP_RANK_DEVICES=0,0 puts both ranks there (NCCL takes one rank a GPU, so nccl is
// refused there). The ranks' logits, on bf16 and on quantized shards, are judged against the GPU
// reference at tp=1; a killed rank makes the trial CRASHED naming it. Skipped (not failed) on
// machines without a GPU: CI compiles it, the GPU machine runs it (scripts/gpu.sh stage tp).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

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

// Both ranks on GPU 0 for one test, and the variable as it was after it.
class BothRanksOnGpu0 : public ScopedEnv {
 public:
  BothRanksOnGpu0() : ScopedEnv("INFERSWEEP_RANK_DEVICES", "0,0") {}
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

// Quantized weights at tp=2: each rank uploads its shard's codes and scales (cut on their scale
// groups, ShardHostModel) and runs them through the qgemm under test; the logits are judged
// against the GPU reference at tp=1 on the whole quantized model. The fp32-class runs
// (qgemm=reference) hold 1e-4 relative and every greedy token; the others are OK in their class.
// A model whose cuts fall inside FP8 128-blocks (tiny-moe's 32-wide heads) is UNSUPPORTED naming
// a weight and its cut, and bad-quant-scale (a tensor of the whole model) is refused at tp=2.
TEST_F(GpuTp, QuantizedShardsOnTwoRanksMatchTpOne) {
  BothRanksOnGpu0 map;
  struct Case {
    const char* model;
    const char* config;
    bool fp32;
  };
  const Case cases[] = {
      {"preset:tiny-moe@nvfp4", "device=cuda,qgemm=reference", true},
      {"preset:tiny-moe@nvfp4", "device=cuda,gemm=fused,attention=flash,moe=fused,qgemm=w4a16",
       false},
      {"preset:tiny-dense@nvfp4", "device=cuda,gemm=cublaslt,qgemm=w4a16", false},
      {"preset:tiny-moe@mxfp4", "device=cuda,qgemm=reference", true},
      {"preset:tiny-moe@mxfp4", "device=cuda,gemm=fused,moe=fused,qgemm=w4a16", false},
      {"preset:tiny-moe@fp8_channel", "device=cuda,qgemm=reference", true},
      {"preset:tiny-moe@fp8_channel", "device=cuda,gemm=fused,moe=fused,qgemm=w8a16", false},
      {"preset:tiny-qwen2-moe@fp8_channel",
       "device=cuda,gemm=fused,attention=flash,moe=fused,graphs=on,qgemm=w8a16", false},
      {"preset:tiny-moe@fp8_tensor", "device=cuda,gemm=cublaslt,qgemm=dequant_bf16", false},
      {"preset:tiny-dense@fp8_channel", "device=cuda,gemm=cublaslt,qgemm=fp8_cublaslt", false},
      {"preset:tiny-dense@fp8_tensor", "device=cuda,gemm=cublaslt,qgemm=cudnn,graphs=off", false},
  };
  for (const Case& c : cases) {
    const std::string config = std::string(c.config) + ",tp=2,allreduce=custom";
    const TrialResult r = RunTrial(c.model, config);
    EXPECT_EQ(r.status, TrialStatus::kOk) << c.model << " " << config << ": " << r.reason << "\n"
                                          << r.stderr_tail;
    EXPECT_FALSE(r.batches.empty()) << c.model << " " << config;
    if (c.fp32) {
      EXPECT_LE(r.verdict.max_rel_error, 1e-4) << c.model << " " << config;
      EXPECT_EQ(r.verdict.top1_agreement, 1.0) << c.model << " " << config;
    }
  }
  const TrialResult block =
      RunTrial("preset:tiny-moe@fp8_block128", "device=cuda,qgemm=w8a16,tp=2,allreduce=custom");
  EXPECT_EQ(block.status, TrialStatus::kUnsupported) << block.reason;
  EXPECT_THAT(block.reason, HasSubstr("device=cuda runs quantized shards only"));
  EXPECT_THAT(block.reason, HasSubstr("model.layers.0.self_attn.q_proj.weight (fp8_block128 "
                                      "[128, 128]): rank 1's rows [64, 128) start inside a "
                                      "128-row scale block"));
  const TrialResult fault =
      RunTrial("preset:tiny-moe@nvfp4", "device=cuda,tp=2,allreduce=custom", "bad-quant-scale:16");
  EXPECT_EQ(fault.status, TrialStatus::kError) << fault.reason;
  EXPECT_THAT(fault.reason,
              HasSubstr("bad-quant-scale corrupts a scale tensor of the whole model"));
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
// per-channel the same with E4M3 codes. FP8 block-128 experts stay whole at ep=on, but the tiny
// presets' 32-wide attention heads cut the q/k/v blocks: UNSUPPORTED naming the cut. Needs
// quantized weights at CUDA tp > 1 (the registry's tp=2 row taking the format): skipped, saying
// so, where it does not.
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
      {"preset:tiny-moe@fp8_channel",
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
  const TrialResult block =
      RunTrial("preset:tiny-moe@fp8_block128",
               "device=cuda,gemm=fused,attention=flash,moe=fused,graphs=on,qgemm=w8a16" + ranks);
  EXPECT_EQ(block.status, TrialStatus::kUnsupported) << block.reason;
  EXPECT_THAT(block.reason, HasSubstr("start inside a 128-row scale block"));
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
