// A parsed sweep spec against what can run it: every device, axis and value through the config
// registry, includes and excludes against the matrix, and the model against the known presets.
#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "api/model_config.h"
#include "api/model_description.h"
#include "api/status_macros.h"
#include "coordinator/sweep_spec.h"
#include "coordinator/sweep_spec_internal.h"

namespace infersweep {
namespace sweep_spec_internal {
namespace {

// The devices of the sweep with the line each is given on.
std::vector<std::pair<std::string, int>> Devices(const SweepSpec& spec) {
  std::vector<std::pair<std::string, int>> out;
  if (auto it = spec.matrix.find("device"); it != spec.matrix.end()) {
    for (size_t i = 0; i < it->second.values.size(); ++i)
      out.emplace_back(it->second.values[i], it->second.value_lines[i]);
  } else if (!spec.device.empty()) {
    out.emplace_back(spec.device, spec.device_line);
  }
  return out;
}

}  // namespace

// Checks one combination (raw values plus its device) against the registry; on failure points
// at the line of the value that is wrong on its own, else at `fallback_line`.
absl::Status CheckCombination(const Parser& p, const ConfigNormalizer& normalize,
                              const BackendConfig& raw, const std::map<std::string, int>& lines,
                              int fallback_line, absl::string_view field) {
  absl::StatusOr<BackendConfig> normalized = normalize(raw);
  if (normalized.ok()) return absl::OkStatus();
  const std::string device = DeviceName(ConfigDevice(raw));
  for (const auto& [axis, value] : raw) {
    BackendConfig single = {{"device", device}, {axis, value}};
    if (absl::StatusOr<BackendConfig> one = normalize(single); !one.ok()) {
      auto it = lines.find(axis);
      return p.Error(it != lines.end() ? it->second : fallback_line, absl::StrCat(field, ".", axis),
                     one.status().message());
    }
  }
  return p.Error(fallback_line, field,
                 absl::StrCat("combination {", BackendConfigString(raw),
                              "}: ", normalized.status().message()));
}

absl::Status ValidateAgainstRegistry(const Parser& p, const ConfigNormalizer& normalize,
                                     SweepSpec& spec) {
  const bool matrix_device = spec.matrix.count("device") > 0;
  if (matrix_device && !spec.device.empty())
    return p.Error(spec.device_line, "device",
                   absl::StrCat("the device is given both here and as a matrix axis (line ",
                                spec.matrix.at("device").line, "); keep one"));
  if (!matrix_device && spec.device.empty())
    return p.Error(spec.matrix_line, "matrix",
                   "no device: add a 'device' axis to the matrix (e.g. device: [cuda]) or a "
                   "top-level 'device:' key");
  const std::vector<std::pair<std::string, int>> devices = Devices(spec);
  for (const auto& [device, line] : devices) {
    if (absl::StatusOr<BackendConfig> n = normalize({{"device", device}}); !n.ok())
      return p.Error(line, matrix_device ? "matrix.device" : "device", n.status().message());
  }
  // Every axis and value on every device of the sweep.
  for (const auto& [axis, values] : spec.matrix) {
    if (axis == "device") continue;
    for (const auto& [device, device_line] : devices) {
      // Every value rejected: the axis itself is unknown (or not an axis of this device), so
      // point at the axis. Otherwise point at the first rejected value.
      std::vector<absl::Status> errors;
      for (const std::string& value : values.values)
        errors.push_back(normalize({{"device", device}, {axis, value}}).status());
      size_t rejected = 0;
      for (const absl::Status& e : errors) rejected += e.ok() ? 0 : 1;
      if (rejected == 0) continue;
      if (rejected == errors.size() && errors.size() > 1)
        return p.Error(
            values.line, absl::StrCat("matrix.", axis),
            absl::StrCat(errors[0].message(), " (device '", device,
                         "'; every value rejected: ", absl::StrJoin(values.values, ", "), ")"));
      for (size_t i = 0; i < errors.size(); ++i)
        if (!errors[i].ok())
          return p.Error(
              values.value_lines[i], absl::StrCat("matrix.", axis),
              absl::StrCat(
                  errors[i].message(),
                  absl::StrContains(errors[i].message(), absl::StrCat("'", values.values[i], "'"))
                      ? ""
                      : absl::StrCat(" (value '", values.values[i], "')"),
                  devices.size() > 1 ? absl::StrCat(" on device '", device, "'") : ""));
    }
  }
  for (size_t i = 0; i < spec.include.size(); ++i) {
    SweepCombination& c = spec.include[i];
    const std::string field = absl::StrCat("include[", i, "]");
    if (!c.values.count("device")) {
      if (spec.device.empty())
        return p.Error(c.line, field,
                       "no device: give 'device' in the entry (the matrix has a device axis, so "
                       "there is no sweep-wide default)");
      c.values["device"] = spec.device;
      c.lines["device"] = spec.device_line;
    }
    RETURN_IF_ERROR(CheckCombination(p, normalize, c.values, c.lines, c.line, field));
  }
  for (size_t i = 0; i < spec.exclude.size(); ++i) {
    const SweepCombination& c = spec.exclude[i];
    const std::string field = absl::StrCat("exclude[", i, "]");
    for (const auto& [axis, value] : c.values) {
      const int line = c.lines.count(axis) ? c.lines.at(axis) : c.line;
      auto it = spec.matrix.find(axis);
      if (it == spec.matrix.end()) {
        std::vector<std::string> axes;
        for (const auto& [name, unused] : spec.matrix) axes.push_back(name);
        return p.Error(line, field,
                       absl::StrCat("'", axis, "' is not a matrix axis (axes: ",
                                    absl::StrJoin(axes, ", "), ")"));
      }
      const std::vector<std::string>& vs = it->second.values;
      if (std::find(vs.begin(), vs.end(), value) == vs.end())
        return p.Error(line, absl::StrCat(field, ".", axis),
                       absl::StrCat("'", value, "' is not a value of matrix axis '", axis,
                                    "' (values: ", absl::StrJoin(vs, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace sweep_spec_internal

absl::StatusOr<std::vector<std::string>> CheckSweepModel(const SweepSpec& spec) {
  const sweep_spec_internal::Parser p(spec.source);
  absl::StatusOr<ModelDescription> description = ParseModelDescription(spec.model);
  if (!description.ok()) return p.Error(spec.model_line, "model", description.status().message());
  std::vector<std::string> warnings;
  absl::string_view preset = description->model;
  if (absl::ConsumePrefix(&preset, "preset:")) {
    const std::vector<std::string> known = PresetNames();
    if (std::find(known.begin(), known.end(), preset) == known.end())
      return p.Error(spec.model_line, "model",
                     absl::StrCat("unknown preset '", preset, "' in '", spec.model,
                                  "' (known presets: ", absl::StrJoin(known, ", "),
                                  "; a '@<format>' suffix quantizes one)"));
    return warnings;
  }
  std::error_code ec;
  if (!std::filesystem::is_directory(description->model, ec))
    warnings.push_back(absl::StrCat("model '", spec.model,
                                    "': not a folder on the coordinator; agents must have it"));
  return warnings;
}

}  // namespace infersweep
