// The `workload:` section of a sweep spec: a lockstep workload (prompt, output, batch sizes) or a
// serving one (load points, request shape, SLO), each field checked where it is written.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "api/status_macros.h"
#include "coordinator/sweep_spec_internal.h"

namespace infersweep::sweep_spec_internal {
namespace {

constexpr const char* kWorkloadKeys[] = {"mode",    "prompt", "output", "batch",
                                         "repeats", "warmup", "timeout"};
constexpr const char* kServingWorkloadKeys[] = {
    "mode",     "concurrency", "rate",  "max_concurrency", "isl",  "osl", "requests",
    "duration", "warmup",      "chunk", "prefill_tokens",  "seed", "slo", "timeout"};
constexpr const char* kSloKeys[] = {"ttft_ms", "tpot_ms", "percentile"};

// Batch sizes and load points run in the order given, each once: a repeated or descending list
// is a typo. `n` is the list's node (or its one scalar).
template <typename T>
absl::Status CheckIncreasing(const Parser& p, const YAML::Node& n, absl::string_view field,
                             const std::vector<T>& values) {
  for (size_t i = 1; i < values.size(); ++i)
    if (values[i] <= values[i - 1])
      return p.Error(n.IsSequence() ? n[i] : n, field,
                     absl::StrCat(values[i], " after ", values[i - 1],
                                  ": the values must increase (e.g. [1, 4, 16])"));
  return absl::OkStatus();
}

// A validation message that names a field as "<prefix>NAME'" points at that key's line, else at
// `fallback`.
int LineOfNamedField(absl::string_view msg, absl::string_view prefix,
                     const std::map<std::string, int>& lines, int fallback) {
  if (size_t at = msg.find(prefix); at != absl::string_view::npos) {
    const size_t start = at + prefix.size();
    const size_t end = msg.find('\'', start);
    if (end != absl::string_view::npos)
      if (auto it = lines.find(std::string(msg.substr(start, end - start))); it != lines.end())
        return it->second;
  }
  return fallback;
}

// An input or output length: N, or a range "A-B" drawn uniformly per request.
absl::Status ParseLengthNode(const Parser& p, const YAML::Node& n, absl::string_view field,
                             int* min, int* max) {
  ASSIGN_OR_RETURN(std::string s, p.Text(n, field));
  std::pair<std::string, std::string> ab = absl::StrSplit(s, absl::MaxSplits('-', 1));
  const bool range = s.find('-') != std::string::npos;
  if (!absl::SimpleAtoi(ab.first, min) || (range && !absl::SimpleAtoi(ab.second, max)))
    return p.Error(n, field, absl::StrCat("'", s, "' is not a length N or a range A-B"));
  if (!range) *max = *min;
  if (*min < 1 || *max > 65536 || *min > *max)
    return p.Error(n, field,
                   absl::StrCat("'", s, "' must lie in [1, 65536] (a range as A-B with A <= B)"));
  return absl::OkStatus();
}

absl::Status ParseSloNode(const Parser& p, const Entry& e, Slo* slo) {
  ASSIGN_OR_RETURN(std::vector<Entry> kv, p.MapEntries(e.value, "workload.slo"));
  for (const Entry& f : kv) {
    const std::string field = absl::StrCat("workload.slo.", f.key);
    if (f.key == "ttft_ms") {
      ASSIGN_OR_RETURN(double v, p.Number(f.value, field, 1e-9, 1e12));
      slo->ttft_ms = v;
    } else if (f.key == "tpot_ms") {
      ASSIGN_OR_RETURN(double v, p.Number(f.value, field, 1e-9, 1e12));
      slo->tpot_ms = v;
    } else if (f.key == "percentile") {
      ASSIGN_OR_RETURN(slo->percentile, p.Number(f.value, field, 1e-9, 100));
    } else {
      return p.Error(f.key_node, "workload.slo",
                     absl::StrCat("unknown key '", f.key, "' (known: ", KnownKeys(kSloKeys), ")"));
    }
  }
  if (slo->empty())
    return p.Error(e.key_node, "workload.slo", "needs a bound: ttft_ms, tpot_ms or both");
  return absl::OkStatus();
}

// `workload: {mode: serving, ...}`: the load points and request shape of a serving workload
// (api/serve_spec.h), each field checked where it is written, then the rules between fields.
absl::Status ParseServingWorkload(const Parser& p, const Entry& e, const std::vector<Entry>& kv,
                                  Workload* w) {
  ServeSpec spec;
  std::map<std::string, int> lines;
  for (const Entry& f : kv) {
    const std::string field = absl::StrCat("workload.", f.key);
    lines[f.key] = LineOf(f.key_node);
    if (f.key == "mode") {
      continue;
    } else if (f.key == "concurrency") {
      ASSIGN_OR_RETURN(std::vector<int64_t> points, p.IntList(f.value, field, 1, 4096, 64));
      RETURN_IF_ERROR(CheckIncreasing(p, f.value, field, points));
      spec.concurrency.assign(points.begin(), points.end());
    } else if (f.key == "rate") {
      std::vector<YAML::Node> items;
      if (f.value.IsSequence()) {
        if (f.value.size() == 0) return p.Error(f.value, field, "empty list");
        if (f.value.size() > 64)
          return p.Error(f.value, field, absl::StrCat(f.value.size(), " values; at most 64"));
        for (const YAML::Node& item : f.value) items.push_back(item);
      } else {
        items.push_back(f.value);
      }
      for (const YAML::Node& item : items) {
        ASSIGN_OR_RETURN(double rate, p.Number(item, field, 0, 1e9));
        if (!(rate > 0)) return p.Error(item, field, "a request rate must be positive");
        spec.rate.push_back(rate);
      }
      RETURN_IF_ERROR(CheckIncreasing(p, f.value, field, spec.rate));
    } else if (f.key == "max_concurrency") {
      ASSIGN_OR_RETURN(spec.max_concurrency, p.Int(f.value, field, 0, 4096));
    } else if (f.key == "isl") {
      RETURN_IF_ERROR(ParseLengthNode(p, f.value, field, &spec.isl_min, &spec.isl_max));
    } else if (f.key == "osl") {
      RETURN_IF_ERROR(ParseLengthNode(p, f.value, field, &spec.osl_min, &spec.osl_max));
    } else if (f.key == "requests") {
      ASSIGN_OR_RETURN(spec.requests, p.Int(f.value, field, 1, 1000000));
    } else if (f.key == "duration") {
      ASSIGN_OR_RETURN(spec.duration_s, p.Number(f.value, field, 1e-3, 86400));
    } else if (f.key == "warmup") {
      ASSIGN_OR_RETURN(spec.warmup, p.Int(f.value, field, 0, 100000));
    } else if (f.key == "chunk") {
      ASSIGN_OR_RETURN(spec.chunk, p.Int(f.value, field, 0, 65536));
    } else if (f.key == "prefill_tokens") {
      ASSIGN_OR_RETURN(spec.prefill_tokens, p.Int(f.value, field, 0, 1048576));
    } else if (f.key == "seed") {
      ASSIGN_OR_RETURN(std::string text, p.Text(f.value, field));
      if (!absl::SimpleAtoi(text, &spec.seed))
        return p.Error(f.value, field,
                       absl::StrCat("'", text, "' is not an unsigned 64-bit integer"));
    } else if (f.key == "slo") {
      RETURN_IF_ERROR(ParseSloNode(p, f, &w->slo));
    } else if (f.key == "timeout") {
      ASSIGN_OR_RETURN(w->timeout_s, p.Number(f.value, field, -1e12, 1e12));
    } else {
      const bool lockstep = std::find(std::begin(kWorkloadKeys), std::end(kWorkloadKeys), f.key) !=
                            std::end(kWorkloadKeys);
      return p.Error(f.key_node, "workload",
                     absl::StrCat("unknown key '", f.key, "' for mode serving",
                                  lockstep ? " (a lockstep workload's key)" : "",
                                  " (known: ", KnownKeys(kServingWorkloadKeys), ")"));
    }
  }
  w->serve = spec;
  if (absl::Status s = ValidateWorkload(*w); !s.ok()) {
    const absl::string_view msg = s.message();
    int line = LineOfNamedField(msg, "workload field '", lines, LineOf(e.key_node));
    if (absl::StartsWith(msg, "workload slo")) line = lines.count("slo") ? lines["slo"] : line;
    return p.Error(line, "", msg);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseWorkloadNode(const Parser& p, const Entry& e, Workload* w) {
  ASSIGN_OR_RETURN(std::vector<Entry> kv, p.MapEntries(e.value, "workload"));
  for (const Entry& f : kv) {
    if (f.key != "mode") continue;
    ASSIGN_OR_RETURN(std::string mode, p.Word(f.value, "workload.mode"));
    if (mode == "serving") return ParseServingWorkload(p, e, kv, w);
    if (mode != "lockstep")
      return p.Error(f.value, "workload.mode",
                     absl::StrCat("unknown mode '", mode, "' (known: lockstep, serving)"));
  }
  std::map<std::string, int> lines;
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  for (const Entry& f : kv) {
    const std::string field = absl::StrCat("workload.", f.key);
    lines[f.key] = LineOf(f.key_node);
    if (f.key == "mode") {
      continue;
    } else if (f.key == "prompt") {
      ASSIGN_OR_RETURN(w->prompt_len, p.Int(f.value, field, -kIntMax, kIntMax));
    } else if (f.key == "output") {
      ASSIGN_OR_RETURN(w->output_len, p.Int(f.value, field, -kIntMax, kIntMax));
    } else if (f.key == "repeats") {
      ASSIGN_OR_RETURN(w->repeats, p.Int(f.value, field, -kIntMax, kIntMax));
    } else if (f.key == "warmup") {
      ASSIGN_OR_RETURN(w->warmup, p.Int(f.value, field, -kIntMax, kIntMax));
    } else if (f.key == "timeout") {
      ASSIGN_OR_RETURN(w->timeout_s, p.Number(f.value, field, -1e12, 1e12));
    } else if (f.key == "batch") {
      ASSIGN_OR_RETURN(std::vector<int64_t> sizes,
                       p.IntList(f.value, field, -kIntMax, kIntMax, 16));
      RETURN_IF_ERROR(CheckIncreasing(p, f.value, field, sizes));
      w->batch_sizes.assign(sizes.begin(), sizes.end());
    } else {
      const bool serving =
          std::find(std::begin(kServingWorkloadKeys), std::end(kServingWorkloadKeys), f.key) !=
          std::end(kServingWorkloadKeys);
      return p.Error(
          f.key_node, "workload",
          absl::StrCat("unknown key '", f.key, "'",
                       serving ? " (a serving workload's key: it needs mode: serving)" : "",
                       " (known: ", KnownKeys(kWorkloadKeys), ")"));
    }
  }
  if (absl::Status s = ValidateWorkload(*w); !s.ok()) {
    // The message names the field as "workload field 'NAME'": point at that key's line.
    return p.Error(LineOfNamedField(s.message(), "workload field '", lines, LineOf(e.key_node)), "",
                   s.message());
  }
  return absl::OkStatus();
}

}  // namespace infersweep::sweep_spec_internal
