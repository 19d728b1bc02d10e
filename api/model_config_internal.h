// What the model-config units share: the architecture table and its traits, the hybrid layer
// pattern, the field error every message about a config uses, and the overflow-free parameter
// count validation bounds. Used by model_config.cc, hf_config.cc, model_validation.cc and
// model_presets.cc; other callers use api/model_config.h.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "api/model_config.h"

namespace infersweep::model_config_internal {

// This abseil build's absl::string_view is not std::string_view; StrCat/StrJoin need the former.
inline absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// The architecture an HF `model_type` names, or none for an unsupported one.
std::optional<ModelArch> ArchFromModelType(std::string_view model_type);

// Every supported `model_type`, comma-separated, for error messages.
std::string SupportedModelTypes();

// The mixture-of-experts architectures: they need experts, the others must have none.
bool IsMoeArch(ModelArch arch);

// The hybrid architectures: Gated DeltaNet layers between gated full-attention layers.
bool IsHybridArch(ModelArch arch);

// Layer i is full attention when (i + 1) % interval == 0, linear attention otherwise.
std::vector<LayerAttention> LayersFromInterval(int num_layers, int interval);

// INVALID_ARGUMENT "SOURCE: field 'FIELD': WHAT".
absl::Status FieldError(std::string_view source, std::string_view field, std::string_view what);

// TotalParams() in double, which cannot overflow whatever the sizes: validation bounds it before
// any exact count is taken.
double TotalParamsBound(const ModelConfig& c);

}  // namespace infersweep::model_config_internal
