#include "api/serve_spec.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "api/status_macros.h"

namespace infersweep {
namespace {

using nlohmann::json;

absl::Status FieldError(absl::string_view field, absl::string_view value, absl::string_view want) {
  return absl::InvalidArgumentError(
      absl::StrCat("--serve field '", field, "': '", value, "' is not ", want));
}

// Load points are served in the order given, each once: a repeated or descending list is a typo.
absl::Status NotIncreasing(absl::string_view field, absl::string_view value) {
  return absl::InvalidArgumentError(absl::StrCat("--serve field '", field, "': '", value,
                                                 "': load points must increase (e.g. ", field,
                                                 field == "rate" ? "=1:2:4)" : "=1:4:16)"));
}

// "N" or "A-B" (A <= B), each in [lo, hi].
absl::Status ParseLength(absl::string_view field, absl::string_view value, int lo, int hi, int* min,
                         int* max) {
  std::pair<absl::string_view, absl::string_view> ab =
      absl::StrSplit(value, absl::MaxSplits('-', 1));
  if (!absl::SimpleAtoi(ab.first, min))
    return FieldError(field, value, "a length N or a range A-B");
  *max = *min;
  if (value.find('-') != absl::string_view::npos && !absl::SimpleAtoi(ab.second, max))
    return FieldError(field, value, "a length N or a range A-B");
  if (*min < lo || *max > hi || *min > *max)
    return absl::InvalidArgumentError(absl::StrCat("--serve field '", field, "': '", value,
                                                   "' must lie in [", lo, ", ", hi,
                                                   "] (a range as A-B with A <= B)"));
  return absl::OkStatus();
}

// Shortest text that reads back to the same double.
std::string Num(double v) {
  for (int digits = 6; digits < 17; ++digits) {
    std::string s = absl::StrFormat("%.*g", digits, v);
    double back = 0;
    if (absl::SimpleAtod(s, &back) && back == v) return s;
  }
  return absl::StrFormat("%.17g", v);
}

std::string Length(int lo, int hi) {
  return lo == hi ? absl::StrCat(lo) : absl::StrCat(lo, "-", hi);
}

// Reads an optional field of type T; a present field of the wrong type is an error naming it.
template <typename T>
absl::Status Read(const json& j, const char* key, T* out, absl::string_view where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  try {
    *out = it->get<T>();
  } catch (const json::exception&) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".", key, ": wrong type (", it->type_name(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateServeSpec(const ServeSpec& spec, std::string_view what_view) {
  const absl::string_view what(what_view.data(), what_view.size());
  auto outside = [&](absl::string_view field, auto value, absl::string_view range) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " field '", field, "': ", value, " must lie in ", range));
  };
  if (spec.concurrency.size() + spec.rate.size() > 64)
    return absl::InvalidArgumentError(absl::StrCat(
        what, " field '", spec.rate.empty() ? "concurrency" : "rate",
        "': ", spec.concurrency.size() + spec.rate.size(), " load points; at most 64"));
  for (int c : spec.concurrency)
    if (c < 1 || c > 4096) return outside("concurrency", c, "[1, 4096]");
  for (double r : spec.rate)
    if (!(r > 0) || !std::isfinite(r)) return outside("rate", Num(r), "(0, inf) requests/s");
  if (spec.max_concurrency < 0 || spec.max_concurrency > 4096)
    return outside("max_concurrency", spec.max_concurrency, "[0, 4096]");
  if (spec.isl_min < 1 || spec.isl_max > 65536 || spec.isl_min > spec.isl_max)
    return outside("isl", Length(spec.isl_min, spec.isl_max), "[1, 65536] (A-B with A <= B)");
  if (spec.osl_min < 1 || spec.osl_max > 65536 || spec.osl_min > spec.osl_max)
    return outside("osl", Length(spec.osl_min, spec.osl_max), "[1, 65536] (A-B with A <= B)");
  if (spec.requests < 0 || spec.requests > 1000000)
    return outside("requests", spec.requests, "[1, 1000000]");
  if (spec.duration_s < 0 || !std::isfinite(spec.duration_s) || spec.duration_s > 86400)
    return outside("duration", Num(spec.duration_s), "(0, 86400] s");
  if (spec.warmup < 0 || spec.warmup > 100000) return outside("warmup", spec.warmup, "[0, 100000]");
  if (spec.chunk < 0 || spec.chunk > 65536) return outside("chunk", spec.chunk, "[0, 65536]");
  if (spec.prefill_tokens < 0 || spec.prefill_tokens > 1048576)
    return outside("prefill_tokens", spec.prefill_tokens, "[0, 1048576]");
  if (spec.prefill_tokens > 0 && spec.prefill_tokens < spec.chunk)
    return absl::InvalidArgumentError(absl::StrCat(
        what, " field 'prefill_tokens': ", spec.prefill_tokens, " is less than the chunk (",
        spec.chunk, "): a step feeds one chunk at least"));
  if (spec.concurrency.empty() && spec.rate.empty())
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     " needs a load: 'concurrency' (closed loop, e.g. concurrency=1:4) or 'rate' "
                     "(Poisson arrivals, requests/s, e.g. rate=2)"));
  if ((spec.requests > 0) == (spec.duration_s > 0))
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     " needs exactly one of 'requests' (timed requests per load point) and "
                     "'duration' (seconds of arrivals per load point)"));
  if (spec.max_concurrency > 0 && spec.rate.empty())
    return absl::InvalidArgumentError(
        absl::StrCat(what, " field 'max_concurrency' caps an open loop: it needs 'rate'"));
  return absl::OkStatus();
}

absl::StatusOr<ServeSpec> ParseServeSpec(std::string_view text) {
  ServeSpec spec;
  std::set<std::string, std::less<>> seen;
  for (absl::string_view item :
       absl::StrSplit(absl::string_view(text.data(), text.size()), ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(item, absl::MaxSplits('=', 1));
    const absl::string_view field = kv.first, value = kv.second;
    if (value.empty())
      return absl::InvalidArgumentError(
          absl::StrCat("--serve item '", item, "' is not of the form field=value"));
    if (!seen.emplace(field).second)
      return absl::InvalidArgumentError(absl::StrCat("--serve field '", field, "' given twice"));
    auto as_int = [&](int* out, int lo, int hi) -> absl::Status {
      if (!absl::SimpleAtoi(value, out)) return FieldError(field, value, "an integer");
      if (*out < lo || *out > hi)
        return absl::InvalidArgumentError(absl::StrCat("--serve field '", field, "': ", *out,
                                                       " must lie in [", lo, ", ", hi, "]"));
      return absl::OkStatus();
    };
    if (field == "concurrency") {
      for (absl::string_view c : absl::StrSplit(value, ':')) {
        int n;
        if (!absl::SimpleAtoi(c, &n) || n < 1 || n > 4096)
          return FieldError(field, c, "a concurrency in [1, 4096] (load points as 1:4:16)");
        if (!spec.concurrency.empty() && n <= spec.concurrency.back())
          return NotIncreasing(field, value);
        spec.concurrency.push_back(n);
      }
    } else if (field == "rate") {
      for (absl::string_view r : absl::StrSplit(value, ':')) {
        double rate;
        if (!absl::SimpleAtod(r, &rate) || !(rate > 0) || !std::isfinite(rate))
          return FieldError(field, r, "a positive request rate in requests/s (load points as 1:4)");
        if (!spec.rate.empty() && rate <= spec.rate.back()) return NotIncreasing(field, value);
        spec.rate.push_back(rate);
      }
    } else if (field == "max_concurrency") {
      RETURN_IF_ERROR(as_int(&spec.max_concurrency, 0, 4096));
    } else if (field == "isl") {
      RETURN_IF_ERROR(ParseLength(field, value, 1, 65536, &spec.isl_min, &spec.isl_max));
    } else if (field == "osl") {
      RETURN_IF_ERROR(ParseLength(field, value, 1, 65536, &spec.osl_min, &spec.osl_max));
    } else if (field == "requests") {
      RETURN_IF_ERROR(as_int(&spec.requests, 0, 1000000));
    } else if (field == "duration") {
      if (!absl::SimpleAtod(value, &spec.duration_s) || !(spec.duration_s >= 0) ||
          !std::isfinite(spec.duration_s))
        return FieldError(field, value, "a positive number of seconds");
    } else if (field == "warmup") {
      RETURN_IF_ERROR(as_int(&spec.warmup, 0, 100000));
    } else if (field == "chunk") {
      RETURN_IF_ERROR(as_int(&spec.chunk, 0, 65536));
    } else if (field == "prefill_tokens") {
      RETURN_IF_ERROR(as_int(&spec.prefill_tokens, 0, 1048576));
    } else if (field == "seed") {
      if (!absl::SimpleAtoi(value, &spec.seed)) return FieldError(field, value, "an integer");
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown --serve field '", field,
                       "' (known: concurrency, rate, max_concurrency, isl, osl, requests, "
                       "duration, warmup, chunk, prefill_tokens, seed)"));
    }
  }
  RETURN_IF_ERROR(ValidateServeSpec(spec));
  return spec;
}

std::string ServeSpecString(const ServeSpec& spec) {
  std::vector<std::string> items;
  if (!spec.concurrency.empty())
    items.push_back(absl::StrCat("concurrency=", absl::StrJoin(spec.concurrency, ":")));
  if (!spec.rate.empty()) {
    std::vector<std::string> rates;
    for (double r : spec.rate) rates.push_back(Num(r));
    items.push_back(absl::StrCat("rate=", absl::StrJoin(rates, ":")));
  }
  if (spec.max_concurrency > 0)
    items.push_back(absl::StrCat("max_concurrency=", spec.max_concurrency));
  items.push_back(absl::StrCat("isl=", Length(spec.isl_min, spec.isl_max)));
  items.push_back(absl::StrCat("osl=", Length(spec.osl_min, spec.osl_max)));
  if (spec.requests > 0) items.push_back(absl::StrCat("requests=", spec.requests));
  if (spec.duration_s > 0) items.push_back(absl::StrCat("duration=", Num(spec.duration_s)));
  items.push_back(absl::StrCat("warmup=", spec.warmup));
  items.push_back(absl::StrCat("chunk=", spec.chunk));
  if (spec.prefill_tokens > 0)
    items.push_back(absl::StrCat("prefill_tokens=", spec.prefill_tokens));
  items.push_back(absl::StrCat("seed=", spec.seed));
  return absl::StrJoin(items, ",");
}

absl::Status ValidateSlo(const Slo& slo, std::string_view what_view) {
  const absl::string_view what(what_view.data(), what_view.size());
  for (auto [name, bound] : {std::pair{"ttft_ms", slo.ttft_ms}, std::pair{"tpot_ms", slo.tpot_ms}})
    if (bound && (!(*bound > 0) || !std::isfinite(*bound)))
      return absl::InvalidArgumentError(
          absl::StrCat(what, " field '", name, "': ", Num(*bound), " is not a positive number"));
  if (!(slo.percentile > 0) || slo.percentile > 100)
    return absl::InvalidArgumentError(
        absl::StrCat(what, " field 'percentile': must lie in (0, 100]"));
  return absl::OkStatus();
}

absl::StatusOr<Slo> ParseSlo(std::string_view text) {
  Slo slo;
  std::set<std::string, std::less<>> seen;
  for (absl::string_view item :
       absl::StrSplit(absl::string_view(text.data(), text.size()), ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (!seen.emplace(kv.first).second)
      return absl::InvalidArgumentError(absl::StrCat("--slo field '", kv.first, "' given twice"));
    double value;
    if (!absl::SimpleAtod(kv.second, &value) || !(value > 0) || !std::isfinite(value))
      return absl::InvalidArgumentError(
          absl::StrCat("--slo field '", kv.first, "': '", kv.second, "' is not a positive number"));
    if (kv.first == "ttft_ms") {
      slo.ttft_ms = value;
    } else if (kv.first == "tpot_ms") {
      slo.tpot_ms = value;
    } else if (kv.first == "percentile") {
      if (value > 100)
        return absl::InvalidArgumentError("--slo field 'percentile': must lie in (0, 100]");
      slo.percentile = value;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown --slo field '", kv.first,
                                                     "' (known: ttft_ms, tpot_ms, percentile)"));
    }
  }
  if (slo.empty())
    return absl::InvalidArgumentError("--slo needs a bound: ttft_ms=..., tpot_ms=... or both");
  return slo;
}

std::string SloString(const Slo& slo) {
  if (slo.empty()) return "";
  std::vector<std::string> items;
  if (slo.ttft_ms) items.push_back(absl::StrCat("ttft_ms=", Num(*slo.ttft_ms)));
  if (slo.tpot_ms) items.push_back(absl::StrCat("tpot_ms=", Num(*slo.tpot_ms)));
  items.push_back(absl::StrCat("percentile=", Num(slo.percentile)));
  return absl::StrJoin(items, ",");
}

std::string LoadPointName(const LoadPoint& point) {
  if (!point.open_loop) return absl::StrCat("concurrency=", point.concurrency);
  return absl::StrCat(
      "rate=", Num(point.rate),
      point.concurrency > 0 ? absl::StrCat(",max_concurrency=", point.concurrency) : "");
}

std::vector<LoadPoint> LoadPoints(const ServeSpec& spec) {
  std::vector<LoadPoint> points;
  for (int c : spec.concurrency) points.push_back({false, c, 0});
  for (double r : spec.rate) points.push_back({true, spec.max_concurrency, r});
  return points;
}

int ServingSlots(const ServeSpec& spec, const LoadPoint& point) {
  if (!point.open_loop || point.concurrency > 0) return point.concurrency;
  return spec.requests > 0 ? std::min(spec.requests + spec.warmup, kUncappedServingSlots)
                           : kUncappedServingSlots;
}

int64_t LargestRaggedStepRows(const ServeSpec& spec, int slots) {
  const int64_t take = spec.chunk > 0 ? std::min(spec.chunk, spec.isl_max) : spec.isl_max;
  if (spec.prefill_tokens > 0) return slots + std::max<int64_t>(spec.prefill_tokens, take);
  if (spec.chunk > 0) return slots + take;
  return int64_t{slots} * spec.isl_max;
}

std::string ServeWorkloadKey(const ServeSpec& spec, const Slo& slo) {
  std::string key =
      absl::StrCat(kServeWorkloadKeyPrefix, "isl=", Length(spec.isl_min, spec.isl_max),
                   ",osl=", Length(spec.osl_min, spec.osl_max));
  if (spec.requests > 0) absl::StrAppend(&key, ",requests=", spec.requests);
  if (spec.duration_s > 0) absl::StrAppend(&key, ",duration=", Num(spec.duration_s));
  absl::StrAppend(&key, ",warmup=", spec.warmup, ",chunk=", spec.chunk);
  if (spec.prefill_tokens > 0) absl::StrAppend(&key, ",prefill_tokens=", spec.prefill_tokens);
  absl::StrAppend(&key, ",seed=", spec.seed);
  if (!slo.empty()) absl::StrAppend(&key, ";slo:", SloString(slo));
  return key;
}

absl::StatusOr<std::string> CanonicalServeWorkloadKey(std::string_view text_view) {
  absl::string_view text(text_view.data(), text_view.size());
  if (!absl::ConsumePrefix(&text, kServeWorkloadKeyPrefix))
    return absl::InvalidArgumentError(absl::StrCat(
        "serving workload key '", text, "' does not start with '", kServeWorkloadKeyPrefix, "'"));
  std::pair<absl::string_view, absl::string_view> parts =
      absl::StrSplit(text, absl::MaxSplits(";slo:", 1));
  // The key names no load points: a stand-in one lets the spec's own parser check the rest.
  for (absl::string_view item : absl::StrSplit(parts.first, ',', absl::SkipWhitespace()))
    if (absl::StartsWith(item, "concurrency=") || absl::StartsWith(item, "rate=") ||
        absl::StartsWith(item, "max_concurrency="))
      return absl::InvalidArgumentError(absl::StrCat(
          "serving workload key: '", item, "' is a load point, not part of the workload key"));
  ASSIGN_OR_RETURN(ServeSpec spec, ParseServeSpec(absl::StrCat(parts.first, ",concurrency=1")));
  Slo slo;
  if (!parts.second.empty()) {
    ASSIGN_OR_RETURN(slo, ParseSlo(std::string_view(parts.second.data(), parts.second.size())));
  }
  return ServeWorkloadKey(spec, slo);
}

json ToJson(const ServeSpec& spec) {
  return {{"concurrency", spec.concurrency},
          {"rate", spec.rate},
          {"max_concurrency", spec.max_concurrency},
          {"isl_min", spec.isl_min},
          {"isl_max", spec.isl_max},
          {"osl_min", spec.osl_min},
          {"osl_max", spec.osl_max},
          {"requests", spec.requests},
          {"duration_s", spec.duration_s},
          {"warmup", spec.warmup},
          {"chunk", spec.chunk},
          {"prefill_tokens", spec.prefill_tokens},
          {"seed", spec.seed}};
}

json ToJson(const Slo& slo) {
  return {{"ttft_ms", slo.ttft_ms ? json(*slo.ttft_ms) : json(nullptr)},
          {"tpot_ms", slo.tpot_ms ? json(*slo.tpot_ms) : json(nullptr)},
          {"percentile", slo.percentile}};
}

absl::StatusOr<ServeSpec> ServeSpecFromJson(const json& j, std::string_view where_view) {
  const absl::string_view where(where_view.data(), where_view.size());
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
  ServeSpec spec;
  RETURN_IF_ERROR(Read(j, "concurrency", &spec.concurrency, where));
  RETURN_IF_ERROR(Read(j, "rate", &spec.rate, where));
  RETURN_IF_ERROR(Read(j, "max_concurrency", &spec.max_concurrency, where));
  RETURN_IF_ERROR(Read(j, "isl_min", &spec.isl_min, where));
  RETURN_IF_ERROR(Read(j, "isl_max", &spec.isl_max, where));
  RETURN_IF_ERROR(Read(j, "osl_min", &spec.osl_min, where));
  RETURN_IF_ERROR(Read(j, "osl_max", &spec.osl_max, where));
  RETURN_IF_ERROR(Read(j, "requests", &spec.requests, where));
  RETURN_IF_ERROR(Read(j, "duration_s", &spec.duration_s, where));
  RETURN_IF_ERROR(Read(j, "warmup", &spec.warmup, where));
  RETURN_IF_ERROR(Read(j, "chunk", &spec.chunk, where));
  RETURN_IF_ERROR(Read(j, "prefill_tokens", &spec.prefill_tokens, where));
  RETURN_IF_ERROR(Read(j, "seed", &spec.seed, where));
  RETURN_IF_ERROR(ValidateServeSpec(spec, where_view));
  return spec;
}

absl::StatusOr<Slo> SloFromJson(const json& j, std::string_view where_view) {
  const absl::string_view where(where_view.data(), where_view.size());
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
  Slo slo;
  double v = 0;
  if (j.contains("ttft_ms") && !j["ttft_ms"].is_null()) {
    RETURN_IF_ERROR(Read(j, "ttft_ms", &v, where));
    slo.ttft_ms = v;
  }
  if (j.contains("tpot_ms") && !j["tpot_ms"].is_null()) {
    RETURN_IF_ERROR(Read(j, "tpot_ms", &v, where));
    slo.tpot_ms = v;
  }
  RETURN_IF_ERROR(Read(j, "percentile", &slo.percentile, where));
  RETURN_IF_ERROR(ValidateSlo(slo, where_view));
  return slo;
}

}  // namespace infersweep
