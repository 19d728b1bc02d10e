// A validated sweep spec into its trials: the matrix product less the excludes, plus the
// includes, normalized and deduplicated, once per repeat; and the bound that caps it first.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/sweep_spec.h"
#include "coordinator/sweep_spec_internal.h"

namespace infersweep {
namespace {

using sweep_spec_internal::CheckCombination;
using sweep_spec_internal::OrDefault;
using sweep_spec_internal::Parser;

uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a)
    return std::numeric_limits<uint64_t>::max();
  return a * b;
}
uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return b > std::numeric_limits<uint64_t>::max() - a ? std::numeric_limits<uint64_t>::max()
                                                      : a + b;
}

}  // namespace

uint64_t SweepTrialBound(const SweepSpec& spec) {
  uint64_t product = 1;
  for (const auto& [axis, values] : spec.matrix)
    product = SaturatingMul(product, values.values.size());
  return SaturatingMul(SaturatingAdd(product, spec.include.size()),
                       static_cast<uint64_t>(std::max(spec.repeats, 0)));
}

absl::StatusOr<std::vector<TrialRecord>> ExpandSweep(const SweepSpec& spec, int64_t sweep_id,
                                                     size_t max_trials,
                                                     const ConfigNormalizer& normalizer) {
  const ConfigNormalizer& normalize = OrDefault(normalizer);
  const Parser p(spec.source);
  if (spec.repeats < 1) return p.Error(0, "repeats", absl::StrCat(spec.repeats, " is below 1"));
  const uint64_t bound = SweepTrialBound(spec);
  if (bound > max_trials) {
    std::vector<std::string> sizes;
    uint64_t product = 1;
    for (const auto& [axis, values] : spec.matrix) {
      sizes.push_back(absl::StrCat(axis, " ", values.values.size()));
      product = SaturatingMul(product, values.values.size());
    }
    const std::string product_text = product == std::numeric_limits<uint64_t>::max()
                                         ? "more than 18446744073709551614"
                                         : absl::StrCat(product);
    const std::string bound_text = bound == std::numeric_limits<uint64_t>::max()
                                       ? "more than 18446744073709551614"
                                       : absl::StrCat(bound);
    return p.Error(
        spec.matrix_line, "matrix",
        absl::StrCat("the sweep is too large: the matrix product is ", product_text,
                     " combinations (", absl::StrJoin(sizes, " x "), ") + ", spec.include.size(),
                     " includes, x ", spec.repeats, " repeats = ", bound_text,
                     " trials before excludes, over the cap "
                     "of ",
                     max_trials, " trials; split the sweep or drop values"));
  }

  std::map<std::string, std::vector<std::string>> axes;
  for (const auto& [axis, values] : spec.matrix) axes[axis] = values.values;

  struct Candidate {
    BackendConfig raw;
    const std::map<std::string, int>* lines;  // include lines, or null for the product
    int line;
    std::string field;
  };
  std::vector<Candidate> candidates;
  if (!axes.empty()) {
    for (BackendConfig& c : ExpandMatrix(axes)) {
      bool excluded = false;
      for (const SweepCombination& ex : spec.exclude) {
        bool all = true;
        for (const auto& [axis, value] : ex.values) {
          auto it = c.find(axis);
          if (it == c.end() || it->second != value) {
            all = false;
            break;
          }
        }
        if (all) {
          excluded = true;
          break;
        }
      }
      if (excluded) continue;
      if (!spec.device.empty() && !c.count("device")) c["device"] = spec.device;
      candidates.push_back({std::move(c), nullptr, spec.matrix_line, "matrix"});
    }
    if (candidates.empty() && spec.include.empty()) {
      const int line = spec.exclude.empty() ? spec.matrix_line : spec.exclude.front().line;
      return p.Error(line, "exclude", "the excludes drop every combination; nothing to run");
    }
  }
  for (size_t i = 0; i < spec.include.size(); ++i) {
    const SweepCombination& inc = spec.include[i];
    BackendConfig c = inc.values;
    if (!spec.device.empty() && !c.count("device")) c["device"] = spec.device;
    candidates.push_back({std::move(c), &inc.lines, inc.line, absl::StrCat("include[", i, "]")});
  }
  if (candidates.empty()) return p.Error(0, "matrix", "no combinations; nothing to run");

  // Normalize, and keep each distinct normalized config once.
  std::vector<BackendConfig> configs;
  std::set<BackendConfig> seen;
  for (const Candidate& c : candidates) {
    absl::StatusOr<BackendConfig> normalized = normalize(c.raw);
    if (!normalized.ok()) {
      std::map<std::string, int> lines;
      if (c.lines != nullptr) {
        lines = *c.lines;
      } else {
        for (const auto& [axis, values] : spec.matrix)
          for (size_t k = 0; k < values.values.size(); ++k)
            if (c.raw.count(axis) && c.raw.at(axis) == values.values[k])
              lines[axis] = values.value_lines[k];
      }
      absl::Status s = CheckCombination(p, normalize, c.raw, lines, c.line, c.field);
      return s.ok() ? p.Error(c.line, c.field, normalized.status().message()) : s;
    }
    if (seen.insert(*normalized).second) configs.push_back(std::move(*normalized));
  }

  std::vector<TrialRecord> trials;
  trials.reserve(configs.size() * static_cast<size_t>(spec.repeats));
  for (int r = 0; r < spec.repeats; ++r) {
    for (const BackendConfig& config : configs) {
      TrialRecord t;
      if (sweep_id != 0) t.trial_id = absl::StrCat(sweep_id, "-", trials.size());
      t.sweep_id = sweep_id;
      t.model = spec.model;
      t.layers = spec.layers;
      t.seed = spec.seed;
      t.config = config;
      t.workload = spec.workload;
      t.selector = spec.selector;
      t.selector.device = ConfigDevice(config);
      // A GPU config's tensor-parallel ranks take a GPU each (the scheduler leases them so), which
      // the queued trial's selector says, so that a sweep waiting for a larger agent names it.
      if (t.selector.device == Device::kCuda)
        t.selector.gpus_needed = std::max(t.selector.gpus_needed, TensorParallelRanks(config));
      t.priority = spec.priority;
      t.state = TrialState::kQueued;
      trials.push_back(std::move(t));
    }
  }
  return trials;
}

SweepRecord MakeSweepRecord(const SweepSpec& spec) {
  SweepRecord r;
  r.name = spec.name;
  r.spec_yaml = spec.yaml;
  r.model = spec.model;
  r.priority = spec.priority;
  r.state = "active";
  return r;
}

}  // namespace infersweep
