// ParseSweepSpec and LoadSweepSpecFile: the spec's text checked, parsed by yaml-cpp, read key by
// key (the matrix, includes and excludes here; workload and selector in their own files), then
// validated against the registry.
#include "coordinator/sweep_spec.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <exception>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "coordinator/sweep_spec_internal.h"

namespace infersweep {
namespace sweep_spec_internal {

const ConfigNormalizer& OrDefault(const ConfigNormalizer& normalize) {
  static const ConfigNormalizer* const kDefault = new ConfigNormalizer(NormalizeBackendConfig);
  return normalize ? normalize : *kDefault;
}

}  // namespace sweep_spec_internal

namespace {

using sweep_spec_internal::CheckSpecText;
using sweep_spec_internal::Entry;
using sweep_spec_internal::KindOf;
using sweep_spec_internal::KnownKeys;
using sweep_spec_internal::LineOf;
using sweep_spec_internal::OrDefault;
using sweep_spec_internal::Parser;
using sweep_spec_internal::ParseSelectorNode;
using sweep_spec_internal::ParseWorkloadNode;
using sweep_spec_internal::ValidateAgainstRegistry;

constexpr const char* kTopLevelKeys[] = {"name",     "model",    "layers",  "seed",
                                         "device",   "matrix",   "include", "exclude",
                                         "workload", "selector", "repeats", "priority"};

absl::Status ParseMatrix(const Parser& p, const Entry& e, SweepSpec* spec) {
  spec->matrix_line = LineOf(e.key_node);
  if (!e.value.IsMap())
    return p.Error(e.key_node, "matrix",
                   absl::StrCat("must be a map of axis -> list of values, got ", KindOf(e.value)));
  ASSIGN_OR_RETURN(std::vector<Entry> axes, p.MapEntries(e.value, "matrix"));
  if (axes.empty()) return p.Error(e.key_node, "matrix", "no axes");
  for (const Entry& a : axes) {
    ASSIGN_OR_RETURN(std::string axis, p.Word(a.key_node, "matrix"));
    const std::string field = absl::StrCat("matrix.", axis);
    if (!a.value.IsSequence())
      return p.Error(a.key_node, field,
                     absl::StrCat("must be a list of values (e.g. [a, b]), got ", KindOf(a.value)));
    if (a.value.size() == 0) return p.Error(a.key_node, field, "empty list");
    SweepAxis& out = spec->matrix[axis];
    out.line = LineOf(a.key_node);
    for (const YAML::Node& v : a.value) {
      ASSIGN_OR_RETURN(std::string value, p.Word(v, field));
      for (size_t i = 0; i < out.values.size(); ++i)
        if (out.values[i] == value)
          return p.Error(v, field,
                         absl::StrCat("duplicate value '", value, "' (first at line ",
                                      out.value_lines[i], ")"));
      out.values.push_back(value);
      out.value_lines.push_back(LineOf(v));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseCombinations(const Parser& p, const Entry& e,
                               std::vector<SweepCombination>* out) {
  if (e.value.IsNull()) return absl::OkStatus();
  if (!e.value.IsSequence())
    return p.Error(e.key_node, e.key,
                   absl::StrCat("must be a list of maps (axis: value), got ", KindOf(e.value)));
  int index = 0;
  for (const YAML::Node& item : e.value) {
    const std::string field = absl::StrCat(e.key, "[", index++, "]");
    ASSIGN_OR_RETURN(std::vector<Entry> kv, p.MapEntries(item, field));
    if (kv.empty())
      return p.Error(
          item, field,
          e.key == "exclude" ? "empty entry (it would drop every combination)" : "empty entry");
    SweepCombination c;
    c.line = LineOf(item);
    for (const Entry& a : kv) {
      ASSIGN_OR_RETURN(std::string axis, p.Word(a.key_node, field));
      ASSIGN_OR_RETURN(std::string value, p.Word(a.value, absl::StrCat(field, ".", axis)));
      c.values[axis] = value;
      c.lines[axis] = LineOf(a.value);
    }
    out->push_back(std::move(c));
  }
  return absl::OkStatus();
}

absl::StatusOr<SweepSpec> ParseSpecUnsafe(absl::string_view yaml, const Parser& p,
                                          const ConfigNormalizer& normalize) {
  SweepSpec spec;
  spec.source = p.source();
  spec.yaml = std::string(yaml);
  YAML::Node root;
  try {
    root = YAML::Load(spec.yaml);
  } catch (const YAML::DeepRecursion& e) {
    // What CheckSpecText's scan missed: yaml-cpp's own bound (it says only "bad file").
    return p.Error(
        e.mark.is_null() ? 0 : e.mark.line + 1, "",
        absl::StrCat("YAML nested too deep (", e.depth(), " levels of parsing); the limit is ",
                     kMaxSweepSpecDepth, " levels of nesting"));
  } catch (const YAML::Exception& e) {
    return p.Error(e.mark.is_null() ? 0 : e.mark.line + 1, "",
                   absl::StrCat("malformed YAML: ", e.msg));
  }
  if (!root.IsDefined() || root.IsNull())
    return p.Error(0, "", "empty sweep spec (expected a map with at least 'model' and 'matrix')");
  const int root_line = LineOf(root);
  if (!root.IsMap())
    return p.Error(
        root, "",
        absl::StrCat("the spec must be a map (name:, model:, matrix:, ...), got ", KindOf(root)));
  ASSIGN_OR_RETURN(std::vector<Entry> entries, p.MapEntries(root, "top level"));
  bool have_matrix = false;
  for (const Entry& e : entries) {
    const std::string& key = e.key;
    if (key == "name") {
      ASSIGN_OR_RETURN(spec.name, p.FreeText(e.value, key, kMaxSweepNameBytes));
    } else if (key == "model") {
      ASSIGN_OR_RETURN(spec.model, p.FreeText(e.value, key, kMaxSweepModelBytes));
      spec.model_line = LineOf(e.value);
    } else if (key == "layers") {
      ASSIGN_OR_RETURN(spec.layers, p.Int(e.value, key, 0, 4096));
    } else if (key == "seed") {
      ASSIGN_OR_RETURN(std::string s, p.Text(e.value, key));
      if (!absl::SimpleAtoi(s, &spec.seed))
        return p.Error(e.value, key, absl::StrCat("'", s, "' is not an unsigned 64-bit integer"));
    } else if (key == "device") {
      ASSIGN_OR_RETURN(spec.device, p.Word(e.value, key));
      spec.device_line = LineOf(e.value);
    } else if (key == "matrix") {
      RETURN_IF_ERROR(ParseMatrix(p, e, &spec));
      have_matrix = true;
    } else if (key == "include") {
      RETURN_IF_ERROR(ParseCombinations(p, e, &spec.include));
    } else if (key == "exclude") {
      RETURN_IF_ERROR(ParseCombinations(p, e, &spec.exclude));
    } else if (key == "workload") {
      RETURN_IF_ERROR(ParseWorkloadNode(p, e, &spec.workload));
    } else if (key == "selector") {
      RETURN_IF_ERROR(ParseSelectorNode(p, e, &spec.selector));
    } else if (key == "repeats") {
      ASSIGN_OR_RETURN(spec.repeats, p.Int(e.value, key, 1, 1000));
    } else if (key == "priority") {
      ASSIGN_OR_RETURN(spec.priority, p.Int(e.value, key, -1000000, 1000000));
    } else {
      return p.Error(e.key_node, "",
                     absl::StrCat("unknown top-level key '", key,
                                  "' (known: ", KnownKeys(kTopLevelKeys), ")"));
    }
  }
  if (spec.model.empty())
    return p.Error(root_line, "model", "missing (e.g. model: preset:qwen3-30b-a3b)");
  if (!have_matrix)
    return p.Error(root_line, "matrix",
                   "missing (a map of axis -> list of values, e.g. matrix: {device: [cpu]})");
  if (spec.name.empty()) spec.name = spec.model;
  RETURN_IF_ERROR(ValidateAgainstRegistry(p, normalize, spec));
  return spec;
}

}  // namespace

absl::StatusOr<SweepSpec> ParseSweepSpec(std::string_view yaml_text, std::string_view source_name,
                                         const ConfigNormalizer& normalize) {
  const absl::string_view yaml(yaml_text.data(), yaml_text.size());
  const Parser p(absl::string_view(source_name.data(), source_name.size()));
  if (yaml.size() > kMaxSweepSpecBytes)
    return p.Error(
        0, "", absl::StrCat("spec is ", yaml.size(), " bytes; the limit is ", kMaxSweepSpecBytes));
  RETURN_IF_ERROR(CheckSpecText(yaml, p));
  try {
    return ParseSpecUnsafe(yaml, p, OrDefault(normalize));
  } catch (const YAML::Exception& e) {
    return p.Error(e.mark.is_null() ? 0 : e.mark.line + 1, "",
                   absl::StrCat("invalid spec: ", e.msg));
  } catch (const std::exception& e) {
    return p.Error(0, "", absl::StrCat("invalid spec: ", e.what()));
  }
}

absl::StatusOr<SweepSpec> LoadSweepSpecFile(const std::string& path,
                                            const ConfigNormalizer& normalize) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open sweep spec '", path, "'"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading sweep spec '", path, "'"));
  return ParseSweepSpec(text.str(), path, normalize);
}

}  // namespace infersweep
