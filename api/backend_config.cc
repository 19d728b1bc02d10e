#include "api/backend_config.h"

#include <algorithm>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "api/status_macros.h"
#include "core/unreachable.h"

namespace infersweep {
namespace {

const BackendDescriptor* Find(const std::vector<BackendDescriptor>& registry, std::string_view axis,
                              std::string_view value) {
  for (const BackendDescriptor& d : registry)
    if (d.axis == axis && d.value == value) return &d;
  return nullptr;
}

// The row of `device` for axis=value (axes such as tp have a row on each device), else the first
// row of any device.
const BackendDescriptor* FindOn(const std::vector<BackendDescriptor>& registry, Device device,
                                std::string_view axis, std::string_view value) {
  for (const BackendDescriptor& d : registry)
    if (d.device == device && d.axis == axis && d.value == value) return &d;
  return Find(registry, axis, value);
}

std::string SmName(int sm) { return absl::StrCat("sm_", sm); }

bool IsQuantizedFormat(std::string_view weight_format) {
  return weight_format == "fp8" || weight_format == "nvfp4" || weight_format == "mxfp4";
}

// Whether `config` holds the conflict entry "axis=value" (or "axis=value: why"); its name and
// reason, split.
bool Holds(const BackendConfig& config, const std::string& conflict, std::string* name,
           std::string* why) {
  std::pair<std::string, std::string> entry = absl::StrSplit(conflict, absl::MaxSplits(": ", 1));
  std::pair<std::string, std::string> kv = absl::StrSplit(entry.first, absl::MaxSplits('=', 1));
  auto it = config.find(kv.first);
  std::string value;
  if (it != config.end()) {
    value = it->second;
  } else {
    const auto implicit = ImplicitAxes(ConfigDevice(config));
    auto default_value = implicit.find(kv.first);
    if (default_value == implicit.end()) return false;
    value = default_value->second;
  }
  if (value != kv.second) return false;
  *name = entry.first;
  *why = entry.second;
  return true;
}

// Every one of d's conflict rows (and, on quantized weights, quantized conflict rows) that
// `config` holds, as preflight states them.
std::vector<std::string> ConflictsOf(const BackendDescriptor& d, const BackendConfig& config,
                                     std::string_view weight_format) {
  const std::string name = absl::StrCat(d.axis, "=", d.value);
  std::vector<std::string> out;
  std::string other, why;
  for (const std::string& conflict : d.conflicts)
    if (Holds(config, conflict, &other, &why))
      out.push_back(
          absl::StrCat(name, " cannot be combined with ", other, why.empty() ? "" : ": ", why));
  if (IsQuantizedFormat(weight_format))
    for (const std::string& conflict : d.quantized_conflicts)
      if (Holds(config, conflict, &other, &why))
        out.push_back(absl::StrCat(name, " cannot be combined with ", other, " on ",
                                   std::string(weight_format), " weights", why.empty() ? "" : ": ",
                                   why));
  return out;
}

}  // namespace

// The device axis's values, indexed by Device. A row whose device differs from its place, or a
// count that differs from the enum's, is a broken build.
const std::vector<std::string>& DeviceNames() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> names;
    for (const BackendDescriptor& d : BackendRegistry()) {
      if (d.axis != "device") continue;
      if (static_cast<size_t>(d.device) != names.size())
        Unreachable("api/backend_config.h: the device rows are not in the Device enum's order");
      names.push_back(d.value);
    }
    if (names.size() != static_cast<size_t>(Device::kCuda) + 1)
      Unreachable("api/backend_config.h: the Device enum and the device rows differ in number");
    return names;
  }();
  return names;
}

const char* DeviceName(Device device) {
  const auto i = static_cast<size_t>(device);
  if (i >= DeviceNames().size()) Unreachable("DeviceName: a value outside Device");
  return DeviceNames()[i].c_str();
}

absl::StatusOr<Device> ParseDevice(std::string_view name, std::string_view field) {
  const std::vector<std::string>& names = DeviceNames();
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return static_cast<Device>(i);
  return absl::InvalidArgumentError(absl::StrCat(std::string(field), ": unknown value '",
                                                 std::string(name),
                                                 "' (known: ", absl::StrJoin(names, ", "), ")"));
}

std::vector<std::string> RegisteredValues(Device device, std::string_view axis) {
  std::vector<std::string> values;
  for (const BackendDescriptor& d : BackendRegistry())
    if (d.device == device && d.axis == axis) values.push_back(d.value);
  return values;
}

std::string_view PrecisionClassName(PrecisionClass p) {
  switch (p) {
    case PrecisionClass::kFp32:
      return "fp32";
    case PrecisionClass::kBf16:
      return "bf16";
    case PrecisionClass::kFp8:
      return "fp8";
    case PrecisionClass::kFp4:
      return "fp4";
  }
  return "?";
}

std::string BackendConfigString(const BackendConfig& config) {
  return absl::StrJoin(config, ",", absl::PairFormatter("="));
}

absl::StatusOr<BackendConfig> ParseBackendConfig(std::string_view text) {
  BackendConfig config;
  for (absl::string_view item :
       absl::StrSplit(absl::string_view(text.data(), text.size()), ',', absl::SkipWhitespace())) {
    std::vector<absl::string_view> kv = absl::StrSplit(item, '=');
    if (kv.size() != 2 || absl::StripAsciiWhitespace(kv[0]).empty() ||
        absl::StripAsciiWhitespace(kv[1]).empty())
      return absl::InvalidArgumentError(
          absl::StrCat("config item '", item, "' is not of the form axis=value"));
    const std::string axis(absl::StripAsciiWhitespace(kv[0]));
    if (config.count(axis))
      return absl::InvalidArgumentError(absl::StrCat("config axis '", axis, "' given twice"));
    config[axis] = std::string(absl::StripAsciiWhitespace(kv[1]));
  }
  return config;
}

std::map<std::string, std::string> ImplicitAxes(Device device) {
  std::map<std::string, std::string> implicit = {
      {"tp", "1"}, {"ep", "off"}, {"allreduce", device == Device::kCuda ? "auto" : "reference"}};
  if (device == Device::kCuda) {
    implicit["linear_attn"] = "reference";
    implicit["test_kernel"] = "none";
  }
  return implicit;
}

std::map<std::string, std::string> DefaultAxes(Device device) {
  if (device == Device::kCuda)  // the GPU reference: every axis at its most conservative value
    return {{"device", DeviceName(device)}, {"gemm", "reference"}, {"attention", "naive"},
            {"kv_cache", "fp32"},           {"moe", "loop"},       {"graphs", "off"},
            {"qgemm", "reference"}};
  return {{"device", DeviceName(device)}, {"matmul", "naive"}, {"threads", "all"}};
}

absl::StatusOr<Device> ParseConfigDevice(const BackendConfig& config) {
  auto it = config.find("device");
  if (it == config.end()) return Device::kCpu;
  return ParseDevice(it->second, "config axis 'device'");
}

Device ConfigDevice(const BackendConfig& normalized) {
  return ParseConfigDevice(normalized).value_or(Device::kCpu);
}

absl::StatusOr<BackendConfig> NormalizeBackendConfig(const BackendConfig& config) {
  ASSIGN_OR_RETURN(const Device device, ParseConfigDevice(config));
  BackendConfig normalized = DefaultAxes(device);
  for (const auto& [axis, value] : config) {
    std::vector<std::string> known_values;
    bool axis_on_device = false;
    for (const BackendDescriptor& d : BackendRegistry()) {
      if (d.axis != axis || d.device != device) continue;
      axis_on_device = true;
      known_values.push_back(d.value);
    }
    if (!axis_on_device) {
      std::set<std::string> axes;
      for (const BackendDescriptor& d : BackendRegistry())
        if (d.device == device) axes.insert(d.axis);
      return absl::InvalidArgumentError(absl::StrCat("config axis '", axis, "' is not an axis of ",
                                                     DeviceName(device),
                                                     " (known: ", absl::StrJoin(axes, ", "), ")"));
    }
    if (std::find(known_values.begin(), known_values.end(), value) == known_values.end())
      return absl::InvalidArgumentError(
          absl::StrCat("config axis '", axis, "': unknown value '", value,
                       "' (known: ", absl::StrJoin(known_values, ", "), ")"));
    normalized[axis] = value;
  }
  for (const auto& [axis, value] : ImplicitAxes(device))
    if (auto it = normalized.find(axis); it != normalized.end() && it->second == value)
      normalized.erase(it);
  return normalized;
}

PreflightResult Preflight(const BackendConfig& config, const PreflightTarget& target,
                          const std::vector<BackendDescriptor>& registry) {
  PreflightResult result;
  // Every reason that applies, in the config's axis order, then the tensor-parallel ones.
  std::vector<std::string> reasons;
  bool no_cuda_build = false, no_gpu = false;
  const Device device = ConfigDevice(config);
  for (const auto& [axis, value] : config) {
    const BackendDescriptor* d = FindOn(registry, device, axis, value);
    if (d == nullptr) {
      reasons.push_back(absl::StrCat(axis, "=", value, " is not registered"));
      continue;
    }
    const std::string name = absl::StrCat(axis, "=", value);
    // A build without CUDA, or a host without a GPU, is said once: it refuses every CUDA axis.
    if (d->needs_cuda_build && !target.has_cuda_build) {
      if (!no_cuda_build)
        reasons.push_back(absl::StrCat(name, " needs a build with CUDA backends"));
      no_cuda_build = true;
    } else if (d->device == Device::kCuda && target.gpu_count == 0) {
      if (!no_gpu) reasons.push_back(absl::StrCat(name, " needs a GPU; this host has none"));
      no_gpu = true;
    } else if (d->device == Device::kCuda && d->min_sm > 0 && target.sm < d->min_sm) {
      reasons.push_back(absl::StrCat(name, " needs ", SmName(d->min_sm), " or newer; the GPU is ",
                                     SmName(target.sm)));
    } else if (d->device == Device::kCuda && d->max_sm > 0 && target.sm > d->max_sm) {
      reasons.push_back(absl::StrCat(name, " runs only up to ", SmName(d->max_sm),
                                     " (arch-specific code); the GPU is ", SmName(target.sm)));
    }
    if (!d->weight_formats.empty() && !target.weight_format.empty() &&
        std::find(d->weight_formats.begin(), d->weight_formats.end(), target.weight_format) ==
            d->weight_formats.end())
      reasons.push_back(absl::StrCat(name, " does not take ", target.weight_format,
                                     " weights (takes ", absl::StrJoin(d->weight_formats, ", "),
                                     ")"));
    for (std::string& why : ConflictsOf(*d, config, target.weight_format))
      reasons.push_back(std::move(why));
    result.precision = std::max(result.precision, d->precision);
  }
  const int tp = TensorParallelRanks(config);
  if (device == Device::kCuda && tp > target.gpu_count && !no_gpu && !no_cuda_build)
    reasons.push_back(absl::StrCat("tp=", tp, " needs ", tp, " GPUs of one host; this host has ",
                                   target.gpu_count));
  if (target.model)
    if (std::string why = TensorParallelRefusal(*target.model, tp, ExpertParallel(config));
        !why.empty())
      reasons.push_back(std::move(why));
  if (!reasons.empty()) {
    result.supported = false;
    result.reason = absl::StrJoin(reasons, "; ");
  }
  return result;
}

int TensorParallelRanks(const BackendConfig& config) {
  int tp = 1;
  auto it = config.find("tp");
  if (it != config.end() && (!absl::SimpleAtoi(it->second, &tp) || tp < 1)) tp = 1;
  return tp;
}

bool ExpertParallel(const BackendConfig& config) {
  auto it = config.find("ep");
  return it != config.end() && it->second == "on";
}

std::string TensorParallelRefusal(const ModelConfig& model, int tp, bool expert_parallel) {
  if (tp <= 1 && !expert_parallel) return "";
  const std::string ranks = absl::StrCat("tp=", tp);
  // "tp=4 does not divide num_q_heads=6": the first dimension the ranks cannot split.
  auto indivisible = [&](const char* name, int value) -> std::string {
    if (value % tp == 0) return "";
    return absl::StrCat(ranks, " does not divide ", name, "=", value);
  };
  bool any_full = false, any_linear = false, any_dense = false, any_moe = false;
  for (int l = 0; l < model.num_layers; ++l) {
    (model.AttentionKind(l) == LayerAttention::kLinear ? any_linear : any_full) = true;
    (model.IsMoeLayer(l) ? any_moe : any_dense) = true;
  }
  std::vector<std::string> why;
  if (any_full) {
    why.push_back(indivisible("num_q_heads", model.num_q_heads));
    if (model.num_kv_heads >= tp) {
      why.push_back(indivisible("num_kv_heads", model.num_kv_heads));
    } else if (tp % model.num_kv_heads != 0) {
      why.push_back(absl::StrCat(ranks, " is not a multiple of num_kv_heads=", model.num_kv_heads,
                                 " (KV heads fewer than the ranks are replicated, each to tp / "
                                 "num_kv_heads ranks)"));
    }
  }
  if (any_linear) {
    why.push_back(indivisible("linear_num_key_heads", model.linear_num_key_heads));
    why.push_back(indivisible("linear_num_value_heads", model.linear_num_value_heads));
  }
  if (any_dense) why.push_back(indivisible("intermediate_size", model.intermediate_size));
  if (expert_parallel && !any_moe)
    why.push_back("ep=on needs a mixture-of-experts model; this one has no MoE layer");
  if (any_moe) {
    why.push_back(expert_parallel
                      ? indivisible("num_experts (ep=on)", model.num_experts)
                      : indivisible("moe_intermediate_size", model.moe_intermediate_size));
    if (model.shared_expert_intermediate_size > 0)
      why.push_back(
          indivisible("shared_expert_intermediate_size", model.shared_expert_intermediate_size));
  }
  why.erase(std::remove(why.begin(), why.end(), std::string()), why.end());
  return absl::StrJoin(why, "; ");
}

std::string RegistryConflict(const BackendConfig& config, std::string_view weight_format,
                             const std::vector<BackendDescriptor>& registry) {
  std::vector<std::string> why;
  for (const auto& [axis, value] : config)
    if (const BackendDescriptor* d = FindOn(registry, ConfigDevice(config), axis, value))
      for (std::string& conflict : ConflictsOf(*d, config, weight_format))
        why.push_back(std::move(conflict));
  return absl::StrJoin(why, "; ");
}

std::vector<BackendConfig> ExpandMatrix(
    const std::map<std::string, std::vector<std::string>>& axes) {
  std::vector<BackendConfig> out = {{}};
  for (const auto& [axis, values] : axes) {
    std::vector<BackendConfig> next;
    next.reserve(out.size() * values.size());
    for (const BackendConfig& partial : out)
      for (const std::string& v : values) {
        BackendConfig c = partial;
        c[axis] = v;
        next.push_back(std::move(c));
      }
    out = std::move(next);
  }
  return out;
}

}  // namespace infersweep
