// The capability probe on a GPU (engine/capability_probe.h): test_kernel=sm100a, whose image is
// sm_100a's alone, is UNSUPPORTED on every other GPU in the driver's words, through the
// executor and through an isolated worker, never CRASHED; the production configs pass it; and
// cuDNN is found at run time, and attention=cudnn (cuDNN's fused attention through its graph API)
// is judged OK and agrees with attention=flash. Skips without a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/inventory.h"
#include "api/serve_spec.h"
#include "engine/backends.h"
#include "engine/capability_probe.h"
#include "engine/cudnn_loader.h"
#include "harness/executor.h"
#include "harness/gpu_sampler.h"
#include "harness/runner.h"
#include "harness/serving.h"
#include "tests/gpu_trial.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using testing::HasSubstr;

#define REQUIRE_GPU_WITHOUT_SM100A(devices)                               \
  if ((devices).gpu_count == 0) GTEST_SKIP() << "no GPU on this machine"; \
  if ((devices).sm == 100) GTEST_SKIP() << "this GPU runs sm_100a code: nothing to refuse"

std::string NoImage(const LocalDevices& d) {
  return absl::StrCat("capability probe: test_kernel=sm100a: no kernel image for sm_", d.sm);
}

TEST(GpuProbe, Sm100aKernelIsUnsupportedByTheProbe) {
  const LocalDevices devices = ProbeLocalDevices();
  REQUIRE_GPU_WITHOUT_SM100A(devices);
  TrialExecutor executor(devices);
  std::vector<std::string> progress;
  const TrialResult r =
      executor.Execute(GpuRequest("preset:tiny-moe", "device=cuda,test_kernel=sm100a"),
                       [&](const std::string& line) { progress.push_back(line); });
  std::cout << "# executor: " << TrialStatusName(r.status) << ": " << r.reason << std::endl;
  EXPECT_EQ(r.status, TrialStatus::kUnsupported) << r.reason;
  EXPECT_THAT(r.reason, HasSubstr(NoImage(devices)));
  EXPECT_THAT(r.reason, HasSubstr(" in this binary (cudaError"));  // the driver's words
  EXPECT_TRUE(progress.empty()) << "ran past the probe: " << progress.front();
}

// In an isolated worker (the agent's path): UNSUPPORTED, not CRASHED; a runnable config after it
// is OK on the same runner.
TEST(GpuProbe, Sm100aKernelIsUnsupportedInAWorker) {
  const LocalDevices devices = ProbeLocalDevices();
  REQUIRE_GPU_WITHOUT_SM100A(devices);
  RunnerOptions options;
  options.worker_argv = {WorkerBinary(), "worker"};
  TrialRunner runner(options);
  const TrialResult r = runner.Run(GpuRequest("preset:tiny-moe", "device=cuda,test_kernel=sm100a"));
  std::cout << "# worker: " << TrialStatusName(r.status) << ": " << r.reason << std::endl;
  EXPECT_EQ(r.status, TrialStatus::kUnsupported) << r.reason << "\n" << r.stderr_tail;
  EXPECT_THAT(r.reason, HasSubstr(NoImage(devices)));
  const TrialResult ok = runner.Run(GpuRequest("preset:tiny-moe", "device=cuda,attention=flash"));
  EXPECT_EQ(ok.status, TrialStatus::kOk) << ok.reason;
}

// Past the probe (a model built without a preflight, as `logits` builds one), the launch's
// missing image is Unimplemented in the driver's words, and the context stays usable.
TEST(GpuProbe, Sm100aKernelPastTheProbeIsRefusedNotCrashed) {
  const LocalDevices devices = ProbeLocalDevices();
  REQUIRE_GPU_WITHOUT_SM100A(devices);
  auto host = LoadHostModel("preset:tiny-moe", {2, 1, false});
  ASSERT_TRUE(host.ok()) << host.status();
  auto config = NormalizeBackendConfig({{"device", "cuda"}, {"test_kernel", "sm100a"}});
  ASSERT_TRUE(config.ok());
  auto model = CreateModel(**host, *config);
  ASSERT_FALSE(model.ok());
  std::cout << "# past the probe: " << model.status() << std::endl;
  EXPECT_TRUE(absl::IsUnimplemented(model.status())) << model.status();
  EXPECT_THAT(model.status().message(), HasSubstr("test_kernel=sm100a: launch failed (cudaError"));
  auto plain = CreateModel(**host, *NormalizeBackendConfig({{"device", "cuda"}}));
  EXPECT_TRUE(plain.ok()) << plain.status();
}

// The fast configs pass the probe on this GPU (kernels present, cuBLASLt algorithms found for
// qwen3-30b-a3b's shapes).
TEST(GpuProbe, ProductionConfigsPassTheProbe) {
  const LocalDevices devices = ProbeLocalDevices();
  if (devices.gpu_count == 0) GTEST_SKIP() << "no GPU on this machine";
  std::unique_ptr<CapabilityProbe> probe = MakeDeviceProbe(devices);
  const ModelConfig shapes = *PresetConfig("qwen3-30b-a3b");
  std::vector<std::string> configs = {"device=cuda",
                                      "device=cuda,gemm=cublaslt,attention=flash,moe=fused"};
  if (devices.sm == 90)
    configs.push_back(
        "device=cuda,gemm=tma,attention=flash,kv_cache=bf16,moe=wgmma,graphs=persistent");
  for (const std::string& text : configs) {
    auto config = NormalizeBackendConfig(*ParseBackendConfig(text));
    ASSERT_TRUE(config.ok()) << config.status();
    const absl::Status s = probe->Probe(*config, shapes, "bf16");
    EXPECT_TRUE(s.ok()) << text << ": " << s;
  }
}

// cuDNN is loaded at run time, from LD_LIBRARY_PATH, INFERSWEEP_CUDNN_DIR or PyTorch's wheel.
TEST(GpuProbe, CudnnLoadsAtRunTime) {
  const absl::StatusOr<const CudnnLibrary*> cudnn = ProcessCudnn();
  if (!cudnn.ok()) {
    std::cout << "# cudnn: " << cudnn.status() << std::endl;
    const absl::Status s = RequireCudnn(cudnn, 90000, "attention=cudnn");
    EXPECT_TRUE(absl::IsUnimplemented(s));
    EXPECT_THAT(s.message(), HasSubstr("libcudnn.so.9 not found"));
    return;
  }
  std::cout << "# cudnn " << CudnnVersionText((*cudnn)->version) << " from " << (*cudnn)->path
            << std::endl;
  EXPECT_GE((*cudnn)->version, 90000u);
#ifdef INFERSWEEP_HAVE_CUDA  // the version a CUDA build's trials record (TrialResult.software)
  EXPECT_EQ(ProbeLocalDevices().cudnn_version, CudnnVersionText((*cudnn)->version));
#endif
}

// The agent offers each GPU as the CUDA runtime describes it, with NVML's driver version, the
// CUDA version the driver supports and its PCI bus id (agent/inventory.h).
TEST(GpuProbe, TheAgentOffersEachGpuAsTheRuntimeDescribesIt) {
  const LocalDevices devices = ProbeLocalDevices();
  if (devices.gpu_count == 0) GTEST_SKIP() << "no GPU on this machine";
  const std::vector<GpuInfo> gpus = DetectGpus();
  ASSERT_GE(gpus.size(), static_cast<size_t>(devices.gpu_count));
  ASSERT_EQ(devices.gpus.size(), static_cast<size_t>(devices.gpu_count));
  for (int i = 0; i < devices.gpu_count; ++i) {
    const GpuInfo& g = gpus[i];
    std::cout << "# GPU " << i << ": " << g.name << " sm_" << g.sm << " "
              << g.memory_bytes / (1 << 20) << " MiB bus " << g.pci_bus_id << " driver "
              << g.driver_version << " CUDA " << g.cuda_version << std::endl;
    EXPECT_EQ(g.index, i);
    EXPECT_EQ(g.name, devices.gpus[i].name);
    EXPECT_EQ(g.sm, devices.gpus[i].sm);
    EXPECT_EQ(g.memory_bytes, devices.gpus[i].memory_bytes);
    EXPECT_FALSE(g.pci_bus_id.empty());
    EXPECT_EQ(g.driver_version, NvidiaDriverVersion());
    EXPECT_FALSE(g.driver_version.empty());
    EXPECT_EQ(g.cuda_version, devices.cuda_driver_version);
  }
}

// attention=cudnn, judged by the harness against the reference: OK eagerly and with its decode
// step captured in a CUDA graph, at batch 1 and 4, on the dense, MoE and hybrid tiny presets.
TEST(GpuCudnn, AttentionIsOkByTheHarness) {
  const LocalDevices devices = ProbeLocalDevices();
  if (devices.gpu_count == 0) GTEST_SKIP() << "no GPU on this machine";
  TrialExecutor executor(devices);
  const std::vector<std::pair<const char*, const char*>> models = {
      {"preset:tiny-moe", ",moe=fused"},
      {"preset:tiny-dense", ",moe=fused"},
      {"preset:tiny-hybrid", ",moe=fused,linear_attn=fused"}};
  for (const auto& [model, axes] : models) {
    for (const char* graphs : {"off", "on"}) {
      const std::string config =
          absl::StrCat("device=cuda,attention=cudnn,kv_cache=bf16,graphs=", graphs, axes);
      const TrialResult r = executor.Execute(GpuRequest(model, config), nullptr);
      std::cout << "# " << model << " " << config << ": " << TrialStatusName(r.status) << " "
                << r.reason << std::endl;
      EXPECT_EQ(r.status, TrialStatus::kOk) << model << " " << config << ": " << r.reason;
    }
  }
}

// attention=cudnn at the hybrids' head size (tiny-hybrid-hd256: head_dim 256, 8 q / 2 kv heads,
// partial RoPE, the output gate): OK against the reference where the installed cuDNN finalizes
// a plan for 256-wide heads, else UNSUPPORTED with cuDNN's reason (naming attention=cudnn);
// never INCORRECT or CRASHED.
TEST(GpuCudnn, AttentionAtHeadDim256IsOkOrRefusedByCudnn) {
  const LocalDevices devices = ProbeLocalDevices();
  if (devices.gpu_count == 0) GTEST_SKIP() << "no GPU on this machine";
  TrialExecutor executor(devices);
  for (const char* graphs : {"off", "on"}) {
    const std::string config = absl::StrCat(
        "device=cuda,attention=cudnn,kv_cache=bf16,moe=fused,linear_attn=fused,graphs=", graphs);
    const TrialResult r = executor.Execute(GpuRequest("preset:tiny-hybrid-hd256", config), nullptr);
    std::cout << "# tiny-hybrid-hd256 " << config << ": " << TrialStatusName(r.status) << " "
              << r.reason << std::endl;
    if (r.status == TrialStatus::kUnsupported) {
      EXPECT_THAT(r.reason, HasSubstr("attention=cudnn")) << config;
    } else {
      EXPECT_EQ(r.status, TrialStatus::kOk) << config << ": " << r.reason;
    }
  }
}

// attention=cudnn serves: a ragged step's decode rows as a batch of every KV slot, each prefill
// chunk as one sequence over its slot's cache; the served tokens are judged as a serving trial
// judges them, eagerly and with each decode bucket's graph, on a MoE and a hybrid.
TEST(GpuCudnn, AttentionServes) {
  const LocalDevices devices = ProbeLocalDevices();
  if (devices.gpu_count == 0) GTEST_SKIP() << "no GPU on this machine";
  auto spec = ParseServeSpec("concurrency=1:4,isl=8-30,osl=4-10,requests=8,chunk=6");
  ASSERT_TRUE(spec.ok()) << spec.status();
  for (const auto& [model, axes] : std::vector<std::pair<const char*, const char*>>{
           {"preset:tiny-moe", ",moe=fused"},
           {"preset:tiny-hybrid", ",moe=fused,linear_attn=fused"}}) {
    auto host = LoadHostModel(model, {2, 1, false});
    ASSERT_TRUE(host.ok()) << host.status();
    for (const char* graphs : {"off", "on"}) {
      const std::string config =
          absl::StrCat("device=cuda,attention=cudnn,kv_cache=bf16,graphs=", graphs, axes);
      const ServeTrialResult trial = RunServeTrial(**host, *ParseBackendConfig(config), *spec, {});
      std::cout << "# served " << model << " " << config << ": " << TrialStatusName(trial.status)
                << " " << trial.reason << std::endl;
      ASSERT_EQ(trial.status, TrialStatus::kOk) << model << " " << config << ": " << trial.reason;
      for (const LoadPointResult& p : trial.points) {
        EXPECT_EQ(p.verdict, TrialStatus::kOk)
            << config << " " << LoadPointName(p.point) << ": " << p.mismatch;
        EXPECT_EQ(p.metrics.completed, spec->requests);
      }
    }
  }
}

// Every position's logits of a 40-token prompt (prefill crosses no tile edge evenly) under
// attention=cudnn against attention=flash on the same bf16 cache: equal to bf16 rounding. A
// wrong causal shift or padding bound moves whole rows, far past the bound.
TEST(GpuCudnn, AttentionMatchesFlash) {
  const LocalDevices devices = ProbeLocalDevices();
  if (devices.gpu_count == 0) GTEST_SKIP() << "no GPU on this machine";
  auto host = LoadHostModel("preset:tiny-dense", {2, 1, false});
  ASSERT_TRUE(host.ok()) << host.status();
  std::vector<int32_t> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 37 + 11) % 200);
  const std::vector<float> flash =
      AllLogits(**host, *ParseBackendConfig("device=cuda,attention=flash,kv_cache=bf16"), prompt);
  const std::vector<float> cudnn =
      AllLogits(**host, *ParseBackendConfig("device=cuda,attention=cudnn,kv_cache=bf16"), prompt);
  ASSERT_EQ(flash.size(), cudnn.size());
  ASSERT_FALSE(flash.empty());
  float peak = 0, worst = 0;
  for (size_t i = 0; i < flash.size(); ++i) {
    peak = std::max(peak, std::fabs(flash[i]));
    worst = std::max(worst, std::fabs(flash[i] - cudnn[i]));
  }
  std::cout << "# cudnn vs flash: max |diff| " << worst << " of max |logit| " << peak << std::endl;
  EXPECT_LT(worst, 2e-2f * peak);
}

// qgemm=cudnn on FP8 weights (cuDNN's E4M3 x E4M3 matmul graph, scales in its epilogue): OK by
// the harness on a dense and an MoE tiny preset (graphs off: like fp8_cublaslt, it takes moe=loop
// only, which cannot be captured), per-tensor and per-channel scales, and a weight
// scale x1000 on layer 0's o_proj (read through the graph's column scales) is INCORRECT. (Not
// q_proj: Qwen3's per-head q_norm cancels a per-tensor scale there exactly, so the run is right.)
TEST(GpuCudnn, Fp8MatmulIsOkAndABadScaleIsIncorrect) {
  const LocalDevices devices = ProbeLocalDevices();
  if (devices.gpu_count == 0 || devices.sm < 90) GTEST_SKIP() << "no sm_90+ GPU on this machine";
  TrialExecutor executor(devices);
  const std::vector<std::pair<std::string, std::string>> trials = {
      {"preset:tiny-dense@fp8_channel", "device=cuda,gemm=cublaslt,qgemm=cudnn,graphs=off"},
      {"preset:tiny-dense@fp8_tensor", "device=cuda,gemm=cublaslt,qgemm=cudnn,graphs=off"},
      {"preset:tiny-moe@fp8_channel", "device=cuda,gemm=cublaslt,qgemm=cudnn,moe=loop"}};
  for (const auto& [model, config] : trials) {
    const TrialResult ok = executor.Execute(GpuRequest(model, config));
    std::cout << "# " << model << " " << config << ": " << TrialStatusName(ok.status) << " "
              << ok.reason << " (top1 " << ok.verdict.top1_agreement << ")" << std::endl;
    EXPECT_EQ(ok.status, TrialStatus::kOk) << model << " " << config << ": " << ok.reason;
    const TrialResult bad = executor.Execute(
        GpuRequest(model, config, "bad-quant-scale:1000@model.layers.0.self_attn.o_proj.weight"));
    EXPECT_EQ(bad.status, TrialStatus::kIncorrect) << model << " " << config << ": " << bad.reason;
  }
}

// qgemm=cudnn on FP4 weights where the GPU has no FP4 tensor cores: UNSUPPORTED by the capability
// probe, in cuDNN's own words (its status name and message), before any weight loads.
TEST(GpuCudnn, Fp4MatmulIsUnsupportedInCudnnsWords) {
  const LocalDevices devices = ProbeLocalDevices();
  if (devices.gpu_count == 0 || devices.sm >= 100 || devices.sm < 90)
    GTEST_SKIP() << "needs an sm_90 GPU (sm_100+ has FP4 tensor cores)";
  TrialExecutor executor(devices);
  for (const char* model : {"preset:tiny-dense@nvfp4", "preset:tiny-dense@mxfp4"}) {
    std::vector<std::string> progress;
    const TrialResult r =
        executor.Execute(GpuRequest(model, "device=cuda,gemm=cublaslt,qgemm=cudnn"),
                         [&](const std::string& line) { progress.push_back(line); });
    std::cout << "# " << model << ": " << TrialStatusName(r.status) << ": " << r.reason
              << std::endl;
    EXPECT_EQ(r.status, TrialStatus::kUnsupported) << r.reason;
    EXPECT_THAT(r.reason, HasSubstr("qgemm=cudnn"));
    EXPECT_THAT(r.reason, HasSubstr("CUDNN_STATUS_"));  // cuDNN's status, then its message
    EXPECT_TRUE(progress.empty()) << "ran past the probe: " << progress.front();
  }
}

}  // namespace
}  // namespace infersweep
