// Which quantization a checkpoint folder declares, and which modules it leaves unquantized:
// ModelOpt's hf_quant_config.json, or config.json's `quantization_config` (docs/QUANTIZATION.md).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/quant/format.h"

namespace infersweep {

struct QuantScheme {
  QuantFormat format = QuantFormat::kNone;
  std::string source;  // where it was declared, for messages
  // Modules the declaration quantizes ("Linear": every linear) and leaves alone. Patterns are
  // globs (fnmatch: '*' crosses dots) or "re:<regex>" (compressed-tensors).
  std::vector<std::string> targets = {"Linear"};
  std::vector<std::string> excluded;

  bool quantized() const { return format != QuantFormat::kNone; }
  // Whether the module (spelled any of `names`, e.g. canonical and on-disk) is quantized.
  bool Quantizes(const std::vector<std::string>& names) const;
  // "nvfp4 (hf_quant_config.json; exclude_modules: lm_head, *.mlp.gate)".
  std::string Describe() const;
};

// A pattern matches a module when it matches the name, an enclosing module (a dotted prefix), or
// a dotted suffix of either ("mlp.gate" matches "model.layers.0.mlp.gate").
bool ModulePatternMatches(std::string_view pattern, std::string_view module);

// Parses the declarations; `hf_quant_config` is the text of hf_quant_config.json when the folder
// has one (it wins over config.json). Unknown or unsupported schemes are Unimplemented errors
// naming the method or algorithm; malformed ones are InvalidArgument naming the file and key.
absl::StatusOr<QuantScheme> ParseQuantScheme(std::string_view config_json,
                                             std::optional<std::string_view> hf_quant_config);

}  // namespace infersweep
