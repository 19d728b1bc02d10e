#include "coordinator/sweep_spec.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "api/model_config.h"
#include "api/model_description.h"
#include "api/status_macros.h"
#include "api/untrusted_regex.h"

namespace infersweep {
namespace {


constexpr const char* kTopLevelKeys[] = {"name",     "model",   "layers",   "seed",
                                         "device",   "matrix",  "include",  "exclude",
                                         "workload", "selector", "repeats", "priority"};
constexpr const char* kWorkloadKeys[] = {"mode",    "prompt", "output", "batch",
                                         "repeats", "warmup", "timeout"};
constexpr const char* kServingWorkloadKeys[] = {
    "mode",     "concurrency", "rate",  "max_concurrency", "isl",  "osl", "requests",
    "duration", "warmup",      "chunk", "prefill_tokens",  "seed", "slo", "timeout"};
constexpr const char* kSloKeys[] = {"ttft_ms", "tpot_ms", "percentile"};
constexpr const char* kSelectorKeys[] = {"sm", "gpu_name", "min_memory_gb", "gpus", "p2p"};

int LineOf(const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  return m.is_null() ? 0 : m.line + 1;
}

std::string KindOf(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null:
      return "nothing (null)";
    case YAML::NodeType::Scalar:
      return absl::StrCat("the scalar '", n.Scalar(), "'");
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Undefined:
      return "nothing";
  }
  return "?";
}

uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a)
    return std::numeric_limits<uint64_t>::max();
  return a * b;
}
uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return b > std::numeric_limits<uint64_t>::max() - a ? std::numeric_limits<uint64_t>::max()
                                                      : a + b;
}

struct Entry {
  std::string key;
  YAML::Node key_node;
  YAML::Node value;
};

// Builds errors "source:line: field: message" (the line left out when unknown).
class Parser {
 public:
  explicit Parser(absl::string_view source) : source_(source.empty() ? "<sweep>" : source) {}

  absl::Status Error(int line, absl::string_view field, absl::string_view message) const {
    std::string where = line > 0 ? absl::StrCat(source_, ":", line) : source_;
    if (!field.empty()) absl::StrAppend(&where, ": ", field);
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", message));
  }
  absl::Status Error(const YAML::Node& at, absl::string_view field, absl::string_view message) const {
    return Error(LineOf(at), field, message);
  }

  // The entries of a map, keys scalar and unique.
  absl::StatusOr<std::vector<Entry>> MapEntries(const YAML::Node& node,
                                                absl::string_view field) const {
    if (!node.IsMap()) return Error(node, field, absl::StrCat("expected a map, got ", KindOf(node)));
    std::vector<Entry> out;
    std::map<std::string, int> seen;
    for (auto it = node.begin(); it != node.end(); ++it) {
      // Copies: the iterator hands out a temporary pair.
      const YAML::Node k = it->first;
      const YAML::Node v = it->second;
      if (!k.IsScalar())
        return Error(k, field, absl::StrCat("keys must be scalars, got ", KindOf(k)));
      const std::string key = k.Scalar();
      if (auto [pos, inserted] = seen.emplace(key, LineOf(k)); !inserted)
        return Error(k, field,
                     absl::StrCat("duplicate key '", key, "' (first at line ", pos->second, ")"));
      out.push_back({key, k, v});
    }
    return out;
  }

  absl::StatusOr<std::string> Text(const YAML::Node& n, absl::string_view field) const {
    if (!n.IsScalar())
      return Error(n, field, absl::StrCat("expected a single value, got ", KindOf(n)));
    if (n.Scalar().empty()) return Error(n, field, "empty value");
    return n.Scalar();
  }

  // Text of at most `max_bytes`, without control characters: it is stored, and printed in
  // tables and log lines.
  absl::StatusOr<std::string> FreeText(const YAML::Node& n, absl::string_view field,
                                       size_t max_bytes) const {
    ASSIGN_OR_RETURN(std::string s, Text(n, field));
    if (s.size() > max_bytes)
      return Error(n, field,
                   absl::StrCat("'", s.substr(0, 32), "...' is ", s.size(),
                                " bytes long; the limit is ", max_bytes));
    for (const char c : s)
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
        return Error(n, field,
                     absl::StrCat("contains a control character (byte 0x",
                                  absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2),
                                  "); keep it to one line of text"));
    return s;
  }

  // A config word (axis name or value): it ends up in "a=b,c=d" strings.
  absl::StatusOr<std::string> Word(const YAML::Node& n, absl::string_view field) const {
    ASSIGN_OR_RETURN(std::string s, FreeText(n, field, kMaxSweepWordBytes));
    if (s.find_first_of(",= \t\r\n") != std::string::npos)
      return Error(n, field, absl::StrCat("'", s, "' contains ',', '=' or whitespace"));
    return s;
  }

  absl::StatusOr<int64_t> Int(const YAML::Node& n, absl::string_view field, int64_t lo,
                              int64_t hi) const {
    ASSIGN_OR_RETURN(std::string s, Text(n, field));
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v)) return Error(n, field, absl::StrCat("'", s, "' is not an integer"));
    if (v < lo || v > hi)
      return Error(n, field, absl::StrCat(v, " is outside [", lo, ", ", hi, "]"));
    return v;
  }

  // true or false (YAML's spellings of them: true/false, yes/no, on/off).
  absl::StatusOr<bool> Bool(const YAML::Node& n, absl::string_view field) const {
    ASSIGN_OR_RETURN(std::string s, Text(n, field));
    bool v = false;
    if (!YAML::convert<bool>::decode(n, v))
      return Error(n, field, absl::StrCat("'", s, "' is not true or false"));
    return v;
  }

  absl::StatusOr<double> Number(const YAML::Node& n, absl::string_view field, double lo,
                                double hi) const {
    ASSIGN_OR_RETURN(std::string s, Text(n, field));
    double v = 0;
    if (!absl::SimpleAtod(s, &v) || !std::isfinite(v))
      return Error(n, field, absl::StrCat("'", s, "' is not a number"));
    if (v < lo || v > hi) return Error(n, field, absl::StrCat(v, " is outside [", lo, ", ", hi, "]"));
    return v;
  }

  // One integer or a non-empty list of them.
  absl::StatusOr<std::vector<int64_t>> IntList(const YAML::Node& n, absl::string_view field,
                                               int64_t lo, int64_t hi, size_t max_count) const {
    std::vector<int64_t> out;
    if (n.IsSequence()) {
      if (n.size() == 0) return Error(n, field, "empty list");
      if (n.size() > max_count)
        return Error(n, field, absl::StrCat(n.size(), " values; at most ", max_count));
      for (const YAML::Node& item : n) {
        ASSIGN_OR_RETURN(int64_t v, Int(item, field, lo, hi));
        out.push_back(v);
      }
      return out;
    }
    ASSIGN_OR_RETURN(int64_t v, Int(n, field, lo, hi));
    out.push_back(v);
    return out;
  }

  const std::string& source() const { return source_; }

 private:
  std::string source_;
};

std::string KnownKeys(const auto& keys) { return absl::StrJoin(keys, ", "); }

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
          return p.Error(v, field, absl::StrCat("duplicate value '", value, "' (first at line ",
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
      return p.Error(item, field,
                     e.key == "exclude" ? "empty entry (it would drop every combination)"
                                        : "empty entry");
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

absl::Status ParseSelectorNode(const Parser& p, const Entry& e, Selector* s) {
  ASSIGN_OR_RETURN(std::vector<Entry> kv, p.MapEntries(e.value, "selector"));
  for (const Entry& f : kv) {
    const std::string field = absl::StrCat("selector.", f.key);
    if (f.key == "sm") {
      ASSIGN_OR_RETURN(std::vector<int64_t> sms, p.IntList(f.value, field, 1, 1000, 64));
      s->sm_archs.assign(sms.begin(), sms.end());
    } else if (f.key == "gpu_name") {
      ASSIGN_OR_RETURN(s->gpu_name_regex, p.Text(f.value, field));
      // RE2, bounded: a pattern is untrusted input and must not cost the coordinator its stack
      // or its memory (api/untrusted_regex.h).
      if (auto re = CompileUntrustedRegex(s->gpu_name_regex); !re.ok())
        return p.Error(f.value, field, re.status().message());
    } else if (f.key == "min_memory_gb") {
      ASSIGN_OR_RETURN(double gb, p.Number(f.value, field, 0, 1e6));
      s->min_memory_bytes = static_cast<int64_t>(std::llround(gb * 1e9));
    } else if (f.key == "gpus") {
      ASSIGN_OR_RETURN(s->gpus_needed, p.Int(f.value, field, 1, 64));
    } else if (f.key == "p2p") {
      ASSIGN_OR_RETURN(s->needs_p2p, p.Bool(f.value, field));
    } else if (f.key == "device") {
      return p.Error(f.key_node, field,
                     "not a selector key: each trial's device follows its config (matrix axis "
                     "'device' or the top-level 'device:')");
    } else {
      return p.Error(f.key_node, "selector",
                     absl::StrCat("unknown key '", f.key, "' (known: ", KnownKeys(kSelectorKeys),
                                  ")"));
    }
  }
  return absl::OkStatus();
}

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
      return p.Error(it != lines.end() ? it->second : fallback_line,
                     absl::StrCat(field, ".", axis), one.status().message());
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
        return p.Error(values.line, absl::StrCat("matrix.", axis),
                       absl::StrCat(errors[0].message(), " (device '", device,
                                    "'; every value rejected: ",
                                    absl::StrJoin(values.values, ", "), ")"));
      for (size_t i = 0; i < errors.size(); ++i)
        if (!errors[i].ok())
          return p.Error(
              values.value_lines[i], absl::StrCat("matrix.", axis),
              absl::StrCat(errors[i].message(),
                           absl::StrContains(errors[i].message(),
                                             absl::StrCat("'", values.values[i], "'"))
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

// "NUL", "ESC", ...: the name of a control byte in messages.
std::string ControlByteName(unsigned char c) {
  static constexpr const char* kNames[32] = {"NUL", "SOH", "STX", "ETX", "EOT", "ENQ", "ACK", "BEL",
                                             "BS",  "TAB", "LF",  "VT",  "FF",  "CR",  "SO",  "SI",
                                             "DLE", "DC1", "DC2", "DC3", "DC4", "NAK", "SYN", "ETB",
                                             "CAN", "EM",  "SUB", "ESC", "FS",  "GS",  "RS",  "US"};
  return c < 32 ? kNames[c] : "DEL";
}

// What yaml-cpp reports badly, checked before it sees the text: a control byte (it names
// neither the byte nor where it is) and nesting deeper than kMaxSweepSpecDepth (it recurses
// per level and gives up at 500 with "bad file"). The nesting scan follows YAML as far as
// depth needs: block levels by indentation and "- " entries, flow collections by brackets
// outside quotes and comments, block scalars' bodies skipped. Where it is unsure it counts
// low; yaml-cpp's own limit stays behind it (ParseSpecUnsafe).
absl::Status CheckSpecText(absl::string_view yaml, const Parser& p) {
  auto error_at = [&](int line, size_t column, absl::string_view message) {
    return absl::InvalidArgumentError(
        absl::StrCat(p.source(), ":", line, ":", column, ": ", message));
  };
  {
    int line = 1;
    size_t line_start = 0;
    for (size_t i = 0; i < yaml.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(yaml[i]);
      if (c == '\n') {
        ++line;
        line_start = i + 1;
      } else if ((c < 0x20 && c != '\t' && c != '\r') || c == 0x7f) {
        return error_at(
            line, i - line_start + 1,
            absl::StrCat("control byte 0x", absl::Hex(c, absl::kZeroPad2), " (", ControlByteName(c),
                         "); a sweep spec is printable text (tabs and newlines "
                         "allowed)"));
      }
    }
  }
  std::vector<size_t> block;  // columns of the open block levels, innermost last
  int flow = 0;               // open flow collections, '[' and '{'
  char quote = 0;             // the quote of a quoted scalar still open at the end of a line
  constexpr size_t kNone = std::string::npos;
  size_t block_scalar_parent = kNone;  // in a block scalar's body: its parent's column
  int line = 0;
  for (absl::string_view rest = yaml; !rest.empty() || line == 0;) {
    ++line;
    const size_t nl = rest.find('\n');
    absl::string_view text = rest.substr(0, nl);
    rest = nl == absl::string_view::npos ? absl::string_view() : rest.substr(nl + 1);
    if (!text.empty() && text.back() == '\r') text.remove_suffix(1);
    size_t indent = 0;
    while (indent < text.size() && text[indent] == ' ') ++indent;
    const bool blank = indent == text.size() || text[indent] == '#';
    if (block_scalar_parent != kNone) {
      if (blank || indent > block_scalar_parent) continue;
      block_scalar_parent = kNone;
    }
    auto too_deep = [&](size_t i) {
      return static_cast<int>(block.size()) + flow > kMaxSweepSpecDepth
                 ? error_at(line, i + 1,
                            absl::StrCat("YAML nested deeper than ", kMaxSweepSpecDepth,
                                         " levels; the limit is ", kMaxSweepSpecDepth))
                 : absl::OkStatus();
    };
    size_t pos = 0, node_start = 0, parent = 0;
    if (quote == 0 && flow == 0) {
      if (blank || text[0] == '%') continue;
      if (absl::StartsWith(text, "---") || absl::StartsWith(text, "...")) {
        block.clear();
        pos = 3;
        while (pos < text.size() && text[pos] == ' ') ++pos;
      } else {
        while (!block.empty() && block.back() >= indent) block.pop_back();
        pos = indent;
      }
      // "- " entries (and "? " / ": " of complex keys) open a level each.
      while (pos < text.size() && (text[pos] == '-' || text[pos] == '?' || text[pos] == ':') &&
             (pos + 1 == text.size() || text[pos + 1] == ' ')) {
        parent = pos;
        block.push_back(pos);
        RETURN_IF_ERROR(too_deep(pos));
        ++pos;
        while (pos < text.size() && text[pos] == ' ') ++pos;
      }
      if (pos < text.size() && text[pos] != '#') {
        block.push_back(pos);
        RETURN_IF_ERROR(too_deep(pos));
      }
      node_start = pos;
    } else {
      node_start = std::string::npos;
    }
    for (size_t i = pos; i < text.size(); ++i) {
      const char c = text[i];
      if (quote != 0) {
        if (quote == '"' && c == '\\') {
          ++i;
        } else if (c == quote) {
          if (quote == '\'' && i + 1 < text.size() && text[i + 1] == '\'') {
            ++i;  // '' is an escaped quote
          } else {
            quote = 0;
          }
        }
        continue;
      }
      if (c == '#' && (i == 0 || text[i - 1] == ' ' || text[i - 1] == '\t')) break;
      if (flow > 0) {
        if (c == '"' || c == '\'') {
          quote = c;
        } else if (c == '[' || c == '{') {
          ++flow;
          RETURN_IF_ERROR(too_deep(i));
        } else if (c == ']' || c == '}') {
          --flow;
        }
        continue;
      }
      // Block context: flow collections, quoted and block scalars begin only where a node does.
      if (i == node_start) {
        if (c == '&' || c == '!') {  // an anchor or a tag before the node
          while (i < text.size() && text[i] != ' ') ++i;
          while (i + 1 < text.size() && text[i + 1] == ' ') ++i;
          node_start = i + 1;
          continue;
        }
        if (c == '[' || c == '{') {
          ++flow;
          RETURN_IF_ERROR(too_deep(i));
          continue;
        }
        if (c == '"' || c == '\'') {
          quote = c;
          continue;
        }
        if (c == '|' || c == '>') {
          block_scalar_parent = parent;
          break;
        }
      }
      if (c == ':' && (i + 1 == text.size() || text[i + 1] == ' ' || text[i + 1] == '\t')) {
        parent = block.empty() ? 0 : block.back();
        size_t j = i + 1;
        while (j < text.size() && (text[j] == ' ' || text[j] == '\t')) ++j;
        node_start = j;
        i = j - 1;
      }
    }
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
    return p.Error(root, "",
                   absl::StrCat("the spec must be a map (name:, model:, matrix:, ...), got ",
                                KindOf(root)));
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
                     absl::StrCat("unknown top-level key '", key, "' (known: ",
                                  KnownKeys(kTopLevelKeys), ")"));
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

const ConfigNormalizer& OrDefault(const ConfigNormalizer& normalize) {
  static const ConfigNormalizer* const kDefault = new ConfigNormalizer(NormalizeBackendConfig);
  return normalize ? normalize : *kDefault;
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
    return p.Error(e.mark.is_null() ? 0 : e.mark.line + 1, "", absl::StrCat("invalid spec: ", e.msg));
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

uint64_t SweepTrialBound(const SweepSpec& spec) {
  uint64_t product = 1;
  for (const auto& [axis, values] : spec.matrix) product = SaturatingMul(product, values.values.size());
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
    return p.Error(spec.matrix_line, "matrix",
                   absl::StrCat("the sweep is too large: the matrix product is ", product_text,
                                " combinations (", absl::StrJoin(sizes, " x "), ") + ",
                                spec.include.size(), " includes, x ", spec.repeats,
                                " repeats = ", bound_text, " trials before excludes, over the cap "
                                "of ", max_trials, " trials; split the sweep or drop values"));
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
      t.priority = spec.priority;
      t.state = TrialState::kQueued;
      trials.push_back(std::move(t));
    }
  }
  return trials;
}

absl::StatusOr<std::vector<std::string>> CheckSweepModel(const SweepSpec& spec) {
  const Parser p(spec.source);
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
