// The typed backend options (engine/options.h): every registered value of every axis parses to
// its enum and back to its name, the shared-behaviour predicates hold for exactly the values
// they name, and a value the registry does not know is an error naming the axis.
#include "engine/options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/backend_config.h"

namespace infersweep {
namespace {

// A normalized config of `device` with one axis set.
BackendConfig With(Device device, const std::string& axis, const std::string& value) {
  BackendConfig config = DefaultAxes(device);
  config[axis] = value;
  return config;
}

TEST(Options, EveryRegisteredValueParsesAndNamesItself) {
  int parsed = 0;
  for (const BackendDescriptor& d : BackendRegistry()) {
    if (d.axis == "device") continue;
    const BackendConfig config = With(d.device, d.axis, d.value);
    SCOPED_TRACE(BackendConfigString(config));
    if (d.device == Device::kCuda) {
      auto o = ParseCudaOptions(config);
      ASSERT_TRUE(o.ok()) << o.status();
      std::string name;
      if (d.axis == "gemm") name = AxisValueName(o->gemm);
      if (d.axis == "attention") name = AxisValueName(o->attention);
      if (d.axis == "kv_cache") name = AxisValueName(o->kv_cache);
      if (d.axis == "moe") name = AxisValueName(o->moe);
      if (d.axis == "graphs") name = AxisValueName(o->graphs);
      if (d.axis == "qgemm") name = AxisValueName(o->qgemm);
      if (d.axis == "linear_attn") name = AxisValueName(o->linear_attn);
      if (d.axis == "test_kernel") name = AxisValueName(o->test_kernel);
      if (d.axis == "tp") name = std::to_string(o->parallel.tp);
      if (d.axis == "ep") name = o->parallel.expert_parallel ? "on" : "off";
      if (d.axis == "allreduce") name = AxisValueName(o->parallel.allreduce);
      EXPECT_EQ(name, d.value) << "axis " << d.axis << " has no typed option";
    } else {
      auto o = ParseCpuOptions(config);
      ASSERT_TRUE(o.ok()) << o.status();
      if (d.axis == "matmul") {
        EXPECT_EQ(AxisValueName(o->matmul), d.value);
      } else if (d.axis == "tp") {
        EXPECT_EQ(std::to_string(o->parallel.tp), d.value);
      } else if (d.axis == "ep") {
        EXPECT_EQ(o->parallel.expert_parallel ? "on" : "off", d.value);
      } else if (d.axis == "allreduce") {
        EXPECT_EQ(AxisValueName(o->parallel.allreduce), d.value);
      } else {
        ASSERT_EQ(d.axis, "threads");
        EXPECT_EQ(o->threads, d.value == "all" ? 0 : std::stoi(d.value));
      }
    }
    ++parsed;
  }
  EXPECT_GT(parsed, 20);
}

// Axes added after results were stored leave a normalized config at their implicit values, so a
// config string from before them still names the same run; any other value stays in it.
TEST(Options, ImplicitAxesAreLeftOutAtTheirValues) {
  for (Device device : {Device::kCpu, Device::kCuda}) {
    BackendConfig config = {{"device", DeviceName(device)}};
    for (const auto& [axis, value] : ImplicitAxes(device)) config[axis] = value;
    auto normalized = NormalizeBackendConfig(config);
    ASSERT_TRUE(normalized.ok()) << normalized.status();
    EXPECT_EQ(*normalized, DefaultAxes(device)) << DeviceName(device);
  }
  auto fused = NormalizeBackendConfig({{"device", "cuda"}, {"linear_attn", "fused"}});
  ASSERT_TRUE(fused.ok()) << fused.status();
  EXPECT_EQ(fused->at("linear_attn"), "fused");
  auto parsed = ParseCudaOptions(*fused);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->linear_attn, LinearAttn::kFused);
  EXPECT_EQ(ImplicitAxes(Device::kCuda).at("linear_attn"), "reference");
  EXPECT_EQ(ImplicitAxes(Device::kCpu).count("linear_attn"), 0u);
}

TEST(Options, DefaultsAreTheReferenceValues) {
  auto cuda = ParseCudaOptions(DefaultAxes(Device::kCuda));
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  EXPECT_EQ(cuda->gemm, Gemm::kReference);
  EXPECT_EQ(cuda->attention, Attention::kNaive);
  EXPECT_EQ(cuda->kv_cache, KvCache::kFp32);
  EXPECT_EQ(cuda->moe, Moe::kLoop);
  EXPECT_EQ(cuda->graphs, Graphs::kOff);
  EXPECT_EQ(cuda->qgemm, QGemm::kReference);
  EXPECT_EQ(cuda->linear_attn, LinearAttn::kReference);
  // An absent axis is its default too.
  auto bare = ParseCudaOptions({{"device", "cuda"}, {"gemm", "tma"}});
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_EQ(bare->gemm, Gemm::kTma);
  EXPECT_EQ(bare->moe, Moe::kLoop);
  auto cpu = ParseCpuOptions({{"device", "cpu"}});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->matmul, Matmul::kNaive);
  EXPECT_EQ(cpu->threads, 0);
}

TEST(Options, PredicatesNameTheirValues) {
  auto values = [](const std::string& axis) {
    std::set<std::string> out;
    for (const BackendDescriptor& d : BackendRegistry())
      if (d.axis == axis) out.insert(d.value);
    return out;
  };
  // Each predicate's set of values, over every registered value of its axis.
  auto holds = [&](const std::string& axis, auto predicate) {
    std::set<std::string> out;
    for (const std::string& v : values(axis)) {
      auto o = ParseCudaOptions(With(Device::kCuda, axis, v));
      EXPECT_TRUE(o.ok()) << o.status();
      if (o.ok() && predicate(*o)) out.insert(v);
    }
    return out;
  };
  using S = std::set<std::string>;
  EXPECT_EQ(holds("gemm", [](const CudaOptions& o) { return UsesCublasLt(o.gemm); }),
            (S{"cublaslt", "fused", "tma"}));
  EXPECT_EQ(holds("gemm", [](const CudaOptions& o) { return UsesFusedGemv(o.gemm); }),
            (S{"fused", "tma"}));
  EXPECT_EQ(holds("gemm", [](const CudaOptions& o) { return UsesTma(o.gemm); }), (S{"tma"}));
  EXPECT_EQ(holds("moe", [](const CudaOptions& o) { return RoutesOnDevice(o.moe); }),
            (S{"fused", "wgmma"}));
  EXPECT_EQ(holds("graphs", [](const CudaOptions& o) { return CapturesDecode(o.graphs); }),
            (S{"on", "persistent"}));
  EXPECT_EQ(holds("graphs", [](const CudaOptions& o) { return IsPersistent(o.graphs); }),
            (S{"persistent"}));
  EXPECT_EQ(holds("qgemm", [](const CudaOptions& o) { return DequantizesInRegisters(o.qgemm); }),
            (S{"w4a16", "w8a16", "w8a8"}));
  EXPECT_EQ(holds("qgemm", [](const CudaOptions& o) { return QuantizesActivationsFp8(o.qgemm); }),
            (S{"w8a8"}));
  EXPECT_EQ(holds("qgemm", [](const CudaOptions& o) { return UsesScaledGemm(o.qgemm); }),
            (S{"cudnn", "fp8_cublaslt", "native_fp4"}));
  EXPECT_EQ(holds("qgemm", [](const CudaOptions& o) { return KeepsQuantCodes(o.qgemm); }),
            (S{"reference", "w4a16", "w8a16", "w8a8"}));
}

TEST(Options, UnregisteredValuesAreErrorsNamingTheAxis) {
  for (const char* axis : {"gemm", "attention", "kv_cache", "moe", "graphs", "qgemm"}) {
    auto o = ParseCudaOptions(With(Device::kCuda, axis, "warp_drive"));
    ASSERT_FALSE(o.ok()) << axis;
    EXPECT_TRUE(absl::IsInvalidArgument(o.status())) << o.status();
    EXPECT_THAT(std::string(o.status().message()),
                testing::HasSubstr(std::string("'") + axis + "': unknown value 'warp_drive'"));
  }
  auto matmul = ParseCpuOptions(With(Device::kCpu, "matmul", "strassen"));
  EXPECT_FALSE(matmul.ok());
  EXPECT_THAT(std::string(matmul.status().message()), testing::HasSubstr("'matmul'"));
  for (const char* threads : {"0", "-2", "many"}) {
    auto t = ParseCpuOptions(With(Device::kCpu, "threads", threads));
    EXPECT_FALSE(t.ok()) << threads;
  }
  // Each device's parser takes its own configs only.
  EXPECT_EQ(ParseCudaOptions(DefaultAxes(Device::kCpu)).status().message(),
            "device=cpu: not a device=cuda config");
  EXPECT_EQ(ParseCpuOptions(DefaultAxes(Device::kCuda)).status().message(),
            "device=cuda: not a device=cpu config");
  // A device the registry does not know is named as the config spells it.
  EXPECT_EQ(ParseCpuOptions({{"device", "tpu"}}).status().message(),
            "device=tpu: not a device=cpu config");
}

// The device axis is parsed once into Device: every registered device's name round-trips, and
// any other name is an InvalidArgument naming the field it came from and the known devices.
TEST(Options, DeviceNamesRoundTripAndAnUnknownDeviceIsRefused) {
  std::vector<std::string> registered;
  for (const BackendDescriptor& d : BackendRegistry()) {
    if (d.axis != "device") continue;
    registered.push_back(d.value);
    EXPECT_EQ(DeviceName(d.device), d.value);
    absl::StatusOr<Device> parsed = ParseDevice(d.value, "--device");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, d.device);
    EXPECT_EQ(DefaultAxes(d.device).at("device"), d.value);
  }
  EXPECT_EQ(registered, (std::vector<std::string>{"cpu", "cuda"}));

  for (const char* unknown : {"tpu", "CUDA", "gpu", ""}) {
    absl::StatusOr<Device> parsed = ParseDevice(unknown, "--device");
    ASSERT_FALSE(parsed.ok()) << unknown;
    EXPECT_TRUE(absl::IsInvalidArgument(parsed.status())) << parsed.status();
    EXPECT_EQ(parsed.status().message(),
              absl::StrCat("--device: unknown value '", unknown, "' (known: cpu, cuda)"));
  }

  // A config without a device axis targets the CPU; an unknown device names the config's axis.
  EXPECT_EQ(ParseConfigDevice({}).value_or(Device::kCuda), Device::kCpu);
  EXPECT_EQ(ParseConfigDevice({{"device", "cuda"}}).value_or(Device::kCpu), Device::kCuda);
  EXPECT_EQ(ConfigDevice(*NormalizeBackendConfig({{"device", "cuda"}})), Device::kCuda);
  const std::string tpu = "config axis 'device': unknown value 'tpu' (known: cpu, cuda)";
  EXPECT_EQ(ParseConfigDevice({{"device", "tpu"}}).status().message(), tpu);
  EXPECT_EQ(NormalizeBackendConfig({{"device", "tpu"}}).status().message(), tpu);
  EXPECT_EQ(NormalizeBackendConfig({{"device", "cpu"}, {"gemm", "fused"}}).status().message(),
            "config axis 'gemm' is not an axis of cpu (known: allreduce, device, ep, matmul, "
            "threads, tp)");
}

// RegistryConflict is Preflight's conflict judgement: on every pair of CUDA values, for dense and
// quantized weights, it names a conflict exactly when Preflight (on a target that takes
// everything else) refuses with that same reason.
TEST(Options, RegistryConflictIsPreflightsConflictJudgement) {
  std::map<std::string, std::vector<std::string>> axes;
  for (const BackendDescriptor& d : BackendRegistry())
    if (d.device == Device::kCuda) axes[d.axis].push_back(d.value);
  // A registry without sm bounds or weight formats: only conflicts can refuse.
  std::vector<BackendDescriptor> open = BackendRegistry();
  for (BackendDescriptor& d : open) {
    d.min_sm = d.max_sm = 0;
    d.weight_formats.clear();
  }
  int conflicts = 0;
  for (const char* format : {"bf16", "nvfp4"}) {
    PreflightTarget target;
    target.has_cuda_build = true;
    target.gpu_count = 8;  // enough for every tp
    target.sm = 90;
    target.weight_format = format;
    for (const BackendConfig& config : ExpandMatrix(axes)) {
      const std::string why = RegistryConflict(config, format, open);
      const PreflightResult preflight = Preflight(config, target, open);
      EXPECT_EQ(why, preflight.reason) << format << " " << BackendConfigString(config);
      EXPECT_EQ(why.empty(), preflight.supported) << format << " " << BackendConfigString(config);
      conflicts += !why.empty();
    }
  }
  EXPECT_GT(conflicts, 0);
  EXPECT_EQ(RegistryConflict(*NormalizeBackendConfig({{"device", "cuda"}}), "nvfp4"), "");
  EXPECT_EQ(
      RegistryConflict(
          *NormalizeBackendConfig({{"device", "cuda"}, {"moe", "loop"}, {"graphs", "on"}}), "bf16"),
      "moe=loop cannot be combined with graphs=on: the runner reads the routing on the host (a "
      "device sync a step), which a captured graph cannot replay");
}

}  // namespace
}  // namespace infersweep
