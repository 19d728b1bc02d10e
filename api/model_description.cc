#include "api/model_description.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "api/model_config.h"
#include "api/status_macros.h"

namespace infersweep {

absl::StatusOr<ModelDescription> ParseModelDescription(const std::string& text) {
  ModelDescription d{text, QuantFormat::kNone};
  const size_t at = text.rfind('@');
  if (at == std::string::npos) return d;
  const std::string suffix = text.substr(at + 1);
  if (const std::optional<QuantFormat> format = QuantFormatFromName(suffix)) {
    d.model = text.substr(0, at);
    d.quantize = *format;
    return d;
  }
  if (absl::StartsWith(text, "preset:"))
    return absl::InvalidArgumentError(
        absl::StrCat("model '", text, "': '@", suffix,
                     "' is not a quantization format (known: ", QuantFormatNames(), ")"));
  return d;  // a folder whose name holds an '@'
}

std::string ModelDescriptionString(const ModelDescription& d) {
  if (d.quantize == QuantFormat::kNone) return d.model;
  return absl::StrCat(d.model, "@", QuantFormatName(d.quantize));
}

absl::StatusOr<std::string> WithQuantization(const std::string& model, const std::string& format) {
  if (format.empty() || format == "none") return model;
  const std::optional<QuantFormat> q = QuantFormatFromName(format);
  if (!q)
    return absl::InvalidArgumentError(
        absl::StrCat("--quantize ", format, ": unknown format (known: ", QuantFormatNames(), ")"));
  ASSIGN_OR_RETURN(auto d, ParseModelDescription(model));
  if (d.quantize != QuantFormat::kNone && d.quantize != *q)
    return absl::InvalidArgumentError(absl::StrCat("--quantize ", format, " conflicts with '",
                                                   model, "', which names another format"));
  d.quantize = *q;
  return ModelDescriptionString(d);
}

absl::StatusOr<ModelIdentity> DescribePreset(const std::string& name, int num_layers_override,
                                             uint64_t seed, QuantFormat quantize) {
  ASSIGN_OR_RETURN(auto config, PresetConfig(name, num_layers_override));
  ModelIdentity id;
  id.source = "preset";
  id.name = name;
  id.layers = config.num_layers;
  id.seed = seed;
  id.weights = quantize != QuantFormat::kNone ? QuantFormatName(quantize) : "bf16";
  return id;
}

}  // namespace infersweep
