// Sweep specs: the YAML a user submits to describe a matrix of backend configs over one model,
// and its expansion into trials (docs/SWEEPS.md documents the format and the rules).
//
//   name: moe-backends-h200
//   model: preset:qwen3-30b-a3b
//   matrix: {device: [cuda], attention: [naive, flash], moe: [loop, grouped, fused]}
//   exclude: [{moe: loop, attention: flash}]
//   workload: {prompt: 128, output: 32, batch: [1, 8]}
//   selector: {sm: [90], min_memory_gb: 80}
//
// Every error names the source, the 1-based YAML line and the field: "sweep.yaml:7: matrix.moe:
// empty list".
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "api/backend_config.h"
#include "api/trial.h"
#include "storage/store.h"

namespace infersweep {

// Default cap on the trials of one sweep, repeats included.
inline constexpr size_t kDefaultMaxSweepTrials = 10000;
// Longest spec text accepted.
inline constexpr size_t kMaxSweepSpecBytes = 1 << 20;
// Deepest nesting of YAML collections accepted (block levels and flow brackets together; a
// spec needs 3). yaml-cpp parses recursively, so the text is checked before it sees it.
inline constexpr int kMaxSweepSpecDepth = 64;
// Longest free text of a spec, in bytes: the name (shown in every table and log line), the
// model (a preset or a checkpoint path), and each axis name or value.
inline constexpr size_t kMaxSweepNameBytes = 128;
inline constexpr size_t kMaxSweepModelBytes = 4096;
inline constexpr size_t kMaxSweepWordBytes = 128;

struct SweepAxis {
  std::vector<std::string> values;  // as written, in order, no duplicates
  std::vector<int> value_lines;     // 1-based YAML line of each value (0: unknown)
  int line = 0;                     // line of the axis key
};

// One include or exclude entry: axis -> value, as written.
struct SweepCombination {
  BackendConfig values;
  std::map<std::string, int> lines;  // axis -> line of its value
  int line = 0;                      // line of the entry
};

struct SweepSpec {
  std::string source;  // where the text came from, for messages: a file name or "<request>"
  std::string yaml;    // the text, verbatim
  std::string name;    // defaults to the model
  std::string model;   // checkpoint folder or preset:NAME, with an optional "@<format>"
  int model_line = 0;  // 1-based YAML line of `model:` (0: unknown)
  int layers = 0;      // preset layer override; 0 = the preset's own
  uint64_t seed = 1;
  // Top-level `device:`: the device of every combination when the matrix has no device axis.
  // Exactly one of this and matrix["device"] is given.
  std::string device;
  int device_line = 0;
  std::map<std::string, SweepAxis> matrix;
  int matrix_line = 0;
  std::vector<SweepCombination> include;  // extra combinations, added after the product
  std::vector<SweepCombination> exclude;  // drops product combinations matching every key
  Workload workload;
  Selector selector;  // `device` is filled in per trial from its config
  int repeats = 1;    // independent trials per combination
  int priority = 0;
};

// Fills in defaults and rejects unknown axes or values: NormalizeBackendConfig, or a stand-in
// registry in tests.
using ConfigNormalizer = std::function<absl::StatusOr<BackendConfig>(const BackendConfig&)>;

// Parses and validates a spec: structure, types, ranges, and every axis and value through
// `normalize` on each device of the sweep. Never throws. The text must be printable (a control
// byte is an error naming its line and column) and nest at most kMaxSweepSpecDepth levels.
absl::StatusOr<SweepSpec> ParseSweepSpec(std::string_view yaml, std::string_view source,
                                         const ConfigNormalizer& normalize = NormalizeBackendConfig);

// Checks the spec's model as far as the coordinator can, before anything is stored: a
// "preset:NAME" must name a known preset (api/model_config.h PresetNames) and a "@<format>"
// suffix a known format, else INVALID_ARGUMENT naming the spec's line, the model and the known
// presets. A checkpoint folder the coordinator cannot see is no error (the agents load it, and
// may have it): it comes back as a warning, "model '/x/y': not a folder on the coordinator;
// agents must have it".
absl::StatusOr<std::vector<std::string>> CheckSweepModel(const SweepSpec& spec);

// Reads and parses a spec file; `path` is the source in messages.
absl::StatusOr<SweepSpec> LoadSweepSpecFile(
    const std::string& path, const ConfigNormalizer& normalize = NormalizeBackendConfig);

// Upper bound on a spec's trials, from the list sizes alone: (product of the matrix list sizes +
// includes) x repeats, saturating at UINT64_MAX. Excludes and duplicates only lower the count.
uint64_t SweepTrialBound(const SweepSpec& spec);

// The trials of a sweep, in a stable order: repeat-major (every combination once, then again
// for each further repeat), combinations in ExpandMatrix order with excluded ones dropped, then
// the includes. Configs are normalized (defaults filled in) and combinations whose normalized
// configs are equal are kept once. Trial ids are "<sweep_id>-<index>" from 0; with sweep_id 0
// they are left empty for Store::CreateSweep to assign the same way once the id is known.
// A spec whose SweepTrialBound exceeds `max_trials` is rejected before anything is expanded.
absl::StatusOr<std::vector<TrialRecord>> ExpandSweep(
    const SweepSpec& spec, int64_t sweep_id, size_t max_trials = kDefaultMaxSweepTrials,
    const ConfigNormalizer& normalize = NormalizeBackendConfig);

// The SweepRecord to store with the trials (name, verbatim YAML, model, priority).
SweepRecord MakeSweepRecord(const SweepSpec& spec);

}  // namespace infersweep
