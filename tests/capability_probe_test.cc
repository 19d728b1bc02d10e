// The capability probe's CPU-testable core (engine/capability_probe.h): its cache, and the
// executor's use of it, with a fake probe standing in for the driver and the libraries.
#include "engine/capability_probe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "harness/executor.h"
#include "harness/runner.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using testing::HasSubstr;

// Refuses every config that holds one of `refused` ("axis=value"), as a library would:
// Unimplemented with its words and the shape. Records what it was asked.
class FakeProbe final : public CapabilityProbe {
 public:
  explicit FakeProbe(std::set<std::string> refused) : refused_(std::move(refused)) {}
  absl::Status Probe(const BackendConfig& config, const ModelConfig& model,
                     const std::string& weight_format) override {
    ++calls;
    hidden_sizes.push_back(model.hidden_size);
    formats.push_back(weight_format);
    for (const auto& [axis, value] : config)
      if (refused_.count(absl::StrCat(axis, "=", value)))
        return absl::UnimplementedError(absl::StrCat(
            axis, "=", value, ": fakelib has no algorithm for M=1 N=", model.hidden_size));
    if (fail_to_ask) return absl::InternalError("fakelib: driver not answering");
    return absl::OkStatus();
  }
  int calls = 0;
  bool fail_to_ask = false;
  std::vector<int> hidden_sizes;
  std::vector<std::string> formats;

 private:
  std::set<std::string> refused_;
};

ModelConfig Shapes() { return *PresetConfig("tiny-moe"); }

TEST(CachedProbe, AsksOncePerConfigAndShapes) {
  auto fake = std::make_unique<FakeProbe>(std::set<std::string>{"matmul=blocked"});
  FakeProbe* raw = fake.get();
  CachedProbe probe(std::move(fake), "gpu=test");
  const BackendConfig blocked = *NormalizeBackendConfig({{"matmul", "blocked"}});
  const BackendConfig naive = *NormalizeBackendConfig({{"matmul", "naive"}});
  for (int i = 0; i < 3; ++i) {
    absl::Status s = probe.Probe(blocked, Shapes(), "bf16");
    EXPECT_TRUE(absl::IsUnimplemented(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr("fakelib has no algorithm"));
    EXPECT_TRUE(probe.Probe(naive, Shapes(), "bf16").ok());
  }
  EXPECT_EQ(raw->calls, 2);
  EXPECT_EQ(probe.inner_calls(), 2);
  ModelConfig wider = Shapes();
  wider.hidden_size *= 2;  // other shapes: asked again
  EXPECT_TRUE(probe.Probe(naive, wider, "bf16").ok());
  EXPECT_TRUE(probe.Probe(naive, Shapes(), "fp8").ok());  // another weight format too
  EXPECT_EQ(raw->calls, 4);
}

// A probe that could not ask (not a refusal) is not remembered: the next trial asks again.
TEST(CachedProbe, DoesNotCacheAFailureToAsk) {
  auto fake = std::make_unique<FakeProbe>(std::set<std::string>{});
  FakeProbe* raw = fake.get();
  raw->fail_to_ask = true;
  CachedProbe probe(std::move(fake), "gpu=test");
  const BackendConfig naive = *NormalizeBackendConfig({{"matmul", "naive"}});
  EXPECT_EQ(probe.Probe(naive, Shapes(), "bf16").code(), absl::StatusCode::kInternal);
  raw->fail_to_ask = false;
  EXPECT_TRUE(probe.Probe(naive, Shapes(), "bf16").ok());
  EXPECT_EQ(raw->calls, 2);
}

// The file cache outlives the process: a second probe on the same file (a later worker) answers
// from it without asking; another environment (a driver or library upgrade) asks again.
TEST(CachedProbe, FileCacheAnswersLaterProbesOfTheSameEnvironment) {
  const std::string path = absl::StrCat(testing::TempDir(), "/probe-cache-", getpid(), ".jsonl");
  std::remove(path.c_str());
  const BackendConfig blocked = *NormalizeBackendConfig({{"matmul", "blocked"}});
  {
    CachedProbe first(std::make_unique<FakeProbe>(std::set<std::string>{"matmul=blocked"}),
                      "gpu=test driver=1", path);
    EXPECT_TRUE(absl::IsUnimplemented(first.Probe(blocked, Shapes(), "bf16")));
  }
  {
    std::ofstream torn(path, std::ios::app);
    torn << "{\"key\": \"half a line\n";  // skipped, not fatal
  }
  auto fake = std::make_unique<FakeProbe>(std::set<std::string>{});
  FakeProbe* raw = fake.get();
  CachedProbe second(std::move(fake), "gpu=test driver=1", path);
  absl::Status s = second.Probe(blocked, Shapes(), "bf16");
  EXPECT_TRUE(absl::IsUnimplemented(s)) << s;
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("fakelib has no algorithm for M=1 N=", Shapes().hidden_size)));
  EXPECT_EQ(raw->calls, 0);
  CachedProbe upgraded(std::make_unique<FakeProbe>(std::set<std::string>{}), "gpu=test driver=2",
                       path);
  EXPECT_TRUE(upgraded.Probe(blocked, Shapes(), "bf16").ok());
  EXPECT_EQ(upgraded.inner_calls(), 1);
  std::remove(path.c_str());
}

TrialRequest Request(const std::string& config) {
  TrialRequest r;
  r.trial_id = config;
  r.model = "preset:tiny-moe";
  r.layers = 2;
  r.config = *ParseBackendConfig(config);
  r.workload.prompt_len = 8;
  r.workload.output_len = 4;
  r.workload.repeats = 1;
  r.workload.warmup = 0;
  r.workload.batch_sizes = {1};
  return r;
}

// A sweep mixing probe-refused and runnable configs through the executor: every refused one is
// UNSUPPORTED with the probe's words, and none loads weights, runs a reference or builds a model
// (its progress says nothing past preflight); the runnable ones run and are OK. The probe sees
// the model's shapes before any weights load.
TEST(CapabilityProbe, RefusedConfigsAreUnsupportedAndNeverRun) {
  auto fake = std::make_shared<FakeProbe>(std::set<std::string>{"matmul=blocked", "threads=2"});
  TrialExecutor executor(LocalDevices{}, {}, fake);
  const std::vector<std::string> sweep = {"matmul=naive,threads=1", "matmul=blocked,threads=1",
                                          "matmul=naive,threads=2", "matmul=naive,threads=4",
                                          "matmul=blocked,threads=2"};
  int refused = 0;
  for (const std::string& config : sweep) {
    std::vector<std::string> progress;
    const TrialResult result = executor.Execute(
        Request(config), [&](const std::string& line) { progress.push_back(line); });
    const bool expect_refused = config.find("blocked") != std::string::npos ||
                                config.find("threads=2") != std::string::npos;
    if (!expect_refused) {
      EXPECT_EQ(result.status, TrialStatus::kOk) << config << ": " << result.reason;
      continue;
    }
    ++refused;
    EXPECT_EQ(result.status, TrialStatus::kUnsupported) << config << ": " << result.reason;
    EXPECT_THAT(result.reason, HasSubstr("capability probe: "));
    EXPECT_THAT(result.reason, HasSubstr(absl::StrCat("fakelib has no algorithm for M=1 N=",
                                                      Shapes().hidden_size)));
    EXPECT_TRUE(progress.empty()) << config << " ran past the probe: " << progress.front();
    EXPECT_TRUE(result.batches.empty());
    EXPECT_EQ(result.load_seconds, 0);
  }
  EXPECT_EQ(refused, 3);
  EXPECT_EQ(fake->calls, static_cast<int>(sweep.size()));
  for (int hidden : fake->hidden_sizes) EXPECT_EQ(hidden, Shapes().hidden_size);
  for (const std::string& format : fake->formats) EXPECT_EQ(format, "bf16");
}

// A cache file holding the probe's refusal (written by an earlier worker, as the agent's workers
// write it) seeded for `refused` on the runner's model.
std::string SeedCacheFile(const std::string& name, const std::string& refused) {
  const std::string path = absl::StrCat(testing::TempDir(), "/", name, "-", getpid(), ".jsonl");
  std::remove(path.c_str());
  CachedProbe seed(std::make_unique<FakeProbe>(std::set<std::string>{refused}),
                   ProbeEnvironmentKey(ProbeLocalDevices()), path);
  const BackendConfig config = *NormalizeBackendConfig(*ParseBackendConfig(refused));
  EXPECT_TRUE(absl::IsUnimplemented(seed.Probe(config, *PresetConfig("tiny-moe", 2), "bf16")));
  return path;
}

// The runner answers a config the cache file refuses without a worker: its worker here is
// /bin/false, which every trial that reaches it turns into a failure.
TEST(CapabilityProbe, ACachedRefusalNeverReachesAWorker) {
  const std::string path = SeedCacheFile("runner-probe", "matmul=blocked");
  RunnerOptions options;
  options.worker_argv = {"/bin/false"};
  options.probe_cache_path = path;
  TrialRunner runner(options);
  const TrialResult refused = runner.Run(Request("matmul=blocked"));
  EXPECT_EQ(refused.status, TrialStatus::kUnsupported) << refused.reason;
  EXPECT_THAT(refused.reason, HasSubstr("capability probe: matmul=blocked: fakelib"));
  EXPECT_TRUE(refused.stderr_tail.empty());
  const TrialResult reached = runner.Run(Request("matmul=naive"));
  EXPECT_NE(reached.status, TrialStatus::kUnsupported) << "a worker should have run it";
  EXPECT_NE(reached.status, TrialStatus::kOk);
  std::remove(path.c_str());
}

// A sweep through real workers sharing the cache file: the refused configs are UNSUPPORTED with
// the probe's words, the others OK.
TEST(CapabilityProbe, SweepThroughWorkersMixesRefusedAndRunnableConfigs) {
  const std::string path = SeedCacheFile("sweep-probe", "threads=2");
  RunnerOptions options;
  options.worker_argv = {WorkerBinary(), "worker"};
  options.probe_cache_path = path;
  TrialRunner runner(options);
  for (const char* config : {"threads=1", "threads=2", "matmul=blocked,threads=1"}) {
    const TrialResult r = runner.Run(Request(config));
    if (std::string(config) == "threads=2") {
      EXPECT_EQ(r.status, TrialStatus::kUnsupported) << r.reason;
      EXPECT_THAT(r.reason, HasSubstr("capability probe: threads=2: fakelib"));
    } else {
      EXPECT_EQ(r.status, TrialStatus::kOk) << config << ": " << r.reason << r.stderr_tail;
    }
  }
  std::remove(path.c_str());
}

// A probe that cannot ask is the trial's ERROR, not a verdict on the config.
TEST(CapabilityProbe, AProbeThatCannotAskIsAnError) {
  auto fake = std::make_shared<FakeProbe>(std::set<std::string>{});
  fake->fail_to_ask = true;
  TrialExecutor executor(LocalDevices{}, {}, fake);
  const TrialResult result = executor.Execute(Request("matmul=naive"));
  EXPECT_EQ(result.status, TrialStatus::kError) << result.reason;
  EXPECT_THAT(result.reason, HasSubstr("capability probe: fakelib: driver not answering"));
}

// test_kernel is TEST ONLY: selectable by name, absent from normalized configs at "none", and
// left out of what an agent advertises and of the generated docs.
TEST(CapabilityProbe, TestKernelAxisIsHiddenButSelectable) {
  auto config = NormalizeBackendConfig({{"device", "cuda"}, {"test_kernel", "sm100a"}});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->at("test_kernel"), "sm100a");
  auto plain = NormalizeBackendConfig({{"device", "cuda"}, {"test_kernel", "none"}});
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->count("test_kernel"), 0u);
  int rows = 0;
  for (const BackendDescriptor& d : BackendRegistry())
    if (d.axis == "test_kernel") {
      ++rows;
      EXPECT_TRUE(d.test_only) << d.value;
    }
  EXPECT_EQ(rows, 2);
}

// The cuDNN values' static side: attention=cudnn takes the bf16 KV cache only and not the
// persistent step (its batch-1 attention is the kernel's own); qgemm=cudnn takes quantized
// weights on sm_90+, FP4 included, so that on the H200 cuDNN's own refusal answers for FP4.
TEST(CudnnPreflight, AttentionNeedsTheBf16CacheAndNoPersistentStep) {
  const PreflightTarget h200 = {true, 90, 1, "bf16"};
  auto preflight = [&](const BackendConfig& axes) {
    BackendConfig config = axes;
    config["device"] = "cuda";
    auto normalized = NormalizeBackendConfig(config);
    EXPECT_TRUE(normalized.ok()) << normalized.status();
    return Preflight(*normalized, h200);
  };
  EXPECT_TRUE(preflight({{"attention", "cudnn"}, {"kv_cache", "bf16"}}).supported);
  const PreflightResult fp32 = preflight({{"attention", "cudnn"}, {"kv_cache", "fp32"}});
  EXPECT_FALSE(fp32.supported);
  EXPECT_THAT(fp32.reason, HasSubstr("cuDNN's fused attention reads bf16 K and V"));
  const PreflightResult persistent = preflight(
      {{"attention", "cudnn"}, {"kv_cache", "bf16"}, {"gemm", "fused"}, {"moe", "fused"},
       {"graphs", "persistent"}});
  EXPECT_FALSE(persistent.supported);
  EXPECT_THAT(persistent.reason, HasSubstr("persistent kernel's own attention"));
}

TEST(CudnnPreflight, QgemmTakesQuantizedWeightsOnSm90AndNewer) {
  BackendConfig config = {{"device", "cuda"}, {"gemm", "cublaslt"}, {"qgemm", "cudnn"}};
  auto normalized = NormalizeBackendConfig(config);
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  for (const char* format : {"fp8", "nvfp4", "mxfp4"})
    EXPECT_TRUE(Preflight(*normalized, {true, 90, 1, format}).supported) << format;
  EXPECT_THAT(Preflight(*normalized, {true, 90, 1, "bf16"}).reason,
              HasSubstr("does not take bf16 weights"));
  EXPECT_EQ(Preflight(*normalized, {true, 89, 1, "fp8"}).reason,
            "qgemm=cudnn needs sm_90 or newer; the GPU is sm_89");
  config["moe"] = "fused";
  EXPECT_FALSE(Preflight(*NormalizeBackendConfig(config), {true, 90, 1, "fp8"}).supported);
}

}  // namespace
}  // namespace infersweep
