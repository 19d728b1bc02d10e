#include "engine/options.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/status_macros.h"
#include "core/unreachable.h"

namespace infersweep {
namespace {

// Each enum's names: its axis's values in the registry's order (the enum's order), on the
// devices that have the axis. A count that differs from the enum's is a broken build.
template <typename E>
struct AxisOf;
template <>
struct AxisOf<Gemm> {
  static constexpr const char* kAxis = "gemm";
  static constexpr int kCount = 4;
};
template <>
struct AxisOf<Attention> {
  static constexpr const char* kAxis = "attention";
  static constexpr int kCount = 3;
};
template <>
struct AxisOf<KvCache> {
  static constexpr const char* kAxis = "kv_cache";
  static constexpr int kCount = 3;
};
template <>
struct AxisOf<Moe> {
  static constexpr const char* kAxis = "moe";
  static constexpr int kCount = 4;
};
template <>
struct AxisOf<Graphs> {
  static constexpr const char* kAxis = "graphs";
  static constexpr int kCount = 3;
};
template <>
struct AxisOf<QGemm> {
  static constexpr const char* kAxis = "qgemm";
  static constexpr int kCount = 8;
};
template <>
struct AxisOf<LinearAttn> {
  static constexpr const char* kAxis = "linear_attn";
  static constexpr int kCount = 4;
};
template <>
struct AxisOf<TestKernel> {
  static constexpr const char* kAxis = "test_kernel";
  static constexpr int kCount = 2;
};
template <>
struct AxisOf<Matmul> {
  static constexpr const char* kAxis = "matmul";
  static constexpr int kCount = 2;
};
// The CPU's reference first, then the CUDA values.
template <>
struct AxisOf<AllReduce> {
  static constexpr const char* kAxis = "allreduce";
  static constexpr int kCount = 5;
};
template <>
struct AxisOf<bool> {  // ep: off, on
  static constexpr const char* kAxis = "ep";
  static constexpr int kCount = 2;
};

template <typename E>
const std::vector<std::string>& Names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> all;
    for (Device device : {Device::kCpu, Device::kCuda})
      for (std::string& v : RegisteredValues(device, AxisOf<E>::kAxis))
        if (std::find(all.begin(), all.end(), v) == all.end()) all.push_back(std::move(v));
    if (static_cast<int>(all.size()) != AxisOf<E>::kCount)
      Unreachable("engine/options.h: an axis's enum and the registry's values differ in number");
    return all;
  }();
  return names;
}

template <typename E>
const char* NameOf(E value) {
  const int i = static_cast<int>(value);
  if (i < 0 || i >= AxisOf<E>::kCount) Unreachable("AxisValueName: a value outside its enum");
  return Names<E>()[static_cast<size_t>(i)].c_str();
}

// The axis's value in `config`, or the device's default when the axis is absent.
std::string ValueOf(const BackendConfig& config, Device device, const std::string& axis) {
  if (auto it = config.find(axis); it != config.end()) return it->second;
  const auto implicit = ImplicitAxes(device);
  if (auto it = implicit.find(axis); it != implicit.end()) return it->second;
  return DefaultAxes(device).at(axis);
}

// `value` of `axis` as its enum; InvalidArgument naming the axis and the known values.
template <typename E>
absl::Status ParseValue(const std::string& axis, const std::string& value, E* out) {
  const std::vector<std::string>& names = Names<E>();
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == value) {
      *out = static_cast<E>(i);
      return absl::OkStatus();
    }
  return absl::InvalidArgumentError(absl::StrCat("config axis '", axis, "': unknown value '", value,
                                                 "' (known: ", absl::StrJoin(names, ", "), ")"));
}

template <typename E>
absl::Status ParseAxis(const BackendConfig& config, Device device, E* out) {
  return ParseValue(AxisOf<E>::kAxis, ValueOf(config, device, AxisOf<E>::kAxis), out);
}

absl::Status ExpectDevice(const BackendConfig& config, Device device) {
  const absl::StatusOr<Device> given = ParseConfigDevice(config);
  if (given.ok() && *given == device) return absl::OkStatus();
  // A device the registry does not know is named as the config spells it.
  return absl::InvalidArgumentError(
      absl::StrCat("device=", given.ok() ? DeviceName(*given) : config.at("device"),
                   ": not a device=", DeviceName(device), " config"));
}

// tp, ep and allreduce of either device.
// tp, ep and allreduce, absent from a normalized config at their defaults (1, off, the device's
// all-reduce), are parsed into `out` as it comes.
absl::Status ParseParallel(const BackendConfig& config, Device device, ParallelOptions* out) {
  auto value_or = [&](const char* axis, const char* default_value) {
    auto it = config.find(axis);
    return it != config.end() ? it->second : std::string(default_value);
  };
  const std::string tp = value_or("tp", "1");
  if (!absl::SimpleAtoi(tp, &out->tp) || out->tp < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("config axis 'tp': '", tp, "' is not a positive rank count"));
  RETURN_IF_ERROR(ParseValue("ep", value_or("ep", "off"), &out->expert_parallel));
  return ParseValue("allreduce",
                    value_or("allreduce", device == Device::kCuda ? "auto" : "reference"),
                    &out->allreduce);
}

}  // namespace

const char* YardstickName(Yardstick y) {
  switch (y) {
    case Yardstick::kNone:
      return "none";
    case Yardstick::kBf16:
      return "bf16";
    case Yardstick::kE4m3:
      return "e4m3";
  }
  Unreachable("YardstickName: a Yardstick outside its enum");
}

const char* AxisValueName(Gemm v) { return NameOf(v); }
const char* AxisValueName(Attention v) { return NameOf(v); }
const char* AxisValueName(KvCache v) { return NameOf(v); }
const char* AxisValueName(Moe v) { return NameOf(v); }
const char* AxisValueName(Graphs v) { return NameOf(v); }
const char* AxisValueName(QGemm v) { return NameOf(v); }
const char* AxisValueName(LinearAttn v) { return NameOf(v); }
const char* AxisValueName(TestKernel v) { return NameOf(v); }
const char* AxisValueName(Matmul v) { return NameOf(v); }
const char* AxisValueName(AllReduce v) { return NameOf(v); }

absl::StatusOr<CudaOptions> ParseCudaOptions(const BackendConfig& normalized) {
  const Device device = Device::kCuda;
  RETURN_IF_ERROR(ExpectDevice(normalized, device));
  CudaOptions o;
  for (absl::Status s :
       {ParseAxis(normalized, device, &o.gemm), ParseAxis(normalized, device, &o.attention),
        ParseAxis(normalized, device, &o.kv_cache), ParseAxis(normalized, device, &o.moe),
        ParseAxis(normalized, device, &o.graphs), ParseAxis(normalized, device, &o.qgemm),
        ParseAxis(normalized, device, &o.linear_attn),
        ParseAxis(normalized, device, &o.test_kernel),
        ParseParallel(normalized, device, &o.parallel)})
    if (!s.ok()) return s;
  return o;
}

absl::StatusOr<CpuOptions> ParseCpuOptions(const BackendConfig& normalized) {
  const Device device = Device::kCpu;
  RETURN_IF_ERROR(ExpectDevice(normalized, device));
  CpuOptions o;
  RETURN_IF_ERROR(ParseAxis(normalized, device, &o.matmul));
  const std::string threads = ValueOf(normalized, device, "threads");
  if (threads != "all" && (!absl::SimpleAtoi(threads, &o.threads) || o.threads <= 0))
    return absl::InvalidArgumentError(absl::StrCat("config axis 'threads': '", threads,
                                                   "' is neither a positive number nor all"));
  RETURN_IF_ERROR(ParseParallel(normalized, device, &o.parallel));
  return o;
}

}  // namespace infersweep
