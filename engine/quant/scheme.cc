#include "engine/quant/scheme.h"

#include <fnmatch.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/status_macros.h"
#include "api/untrusted_json.h"
#include "api/untrusted_regex.h"
#include "engine/quant/layout.h"
#include "nlohmann/json.hpp"

namespace infersweep {
namespace {

using json = nlohmann::json;

constexpr char kHfQuantConfig[] = "hf_quant_config.json";
constexpr char kConfigQuant[] = "config.json quantization_config";

bool Glob(const std::string& pattern, const std::string& name) {
  return ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

absl::StatusOr<json> ParseJson(std::string_view text, absl::string_view source) {
  return ParseUntrustedJson(text, std::string_view(source.data(), source.size()));
}

// The member `key` of `object`, or null when it is absent: compared, never converted, so a
// member of an unexpected type reads as unsupported instead of throwing.
const json& Member(const json& object, const char* key) {
  static const json* const kNull = new json();
  const auto it = object.find(key);
  return it == object.end() ? *kNull : *it;
}

// A list of strings under `key` (absent or null: empty).
absl::StatusOr<std::vector<std::string>> StringList(const json& object, const char* key,
                                                    absl::string_view source) {
  std::vector<std::string> out;
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return out;
  if (!it->is_array())
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": \"", key, "\" must be a list of module names"));
  for (const json& v : *it) {
    if (!v.is_string())
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": \"", key, "\" must hold strings, found ", v.type_name()));
    std::string name = v.get<std::string>();
    // "re:<regex>" entries are compiled here, bounded, so a bad one is an error at load.
    if (name.starts_with("re:"))
      if (auto re = CompileUntrustedRegex(std::string_view(name).substr(3)); !re.ok())
        return absl::InvalidArgumentError(absl::StrCat(source, ": \"", key, "\"[", out.size(),
                                                       "] '", name.substr(0, 64),
                                                       "': ", re.status().message()));
    out.push_back(std::move(name));
  }
  return out;
}

// ModelOpt's quant_algo names.
absl::StatusOr<QuantFormat> ModelOptFormat(const json& algo, const json& group_size,
                                           absl::string_view source) {
  if (algo.is_null()) return QuantFormat::kNone;  // e.g. only the KV cache is quantized
  if (!algo.is_string())
    return absl::InvalidArgumentError(absl::StrCat(source, ": quant_algo must be a string"));
  const std::string name = algo.get<std::string>();
  if (name == "NVFP4") {
    if (!group_size.is_null() && group_size != json(kNvfp4GroupSize))
      return absl::UnimplementedError(absl::StrCat(source, ": NVFP4 with group_size ",
                                                   group_size.dump(), " (only 16 is supported)"));
    return QuantFormat::kNvfp4;
  }
  if (name == "FP8") return QuantFormat::kFp8Tensor;
  if (name == "FP8_PER_CHANNEL_PER_TOKEN") return QuantFormat::kFp8Channel;
  return absl::UnimplementedError(
      absl::StrCat(source, ": quant_algo '", name,
                   "' is not supported (NVFP4, FP8, FP8_PER_CHANNEL_PER_TOKEN)"));
}

absl::StatusOr<QuantScheme> FromHfQuantConfig(std::string_view text) {
  ASSIGN_OR_RETURN(auto root, ParseJson(text, kHfQuantConfig));
  if (!root.is_object() || !root.contains("quantization") || !root["quantization"].is_object())
    return absl::InvalidArgumentError(
        absl::StrCat(kHfQuantConfig, ": missing the \"quantization\" object"));
  const json& q = root["quantization"];
  QuantScheme scheme;
  scheme.source = kHfQuantConfig;
  ASSIGN_OR_RETURN(auto format, ModelOptFormat(q.value("quant_algo", json()),
                                               q.value("group_size", json()), kHfQuantConfig));
  scheme.format = format;
  ASSIGN_OR_RETURN(auto excluded, StringList(q, "exclude_modules", kHfQuantConfig));
  scheme.excluded = std::move(excluded);
  return scheme;
}

// compressed-tensors: every config group must describe the same float8 layout.
absl::StatusOr<QuantScheme> FromCompressedTensors(const json& qc) {
  const std::string source = absl::StrCat(kConfigQuant, " (compressed-tensors)");
  QuantScheme scheme;
  scheme.source = source;
  scheme.targets.clear();
  const auto groups = qc.find("config_groups");
  if (groups == qc.end() || !groups->is_object() || groups->empty())
    return absl::InvalidArgumentError(absl::StrCat(source, ": missing \"config_groups\""));
  for (const auto& [name, group] : groups->items()) {
    const std::string where = absl::StrCat(source, ": config_groups.", name);
    if (!group.is_object() || !group.contains("weights") || !group["weights"].is_object())
      return absl::InvalidArgumentError(absl::StrCat(where, ": missing \"weights\""));
    const json& w = group["weights"];
    const json &type = Member(w, "type"), &strategy = Member(w, "strategy");
    const bool float8 = type == "float" && Member(w, "num_bits") == 8;
    QuantFormat format = QuantFormat::kNone;
    if (float8 && strategy == "tensor") {
      format = QuantFormat::kFp8Tensor;
    } else if (float8 && strategy == "channel") {
      format = QuantFormat::kFp8Channel;
    } else if (float8 && strategy == "block" &&
               Member(w, "block_structure") == json({kFp8BlockSize, kFp8BlockSize})) {
      format = QuantFormat::kFp8Block128;
    } else {
      return absl::UnimplementedError(absl::StrCat(
          where, ": weights ", w.dump(),
          " are not supported (float 8-bit with strategy tensor, channel or block [128, 128])"));
    }
    if (scheme.format != QuantFormat::kNone && scheme.format != format)
      return absl::UnimplementedError(
          absl::StrCat(source, ": groups with different formats are not supported"));
    scheme.format = format;
    ASSIGN_OR_RETURN(auto targets, StringList(group, "targets", where));
    scheme.targets.insert(scheme.targets.end(), targets.begin(), targets.end());
  }
  ASSIGN_OR_RETURN(auto ignore, StringList(qc, "ignore", source));
  scheme.excluded = std::move(ignore);
  return scheme;
}

absl::StatusOr<QuantScheme> FromQuantizationConfig(const json& qc) {
  if (!qc.is_object())
    return absl::InvalidArgumentError(absl::StrCat(kConfigQuant, " must be an object"));
  const auto method_it = qc.find("quant_method");
  if (method_it == qc.end() || !method_it->is_string())
    return absl::InvalidArgumentError(absl::StrCat(kConfigQuant, ": missing \"quant_method\""));
  const std::string method = method_it->get<std::string>();
  if (method == "compressed-tensors") return FromCompressedTensors(qc);

  QuantScheme scheme;
  scheme.source = absl::StrCat(kConfigQuant, " (", method, ")");
  const char* excluded_key = "modules_to_not_convert";
  if (method == "modelopt") {
    // Newer exports flatten the hf_quant_config.json fields; older ones nest "quantization".
    const json& q =
        qc.contains("quantization") && qc["quantization"].is_object() ? qc["quantization"] : qc;
    ASSIGN_OR_RETURN(auto format, ModelOptFormat(q.value("quant_algo", json()),
                                                 q.value("group_size", json()), scheme.source));
    scheme.format = format;
    ASSIGN_OR_RETURN(
        auto excluded,
        StringList(q, q.contains("exclude_modules") ? "exclude_modules" : "ignore", scheme.source));
    scheme.excluded = std::move(excluded);
    return scheme;
  }
  if (method == "mxfp4") {
    scheme.format = QuantFormat::kMxfp4;
  } else if (method == "fbgemm_fp8") {
    scheme.format = QuantFormat::kFp8Channel;
  } else if (method == "fp8") {
    const json block = qc.value("weight_block_size", json({kFp8BlockSize, kFp8BlockSize}));
    if (block != json({kFp8BlockSize, kFp8BlockSize}))
      return absl::UnimplementedError(
          absl::StrCat(scheme.source, ": weight_block_size ", block.dump(), " (only [128, 128])"));
    scheme.format = QuantFormat::kFp8Block128;
  } else {
    return absl::UnimplementedError(
        absl::StrCat(kConfigQuant, ": quant_method '", method,
                     "' is not supported (fp8, fbgemm_fp8, compressed-tensors, modelopt, mxfp4)"));
  }
  ASSIGN_OR_RETURN(auto excluded, StringList(qc, excluded_key, scheme.source));
  scheme.excluded = std::move(excluded);
  return scheme;
}

}  // namespace

bool ModulePatternMatches(std::string_view pattern_view, std::string_view module_view) {
  const std::string pattern(pattern_view), module(module_view);
  // The module and every enclosing module: "a.b.c", "a.b", "a".
  std::vector<std::string> scopes = {module};
  for (size_t dot = module.rfind('.'); dot != std::string::npos && dot > 0;
       dot = module.rfind('.', dot - 1))
    scopes.push_back(module.substr(0, dot));
  if (pattern.starts_with("re:")) {
    auto re = CompileUntrustedRegex(std::string_view(pattern).substr(3));
    if (!re.ok()) return false;  // refused at load (StringList); matches nothing here
    for (const std::string& s : scopes)
      if (RegexMatchesPrefix(**re, s)) return true;
    return false;
  }
  const std::string suffix_pattern = "*." + pattern;
  for (const std::string& s : scopes)
    if (Glob(pattern, s) || Glob(suffix_pattern, s)) return true;
  return false;
}

bool QuantScheme::Quantizes(const std::vector<std::string>& names) const {
  if (!quantized()) return false;
  for (const std::string& name : names)
    for (const std::string& pattern : excluded)
      if (ModulePatternMatches(pattern, name)) return false;
  for (const std::string& target : targets) {
    if (target == "Linear") return true;
    for (const std::string& name : names)
      if (ModulePatternMatches(target, name)) return true;
  }
  return false;
}

std::string QuantScheme::Describe() const {
  if (!quantized())
    return "no quantization declared (no hf_quant_config.json or quantization_config)";
  std::string text = absl::StrCat(QuantFormatName(format), " (", source);
  if (targets != std::vector<std::string>{"Linear"})
    absl::StrAppend(&text, "; targets: ", absl::StrJoin(targets, ", "));
  if (!excluded.empty()) absl::StrAppend(&text, "; excluded: ", absl::StrJoin(excluded, ", "));
  return text + ")";
}

absl::StatusOr<QuantScheme> ParseQuantScheme(std::string_view config_json,
                                             std::optional<std::string_view> hf_quant_config) {
  if (hf_quant_config) return FromHfQuantConfig(*hf_quant_config);
  ASSIGN_OR_RETURN(auto config, ParseJson(config_json, "config.json"));
  if (!config.is_object()) return absl::InvalidArgumentError("config.json: not an object");
  const auto qc = config.find("quantization_config");
  if (qc == config.end() || qc->is_null()) return QuantScheme{};
  return FromQuantizationConfig(*qc);
}

}  // namespace infersweep
