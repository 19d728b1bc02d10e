// The trial harness: configs, preflight, workloads, verdicts, and isolation under injected faults.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/model_config.h"
#include "engine/backends.h"
#include "engine/cpu_model.h"
#include "engine/roofline.h"
#include "engine/sampler.h"
#include "engine/synthetic.h"
#include "engine/weights.h"
#include "harness/child_process.h"
#include "harness/executor.h"
#include "harness/gpu_sampler.h"
#include "harness/measure.h"
#include "harness/report.h"
#include "harness/runner.h"
#include "harness/verdict.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using testing::HasSubstr;
using testing::Not;

TEST(BackendConfig, ParsesAndNormalizesWithDefaults) {
  auto parsed = ParseBackendConfig("matmul=blocked, threads=2");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  auto normalized = NormalizeBackendConfig(*parsed);
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  EXPECT_EQ(BackendConfigString(*normalized), "device=cpu,matmul=blocked,threads=2");
}

TEST(BackendConfig, RejectsMalformedAndUnknown) {
  EXPECT_THAT(ParseBackendConfig("matmul").status().message(), HasSubstr("axis=value"));
  EXPECT_THAT(ParseBackendConfig("a=1,a=2").status().message(), HasSubstr("given twice"));
  auto unknown_axis = NormalizeBackendConfig({{"flux", "on"}});
  EXPECT_THAT(unknown_axis.status().message(), HasSubstr("'flux' is not an axis of cpu"));
  auto unknown_value = NormalizeBackendConfig({{"matmul", "magic"}});
  EXPECT_THAT(unknown_value.status().message(), HasSubstr("unknown value 'magic'"));
  EXPECT_THAT(unknown_value.status().message(), HasSubstr("naive, blocked"));
  auto wrong_device_axis = NormalizeBackendConfig({{"device", "cpu"}, {"graphs", "on"}});
  EXPECT_FALSE(wrong_device_axis.ok());
  EXPECT_FALSE(NormalizeBackendConfig({{"device", "tpu"}}).ok());
}

TEST(Preflight, GatesOnBuildAndConflicts) {
  auto cuda = NormalizeBackendConfig({{"device", "cuda"}, {"gemm", "cublaslt"}});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  PreflightTarget no_build{false, 0, 0, "bf16"};
  EXPECT_THAT(Preflight(*cuda, no_build).reason, HasSubstr("needs a build with CUDA"));
  PreflightTarget hopper{true, 90, 1, "bf16"};
  EXPECT_TRUE(Preflight(*cuda, hopper).supported) << Preflight(*cuda, hopper).reason;
  EXPECT_EQ(Preflight(*cuda, hopper).precision, PrecisionClass::kBf16);
  PreflightTarget no_gpu{true, 0, 0, "bf16"};
  EXPECT_THAT(Preflight(*cuda, no_gpu).reason, HasSubstr("needs a GPU"));
  PreflightTarget fp32_weights{true, 90, 1, "f32"};
  EXPECT_THAT(Preflight(*cuda, fp32_weights).reason, HasSubstr("does not take f32 weights"));

  auto conflict = NormalizeBackendConfig({{"device", "cuda"}, {"moe", "loop"}, {"graphs", "on"}});
  ASSERT_TRUE(conflict.ok());
  EXPECT_THAT(Preflight(*conflict, hopper).reason,
              HasSubstr("moe=loop cannot be combined with graphs=on"));

  auto cpu = NormalizeBackendConfig({{"matmul", "blocked"}});
  ASSERT_TRUE(cpu.ok());
  EXPECT_TRUE(Preflight(*cpu, no_build).supported);
  EXPECT_EQ(Preflight(*cpu, no_build).precision, PrecisionClass::kFp32);
}

// The KV cache dtype is an axis: fp32 by default (the GPU reference), bf16 a bf16-class value
// that only the flash kernels read.
TEST(Preflight, KvCacheAxisDefaultsToFp32AndBf16NeedsFlash) {
  auto plain = NormalizeBackendConfig({{"device", "cuda"}, {"attention", "flash"}});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->at("kv_cache"), "fp32");
  PreflightTarget hopper{true, 90, 1, "bf16"};
  auto naive = NormalizeBackendConfig({{"device", "cuda"}, {"kv_cache", "bf16"}});
  ASSERT_TRUE(naive.ok()) << naive.status();
  EXPECT_THAT(Preflight(*naive, hopper).reason,
              HasSubstr("kv_cache=bf16 cannot be combined with attention=naive"));
  auto flash = NormalizeBackendConfig(
      {{"device", "cuda"}, {"gemm", "reference"}, {"attention", "flash"}, {"kv_cache", "bf16"}});
  ASSERT_TRUE(flash.ok()) << flash.status();
  EXPECT_TRUE(Preflight(*flash, hopper).supported) << Preflight(*flash, hopper).reason;
  EXPECT_EQ(Preflight(*flash, hopper).precision, PrecisionClass::kBf16);
  EXPECT_THAT(NormalizeBackendConfig({{"device", "cuda"}, {"kv_cache", "fp16"}}).status().message(),
              HasSubstr("known: fp32, bf16, fp8"));
}

// kv_cache=fp8 judges as fp8 (its E4M3 rounding is the config's coarsest), is read by the flash
// kernels only, and is refused by the backends with their own bf16 attention.
TEST(Preflight, KvCacheFp8IsAnFp8ClassValueForFlashOnly) {
  PreflightTarget hopper{true, 90, 1, "bf16"};
  auto flash = NormalizeBackendConfig(
      {{"device", "cuda"}, {"gemm", "fused"}, {"attention", "flash"}, {"kv_cache", "fp8"}});
  ASSERT_TRUE(flash.ok()) << flash.status();
  EXPECT_TRUE(Preflight(*flash, hopper).supported) << Preflight(*flash, hopper).reason;
  EXPECT_EQ(Preflight(*flash, hopper).precision, PrecisionClass::kFp8);
  const std::vector<std::pair<BackendConfig, std::string>> refused = {
      {{{"device", "cuda"}, {"kv_cache", "fp8"}},
       "kv_cache=fp8 cannot be combined with attention=naive"},
      {{{"device", "cuda"}, {"attention", "cudnn"}, {"kv_cache", "fp8"}},
       "cuDNN's fused attention reads bf16 K and V"},
      {{{"device", "cuda"},
        {"gemm", "fused"},
        {"attention", "flash"},
        {"kv_cache", "fp8"},
        {"graphs", "persistent"}},
       "the persistent kernel's own attention reads a bf16 cache"}};
  for (const auto& [axes, reason] : refused) {
    auto config = NormalizeBackendConfig(axes);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_THAT(Preflight(*config, hopper).reason, HasSubstr(reason));
  }
}

// SM ranges, judged against a registry of the test's own (an sm_90a-only kernel).
TEST(Preflight, GatesOnSmRange) {
  std::vector<BackendDescriptor> registry = {
      {"device", "cuda", Device::kCuda, 80, 0, true, {}, {}, PrecisionClass::kFp32, ""},
      {"gemm",
       "hopper_only",
       Device::kCuda,
       90,
       90,
       true,
       {"bf16"},
       {},
       PrecisionClass::kBf16,
       ""}};
  const BackendConfig config = {{"device", "cuda"}, {"gemm", "hopper_only"}};
  EXPECT_TRUE(Preflight(config, {true, 90, 1, "bf16"}, registry).supported);
  EXPECT_THAT(Preflight(config, {true, 120, 1, "bf16"}, registry).reason,
              HasSubstr("gemm=hopper_only runs only up to sm_90"));
  EXPECT_THAT(Preflight(config, {true, 75, 1, "bf16"}, registry).reason,
              HasSubstr("device=cuda needs sm_80 or newer"));
  EXPECT_THAT(
      Preflight({{"device", "cuda"}, {"gemm", "nope"}}, {true, 90, 1, "bf16"}, registry).reason,
      HasSubstr("not registered"));
}

// The real registry's sm_90a-only backends: OK on Hopper, UNSUPPORTED (not a crash) elsewhere.
TEST(Preflight, Sm90aBackendsAreExactlySm90) {
  for (const auto& [axis, value] : {std::pair<std::string, std::string>{"gemm", "tma"},
                                    std::pair<std::string, std::string>{"moe", "wgmma"}}) {
    const std::string name = axis + "=" + value;
    auto config = NormalizeBackendConfig({{"device", "cuda"}, {axis, value}});
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_TRUE(Preflight(*config, {true, 90, 1, "bf16"}).supported) << name;
    for (int sm : {80, 89, 100, 120}) {
      const PreflightResult r = Preflight(*config, {true, sm, 1, "bf16"});
      EXPECT_FALSE(r.supported) << name << " on sm_" << sm;
      EXPECT_THAT(r.reason, HasSubstr(name)) << sm;
    }
    // bf16 weights only: quantized experts keep moe=fused's per-pair kernels.
    const PreflightResult fp4 = Preflight(*config, {true, 90, 1, "nvfp4"});
    EXPECT_FALSE(fp4.supported) << name;
    EXPECT_THAT(fp4.reason, HasSubstr(name)) << name;
  }
}

// graphs=persistent: Hopper machine code, bf16 weights or fp8 / FP4 codes read in registers
// (qgemm=w8a16 / w4a16, or dequant_bf16's copies), a bf16 KV cache, gemm=fused, and no
// host-syncing MoE runner (batch > 1 steps take graphs=on's captured chain).
TEST(Preflight, PersistentDecodeNeedsHopperStreamableWeightsAndCache) {
  const BackendConfig base = {{"device", "cuda"},   {"gemm", "fused"}, {"attention", "flash"},
                              {"kv_cache", "bf16"}, {"moe", "fused"},  {"graphs", "persistent"}};
  auto config = NormalizeBackendConfig(base);
  ASSERT_TRUE(config.ok()) << config.status();
  const PreflightResult hopper = Preflight(*config, {true, 90, 1, "bf16"});
  EXPECT_TRUE(hopper.supported) << hopper.reason;
  EXPECT_EQ(hopper.precision, PrecisionClass::kBf16);
  for (int sm : {80, 89, 100, 120})
    EXPECT_THAT(Preflight(*config, {true, sm, 1, "bf16"}).reason, HasSubstr("graphs=persistent"))
        << sm;
  EXPECT_THAT(Preflight(*config, {true, 90, 1, "f32"}).reason,
              HasSubstr("graphs=persistent does not take f32 weights"));
  for (const char* format : {"nvfp4", "mxfp4"})
    for (const char* qgemm : {"w4a16", "dequant_bf16"}) {
      BackendConfig fp4 = base;
      fp4["qgemm"] = qgemm;
      const PreflightResult streamed =
          Preflight(*NormalizeBackendConfig(fp4), {true, 90, 1, format});
      EXPECT_TRUE(streamed.supported) << format << " " << qgemm << ": " << streamed.reason;
    }
  BackendConfig fp8 = base;
  fp8["qgemm"] = "w8a16";
  EXPECT_TRUE(Preflight(*NormalizeBackendConfig(fp8), {true, 90, 1, "fp8"}).supported);
  for (const char* qgemm : {"reference", "fp8_cublaslt"}) {  // nothing the kernel can stream
    fp8["qgemm"] = qgemm;
    EXPECT_THAT(Preflight(*NormalizeBackendConfig(fp8), {true, 90, 1, "fp8"}).reason,
                HasSubstr(std::string("graphs=persistent cannot be combined with qgemm=") + qgemm))
        << qgemm;
  }
  BackendConfig fp32_cache = base;
  fp32_cache["kv_cache"] = "fp32";
  EXPECT_THAT(Preflight(*NormalizeBackendConfig(fp32_cache), {true, 90, 1, "bf16"}).reason,
              HasSubstr("graphs=persistent cannot be combined with kv_cache=fp32"));
  BackendConfig loop = base;
  loop["moe"] = "loop";
  EXPECT_THAT(Preflight(*NormalizeBackendConfig(loop), {true, 90, 1, "bf16"}).reason,
              HasSubstr("moe=loop cannot be combined with graphs=persistent"));
  // Its batch-1 decode is its own kernel's GEMVs: another gemm value would name a GEMM that
  // decode never ran. moe=wgmma differs from moe=fused only at 4+ rows, which graphs=on runs.
  for (const char* gemm : {"reference", "cublaslt", "tma"}) {
    BackendConfig other = base;
    other["gemm"] = gemm;
    const PreflightResult r = Preflight(*NormalizeBackendConfig(other), {true, 90, 1, "bf16"});
    EXPECT_FALSE(r.supported) << gemm;
    EXPECT_THAT(r.reason,
                HasSubstr(std::string("graphs=persistent cannot be combined with gemm=") + gemm +
                          ": its batch-1 decode step runs the persistent kernel's "
                          "own GEMVs"))
        << gemm;
  }
  BackendConfig wgmma = base;
  wgmma["moe"] = "wgmma";
  EXPECT_TRUE(Preflight(*NormalizeBackendConfig(wgmma), {true, 90, 1, "bf16"}).supported);
}

// A preset's head_dim can be overridden (the persistent kernel's GPU test takes head_dims the
// presets lack): the attention weights take the new shape and the CPU reference runs on it; an
// override the model cannot take is refused naming the preset and the value.
TEST(Presets, HeadDimOverrideReshapesAttentionOrSaysWhy) {
  LoadOptions options{2};
  options.head_dim_override = 64;
  auto host = LoadHostModel("preset:tiny-moe", options);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ((*host)->config.head_dim, 64);
  bool saw_q = false;
  for (const TensorSpec& spec : (*host)->specs)
    if (spec.name == "model.layers.0.self_attn.q_proj.weight") {
      saw_q = true;
      EXPECT_EQ(spec.shape, (std::vector<int64_t>{(*host)->config.num_q_heads * 64,
                                                  (*host)->config.hidden_size}));
    }
  EXPECT_TRUE(saw_q);
  auto model = CreateModel(**host, *NormalizeBackendConfig({{"device", "cpu"}}));
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->StartBatch(1, 8).ok());
  const std::vector<int32_t> prompt = {1, 2, 3};
  std::vector<float> logits;
  ASSERT_TRUE((*model)->Forward(prompt, 3, LogitsMode::kLast, &logits).ok());
  EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));

  options.head_dim_override = 33;  // RoPE rotates pairs
  auto odd = LoadHostModel("preset:tiny-moe", options);
  ASSERT_FALSE(odd.ok());
  EXPECT_THAT(std::string(odd.status().message()), HasSubstr("preset 'tiny-moe' with head_dim 33"));
}

// The eval judges decode steps too: each prompt's last decode_steps tokens go one step at a time
// at the eval batch, then prompt 0 again alone (batch 1 has decode kernels of its own). On the
// CPU reference every way of computing a position gives the same logits, so the blocks agree.
// The CPU reference's eval outputs on tiny-moe (2 layers), and its vocabulary size.
struct ReferenceEval {
  EvalOutputs outputs;
  int vocab = 0;
};
absl::StatusOr<ReferenceEval> TinyMoeReferenceEval(const EvalSpec& spec) {
  auto host = LoadHostModel("preset:tiny-moe", {2});
  if (!host.ok()) return host.status();
  auto model = CreateModel(**host, *NormalizeBackendConfig({{"device", "cpu"}}));
  if (!model.ok()) return model.status();
  auto outputs = RunEval(**model, spec);
  if (!outputs.ok()) return outputs.status();
  return ReferenceEval{*std::move(outputs), (*host)->config.vocab_size};
}

TEST(Verdict, EvalTeacherForcesDecodeStepsAtTheBatchAndAtBatchOne) {
  EvalSpec spec;
  auto eval = TinyMoeReferenceEval(spec);
  ASSERT_TRUE(eval.ok()) << eval.status();
  const EvalOutputs* out = &eval->outputs;
  const size_t vocab = eval->vocab, len = spec.prompt_len;
  ASSERT_EQ(out->logits.size(), (spec.prompts + 1) * len * vocab);
  // Prompt 0 at batch 1 (the last block) against prompt 0 at the eval batch (the first).
  const float* batched = out->logits.data();
  const float* alone = out->logits.data() + spec.prompts * len * vocab;
  double worst = 0;
  for (size_t i = 0; i < len * vocab; ++i)
    worst = std::max(worst, std::fabs(double{batched[i]} - alone[i]));
  EXPECT_LE(worst, 1e-4);
  // A decode step's logits differ from the prefill position before it (the test can see them).
  const size_t last_prefill = len - spec.decode_steps - 1;
  EXPECT_NE(alone[last_prefill * vocab], alone[(last_prefill + 1) * vocab]);
  // And a wrong batch-1 decode step is judged: the same outputs with one decode position of the
  // batch-1 block corrupted are INCORRECT.
  EvalOutputs corrupted = *out;
  float* step = corrupted.logits.data() + (spec.prompts * len + len - 1) * vocab;
  for (size_t i = 0; i < vocab; ++i) step[i] = (i % 7) * 3.f;
  VerdictMetrics metrics;
  EXPECT_EQ(JudgeOutputs(*out, *out, static_cast<int>(vocab), PrecisionClass::kFp32, &metrics),
            TrialStatus::kOk);
  EXPECT_EQ(JudgeOutputs(*out, corrupted, static_cast<int>(vocab), PrecisionClass::kFp32, &metrics),
            TrialStatus::kIncorrect);
}

// Each forward pass is judged on its own: batch-1 decode makes 8 of the 160 teacher-forced
// positions, so a batch-1 decode path wrong by KL ~0.05 a position (e.g. graphs=persistent with
// every layer's MLP output dropped) moves the overall kl_mean by only ~0.0025 and top-1 by at most
// 5 %, inside the bf16 class's overall ceilings. A pass's ceilings are looser than the overall ones
// (8 positions are noisier than 160): KL 0.018 on one pass (correct backends on tiny-moe's
// quantized weights measured up to 0.0187) and a quarter of the wrong path's noise on every
// position stay OK; a pass with its argmaxes flipped at small KL is INCORRECT by its top-1
// agreement. The bf16 yardstick's drift widens the ceilings only where twice it exceeds them, to
// twice its KL and its top-1 less 0.15; a config as far from the reference as twice the
// yardstick's drift passes under them, garbage does not; a yardstick within half the class's
// ceilings widens nothing, and one between half and all of them widens to twice its drift.
TEST(Verdict, CeilingsWidenToTheBf16YardsticksDriftOnlyWhereItExceedsThem) {
  EvalSpec spec;
  auto eval = TinyMoeReferenceEval(spec);
  ASSERT_TRUE(eval.ok()) << eval.status();
  const EvalOutputs& ref = eval->outputs;
  const int vocab = eval->vocab;
  // Every logit plus eps times a fixed pattern in [-1, 1): KL ~ eps^2 / 6 a position.
  auto perturbed = [&](double eps, uint64_t salt) {
    EvalOutputs out = ref;
    for (size_t i = 0; i < out.logits.size(); ++i)
      out.logits[i] += static_cast<float>(eps * ((Mix64(i ^ salt) >> 11) * 0x1p-52 - 1.0));
    return out;
  };
  const Thresholds bf16 = ThresholdsFor(PrecisionClass::kBf16);
  VerdictMetrics drift, test;
  JudgeOutputs(ref, perturbed(0.5, 1), vocab, PrecisionClass::kBf16, &drift);
  ASSERT_GT(drift.kl_mean, bf16.max_kl_mean);  // a model more sensitive than the class assumes
  const std::optional<Thresholds> wide = WidenedToYardstick(PrecisionClass::kBf16, drift);
  ASSERT_TRUE(wide.has_value());
  EXPECT_DOUBLE_EQ(wide->max_kl_mean, 2 * drift.kl_mean);
  EXPECT_DOUBLE_EQ(wide->max_kl, std::max(bf16.max_kl, 2 * drift.kl_max));
  EXPECT_DOUBLE_EQ(wide->min_top1,
                   std::min(bf16.min_top1, std::max(0.0, drift.top1_agreement - 0.15)));
  EXPECT_GT(wide->pass_max_kl_mean, bf16.pass_max_kl_mean);
  // A config drifting like the yardstick (another pattern, the same size): INCORRECT by the
  // class's ceilings, OK by the widened ones.
  const EvalOutputs like = perturbed(0.5, 2);
  EXPECT_EQ(JudgeOutputs(ref, like, vocab, PrecisionClass::kBf16, &test), TrialStatus::kIncorrect);
  EXPECT_EQ(JudgeOutputs(ref, like, vocab, PrecisionClass::kBf16, &test, nullptr, &*wide),
            TrialStatus::kOk)
      << absl::StrJoin(test.failures, "; ");
  // Garbage stays INCORRECT: three times the drift's size (nine times its KL).
  EXPECT_EQ(
      JudgeOutputs(ref, perturbed(1.5, 3), vocab, PrecisionClass::kBf16, &test, nullptr, &*wide),
      TrialStatus::kIncorrect);
  // A yardstick within half the ceilings, or not finite, widens nothing.
  JudgeOutputs(ref, perturbed(0.05, 4), vocab, PrecisionClass::kBf16, &drift);
  ASSERT_LE(2 * drift.kl_mean, bf16.max_kl_mean);
  ASSERT_LE(2 * drift.kl_max, bf16.max_kl);
  ASSERT_GE(drift.top1_agreement, bf16.min_top1);
  EXPECT_FALSE(WidenedToYardstick(PrecisionClass::kBf16, drift).has_value());
  // Within the ceilings but past half of them: a config 1.4 times as far (twice the KL) passes
  // under the widened ceilings, where the class's alone would leave it no room.
  JudgeOutputs(ref, perturbed(0.22, 5), vocab, PrecisionClass::kBf16, &drift);
  ASSERT_LE(drift.kl_mean, bf16.max_kl_mean);
  ASSERT_GT(2 * drift.kl_mean, bf16.max_kl_mean);
  const std::optional<Thresholds> near = WidenedToYardstick(PrecisionClass::kBf16, drift);
  ASSERT_TRUE(near.has_value());
  EXPECT_DOUBLE_EQ(near->max_kl_mean, 2 * drift.kl_mean);
  const EvalOutputs farther = perturbed(0.22 * 1.4, 6);
  EXPECT_EQ(JudgeOutputs(ref, farther, vocab, PrecisionClass::kBf16, &test),
            TrialStatus::kIncorrect);
  EXPECT_EQ(JudgeOutputs(ref, farther, vocab, PrecisionClass::kBf16, &test, nullptr, &*near),
            TrialStatus::kOk)
      << absl::StrJoin(test.failures, "; ");
  drift.kl_mean = INFINITY;
  EXPECT_FALSE(WidenedToYardstick(PrecisionClass::kBf16, drift).has_value());
}

// The yardstick a config is measured by rounds its GEMM inputs as the config does: E4M3 rows
// where its quantized linears take E4M3 activations, bf16 otherwise. The result names it, and a
// stored result from before the field reads as the bf16 one.
TEST(Verdict, ConfigsWithE4m3ActivationsAreMeasuredByTheE4m3Yardstick) {
  const std::pair<const char*, Yardstick> cases[] = {
      {"device=cuda,gemm=fused,moe=fused,qgemm=w8a8", Yardstick::kE4m3},
      {"device=cuda,gemm=cublaslt,qgemm=fp8_cublaslt", Yardstick::kE4m3},
      {"device=cuda,gemm=cublaslt,qgemm=cudnn", Yardstick::kE4m3},
      {"device=cuda,gemm=fused,moe=fused,qgemm=w8a16", Yardstick::kBf16},
      {"device=cuda,gemm=fused,moe=fused,qgemm=w4a16", Yardstick::kBf16},
      {"device=cuda,gemm=fused,kv_cache=fp8,attention=flash", Yardstick::kBf16},
      {"device=cpu", Yardstick::kBf16}};
  for (const auto& [text, want] : cases) {
    auto parsed = ParseBackendConfig(text);
    ASSERT_TRUE(parsed.ok()) << text << ": " << parsed.status();
    auto normalized = NormalizeBackendConfig(*parsed);
    ASSERT_TRUE(normalized.ok()) << text << ": " << normalized.status();
    EXPECT_EQ(YardstickFor(*normalized), want) << text;
  }
  EXPECT_STREQ(YardstickName(Yardstick::kE4m3), "e4m3");

  auto host = LoadHostModel("preset:tiny-moe");
  ASSERT_TRUE(host.ok()) << host.status();
  const BackendConfig cpu = *NormalizeBackendConfig(*ParseBackendConfig("device=cpu"));
  auto none = CreateYardstick(**host, cpu, Yardstick::kNone);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  auto on_cpu = CreateYardstick(**host, cpu, Yardstick::kE4m3);
  EXPECT_EQ(on_cpu.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(on_cpu.status().message()), testing::HasSubstr("no e4m3 yardstick"));

  TrialResult r;
  r.trial_id = "t";
  r.verdict.yardstick_kl_mean = 0.2;
  r.verdict.yardstick = "e4m3";
  auto back = TrialResultFromJson(ToJson(r));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->verdict.yardstick, "e4m3");
  nlohmann::json stored = ToJson(r);
  stored["verdict"].erase("yardstick");
  auto old = TrialResultFromJson(stored);
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->verdict.yardstick, "bf16");
}

TEST(Verdict, EachForwardPassMeetsThePassThresholdsOnItsOwn) {
  EvalSpec spec;
  auto eval = TinyMoeReferenceEval(spec);
  ASSERT_TRUE(eval.ok()) << eval.status();
  const EvalOutputs* ref = &eval->outputs;
  const int vocab = eval->vocab;
  const int64_t len = spec.prompt_len, prefix = len - spec.decode_steps;
  // The passes: prefill and decode at the eval batch, then at batch 1.
  ASSERT_EQ(ref->passes.size(), 4u);
  EXPECT_EQ(ref->passes[0].name, "prefill at batch 4");
  EXPECT_EQ(ref->passes[1].name, "decode at batch 4");
  EXPECT_EQ(ref->passes[2].name, "prefill at batch 1");
  EXPECT_EQ(ref->passes[3].name, "decode at batch 1");
  ASSERT_EQ(ref->passes[3].ranges.size(), 1u);
  EXPECT_EQ(ref->passes[3].ranges[0],
            (std::pair<int64_t, int64_t>{spec.prompts * len + prefix, (spec.prompts + 1) * len}));
  EXPECT_EQ(ref->passes[1].ranges.size(), static_cast<size_t>(spec.prompts));

  // Logits plus eps times a fixed pattern in [-1, 1): KL ~ eps^2 / 6 a position.
  auto perturbed = [&](double eps, int64_t first, int64_t end) {
    EvalOutputs out = *ref;
    for (int64_t p = first; p < end; ++p)
      for (int i = 0; i < vocab; ++i) {
        const uint64_t bits = Mix64(static_cast<uint64_t>(p) * vocab + i);
        out.logits[p * vocab + i] += static_cast<float>(eps * ((bits >> 11) * 0x1p-52 - 1.0));
      }
    return out;
  };
  const int64_t positions = static_cast<int64_t>(ref->logits.size()) / vocab;
  VerdictMetrics m;
  const EvalOutputs wrong_decode = perturbed(0.55, spec.prompts * len + prefix, positions);
  EXPECT_EQ(JudgeOutputs(*ref, wrong_decode, vocab, PrecisionClass::kBf16, &m),
            TrialStatus::kIncorrect);
  // The overall figures alone would have passed.
  EXPECT_LE(m.kl_mean, ThresholdsFor(PrecisionClass::kBf16).max_kl_mean);
  EXPECT_GE(m.top1_agreement, ThresholdsFor(PrecisionClass::kBf16).min_top1);
  EXPECT_EQ(m.worst_pass, "decode at batch 1");
  const Thresholds bf16 = ThresholdsFor(PrecisionClass::kBf16);
  EXPECT_GT(m.worst_pass_kl_mean, bf16.pass_max_kl_mean);
  ASSERT_GE(m.failures.size(), 1u);
  EXPECT_THAT(m.failures[0], HasSubstr("kl_mean over the decode at batch 1 positions (8)"));

  // Above the overall ceiling on one pass, below the pass's: OK.
  const EvalOutputs noisy_decode = perturbed(0.33, spec.prompts * len + prefix, positions);
  EXPECT_EQ(JudgeOutputs(*ref, noisy_decode, vocab, PrecisionClass::kBf16, &m), TrialStatus::kOk)
      << absl::StrJoin(m.failures, "; ");
  EXPECT_GT(m.worst_pass_kl_mean, bf16.max_kl_mean);
  EXPECT_LT(m.worst_pass_kl_mean, bf16.pass_max_kl_mean);

  // Every batch-1 decode position's two largest logits swapped: the argmax moves, the KL stays
  // small where they are close.
  EvalOutputs swapped = *ref;
  for (int64_t p = spec.prompts * len + prefix; p < positions; ++p) {
    float* row = swapped.logits.data() + p * vocab;
    const int first = static_cast<int>(std::max_element(row, row + vocab) - row);
    int second = first == 0 ? 1 : 0;
    for (int i = 0; i < vocab; ++i)
      if (i != first && row[i] > row[second]) second = i;
    std::swap(row[first], row[second]);
  }
  EXPECT_EQ(JudgeOutputs(*ref, swapped, vocab, PrecisionClass::kBf16, &m), TrialStatus::kIncorrect);
  EXPECT_GE(m.top1_agreement, bf16.min_top1);
  EXPECT_LE(m.kl_mean, bf16.max_kl_mean);
  EXPECT_THAT(absl::StrJoin(m.failures, "; "),
              HasSubstr("top1_agreement over the decode at batch 1 positions (8) 0.000 < 0.500"));

  // The fp8 class does not judge passes (its ceiling sits close above its noise): reported only.
  EXPECT_EQ(JudgeOutputs(*ref, wrong_decode, vocab, PrecisionClass::kFp8, &m), TrialStatus::kOk)
      << absl::StrJoin(m.failures, "; ");
  EXPECT_EQ(m.worst_pass, "decode at batch 1");

  const EvalOutputs noisy = perturbed(0.55 / 4, 0, positions);
  EXPECT_EQ(JudgeOutputs(*ref, noisy, vocab, PrecisionClass::kBf16, &m), TrialStatus::kOk)
      << absl::StrJoin(m.failures, "; ");
  EXPECT_GT(m.worst_pass_kl_mean, 0.0);
  EXPECT_LE(m.worst_pass_kl_mean, bf16.max_kl_mean);
}

TEST(Workload, ParsesAndRejectsBadValues) {
  auto w = ParseWorkload("prompt=16,output=8,batch=1:4,repeats=2,warmup=0,timeout=30");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->batch_sizes, (std::vector<int>{1, 4}));
  EXPECT_THAT(ParseWorkload("batch=0").status().message(), HasSubstr("'batch': 0"));
  EXPECT_THAT(ParseWorkload("batch=100000").status().message(), HasSubstr("[1, 1024]"));
  EXPECT_THAT(ParseWorkload("output=1").status().message(), HasSubstr("'output'"));
  EXPECT_THAT(ParseWorkload("prompt=abc").status().message(), HasSubstr("not an integer"));
  EXPECT_THAT(ParseWorkload("flavour=1").status().message(), HasSubstr("unknown workload field"));
}

// A key given twice, and batch sizes that repeat or go down, are typos: refused naming the key.
TEST(Workload, RefusesARepeatedKeyAndBatchSizesThatDoNotIncrease) {
  for (const char* text :
       {"prompt=64,prompt=32", "output=8,batch=1,output=16", "timeout=5,timeout=5"}) {
    absl::StatusOr<Workload> w = ParseWorkload(text);
    ASSERT_FALSE(w.ok()) << text;
    EXPECT_THAT(w.status().message(), HasSubstr("given twice")) << text;
  }
  EXPECT_THAT(ParseWorkload("prompt=64,prompt=32").status().message(),
              HasSubstr("workload field 'prompt' given twice"));
  for (const char* batch : {"4:1", "1:4:2", "2:2"}) {
    absl::StatusOr<Workload> w = ParseWorkload(absl::StrCat("batch=", batch));
    ASSERT_FALSE(w.ok()) << batch;
    EXPECT_THAT(w.status().message(), HasSubstr(absl::StrCat("workload field 'batch': '", batch,
                                                             "': batch sizes must increase")));
  }
  EXPECT_TRUE(ParseWorkload("batch=1:2:64").ok());
}

// WorkloadString writes every lockstep key; ParseWorkload reads it back, and the empty text is
// Workload{}: the defaults `run --help` shows are the ones a partial --workload keeps.
TEST(Workload, StringReadsBackAndTheDefaultsAreWorkloadsOwn) {
  const Workload defaults;
  EXPECT_EQ(WorkloadString(defaults),
            "prompt=128,output=32,batch=1,repeats=3,warmup=1,timeout=600");
  Workload w;
  w.prompt_len = 7;
  w.output_len = 5;
  w.batch_sizes = {1, 8, 64};
  w.repeats = 2;
  w.warmup = 0;
  w.timeout_s = 12.5;
  absl::StatusOr<Workload> back = ParseWorkload(WorkloadString(w));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(ToJson(*back), ToJson(w));
  absl::StatusOr<Workload> empty = ParseWorkload("");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(ToJson(*empty), ToJson(defaults));
}

TEST(Verdict, DegenerateRepetition) {
  EXPECT_TRUE(IsDegenerate({1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 7, 7, 7, 7}));
  EXPECT_TRUE(IsDegenerate({1, 2, 3, 4, 5, 6, 8, 9, 8, 9, 8, 9, 8, 9}));
  EXPECT_FALSE(IsDegenerate({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}));
}

// The reference's picks on a test's free runs: pick i is the reference's argmax after the start
// and the run's tokens before i, whatever those tokens are. On the reference's own runs the
// picks are the runs themselves (a greedy run is its own argmax at every step); on a run with
// one token changed, the picks up to that token stay the reference's and the other runs' picks
// are untouched (each row is its own sequence).
TEST(Verdict, ReferencePicksFollowTheTestsOwnPath) {
  EvalSpec spec;
  auto host = LoadHostModel("preset:tiny-moe", {2});
  ASSERT_TRUE(host.ok()) << host.status();
  auto model = CreateModel(**host, *NormalizeBackendConfig({{"device", "cpu"}}));
  ASSERT_TRUE(model.ok()) << model.status();
  auto eval = RunEval(**model, spec);
  ASSERT_TRUE(eval.ok()) << eval.status();
  auto own = ReferencePicksOnFreeRuns(**model, spec, eval->free);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(*own, eval->free);

  const int vocab = (*host)->config.vocab_size, changed = 5;
  std::vector<std::vector<int32_t>> detour = eval->free;
  detour[0][changed] = (detour[0][changed] + 1) % vocab;
  auto picks = ReferencePicksOnFreeRuns(**model, spec, detour);
  ASSERT_TRUE(picks.ok()) << picks.status();
  for (int i = 0; i <= changed; ++i) EXPECT_EQ((*picks)[0][i], eval->free[0][i]) << "token " << i;
  for (int s = 1; s < spec.prompts; ++s) EXPECT_EQ((*picks)[s], eval->free[s]) << "run " << s;
  // After the changed token the reference walks the detour: its picks are not the old run's.
  EXPECT_NE(std::vector<int32_t>((*picks)[0].begin() + changed + 1, (*picks)[0].end()),
            std::vector<int32_t>(eval->free[0].begin() + changed + 1, eval->free[0].end()));

  std::vector<std::vector<int32_t>> short_run = eval->free;
  short_run[2].pop_back();
  EXPECT_THAT(ReferencePicksOnFreeRuns(**model, spec, short_run).status().message(),
              HasSubstr("free run 2 has 23 tokens where the eval makes 24"));
  EXPECT_THAT(ReferencePicksOnFreeRuns(**model, spec, {eval->free[0]}).status().message(),
              HasSubstr("1 free runs where the eval has 4"));
}

// A test whose free runs loop where the reference's do not is INCORRECT, unless the reference,
// fed those runs, picks the same tokens (then the loop is the model's: a correct bf16 config
// that a near-tie sent off the reference's path, as seen once on the H200 in the fourth
// session). The bar is the class's top-1 floor over the looping runs' tokens.
TEST(Verdict, ALoopTheReferenceWalksTooIsTheModelsNotTheConfigs) {
  EvalSpec spec;
  auto eval = TinyMoeReferenceEval(spec);
  ASSERT_TRUE(eval.ok()) << eval.status();
  const EvalOutputs& ref = eval->outputs;
  for (const auto& run : ref.free) ASSERT_FALSE(IsDegenerate(run));
  const double floor = ThresholdsFor(PrecisionClass::kBf16).min_top1;  // 0.7
  const int run_len = spec.free_run_len;
  // Runs 0 and 1 leave the reference's path at token 4 and settle into "x x x ...".
  EvalOutputs test = ref;
  for (int s = 0; s < 2; ++s)
    for (int i = 4; i < run_len; ++i) test.free[s][i] = 17 + s;
  VerdictMetrics m;
  EXPECT_EQ(JudgeOutputs(ref, test, eval->vocab, PrecisionClass::kBf16, &m),
            TrialStatus::kIncorrect);
  EXPECT_TRUE(m.degenerate);
  EXPECT_FALSE(m.loop_reference_agreement.has_value());
  EXPECT_THAT(absl::StrJoin(m.failures, "; "), HasSubstr("degenerate in 2 of 4 sequences"));

  // The reference picks every token of the test's runs: the model's loop.
  std::vector<std::vector<int32_t>> picks = test.free;
  EXPECT_EQ(JudgeOutputs(ref, test, eval->vocab, PrecisionClass::kBf16, &m, &picks),
            TrialStatus::kOk)
      << absl::StrJoin(m.failures, "; ");
  EXPECT_FALSE(m.degenerate);
  ASSERT_TRUE(m.loop_reference_agreement.has_value());
  EXPECT_EQ(*m.loop_reference_agreement, 1.0);

  // It picks 17 of 24 tokens of each looping run (0.708 >= 0.7): still the model's. 16 of 24
  // (0.667): the config's.
  auto disagree = [&](int tokens) {
    std::vector<std::vector<int32_t>> p = test.free;
    for (int s = 0; s < 2; ++s)
      for (int i = 0; i < tokens; ++i) p[s][run_len - 1 - i] = 100 + i;
    return p;
  };
  picks = disagree(run_len - 17);
  EXPECT_EQ(JudgeOutputs(ref, test, eval->vocab, PrecisionClass::kBf16, &m, &picks),
            TrialStatus::kOk)
      << absl::StrJoin(m.failures, "; ");
  EXPECT_NEAR(*m.loop_reference_agreement, 17.0 / 24, 1e-12);
  EXPECT_GE(*m.loop_reference_agreement, floor);
  picks = disagree(run_len - 16);
  EXPECT_EQ(JudgeOutputs(ref, test, eval->vocab, PrecisionClass::kBf16, &m, &picks),
            TrialStatus::kIncorrect);
  EXPECT_TRUE(m.degenerate);
  EXPECT_THAT(absl::StrJoin(m.failures, "; "),
              HasSubstr("degenerate in 2 of 4 sequences (reference: 0; the reference picks 0.667 "
                        "of the looping runs' tokens on their own path, < 0.70)"));
  // Three looping runs, one the reference walks too: the failure quotes the two that count
  // (0.667), not the three together (0.778, above the floor).
  EvalOutputs three = test;
  for (int i = 4; i < run_len; ++i) three.free[2][i] = 19;
  picks = disagree(run_len - 16);
  picks[2] = three.free[2];
  EXPECT_EQ(JudgeOutputs(ref, three, eval->vocab, PrecisionClass::kBf16, &m, &picks),
            TrialStatus::kIncorrect);
  EXPECT_NEAR(*m.loop_reference_agreement, (16.0 + 16 + 24) / 72, 1e-12);
  EXPECT_THAT(absl::StrJoin(m.failures, "; "),
              HasSubstr("degenerate in 2 of 4 sequences (reference: 0; the reference picks 0.667"));
  // One disowned loop of 4 runs is chaos, not garbage (at least half must loop), as before.
  picks = disagree(run_len - 16);
  picks[1] = test.free[1];
  EXPECT_EQ(JudgeOutputs(ref, test, eval->vocab, PrecisionClass::kBf16, &m, &picks),
            TrialStatus::kOk)
      << absl::StrJoin(m.failures, "; ");
}

TEST(Measure, PercentileIsNearestRank) {
  EXPECT_EQ(Percentile({5, 1, 4, 2, 3}, 50), 3);
  EXPECT_EQ(Percentile({5, 1, 4, 2, 3}, 99), 5);
  EXPECT_EQ(Percentile({5, 1, 4, 2, 3}, 0), 1);
}

// The measurement tests' model (2 layers of tiny-dense on the CPU) and workload.
void TinyDenseOnCpu(std::unique_ptr<HostModel>* host, std::unique_ptr<Model>* model) {
  auto loaded = LoadHostModel("preset:tiny-dense", {2});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(MaterializeHostWeights(**loaded).ok());
  *host = std::move(*loaded);
  *model = MakeCpuModel(**host);
}
Workload ShortWorkload() {
  Workload w;
  w.prompt_len = 4;
  w.output_len = 3;
  w.repeats = 2;
  w.warmup = 0;
  return w;
}

// The default ForwardGreedy (the CPU engine's) picks what Greedy picks from Forward's logits, for
// every sequence of a batch, through a prefill and decode steps, with `next` aliasing the tokens
// it is fed.
TEST(Model, ForwardGreedyPicksWhatGreedyPicksFromTheLogits) {
  std::unique_ptr<HostModel> host;
  std::unique_ptr<Model> logits_model;
  ASSERT_NO_FATAL_FAILURE(TinyDenseOnCpu(&host, &logits_model));
  std::unique_ptr<Model> token_model = MakeCpuModel(*host);
  const int batch = 2, vocab = host->config.vocab_size;
  ASSERT_TRUE(logits_model->StartBatch(batch, 8).ok());
  ASSERT_TRUE(token_model->StartBatch(batch, 8).ok());
  std::vector<int32_t> feed = {3, 14, 15, 92, 65, 35};  // [2, 3]
  std::vector<int32_t> tokens = feed;
  int n = 3;
  std::set<int32_t> seen;
  for (int step = 0; step < 4; ++step) {
    std::vector<float> logits;
    ASSERT_TRUE(logits_model->Forward(feed, n, LogitsMode::kLast, &logits).ok());
    ASSERT_TRUE(token_model->ForwardGreedy(tokens, n, &tokens).ok());
    ASSERT_EQ(tokens.size(), static_cast<size_t>(batch));
    feed.assign(batch, 0);
    for (int b = 0; b < batch; ++b) {
      feed[b] =
          Greedy({logits.data() + static_cast<size_t>(b) * vocab, static_cast<size_t>(vocab)});
      seen.insert(feed[b]);
    }
    EXPECT_EQ(tokens, feed) << "step " << step;
    n = 1;
  }
  EXPECT_GT(seen.size(), 1u);  // the picks are not all one token
}

// A model that counts the calls it passes on to a real one.
class CountingModel : public Model {
 public:
  explicit CountingModel(Model& inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_.config(); }
  std::string device() const override { return inner_.device(); }
  absl::Status StartBatch(int batch, int max_tokens) override {
    return inner_.StartBatch(batch, max_tokens);
  }
  absl::Status Forward(std::span<const int32_t> tokens, int n, LogitsMode mode,
                       std::vector<float>* logits) override {
    ++forward_calls;
    return inner_.Forward(tokens, n, mode, logits);
  }
  absl::Status ForwardGreedy(std::span<const int32_t> tokens, int n,
                             std::vector<int32_t>* next) override {
    ++greedy_calls;
    return inner_.ForwardGreedy(tokens, n, next);
  }
  int position() const override { return inner_.position(); }
  int forward_calls = 0, greedy_calls = 0;

 private:
  Model& inner_;
};

// The timed loop takes its tokens from ForwardGreedy (the device's pick on GPUs), one call a
// step, and never asks for logits. (Without warm-up, one more prefill and decode step after the
// timed repeats records what ran: tests/provenance_test.cc.)
TEST(Measure, TimedStepsPickTheirTokensThroughForwardGreedy) {
  std::unique_ptr<HostModel> host;
  std::unique_ptr<Model> model;
  ASSERT_NO_FATAL_FAILURE(TinyDenseOnCpu(&host, &model));
  CountingModel counting(*model);
  const Workload w = ShortWorkload();
  ASSERT_EQ(w.warmup, 0);
  auto figures = MeasureBatch(counting, w, 2, MeasureOptions{});
  ASSERT_TRUE(figures.ok()) << figures.status();
  EXPECT_EQ(counting.greedy_calls, (w.warmup + w.repeats) * w.output_len + 2);
  EXPECT_EQ(counting.forward_calls, 0);
}

// Power and J/token come from the energy counter's change over each repeat. A counter that did
// not move (NVML's steps are tens of ms apart; a short repeat can fall between two) is no
// reading: the figures stay unset instead of reading 0 W.
TEST(Measure, EnergyCounterThatDidNotMoveGivesNoPowerFigure) {
  class FrozenMeter : public GpuEnergyMeter {
   public:
    std::optional<double> ReadJoules() override { return 1000.0; }
  };
  class TickingMeter : public GpuEnergyMeter {
   public:
    std::optional<double> ReadJoules() override { return joules += 2.0; }
    double joules = 1000.0;
  };
  std::unique_ptr<HostModel> host;
  std::unique_ptr<Model> model;
  ASSERT_NO_FATAL_FAILURE(TinyDenseOnCpu(&host, &model));
  const Workload w = ShortWorkload();
  FrozenMeter frozen;
  TickingMeter ticking;
  MeasureOptions options;
  options.energy = &frozen;
  auto still = MeasureBatch(*model, w, 1, options);
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_FALSE(still->avg_power_w.has_value());
  EXPECT_FALSE(still->joules_per_output_token.has_value());
  options.energy = &ticking;
  auto moving = MeasureBatch(*model, w, 1, options);
  ASSERT_TRUE(moving.ok()) << moving.status();
  ASSERT_TRUE(moving->avg_power_w.has_value());
  EXPECT_GT(*moving->avg_power_w, 0);
  ASSERT_TRUE(moving->joules_per_output_token.has_value());
  EXPECT_DOUBLE_EQ(*moving->joules_per_output_token, 2.0 / 3);  // 2 J per repeat, 3 tokens
}

// The prefill FLOPs: METRICS.md's worked example, and a hand count on a small MoE model with a
// shared expert and a dense layer.
TEST(Roofline, PrefillFlops) {
  auto qwen3 = PresetConfig("qwen3-30b-a3b");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  // 48 x (attention 18,874,368 + router 262,144 + 8 experts x 4,718,592) weights a token, x 2 x
  // 2048 tokens; attention products 4 x 32 x 128 x 2048 x 2049 / 2 x 48; lm_head 2 x 151936 x 2048.
  EXPECT_DOUBLE_EQ(PrefillFlops(*qwen3, 1, 2048), 12834789916672.0);
  EXPECT_DOUBLE_EQ(PrefillFlops(*qwen3, 3, 2048), 3 * PrefillFlops(*qwen3, 1, 2048));
  auto small = PresetConfig("tiny-qwen2-moe", 2);  // layer 0 MoE + shared expert, layer 1 dense
  ASSERT_TRUE(small.ok()) << small.status();
  ASSERT_TRUE(small->IsMoeLayer(0));
  ASSERT_FALSE(small->IsMoeLayer(1));
  const double attention = 128.0 * 128 * 2 + 128.0 * 64 * 2;                    // q, o; k, v
  const double moe = 8.0 * 128 + 2 * 3.0 * 128 * 64 + (3.0 * 128 * 128 + 128);  // + shared
  const double dense = 3.0 * 128 * 256;
  const double prompt = 5;
  const double want = 2 * (2 * attention + moe + dense) * prompt        // the linears
                      + 4.0 * 4 * 32 * (prompt * (prompt + 1) / 2) * 2  // QK^T and PV, 2 layers
                      + 2.0 * 512 * 128;                                // lm_head, last token
  EXPECT_DOUBLE_EQ(PrefillFlops(*small, 1, 5), want);
  EXPECT_EQ(KnownBf16Tflops("NVIDIA H200"), 794.0);
  EXPECT_FALSE(KnownBf16Tflops("cpu").has_value());
}

// Hybrids by hand (tiny-hybrid, 2 layers: layer 0 Gated DeltaNet, layer 1 gated full attention;
// both MoE with a shared expert): the linear layer reads its projections and each sequence's
// state instead of a KV cache; only the full layer has attention products.
TEST(Roofline, Hybrid) {
  auto c = PresetConfig("tiny-hybrid", 2);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->AttentionKind(0), LayerAttention::kLinear);
  ASSERT_EQ(c->AttentionKind(1), LayerAttention::kFull);
  const double gated = 128.0 * 128 * 3 + 128.0 * 64 * 2;  // q with its gate, o; k, v
  const double conv_dim = 2 * 64 + 128;                   // q | k | v
  const double linear = 128.0 * (conv_dim + 2 * 128 + 2 * 4) + conv_dim * 4;  // + z, b, a, out
  const double moe = 8.0 * 128 + 2 * 3.0 * 128 * 64 + (3.0 * 128 * 64 + 128);
  const double prompt = 70;
  const double want = 2 * (gated + linear + 2 * moe) * prompt       // the linears
                      + 8.0 * 4 * 32 * 32 * prompt                  // the delta rule, 4 value heads
                      + 4.0 * 4 * 32 * (prompt * (prompt + 1) / 2)  // QK^T and PV, 1 layer
                      + 2.0 * 512 * 128;                            // lm_head
  EXPECT_DOUBLE_EQ(PrefillFlops(*c, 1, 70), want);

  const DecodeTraffic t = DecodeBytesPerStep(*c, 3, 100, 2, 4);
  EXPECT_DOUBLE_EQ(t.kv_bytes, 2.0 * 64 * 100 * 3 * 4);                     // the full layer only
  EXPECT_DOUBLE_EQ(t.state_bytes, (4.0 * 32 * 32 + 3 * conv_dim) * 3 * 4);  // fp32 state
  EXPECT_DOUBLE_EQ(t.total(), t.weight_bytes + t.kv_bytes + t.state_bytes);

  // Quantized: in_proj_qkv, in_proj_z and out_proj count at the quantized width, as the full
  // layer's projections and the experts do; in_proj_b/a, the conv and the router stay bf16.
  const DecodeTraffic dense = DecodeBytesPerStep(*c, 1, 100, 2, 4);
  const DecodeTraffic quantized = DecodeBytesPerStep(*c, 1, 100, 2, 4, 0.5);
  const double projections = 128.0 * (conv_dim + 2 * 128);
  const double experts = 2 * (2 * 3.0 * 128 * 64 + 3.0 * 128 * 64);  // top-2 + shared, 2 layers
  EXPECT_DOUBLE_EQ(dense.weight_bytes - quantized.weight_bytes,
                   1.5 * (projections + gated + experts));
}

// The prefill roofline appears only with a known tensor rate, and is the prompt tokens at that
// rate over the prefill FLOPs.
TEST(Measure, PrefillRooflineAtAKnownTensorRate) {
  std::unique_ptr<HostModel> host;
  std::unique_ptr<Model> model;
  ASSERT_NO_FATAL_FAILURE(TinyDenseOnCpu(&host, &model));
  const Workload w = ShortWorkload();
  MeasureOptions options;
  auto unknown = MeasureBatch(*model, w, 2, options);
  ASSERT_TRUE(unknown.ok()) << unknown.status();
  EXPECT_DOUBLE_EQ(unknown->prefill_flops, PrefillFlops(host->config, 2, 4));
  EXPECT_FALSE(unknown->prefill_roofline_tok_s.has_value());
  EXPECT_FALSE(unknown->prefill_roofline_fraction.has_value());
  options.bf16_tflops = 1e-3;  // 1 GFLOP/s
  auto known = MeasureBatch(*model, w, 2, options);
  ASSERT_TRUE(known.ok()) << known.status();
  ASSERT_TRUE(known->prefill_roofline_tok_s.has_value());
  EXPECT_DOUBLE_EQ(*known->prefill_roofline_tok_s, 2 * 4 * 1e9 / known->prefill_flops);
  ASSERT_TRUE(known->prefill_roofline_fraction.has_value());
  EXPECT_DOUBLE_EQ(*known->prefill_roofline_fraction,
                   known->prefill_tok_s.median / *known->prefill_roofline_tok_s);
}

TrialRequest TinyRequest(const std::string& config, const std::string& fault = "") {
  TrialRequest r;
  r.trial_id = "t";
  r.model = "preset:tiny-moe";
  r.layers = 2;
  r.config = *ParseBackendConfig(config);
  r.workload.prompt_len = 8;
  r.workload.output_len = 4;
  r.workload.repeats = 2;
  r.workload.warmup = 0;
  r.workload.batch_sizes = {1, 2};
  r.inject_fault = fault;
  return r;
}

// No false positives: every registered CPU config is OK against the CPU reference, except those
// preflight refuses on this model (ep=on with one rank, tp=8 over its 4 q heads), which are
// UNSUPPORTED with preflight's reason. The kernel axes are crossed with each other, the
// tensor-parallel axes with each other.
TEST(Executor, EveryCpuConfigIsOk) {
  TrialExecutor executor(LocalDevices{});
  std::map<std::string, std::vector<std::string>> kernel_axes, parallel_axes;
  for (const BackendDescriptor& d : BackendRegistry()) {
    if (d.device != Device::kCpu) continue;
    const bool parallel = d.axis == "tp" || d.axis == "ep" || d.axis == "allreduce";
    (parallel ? parallel_axes : kernel_axes)[d.axis].push_back(d.value);
  }
  auto configs = ExpandMatrix(kernel_axes);
  ASSERT_EQ(configs.size(), 10u);  // device=cpu x 2 matmul x 5 threads
  parallel_axes["device"] = {"cpu"};
  for (const BackendConfig& config : ExpandMatrix(parallel_axes)) configs.push_back(config);
  ASSERT_EQ(configs.size(), 18u);  // and 4 tp x 2 ep x 1 allreduce
  int unsupported = 0;
  for (const BackendConfig& config : configs) {
    TrialRequest request = TinyRequest("device=cpu");
    request.config = config;
    const TrialResult result = executor.Execute(request);
    PreflightTarget target;
    target.model = *PresetConfig("tiny-moe", request.layers);
    const PreflightResult preflight = Preflight(*NormalizeBackendConfig(config), target);
    if (!preflight.supported) {
      EXPECT_EQ(result.status, TrialStatus::kUnsupported) << BackendConfigString(config);
      EXPECT_EQ(result.reason, preflight.reason);
      ++unsupported;
      continue;
    }
    EXPECT_EQ(result.status, TrialStatus::kOk)
        << BackendConfigString(config) << ": " << result.reason;
    ASSERT_EQ(result.batches.size(), 2u);
    EXPECT_GT(result.batches[1].output_tok_s.median, 0);
    EXPECT_GT(result.batches[0].decode_bytes_per_step, 0);
    // The CPU has no device timer and no energy counter: wall clock, no power, host RSS.
    EXPECT_EQ(result.batches[0].timer, "wall_clock");
    EXPECT_FALSE(result.batches[0].wall_tpot_ms.has_value());
    EXPECT_FALSE(result.batches[0].avg_power_w.has_value());
    EXPECT_GT(result.peak_memory_bytes, 0);
    EXPECT_LE(result.verdict.max_rel_error, 1e-4);
    EXPECT_EQ(result.verdict.top1_agreement, 1.0);
  }
  EXPECT_EQ(unsupported, 3);  // tp=1 ep=on, tp=8 ep=off, tp=8 ep=on
}

class NumericFaults : public testing::TestWithParam<std::string> {};

TEST_P(NumericFaults, AreIncorrect) {
  TrialExecutor executor(LocalDevices{});
  const TrialResult result = executor.Execute(TinyRequest("matmul=blocked", GetParam()));
  EXPECT_EQ(result.status, TrialStatus::kIncorrect) << GetParam() << ": " << result.reason;
  EXPECT_FALSE(result.verdict.failures.empty());
  EXPECT_TRUE(result.batches.empty()) << "garbage is not timed";
}

INSTANTIATE_TEST_SUITE_P(Injected, NumericFaults,
                         testing::Values("nan-layer:1", "zero-expert:3", "bad-scale:2",
                                         "stuck-token:7"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name)
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           return name;
                         });

// A hybrid model's recurrent state carried wrongly between steps (here dropped at every
// forward) is INCORRECT; the same trial without the fault is OK.
TEST(Executor, HybridRecurrentStateFaultIsIncorrect) {
  TrialExecutor executor(LocalDevices{});
  TrialRequest clean = TinyRequest("matmul=blocked");
  clean.model = "preset:tiny-hybrid";
  const TrialResult ok = executor.Execute(clean);
  EXPECT_EQ(ok.status, TrialStatus::kOk) << ok.reason;
  TrialRequest faulty = TinyRequest("matmul=blocked", "bad-state:0");
  faulty.model = "preset:tiny-hybrid";
  const TrialResult result = executor.Execute(faulty);
  EXPECT_EQ(result.status, TrialStatus::kIncorrect) << result.reason;
  EXPECT_FALSE(result.verdict.failures.empty());
}

// bad-state on a model without linear attention would corrupt nothing: the request's ERROR, and
// the error says what it needs.
TEST(Executor, StateFaultOnAModelWithoutRecurrentStateIsAnError) {
  TrialExecutor executor(LocalDevices{});
  const TrialResult result = executor.Execute(TinyRequest("matmul=blocked", "bad-state:0"));
  EXPECT_EQ(result.status, TrialStatus::kError) << result.reason;
  EXPECT_THAT(result.reason, HasSubstr("bad-state needs a model with linear-attention layers"));
}

TEST(Executor, NanFaultIsCountedAsNonFinite) {
  TrialExecutor executor(LocalDevices{});
  const TrialResult result = executor.Execute(TinyRequest("device=cpu", "nan-layer:0"));
  EXPECT_GT(result.verdict.non_finite, 0);
  EXPECT_THAT(result.reason, HasSubstr("non-finite"));
}

// Garbage loops stay degenerate: the reference, fed "7 7 7 ...", does not pick 7.
TEST(Executor, StuckTokenIsDegenerate) {
  TrialExecutor executor(LocalDevices{});
  const TrialResult result = executor.Execute(TinyRequest("device=cpu", "stuck-token:7"));
  EXPECT_TRUE(result.verdict.degenerate);
  ASSERT_TRUE(result.verdict.loop_reference_agreement.has_value());
  EXPECT_LT(*result.verdict.loop_reference_agreement,
            ThresholdsFor(PrecisionClass::kFp32).min_top1);
  EXPECT_THAT(result.reason, HasSubstr("the reference picks"));
}

TEST(Executor, BadRequestsAreErrorsAndCudaIsUnsupportedWithoutBuild) {
  TrialExecutor executor(LocalDevices{});
  EXPECT_EQ(executor.Execute(TinyRequest("matmul=magic")).status, TrialStatus::kError);
  TrialRequest bad_workload = TinyRequest("device=cpu");
  bad_workload.workload.batch_sizes = {0};
  EXPECT_EQ(executor.Execute(bad_workload).status, TrialStatus::kError);
  TrialRequest missing = TinyRequest("device=cpu");
  missing.model = "/nonexistent/checkpoint";
  const TrialResult load_error = executor.Execute(missing);
  EXPECT_EQ(load_error.status, TrialStatus::kError);
  EXPECT_THAT(load_error.reason, HasSubstr("/nonexistent/checkpoint"));
  const TrialResult cuda = executor.Execute(TinyRequest("device=cuda,moe=fused"));
  EXPECT_EQ(cuda.status, TrialStatus::kUnsupported);
  EXPECT_THAT(cuda.reason, HasSubstr("CUDA"));
}

// Isolation: the worker is this test suite's own `infersweep` binary.
RunnerOptions WorkerOptions() {
  RunnerOptions options;
  options.worker_argv = {WorkerBinary(), "worker"};
  return options;
}

TEST(Runner, CrashesAndHangsAreClassifiedAndTheParentCarriesOn) {
  TrialRunner runner(WorkerOptions());
  std::vector<std::string> progress;

  const TrialResult segv = runner.Run(TinyRequest("device=cpu", "segv"));
  EXPECT_EQ(segv.status, TrialStatus::kCrashed);
  EXPECT_THAT(segv.reason, HasSubstr("SIGSEGV"));

  const TrialResult aborted = runner.Run(TinyRequest("device=cpu", "abort"));
  EXPECT_EQ(aborted.status, TrialStatus::kCrashed);
  EXPECT_THAT(aborted.reason, HasSubstr("SIGABRT"));

  TrialRequest hang = TinyRequest("device=cpu", "hang");
  hang.workload.timeout_s = 3;
  const auto start = std::chrono::steady_clock::now();
  const TrialResult hung = runner.Run(hang);
  EXPECT_EQ(hung.status, TrialStatus::kTimeout);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));

  // A healthy config right after: a fresh worker, a clean OK.
  const TrialResult ok = runner.Run(TinyRequest("matmul=blocked,threads=2"));
  EXPECT_EQ(ok.status, TrialStatus::kOk) << ok.reason << "\n" << ok.stderr_tail;
  const TrialResult incorrect = runner.Run(TinyRequest("device=cpu", "zero-expert:1"));
  EXPECT_EQ(incorrect.status, TrialStatus::kIncorrect);
  const TrialResult ok_again = runner.Run(TinyRequest("device=cpu"));
  EXPECT_EQ(ok_again.status, TrialStatus::kOk) << ok_again.reason;
}

// Cancel() from another thread ends a running trial at once (its worker killed): ERROR
// "cancelled", long before the trial's own deadline; the runner then serves the next trial.
TEST(Runner, CancelFromAnotherThreadEndsTheRunningTrial) {
  TrialRunner runner(WorkerOptions());
  TrialRequest hang = TinyRequest("device=cpu", "hang");
  hang.workload.timeout_s = 60;
  const auto start = std::chrono::steady_clock::now();
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    runner.Cancel();
  });
  const TrialResult cancelled = runner.Run(hang);
  canceller.join();
  EXPECT_EQ(cancelled.status, TrialStatus::kError);
  EXPECT_THAT(cancelled.reason, HasSubstr("cancelled while running"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));

  // A cancellation still pending before the next trial starts ends it too...
  const TrialResult early = runner.Run(TinyRequest("device=cpu"));
  EXPECT_EQ(early.status, TrialStatus::kError);
  EXPECT_THAT(early.reason, HasSubstr("cancelled before it started"));
  // ...until it is withdrawn; then trials run normally.
  runner.ClearCancel();
  const TrialResult ok = runner.Run(TinyRequest("device=cpu"));
  EXPECT_EQ(ok.status, TrialStatus::kOk) << ok.reason << "\n" << ok.stderr_tail;
}

TEST(Runner, WorkerThatCannotStartIsCrashed) {
  RunnerOptions options;
  options.worker_argv = {"/nonexistent/worker"};
  TrialRunner runner(options);
  const TrialResult result = runner.Run(TinyRequest("device=cpu"));
  EXPECT_EQ(result.status, TrialStatus::kCrashed);
  EXPECT_THAT(result.reason, HasSubstr("127"));
}

// The lines a wrapped worker wrote: its CUDA_VISIBLE_DEVICES ("unset" when it had none), one
// line a worker start.
std::vector<std::string> VisibleDevicesLog(const std::string& path) {
  std::vector<std::string> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// A trial given devices runs in a worker that sees those alone (CUDA_VISIBLE_DEVICES, in the
// given order), and a worker that saw other devices is not reused; without devices the worker
// inherits this process's environment. The worker is wrapped in a shell that logs what it sees.
TEST(Runner, WorkerSeesTheTrialsDevicesAlone) {
  ScopedEnv inherited("CUDA_VISIBLE_DEVICES", nullptr);
  const std::string log = testing::TempDir() + "/visible_devices.log";
  std::remove(log.c_str());
  RunnerOptions options;
  options.worker_argv = {"/bin/sh", "-c",
                         "echo \"${CUDA_VISIBLE_DEVICES-unset}\" >> '" + log + "'; exec '" +
                             WorkerBinary() + "' worker"};
  {
    TrialRunner runner(options);
    for (const std::vector<int>& devices :
         std::vector<std::vector<int>>{{1}, {1}, {2, 0}, {}, {3}}) {
      const TrialResult result = runner.Run(TinyRequest("device=cpu"), devices);
      EXPECT_EQ(result.status, TrialStatus::kOk) << result.reason << "\n" << result.stderr_tail;
    }
  }
  // {1} twice: one worker; {2, 0}, inherited and {3}: a new worker each.
  EXPECT_THAT(VisibleDevicesLog(log), ::testing::ElementsAre("1", "2,0", "unset", "3"));

  // Under a CUDA_VISIBLE_DEVICES of its own, the worker gets the entries the indices name.
  ScopedEnv own("CUDA_VISIBLE_DEVICES", "GPU-aaa,5,7");
  std::remove(log.c_str());
  {
    TrialRunner runner(options);
    const TrialResult ok = runner.Run(TinyRequest("device=cpu"), {2, 0});
    EXPECT_EQ(ok.status, TrialStatus::kOk) << ok.reason;
    const TrialResult past = runner.Run(TinyRequest("device=cpu"), {3});
    EXPECT_EQ(past.status, TrialStatus::kError);
    EXPECT_THAT(past.reason, HasSubstr("device 3 is past this process's CUDA_VISIBLE_DEVICES"));
  }
  EXPECT_THAT(VisibleDevicesLog(log), ::testing::ElementsAre("7,GPU-aaa"));
}

// The tests' environment helper puts back what the variable held: a value, or nothing.
TEST(ScopedEnv, PutsBackWhatTheVariableHeld) {
  constexpr char kName[] = "INFERSWEEP_TEST_SCOPED_ENV";
  setenv(kName, "outer", 1);
  {
    ScopedEnv inner(kName, "inner");
    EXPECT_STREQ(std::getenv(kName), "inner");
    {
      ScopedEnv unset(kName, nullptr);
      EXPECT_EQ(std::getenv(kName), nullptr);
    }
    EXPECT_STREQ(std::getenv(kName), "inner");
  }
  EXPECT_STREQ(std::getenv(kName), "outer");
  unsetenv(kName);
  { ScopedEnv set(kName, "x"); }
  EXPECT_EQ(std::getenv(kName), nullptr);
}

TEST(ChildVisibleDevices, MapsIndicesThroughTheInheritedList) {
  EXPECT_EQ(*ChildVisibleDevices({}, nullptr), "");
  EXPECT_EQ(*ChildVisibleDevices({0, 3}, nullptr), "0,3");
  EXPECT_EQ(*ChildVisibleDevices({0, 3}, ""), "0,3");
  EXPECT_EQ(*ChildVisibleDevices({1}, "4,6"), "6");
  EXPECT_FALSE(ChildVisibleDevices({2}, "4,6").ok());
  EXPECT_FALSE(ChildVisibleDevices({-1}, nullptr).ok());
}

TEST(TrialJson, RoundTrips) {
  TrialExecutor executor(LocalDevices{});
  const TrialResult result = executor.Execute(TinyRequest("device=cpu"));
  auto back = TrialResultFromJson(nlohmann::json::parse(ToJson(result).dump()));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(ToJson(*back), ToJson(result));
  // GPU-only fields round-trip too.
  TrialResult gpu = result;
  gpu.batches[0].timer = "cuda_events";
  gpu.batches[0].wall_tpot_ms = Spread{1.5, 1.25, 2.0};
  gpu.batches[0].wall_ttft_ms = Spread{9, 8, 10};
  gpu.batches[0].avg_power_w = 412.5;
  gpu.batches[0].joules_per_output_token = 0.75;
  gpu.batches[0].prefill_roofline_tok_s = 126695.6;
  gpu.batches[0].prefill_roofline_fraction = 0.385;
  auto gpu_back = TrialResultFromJson(nlohmann::json::parse(ToJson(gpu).dump()));
  ASSERT_TRUE(gpu_back.ok()) << gpu_back.status();
  EXPECT_EQ(ToJson(*gpu_back), ToJson(gpu));
  EXPECT_EQ(gpu_back->batches[0].timer, "cuda_events");
  ASSERT_TRUE(gpu_back->batches[0].wall_tpot_ms.has_value());
  EXPECT_EQ(gpu_back->batches[0].wall_tpot_ms->min, 1.25);
  EXPECT_EQ(gpu_back->batches[0].prefill_roofline_fraction, 0.385);
  EXPECT_GT(gpu_back->batches[0].prefill_flops, 0);
  // The loop's agreement with the reference: null unless measured, and it round-trips.
  EXPECT_TRUE(ToJson(result).at("verdict").at("loop_reference_agreement").is_null());
  TrialResult looped = result;
  looped.verdict.loop_reference_agreement = 0.625;
  auto looped_back = TrialResultFromJson(nlohmann::json::parse(ToJson(looped).dump()));
  ASSERT_TRUE(looped_back.ok()) << looped_back.status();
  EXPECT_EQ(looped_back->verdict.loop_reference_agreement, 0.625);
  // A result stored before the prefill roofline existed still reads, without one.
  nlohmann::json old = ToJson(gpu);
  for (auto& b : old.at("batches"))
    for (const char* key : {"prefill_flops", "prefill_roofline_tok_s", "prefill_roofline_fraction"})
      b.erase(key);
  auto old_back = TrialResultFromJson(old);
  ASSERT_TRUE(old_back.ok()) << old_back.status();
  EXPECT_EQ(old_back->batches[0].prefill_flops, 0);
  EXPECT_FALSE(old_back->batches[0].prefill_roofline_tok_s.has_value());
  EXPECT_FALSE(TrialResultFromJson(nlohmann::json{{"status", "MAYBE"}}).ok());
  EXPECT_THAT(
      TrialResultFromJson(nlohmann::json{{"status", "OK"}, {"sm", "ninety"}}).status().message(),
      HasSubstr("result.sm"));
}

// A batch's memory verdict, its planned memory and the device memory in use after it round-trip;
// results written before they existed read without them; a verdict of another name is refused.
TEST(TrialJson, MemoryVerdictsAndPlannedMemoryRoundTrip) {
  TrialExecutor executor(LocalDevices{});
  TrialResult result = executor.Execute(TinyRequest("device=cpu"));
  ASSERT_EQ(result.status, TrialStatus::kOk) << result.reason;
  ASSERT_FALSE(result.batches.empty());
  EXPECT_TRUE(result.batches[0].measured());
  // CPU configs are not planned: none of the new fields is written.
  const nlohmann::json cpu = ToJson(result).at("batches").at(0);
  for (const char* key : {"memory_verdict", "memory_reason", "planned_memory",
                          "device_memory_used_bytes", "measured_memory_bytes"})
    EXPECT_FALSE(cpu.contains(key)) << key;
  EXPECT_FALSE(ToJson(result).contains("model_memory_bytes"));

  result.batches[0].planned_memory =
      PlannedMemory{3 << 20, {{"weights", 2 << 20}, {"KV", 1 << 20}}};
  result.batches[0].device_memory_used_bytes = 5 << 20;
  result.batches[0].measured_memory_bytes = 4 << 20;
  result.model_memory_bytes = 2 << 20;
  BatchFigures refused;
  refused.batch = 512;
  refused.memory_verdict = BatchMemoryVerdict::kDoesNotFit;
  refused.memory_reason = "needs 80.00 GiB on the device (weights 50.00 GiB, ...), 70.00 GiB free";
  refused.planned_memory = PlannedMemory{int64_t{80} << 30, {{"weights", int64_t{50} << 30}}};
  BatchFigures out_of_memory;
  out_of_memory.batch = 1024;
  out_of_memory.memory_verdict = BatchMemoryVerdict::kOutOfMemory;
  out_of_memory.memory_reason = "attention KV cache: cudaMalloc: cudaErrorMemoryAllocation";
  const size_t measured = result.batches.size();  // the refused batches come after these
  result.batches.push_back(refused);
  result.batches.push_back(out_of_memory);

  const nlohmann::json j = ToJson(result);
  EXPECT_EQ(j.at("batches").at(measured).at("memory_verdict"), "DOES_NOT_FIT");
  EXPECT_EQ(j.at("batches").at(measured + 1).at("memory_verdict"), "OUT_OF_MEMORY");
  EXPECT_EQ(j.at("batches").at(0).at("planned_memory").at("pools").at("KV"), 1 << 20);
  auto back = TrialResultFromJson(nlohmann::json::parse(j.dump()));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(ToJson(*back), j);
  ASSERT_EQ(back->batches.size(), measured + 2);
  EXPECT_TRUE(back->batches[0].measured());
  EXPECT_EQ(back->batches[0].device_memory_used_bytes, 5 << 20);
  EXPECT_EQ(back->batches[0].measured_memory_bytes, 4 << 20);
  EXPECT_EQ(back->model_memory_bytes, 2 << 20);
  ASSERT_TRUE(back->batches[0].planned_memory.has_value());
  EXPECT_EQ(back->batches[0].planned_memory->total_bytes, 3 << 20);
  EXPECT_EQ(back->batches[0].planned_memory->pool_bytes.at("weights"), 2 << 20);
  EXPECT_FALSE(back->batches[measured].measured());
  EXPECT_EQ(back->batches[measured].memory_verdict, BatchMemoryVerdict::kDoesNotFit);
  EXPECT_EQ(back->batches[measured].memory_reason, refused.memory_reason);
  EXPECT_EQ(back->batches[measured].planned_memory->total_bytes, int64_t{80} << 30);
  EXPECT_EQ(back->batches[measured + 1].memory_verdict, BatchMemoryVerdict::kOutOfMemory);

  // The table shows the verdict in place of a refused batch's figures.
  const std::string table = FormatResultRows(*back);
  EXPECT_THAT(table, HasSubstr("batch 512 does not fit: needs 80.00 GiB on the device"));
  EXPECT_THAT(table, Not(HasSubstr("#   OK:")));
  // A trial the plan refused whole keeps its batch entries, and its reason heads them.
  TrialResult refused_trial;
  refused_trial.status = TrialStatus::kUnsupported;
  refused_trial.reason = "batch 512: needs 80.00 GiB on the device (...), 70.00 GiB free";
  refused_trial.batches = {refused};
  const std::string refused_table = FormatResultRows(refused_trial);
  EXPECT_THAT(refused_table, HasSubstr("#   UNSUPPORTED: batch 512: needs 80.00 GiB"));
  EXPECT_THAT(refused_table, HasSubstr("batch 512 does not fit: needs 80.00 GiB"));
  EXPECT_THAT(table, HasSubstr("batch 1024 out of memory: attention KV cache"));
  EXPECT_THAT(table, HasSubstr("device memory planned 3.0 MiB, measured 4.0 MiB (133 % of the "
                               "plan; 5.0 MiB in use on the device)"));

  nlohmann::json bad = j;
  bad["batches"][measured]["memory_verdict"] = "TOO_BIG";
  EXPECT_THAT(std::string(TrialResultFromJson(bad).status().message()),
              HasSubstr("result.batches[].memory_verdict: not DOES_NOT_FIT or OUT_OF_MEMORY"));
  bad = j;
  bad["batches"][0]["planned_memory"]["pools"]["KV"] = -1;
  EXPECT_THAT(std::string(TrialResultFromJson(bad).status().message()),
              HasSubstr("planned_memory.pools.KV: not a byte count"));
  bad = j;
  bad["batches"][0]["planned_memory"].erase("total_bytes");
  EXPECT_THAT(std::string(TrialResultFromJson(bad).status().message()),
              HasSubstr("planned_memory.total_bytes: missing"));
  bad = j;
  bad["batches"][0]["device_memory_used_bytes"] = "lots";
  EXPECT_THAT(std::string(TrialResultFromJson(bad).status().message()),
              HasSubstr("device_memory_used_bytes: not a byte count"));
  bad = j;
  bad["batches"][0]["measured_memory_bytes"] = 1.5;
  EXPECT_THAT(std::string(TrialResultFromJson(bad).status().message()),
              HasSubstr("measured_memory_bytes: not a whole number of bytes"));
  bad = j;
  bad["model_memory_bytes"] = "some";
  EXPECT_THAT(std::string(TrialResultFromJson(bad).status().message()),
              HasSubstr("result.model_memory_bytes: not a whole number of bytes"));
}

// hog-gpu-memory:F takes a fraction of free memory in (0, 1); on a CPU config it does nothing.
TEST(Executor, HogGpuMemoryFaultTakesAFractionAndLeavesCpuTrialsAlone) {
  absl::StatusOr<FaultInjection> hog = ParseFaultInjection("hog-gpu-memory:0.9");
  ASSERT_TRUE(hog.ok()) << hog.status();
  EXPECT_EQ(hog->kind, FaultInjection::Kind::kHogGpuMemory);
  EXPECT_EQ(FaultInjectionString(*hog), "hog-gpu-memory:0.9");
  for (const char* bad :
       {"hog-gpu-memory:1", "hog-gpu-memory:0", "hog-gpu-memory:-0.5", "hog-gpu-memory:90"})
    EXPECT_THAT(std::string(ParseFaultInjection(bad).status().message()), HasSubstr("in (0, 1)"))
        << bad;
  TrialExecutor executor(LocalDevices{});
  TrialRequest request = TinyRequest("device=cpu");
  request.inject_fault = "hog-gpu-memory:0.9";
  const TrialResult result = executor.Execute(request);
  EXPECT_EQ(result.status, TrialStatus::kOk) << result.reason;
}

}  // namespace
}  // namespace infersweep

namespace infersweep {
namespace {

// `infersweep run` end to end on a CPU matrix: isolated workers, the table, the JSON file.
TEST(RunCommand, CpuMatrixEndToEnd) {
  const std::string json_path = testing::TempDir() + "/run_matrix.json";
  const std::string command = WorkerBinary() +
                              " run --model preset:tiny-moe --layers 1"
                              " --config 'matmul=naive|blocked,threads=1|2'"
                              " --workload prompt=8,output=4,batch=1:2,repeats=2,warmup=0"
                              " --json " +
                              json_path + " 2>&1";
  int exit_code = -1;
  const std::string table = RunCommand(command, &exit_code);
  ASSERT_EQ(exit_code, 0) << table;
  EXPECT_THAT(table, HasSubstr("device=cpu,matmul=blocked,threads=2"));
  std::ifstream in(json_path);
  const auto json = nlohmann::json::parse(in);
  ASSERT_EQ(json.at("results").size(), 4u) << json.dump(1);
  for (const auto& r : json.at("results")) {
    auto result = TrialResultFromJson(r);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->status, TrialStatus::kOk) << result->reason;
    EXPECT_EQ(result->batches.size(), 2u);
  }
}

// `run` checks its flags before any worker starts: each bad one exits 2 with an error naming
// the flag and what it takes, and prints no result row.
TEST(RunCommand, BadFlagsAreUsageErrorsBeforeAnyWorkerStarts) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--layers -1", "--layers -1: must lie in [1, 4], the layer count of preset:tiny-moe"},
      {"--layers 100000", "--layers 100000: must lie in [1, 4]"},
      {"--layers 5", "--layers 5: must lie in [1, 4]"},
      {"--model preset:nope", "unknown preset 'nope' (known presets: "},
      {"--model preset:nope@nvfp4", "unknown preset 'nope'"},
      {"--model /no/such/folder", "--model '/no/such/folder': no such checkpoint folder"},
      {"--model tests/fixtures/hf/qwen3_moe --layers 9", "--layers 9: must lie in [1, 4]"},
      {"--workload prompt=64,prompt=32", "--workload: workload field 'prompt' given twice"},
      {"--workload batch=4:1", "'batch': '4:1': batch sizes must increase"},
      {"--config 'matmul=naive||blocked'", "'naive||blocked' has an empty alternative"},
      {"--config 'matmul=|naive'", "empty alternative"},
      {"--config 'matmul=naive|'", "empty alternative"},
      {"--config 'matmul=naive|naive'", "value 'naive' given twice"},
      {"--serve concurrency=1,isl=8,isl=16,requests=2", "--serve field 'isl' given twice"},
      {"--serve concurrency=4:1,requests=2", "'concurrency': '4:1': load points must increase"},
      {"--serve rate=2:1,requests=2", "'rate': '2:1': load points must increase"},
      {"--serve concurrency=1,requests=2 --slo ttft_ms=5,ttft_ms=9",
       "--slo field 'ttft_ms' given twice"},
      {"--serve concurrency=1,requests=2 --layers 7", "--layers 7: must lie in [1, 4]"},
  };
  for (const auto& [flags, want] : cases) {
    int exit_code = -1;
    // From the source tree, where the fixture path resolves.
    const std::string out = RunCommand(
        absl::StrCat("cd '", SourceDir(), "' && '", WorkerBinary(), "' run ", flags, " 2>&1"),
        &exit_code);
    EXPECT_EQ(exit_code, 2) << flags << "\n" << out;
    EXPECT_THAT(out, HasSubstr(want)) << flags;
    EXPECT_THAT(out, Not(HasSubstr("# config"))) << flags;
    EXPECT_THAT(out, Not(HasSubstr("ERROR"))) << flags;
  }
}

// A partial --workload keeps the defaults `run --help` shows for the keys it leaves out.
TEST(RunCommand, PartialWorkloadKeepsTheDefaultsTheHelpShows) {
  int exit_code = -1;
  const std::string help = RunCommand(WorkerBinary() + " run --help 2>&1", &exit_code);
  ASSERT_EQ(exit_code, 0) << help;
  const size_t at = help.find("--workload TEXT=");
  ASSERT_NE(at, std::string::npos) << help;
  const std::string shown = help.substr(at + 16, help.find_first_of(" \n", at + 16) - at - 16);
  absl::StatusOr<Workload> defaults = ParseWorkload(shown);
  ASSERT_TRUE(defaults.ok()) << shown << ": " << defaults.status();
  const std::string out = RunCommand(WorkerBinary() +
                                         " run --model preset:tiny-moe --layers 1 "
                                         "--workload batch=1,repeats=1,warmup=0 2>&1",
                                     &exit_code);
  ASSERT_EQ(exit_code, 0) << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("workload: prompt ", defaults->prompt_len,
                                          " tokens, output ", defaults->output_len, " tokens")))
      << "--help shows " << shown << "\n"
      << out;
}
}  // namespace
}  // namespace infersweep
