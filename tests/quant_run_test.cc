// Quantized models through the harness and the CLI: the qgemm axis's preflight judgements,
// `--quantize` end to end (a CPU config judged OK against the quantized model's exact-dequant
// reference), and the bad-quant-scale fault judged INCORRECT.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "api/model_config.h"
#include "engine/backends.h"
#include "engine/fault_injection.h"
#include "engine/npy.h"
#include "engine/quant/layout.h"
#include "engine/roofline.h"
#include "harness/executor.h"
#include "harness/verdict.h"
#include "tests/gpu_trial.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;

constexpr const char* kFormatNames[] = {"fp8_tensor", "fp8_channel", "fp8_block128", "nvfp4",
                                        "mxfp4"};

BackendConfig Cuda(const std::string& qgemm) {
  auto c = NormalizeBackendConfig({{"device", "cuda"}, {"qgemm", qgemm}});
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(QuantPreflight, QgemmAxisJudgesArchAndWeightFormat) {
  const PreflightTarget h200_nvfp4{true, 90, 1, "nvfp4"};
  const PreflightTarget b200_nvfp4{true, 100, 1, "nvfp4"};
  // native_fp4 needs block-scaled FP4 tensor cores: UNSUPPORTED on Hopper, with the reason.
  PreflightResult r = Preflight(Cuda("native_fp4"), h200_nvfp4);
  EXPECT_FALSE(r.supported);
  EXPECT_EQ(r.reason, "qgemm=native_fp4 needs sm_100 or newer; the GPU is sm_90");
  r = Preflight(Cuda("native_fp4"), b200_nvfp4);
  EXPECT_TRUE(r.supported) << r.reason;
  EXPECT_EQ(r.precision, PrecisionClass::kFp4);
  EXPECT_TRUE(Preflight(Cuda("native_fp4"), {true, 120, 1, "mxfp4"}).supported);

  // w4a16: FP4 weights only; bf16 activations.
  r = Preflight(Cuda("w4a16"), h200_nvfp4);
  EXPECT_TRUE(r.supported) << r.reason;
  EXPECT_EQ(r.precision, PrecisionClass::kBf16);
  EXPECT_EQ(Preflight(Cuda("w4a16"), {true, 90, 1, "fp8"}).reason,
            "qgemm=w4a16 does not take fp8 weights (takes nvfp4, mxfp4)");
  EXPECT_THAT(Preflight(Cuda("w4a16"), {true, 90, 1, "bf16"}).reason,
              HasSubstr("does not take bf16 weights"));

  // w8a16: FP8 weights only (every scale layout); bf16 class like w4a16.
  r = Preflight(Cuda("w8a16"), {true, 90, 1, "fp8"});
  EXPECT_TRUE(r.supported) << r.reason;
  EXPECT_EQ(r.precision, PrecisionClass::kBf16);
  EXPECT_EQ(Preflight(Cuda("w8a16"), h200_nvfp4).reason,
            "qgemm=w8a16 does not take nvfp4 weights (takes fp8)");
  EXPECT_THAT(Preflight(Cuda("w8a16"), {true, 90, 1, "bf16"}).reason,
              HasSubstr("does not take bf16 weights"));

  // dequant_bf16 takes every quantized format; the reference takes anything, exactly.
  EXPECT_EQ(Preflight(Cuda("dequant_bf16"), {true, 90, 1, "mxfp4"}).precision,
            PrecisionClass::kBf16);
  EXPECT_THAT(Preflight(Cuda("dequant_bf16"), {true, 90, 1, "bf16"}).reason,
              HasSubstr("does not take bf16 weights"));
  EXPECT_EQ(Preflight(Cuda("reference"), h200_nvfp4).precision, PrecisionClass::kFp32);
  EXPECT_TRUE(Preflight(Cuda("reference"), {true, 90, 1, "bf16"}).supported);
  // The CPU dequantizes exactly: every format, fp32 class.
  auto cpu = NormalizeBackendConfig({{"matmul", "blocked"}});
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(Preflight(*cpu, {false, 0, 0, "mxfp4"}).precision, PrecisionClass::kFp32);
  // The GPU reference's defaults include the axis.
  EXPECT_EQ(DefaultAxes(Device::kCuda).at("qgemm"), "reference");
}

// The fast decode configs on quantized weights: gemm=fused takes every format (quantized
// linears through qgemm); moe=fused reads quantized experts with w4a16 / w8a16 or dequant_bf16's
// copies, never qgemm=reference's fp32 copies (UNSUPPORTED on quantized weights only).
TEST(QuantPreflight, FusedDecodeConfigsOnQuantizedWeights) {
  auto config = [](const std::string& qgemm) {
    auto c = NormalizeBackendConfig({{"device", "cuda"},
                                     {"gemm", "fused"},
                                     {"attention", "flash"},
                                     {"moe", "fused"},
                                     {"graphs", "on"},
                                     {"qgemm", qgemm}});
    EXPECT_TRUE(c.ok()) << c.status();
    return *c;
  };
  for (const char* format : {"nvfp4", "mxfp4"}) {
    const PreflightResult r = Preflight(config("w4a16"), {true, 90, 1, format});
    EXPECT_TRUE(r.supported) << format << ": " << r.reason;
    EXPECT_EQ(r.precision, PrecisionClass::kBf16);
    EXPECT_TRUE(Preflight(config("dequant_bf16"), {true, 90, 1, format}).supported);
    EXPECT_THAT(
        Preflight(config("reference"), {true, 90, 1, format}).reason,
        testing::StartsWith(std::string("moe=fused cannot be combined with qgemm=reference on ") +
                            format + " weights: qgemm=reference is the exact dequantization"));
  }
  EXPECT_TRUE(Preflight(config("w8a16"), {true, 90, 1, "fp8"}).supported);
  EXPECT_FALSE(Preflight(config("reference"), {true, 90, 1, "fp8"}).supported);
  // Dense weights: the fused runner is unchanged; qgemm stays at its reference.
  EXPECT_TRUE(Preflight(config("reference"), {true, 90, 1, "bf16"}).supported);
  EXPECT_FALSE(Preflight(config("w8a16"), {true, 90, 1, "bf16"}).supported);
  // gemm=fused without moe=fused takes qgemm=reference (the quantized linears' fp32 copies go
  // through the reference GEMM); an unknown format (a checkpoint without a declaration) is
  // judged at load.
  auto loop = NormalizeBackendConfig({{"device", "cuda"}, {"gemm", "fused"}});
  ASSERT_TRUE(loop.ok());
  EXPECT_TRUE(Preflight(*loop, {true, 90, 1, "nvfp4"}).supported);
  EXPECT_TRUE(Preflight(config("reference"), {true, 90, 1, ""}).supported);
}

// A two-layer trial with a short single-repeat workload, as a worker receives it (JSON).
TrialRequest QuantRequest(const std::string& model, const std::string& config,
                          const std::string& fault = "") {
  const nlohmann::json request = {
      {"trial_id", "q"},
      {"model", model},
      {"layers", 2},
      {"config", *ParseBackendConfig(config)},
      {"inject_fault", fault},
      {"workload", {{"prompt_len", 8}, {"output_len", 4}, {"repeats", 1}, {"warmup", 0}}}};
  auto parsed = TrialRequestFromJson(request);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  return *parsed;
}

TEST(QuantExecutor, UnsupportedIsJudgedBeforeAnyWeightLoads) {
  TrialExecutor executor(SimulatedH200());
  const TrialResult r =
      executor.Execute(QuantRequest("preset:qwen3-30b-a3b@nvfp4", "device=cuda,qgemm=native_fp4"));
  EXPECT_EQ(r.status, TrialStatus::kUnsupported) << r.reason;
  EXPECT_EQ(r.reason, "qgemm=native_fp4 needs sm_100 or newer; the GPU is sm_90");
  // The weight format too comes from the description ("@nvfp4"), before any weight loads.
  // moe=fused with the default qgemm=reference (fp32 expert copies: no fused runner).
  const TrialResult fused =
      executor.Execute(QuantRequest("preset:tiny-moe@nvfp4", "device=cuda,moe=fused"));
  EXPECT_EQ(fused.status, TrialStatus::kUnsupported) << fused.reason;
  EXPECT_THAT(fused.reason, testing::StartsWith("moe=fused cannot be combined with "
                                                "qgemm=reference on nvfp4 weights: "));
  EXPECT_EQ(fused.load_seconds, 0) << "judged from the model description alone";
  const TrialResult tma =
      executor.Execute(QuantRequest("preset:tiny-moe@fp8_block128", "device=cuda,gemm=tma"));
  EXPECT_EQ(tma.status, TrialStatus::kUnsupported) << tma.reason;
  EXPECT_EQ(tma.reason, "gemm=tma does not take fp8 weights (takes bf16)");
}

TEST(QuantExecutor, CpuConfigsAreOkAgainstTheQuantizedReferenceAndBadScaleIsIncorrect) {
  TrialExecutor executor(LocalDevices{});
  for (const char* format : kFormatNames) {
    const std::string model = std::string("preset:tiny-moe@") + format;
    const TrialResult ok = executor.Execute(QuantRequest(model, "matmul=blocked,threads=2"));
    EXPECT_EQ(ok.status, TrialStatus::kOk) << format << ": " << ok.reason;
    EXPECT_EQ(ok.verdict.precision_class, "fp32");
    EXPECT_LE(ok.verdict.max_rel_error, 1e-4) << format;

    const TrialResult bad =
        executor.Execute(QuantRequest(model, "matmul=naive", "bad-quant-scale:0.0625"));
    EXPECT_EQ(bad.status, TrialStatus::kIncorrect) << format << ": " << bad.reason;
    EXPECT_THAT(bad.reason, HasSubstr("max_rel_error")) << format;
  }
  const TrialResult dense =
      executor.Execute(QuantRequest("preset:tiny-moe", "matmul=naive", "bad-quant-scale:0.0625"));
  EXPECT_EQ(dense.status, TrialStatus::kError);
  EXPECT_THAT(dense.reason, HasSubstr("needs quantized weights"));
}

// Hybrids quantize Gated DeltaNet's wide projections and keep ModelOpt's default exclusions
// dense; the CPU runs the quantized matrices through the exact dequantizing matmul, OK against
// the quantized model's reference, and a corrupted scale (the first linear-attention one) is
// INCORRECT.
TEST(QuantExecutor, HybridQuantizesLinearAttentionAndKeepsTheExclusionsDense) {
  TrialExecutor executor(LocalDevices{});
  for (const char* format : {"nvfp4", "fp8_channel"}) {
    const std::string model = std::string("preset:tiny-hybrid@") + format;
    auto host = LoadHostModel(model, {2});
    ASSERT_TRUE(host.ok()) << format << ": " << host.status();
    std::set<std::string> quantized, dense;
    for (const TensorSpec& spec : (*host)->specs)
      (spec.quant == QuantFormat::kNone ? dense : quantized)
          .insert(spec.quant == QuantFormat::kNone ? spec.name : spec.linear);
    for (const char* name :
         {"model.layers.0.linear_attn.in_proj_qkv.weight",
          "model.layers.0.linear_attn.in_proj_z.weight",
          "model.layers.0.linear_attn.out_proj.weight", "model.layers.1.self_attn.q_proj.weight",
          "model.layers.1.mlp.shared_expert.down_proj.weight",
          "model.layers.0.mlp.experts.0.gate_proj.weight"})
      EXPECT_TRUE(quantized.contains(name)) << format << ": " << name;
    for (const char* name :
         {"model.layers.0.linear_attn.in_proj_a.weight",
          "model.layers.0.linear_attn.in_proj_b.weight", "model.layers.0.linear_attn.conv1d.weight",
          "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
          "lm_head.weight"}) {
      EXPECT_TRUE(dense.contains(name)) << format << ": " << name;
      EXPECT_FALSE(quantized.contains(name)) << format << ": " << name;
    }
    auto qkv = FindWeight(**host, "model.layers.0.linear_attn.in_proj_qkv.weight");
    ASSERT_TRUE(qkv.ok()) << qkv.status();
    EXPECT_TRUE(qkv->quantized()) << format;

    const TrialResult ok = executor.Execute(QuantRequest(model, "matmul=blocked,threads=2"));
    EXPECT_EQ(ok.status, TrialStatus::kOk) << format << ": " << ok.reason;
    EXPECT_LE(ok.verdict.max_rel_error, 1e-4) << format;
    const TrialResult bad = executor.Execute(
        QuantRequest(model, "matmul=naive",
                     "bad-quant-scale:0.0625@model.layers.0.linear_attn.out_proj.weight"));
    EXPECT_EQ(bad.status, TrialStatus::kIncorrect) << format << ": " << bad.reason;
  }
}

// bad-quant-scale@WEIGHT corrupts the named linear's first scale, not the first linear's: an
// expert's (the MoE runner's weights, where the motivating NVFP4 failure was) is INCORRECT too,
// and a name the model lacks, or one that is not quantized, is the request's error.
TEST(QuantExecutor, ACorruptedScaleOfANamedExpertIsIncorrect) {
  const std::string expert = "model.layers.1.mlp.experts.2.down_proj.weight";
  auto host = LoadHostModel("preset:tiny-moe@nvfp4", {2});
  ASSERT_TRUE(host.ok()) << host.status();
  ModelWeights copy = (*host)->weights;
  std::vector<uint8_t> corrupted;
  ASSERT_TRUE(CorruptQuantScale(copy, **host, 0.0625, expert, &corrupted).ok());
  EXPECT_EQ(copy.layers[1].experts[2].down.quant.scale, corrupted.data());
  EXPECT_EQ(copy.layers[0].q.quant.scale, (*host)->weights.layers[0].q.quant.scale);
  EXPECT_NE(corrupted[0],
            static_cast<const uint8_t*>((*host)->weights.layers[1].experts[2].down.quant.scale)[0]);

  TrialExecutor executor(LocalDevices{});
  for (const char* format : kFormatNames) {
    const std::string model = std::string("preset:tiny-moe@") + format;
    const TrialResult bad =
        executor.Execute(QuantRequest(model, "matmul=blocked", "bad-quant-scale:0.0625@" + expert));
    EXPECT_EQ(bad.status, TrialStatus::kIncorrect) << format << ": " << bad.reason;
    EXPECT_THAT(bad.reason, HasSubstr("max_rel_error")) << format;
  }
  const std::string model = "preset:tiny-moe@nvfp4";
  const TrialResult missing = executor.Execute(QuantRequest(
      model, "matmul=naive", "bad-quant-scale:16@model.layers.1.mlp.experts.8.up_proj.weight"));
  EXPECT_EQ(missing.status, TrialStatus::kError);
  EXPECT_THAT(missing.reason,
              HasSubstr("has no weight 'model.layers.1.mlp.experts.8.up_proj.weight'"));
  const TrialResult dense_part = executor.Execute(QuantRequest(
      model, "matmul=naive", "bad-quant-scale:16@model.layers.0.input_layernorm.weight"));
  EXPECT_EQ(dense_part.status, TrialStatus::kError);
  EXPECT_THAT(dense_part.reason,
              HasSubstr("model.layers.0.input_layernorm.weight is not quantized"));
  const TrialResult no_target =
      executor.Execute(QuantRequest(model, "matmul=naive", "bad-quant-scale:16@"));
  EXPECT_EQ(no_target.status, TrialStatus::kError);
  EXPECT_THAT(no_target.reason, HasSubstr("the target after '@' is a weight's name"));
  auto parsed = ParseFaultInjection("bad-quant-scale:16@" + expert);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->target, expert);
  EXPECT_EQ(FaultInjectionString(*parsed), "bad-quant-scale:16@" + expert);
}

// The exact-dequant reference of a quantized model stays close to the dense model it came from:
// far closer than a model with unrelated weights (another seed) is. A forward pass that misread
// the codes (as bf16, say) would agree with itself, but not with the dense model.
TEST(QuantExecutor, QuantizedReferenceTracksTheDenseModel) {
  auto cpu = NormalizeBackendConfig({{"matmul", "naive"}});
  ASSERT_TRUE(cpu.ok());
  auto eval = [&](const std::string& model, uint64_t seed) -> EvalOutputs {
    auto host = LoadHostModel(model, {2, seed});
    EXPECT_TRUE(host.ok()) << host.status();
    auto m = CreateModel(**host, *cpu);
    EXPECT_TRUE(m.ok()) << m.status();
    auto out = RunEval(**m, EvalSpec{});
    EXPECT_TRUE(out.ok()) << out.status();
    return *out;
  };
  const int vocab = 512;
  const EvalOutputs dense = eval("preset:tiny-moe", 1);
  VerdictMetrics unrelated;
  JudgeOutputs(dense, eval("preset:tiny-moe", 2), vocab, PrecisionClass::kFp4, &unrelated);
  std::printf("# unrelated weights vs bf16: top1 %.3f, kl_mean %.2g\n", unrelated.top1_agreement,
              unrelated.kl_mean);
  for (const char* format : kFormatNames) {
    VerdictMetrics m;
    JudgeOutputs(dense, eval(std::string("preset:tiny-moe@") + format, 1), vocab,
                 PrecisionClass::kFp4, &m);
    std::printf("# %s vs bf16: top1 %.3f, kl_mean %.2g, kl_max %.2g\n", format, m.top1_agreement,
                m.kl_mean, m.kl_max);
    EXPECT_EQ(m.non_finite, 0) << format;
    EXPECT_GT(m.kl_mean, 0) << format << ": quantization must change something";
    EXPECT_LT(m.kl_mean, unrelated.kl_mean / 4) << format;
    EXPECT_GT(m.top1_agreement, unrelated.top1_agreement + 0.2) << format;
  }
}

TEST(QuantExecutor, ModelDescriptions) {
  auto d = ParseModelDescription("preset:tiny-moe@fp8_block128");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->model, "preset:tiny-moe");
  EXPECT_EQ(d->quantize, QuantFormat::kFp8Block128);
  EXPECT_EQ(ParseModelDescription("/data/ckpt@v2")->model, "/data/ckpt@v2");
  EXPECT_THAT(ParseModelDescription("preset:tiny-moe@int3").status().message(),
              HasSubstr("'@int3' is not a quantization format"));
  EXPECT_EQ(*WithQuantization("preset:tiny-moe", "mxfp4"), "preset:tiny-moe@mxfp4");
  EXPECT_EQ(*WithQuantization("preset:tiny-moe@mxfp4", "mxfp4"), "preset:tiny-moe@mxfp4");
  EXPECT_EQ(*WithQuantization("preset:tiny-moe", "none"), "preset:tiny-moe");
  EXPECT_FALSE(WithQuantization("preset:tiny-moe@mxfp4", "nvfp4").ok());
  EXPECT_THAT(WithQuantization("x", "fp5").status().message(), HasSubstr("unknown format"));
  EXPECT_EQ(DeclaredWeightFormat("preset:tiny-moe@fp8_channel"), "fp8");
  EXPECT_EQ(DeclaredWeightFormat("preset:tiny-moe"), "bf16");

  // A quantized model cannot be quantized again; the roofline counts its smaller linears.
  auto host = LoadHostModel("preset:tiny-moe@nvfp4", {2});
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ((*host)->source, "preset:tiny-moe@nvfp4");
  EXPECT_FALSE((*host)->is_synthetic);
  EXPECT_THAT(QuantizeHostModel(**host, QuantFormat::kMxfp4).message(),
              HasSubstr("already quantized (nvfp4)"));
  EXPECT_THAT(
      LoadHostModel("preset:tiny-moe@nvfp4", {2, 1, true, QuantFormat::kMxfp4}).status().message(),
      HasSubstr("names format nvfp4"));
}

// The decode roofline of a quantized qwen3-30b-a3b counts its linears' stored bytes (codes and
// scales), with the router and lm_head in bf16 and the fp32 KV cache, as the engine runs them:
// batch 1 at context 544 (prompt 512 + half of 64 outputs), the H200's 4.46 TB/s. Coarser
// estimates (~2,600 tok/s NVFP4, ~1,470 FP8) count every active parameter quantized and no KV:
// the bf16 lm_head alone is 0.62 GB a step.
TEST(QuantRoofline, CountsTheStoredBytesOfQuantizedLinears) {
  auto config = PresetConfig("qwen3-30b-a3b");
  ASSERT_TRUE(config.ok());
  auto roofline = [&](QuantFormat f) {
    const double q = f == QuantFormat::kNone
                         ? 0
                         : QuantBytesPerElement(f, config->hidden_size, config->hidden_size);
    const DecodeTraffic t = DecodeBytesPerStep(*config, 1, 544, 2, 4, q);
    std::printf("# %-12s %.3f GB a step -> %.0f tok/s\n",
                f == QuantFormat::kNone ? "bf16" : QuantFormatName(f).c_str(), t.total() / 1e9,
                4460e9 / t.total());
    return 4460e9 / t.total();
  };
  EXPECT_NEAR(roofline(QuantFormat::kNone), 720, 5);  // docs/PERFORMANCE.md: 6.19 GB, 720 tok/s
  EXPECT_NEAR(roofline(QuantFormat::kNvfp4), 1953, 10);
  EXPECT_NEAR(roofline(QuantFormat::kMxfp4), 2029, 10);
  EXPECT_NEAR(roofline(QuantFormat::kFp8Block128), 1284, 10);
  EXPECT_NEAR(roofline(QuantFormat::kFp8Channel), 1283, 10);
}

// FNV-1a over every tensor's name, dtype and bytes, in table order.
uint64_t ModelHash(const HostModel& m) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const void* data, size_t n) {
    for (size_t i = 0; i < n; ++i)
      h = (h ^ static_cast<const uint8_t*>(data)[i]) * 1099511628211ull;
  };
  for (size_t i = 0; i < m.specs.size(); ++i) {
    mix(m.specs[i].name.data(), m.specs[i].name.size());
    const DType dtype = m.tensors[i].dtype;
    mix(&dtype, sizeof dtype);
    mix(m.tensors[i].data, static_cast<size_t>(m.specs[i].numel()) * DTypeSize(dtype));
  }
  return h;
}

// A quantized preset is generated and quantized tensor by tensor (threads, no dense copy): the
// bytes equal quantizing the materialised dense model, and equal what the quantizer wrote
// before it was streamed and made branch-free (the hashes below were taken from that version).
TEST(QuantizePreset, StreamedQuantizationIsBitIdenticalToTheMaterialisedModel) {
  const std::map<std::string, uint64_t> golden = {{"fp8_tensor", 0xed17f1b7c24ebbafull},
                                                  {"fp8_channel", 0x54cab98badab6a4full},
                                                  {"fp8_block128", 0xee6b436cd45a0fe3ull},
                                                  {"nvfp4", 0x5090aabf9a765f98ull},
                                                  {"mxfp4", 0x3b1e484ca7b3d1a8ull}};
  for (const char* format : kFormatNames) {
    auto streamed = LoadHostModel(std::string("preset:tiny-moe@") + format, {2, 7, true});
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    EXPECT_TRUE((*streamed)->host_materialized);
    auto dense = LoadHostModel("preset:tiny-moe", {2, 7, true});
    ASSERT_TRUE(dense.ok()) << dense.status();
    ASSERT_TRUE(QuantizeHostModel(**dense, *QuantFormatFromName(format)).ok());
    const uint64_t hash = ModelHash(**streamed);
    EXPECT_EQ(hash, ModelHash(**dense)) << format;
    std::printf("# %s: %016llx\n", format, static_cast<unsigned long long>(hash));
    EXPECT_EQ(hash, golden.at(format)) << format;
  }
}

// ---- the CLI: infersweep run / logits / generate --quantize

struct Cli {
  int exit_code = 0;
  std::string output;
};

Cli RunCli(const std::string& args) {
  Cli run;
  run.output = RunCommand(WorkerBinary() + " " + args + " 2>&1", &run.exit_code);
  return run;
}

// `infersweep run <args> --json <file>` on a tiny workload; the parsed JSON report.
nlohmann::json RunTrials(const std::string& args, const std::string& name) {
  const std::string json_path = testing::TempDir() + "/" + name + ".json";
  const Cli run = RunCli("run " + args +
                         " --layers 2 --workload prompt=8,output=4,batch=1,repeats=1,warmup=0 "
                         "--json " +
                         json_path);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  std::ifstream in(json_path);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

TEST(QuantCli, RunQuantizeEveryFormatIsOkOnCpuAndTheFaultIsIncorrect) {
  for (const char* format : kFormatNames) {
    const nlohmann::json json = RunTrials(std::string("--model preset:tiny-moe --quantize ") +
                                              format + " --config 'matmul=naive|blocked'",
                                          std::string("quant_run_") + format);
    EXPECT_EQ(json.value("model", ""), std::string("preset:tiny-moe@") + format);
    ASSERT_EQ(json.value("results", nlohmann::json::array()).size(), 2u) << json.dump(1);
    for (const auto& result : json.at("results")) {
      EXPECT_EQ(result.at("status"), "OK") << format << ": " << result.dump();
      EXPECT_EQ(result.at("model"), std::string("preset:tiny-moe@") + format);
    }
  }
  const nlohmann::json faulty = RunTrials(
      "--model preset:tiny-moe@mxfp4 --config matmul=blocked --test-inject-fault bad-quant-scale:4",
      "quant_run_fault");
  ASSERT_EQ(faulty.value("results", nlohmann::json::array()).size(), 1u) << faulty.dump(1);
  EXPECT_EQ(faulty["results"][0].at("status"), "INCORRECT") << faulty.dump(1);
}

TEST(QuantCli, LogitsAndGenerateTakeQuantize) {
  const std::string npy = testing::TempDir() + "/quant_logits.npy";
  Cli run = RunCli(
      "logits --model preset:tiny-moe --layers 2 --quantize fp8_block128 "
      "--tokens 1,2,3 --out " +
      npy);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("preset:tiny-moe@fp8_block128"));
  auto logits = ReadNpyFloat32(npy);
  ASSERT_TRUE(logits.ok()) << logits.status();
  EXPECT_EQ(logits->shape, (std::vector<int64_t>{3, 512}));

  run = RunCli(
      "generate --model preset:tiny-moe --layers 2 --quantize nvfp4 --tokens 1,2,3 "
      "--max-new-tokens 3");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("{\"tokens\":["));

  run = RunCli("generate --model preset:tiny-moe --quantize int4 --tokens 1 --max-new-tokens 2");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("--quantize int4: unknown format (known: fp8_tensor"));
}

}  // namespace
}  // namespace infersweep
