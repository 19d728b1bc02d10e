#include "engine/options.h"

#include <array>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace infersweep {
namespace {

template <typename E, size_t N>
using Names = std::array<std::pair<E, const char*>, N>;

constexpr Names<Gemm, 4> kGemm = {{{Gemm::kReference, "reference"},
                                   {Gemm::kCublasLt, "cublaslt"},
                                   {Gemm::kFused, "fused"},
                                   {Gemm::kTma, "tma"}}};
constexpr Names<Attention, 3> kAttention = {
    {{Attention::kNaive, "naive"}, {Attention::kFlash, "flash"}, {Attention::kCudnn, "cudnn"}}};
constexpr Names<KvCache, 3> kKvCache = {
    {{KvCache::kFp32, "fp32"}, {KvCache::kBf16, "bf16"}, {KvCache::kFp8, "fp8"}}};
constexpr Names<Moe, 4> kMoe = {{{Moe::kLoop, "loop"},
                                 {Moe::kGrouped, "grouped"},
                                 {Moe::kFused, "fused"},
                                 {Moe::kWgmma, "wgmma"}}};
constexpr Names<Graphs, 3> kGraphs = {
    {{Graphs::kOff, "off"}, {Graphs::kOn, "on"}, {Graphs::kPersistent, "persistent"}}};
constexpr Names<QGemm, 7> kQGemm = {{{QGemm::kReference, "reference"},
                                     {QGemm::kDequantBf16, "dequant_bf16"},
                                     {QGemm::kW4A16, "w4a16"},
                                     {QGemm::kW8A16, "w8a16"},
                                     {QGemm::kFp8CublasLt, "fp8_cublaslt"},
                                     {QGemm::kNativeFp4, "native_fp4"},
                                     {QGemm::kCudnn, "cudnn"}}};
constexpr Names<LinearAttn, 2> kLinearAttn = {
    {{LinearAttn::kReference, "reference"}, {LinearAttn::kFused, "fused"}}};
constexpr Names<TestKernel, 2> kTestKernel = {
    {{TestKernel::kNone, "none"}, {TestKernel::kSm100a, "sm100a"}}};
constexpr Names<Matmul, 2> kMatmul = {{{Matmul::kNaive, "naive"}, {Matmul::kBlocked, "blocked"}}};
constexpr Names<AllReduce, 5> kAllReduce = {{{AllReduce::kReference, "reference"},
                                             {AllReduce::kAuto, "auto"},
                                             {AllReduce::kNccl, "nccl"},
                                             {AllReduce::kCustom, "custom"},
                                             {AllReduce::kFused, "fused"}}};
constexpr Names<bool, 2> kSwitch = {{{false, "off"}, {true, "on"}}};

template <typename E, size_t N>
const char* NameOf(const Names<E, N>& names, E value) {
  for (const auto& [v, name] : names)
    if (v == value) return name;
  return "?";
}

// The axis's value in `config`, or the device's default when the axis is absent.
std::string ValueOf(const BackendConfig& config, const std::string& device,
                    const std::string& axis) {
  if (auto it = config.find(axis); it != config.end()) return it->second;
  const auto implicit = ImplicitAxes(device);
  if (auto it = implicit.find(axis); it != implicit.end()) return it->second;
  return DefaultAxes(device).at(axis);
}

// `value` of `axis` as its enum; InvalidArgument naming the axis and the known values.
template <typename E, size_t N>
absl::Status ParseValue(const std::string& axis, const std::string& value, const Names<E, N>& names,
                        E* out) {
  for (const auto& [v, name] : names)
    if (name == value) {
      *out = v;
      return absl::OkStatus();
    }
  std::vector<std::string> known;
  for (const auto& [v, name] : names) known.emplace_back(name);
  return absl::InvalidArgumentError(absl::StrCat("config axis '", axis, "': unknown value '", value,
                                                 "' (known: ", absl::StrJoin(known, ", "), ")"));
}

template <typename E, size_t N>
absl::Status ParseAxis(const BackendConfig& config, const std::string& device,
                       const std::string& axis, const Names<E, N>& names, E* out) {
  return ParseValue(axis, ValueOf(config, device, axis), names, out);
}

absl::Status ExpectDevice(const BackendConfig& config, const std::string& device) {
  if (ConfigDevice(config) == device) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("device=", ConfigDevice(config), ": not a device=", device, " config"));
}

// tp, ep and allreduce of either device.
// tp, ep and allreduce, absent from a normalized config at their defaults (1, off, the device's
// all-reduce), are parsed into `out` as it comes.
absl::Status ParseParallel(const BackendConfig& config, const std::string& device,
                           ParallelOptions* out) {
  auto value_or = [&](const char* axis, const char* default_value) {
    auto it = config.find(axis);
    return it != config.end() ? it->second : std::string(default_value);
  };
  const std::string tp = value_or("tp", "1");
  if (!absl::SimpleAtoi(tp, &out->tp) || out->tp < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("config axis 'tp': '", tp, "' is not a positive rank count"));
  if (auto s = ParseValue("ep", value_or("ep", "off"), kSwitch, &out->expert_parallel); !s.ok())
    return s;
  return ParseValue("allreduce", value_or("allreduce", device == "cuda" ? "auto" : "reference"),
                    kAllReduce, &out->allreduce);
}

}  // namespace

const char* AxisValueName(Gemm v) { return NameOf(kGemm, v); }
const char* AxisValueName(Attention v) { return NameOf(kAttention, v); }
const char* AxisValueName(KvCache v) { return NameOf(kKvCache, v); }
const char* AxisValueName(Moe v) { return NameOf(kMoe, v); }
const char* AxisValueName(Graphs v) { return NameOf(kGraphs, v); }
const char* AxisValueName(QGemm v) { return NameOf(kQGemm, v); }
const char* AxisValueName(LinearAttn v) { return NameOf(kLinearAttn, v); }
const char* AxisValueName(TestKernel v) { return NameOf(kTestKernel, v); }
const char* AxisValueName(Matmul v) { return NameOf(kMatmul, v); }
const char* AxisValueName(AllReduce v) { return NameOf(kAllReduce, v); }

absl::StatusOr<CudaOptions> ParseCudaOptions(const BackendConfig& normalized) {
  if (auto s = ExpectDevice(normalized, "cuda"); !s.ok()) return s;
  const std::string device = "cuda";
  CudaOptions o;
  for (absl::Status s : {ParseAxis(normalized, device, "gemm", kGemm, &o.gemm),
                         ParseAxis(normalized, device, "attention", kAttention, &o.attention),
                         ParseAxis(normalized, device, "kv_cache", kKvCache, &o.kv_cache),
                         ParseAxis(normalized, device, "moe", kMoe, &o.moe),
                         ParseAxis(normalized, device, "graphs", kGraphs, &o.graphs),
                         ParseAxis(normalized, device, "qgemm", kQGemm, &o.qgemm),
                         ParseAxis(normalized, device, "linear_attn", kLinearAttn, &o.linear_attn),
                         ParseAxis(normalized, device, "test_kernel", kTestKernel, &o.test_kernel),
                         ParseParallel(normalized, device, &o.parallel)})
    if (!s.ok()) return s;
  return o;
}

absl::StatusOr<CpuOptions> ParseCpuOptions(const BackendConfig& normalized) {
  if (auto s = ExpectDevice(normalized, "cpu"); !s.ok()) return s;
  CpuOptions o;
  if (auto s = ParseAxis(normalized, "cpu", "matmul", kMatmul, &o.matmul); !s.ok()) return s;
  const std::string threads = ValueOf(normalized, "cpu", "threads");
  if (threads != "all" && (!absl::SimpleAtoi(threads, &o.threads) || o.threads <= 0))
    return absl::InvalidArgumentError(absl::StrCat("config axis 'threads': '", threads,
                                                   "' is neither a positive number nor all"));
  if (auto s = ParseParallel(normalized, "cpu", &o.parallel); !s.ok()) return s;
  return o;
}

}  // namespace infersweep
