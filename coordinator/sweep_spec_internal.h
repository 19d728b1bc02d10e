// What the parts of the sweep spec parser share, and nothing outside coordinator/sweep_spec*.cc
// includes: the YAML field reader with its "source:line: field: message" errors, and the steps
// of parsing, validation and expansion that live in separate files.
//
//   sweep_spec.cc           ParseSweepSpec, LoadSweepSpecFile: top-level keys, matrix, include,
//                           exclude
//   sweep_spec_yaml.cc      Parser (typed fields, file:line errors) and the text checks made
//                           before yaml-cpp sees the spec
//   sweep_spec_workload.cc  the workload: section, lockstep and serving
//   sweep_spec_selector.cc  the selector: section (gpu_name a bounded regex)
//   sweep_spec_validate.cc  axes and values against the registry; CheckSweepModel
//   sweep_spec_expand.cc    SweepTrialBound, ExpandSweep, MakeSweepRecord
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "api/backend_config.h"
#include "api/trial.h"
#include "coordinator/sweep_spec.h"

namespace infersweep::sweep_spec_internal {

// 1-based line of a node, 0 when yaml-cpp has no mark for it.
int LineOf(const YAML::Node& n);

// What a node is, for "expected X, got Y" messages.
std::string KindOf(const YAML::Node& n);

// "a, b, c": the keys a section accepts, for unknown-key messages.
std::string KnownKeys(const auto& keys) { return absl::StrJoin(keys, ", "); }

struct Entry {
  std::string key;
  YAML::Node key_node;
  YAML::Node value;
};

// Builds errors "source:line: field: message" (the line left out when unknown).
class Parser {
 public:
  explicit Parser(absl::string_view source) : source_(source.empty() ? "<sweep>" : source) {}

  absl::Status Error(int line, absl::string_view field, absl::string_view message) const;
  absl::Status Error(const YAML::Node& at, absl::string_view field,
                     absl::string_view message) const;

  // The entries of a map, keys scalar and unique.
  absl::StatusOr<std::vector<Entry>> MapEntries(const YAML::Node& node,
                                                absl::string_view field) const;

  absl::StatusOr<std::string> Text(const YAML::Node& n, absl::string_view field) const;

  // Text of at most `max_bytes`, without control characters: it is stored, and printed in
  // tables and log lines.
  absl::StatusOr<std::string> FreeText(const YAML::Node& n, absl::string_view field,
                                       size_t max_bytes) const;

  // A config word (axis name or value): it ends up in "a=b,c=d" strings.
  absl::StatusOr<std::string> Word(const YAML::Node& n, absl::string_view field) const;

  absl::StatusOr<int64_t> Int(const YAML::Node& n, absl::string_view field, int64_t lo,
                              int64_t hi) const;

  // true or false (YAML's spellings of them: true/false, yes/no, on/off).
  absl::StatusOr<bool> Bool(const YAML::Node& n, absl::string_view field) const;

  absl::StatusOr<double> Number(const YAML::Node& n, absl::string_view field, double lo,
                                double hi) const;

  // One integer or a non-empty list of them.
  absl::StatusOr<std::vector<int64_t>> IntList(const YAML::Node& n, absl::string_view field,
                                               int64_t lo, int64_t hi, size_t max_count) const;

  const std::string& source() const { return source_; }

 private:
  std::string source_;
};

// A control byte or nesting deeper than kMaxSweepSpecDepth, as "source:line:column: message",
// found before yaml-cpp parses the text (sweep_spec_yaml.cc says why).
absl::Status CheckSpecText(absl::string_view yaml, const Parser& p);

// The `workload:` entry into `w`, checked with ValidateWorkload (sweep_spec_workload.cc).
absl::Status ParseWorkloadNode(const Parser& p, const Entry& e, Workload* w);

// The `selector:` entry into `s` (sweep_spec_selector.cc).
absl::Status ParseSelectorNode(const Parser& p, const Entry& e, Selector* s);

// Checks one combination (raw values plus its device) against the registry; on failure points
// at the line of the value that is wrong on its own, else at `fallback_line`.
absl::Status CheckCombination(const Parser& p, const ConfigNormalizer& normalize,
                              const BackendConfig& raw, const std::map<std::string, int>& lines,
                              int fallback_line, absl::string_view field);

// The device(s), matrix axes and values, includes and excludes against `normalize`; fills in
// each include's device from the top-level `device:` (sweep_spec_validate.cc).
absl::Status ValidateAgainstRegistry(const Parser& p, const ConfigNormalizer& normalize,
                                     SweepSpec& spec);

// `normalize`, or NormalizeBackendConfig when it is empty.
const ConfigNormalizer& OrDefault(const ConfigNormalizer& normalize);

}  // namespace infersweep::sweep_spec_internal
