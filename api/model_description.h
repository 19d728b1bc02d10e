// Model descriptions, the model string trials, sweeps and stored results carry, and the identity
// of a preset's weights: both known without loading anything (the coordinator uses them).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "core/identity.h"
#include "core/quant/format.h"

namespace infersweep {

// A model description: "<checkpoint folder | preset:NAME>[@<format>]", e.g.
// "preset:qwen3-30b-a3b@nvfp4": the weights, quantized into <format> on load. It is the model
// string trials, sweeps and stored results carry, so each quantization is its own model there.
struct ModelDescription {
  std::string model;  // folder or preset:NAME
  QuantFormat quantize = QuantFormat::kNone;
};
// A suffix after the last '@' that names a format is split off; any other '@' stays part of a
// folder name. "preset:NAME@<not a format>" is an error naming the known formats.
absl::StatusOr<ModelDescription> ParseModelDescription(const std::string& text);
std::string ModelDescriptionString(const ModelDescription& description);
// `model` with `--quantize <format>` applied ("" or "none": unchanged); an error when the
// description already names another format.
absl::StatusOr<std::string> WithQuantization(const std::string& model, const std::string& format);

// The identity of preset NAME's weights (core/identity.h): a pure function of its name, layer
// count (0: the preset's own), seed and format. NotFound for an unknown preset.
absl::StatusOr<ModelIdentity> DescribePreset(const std::string& name, int num_layers_override,
                                             uint64_t seed, QuantFormat quantize);

}  // namespace infersweep
