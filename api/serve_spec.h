// Serving workloads, free of the engine: the load a serving trial puts on a model (closed-loop
// concurrency points or Poisson request-rate points, request lengths and counts), the SLO its
// load points are held to, and the load points themselves. The CLI (`run --serve`), sweep YAML
// (`workload: {mode: serving, ...}`), trial requests and stored results all carry these.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace infersweep {

// What `run --serve` takes: "concurrency=1:4,isl=64,osl=16,requests=8" or
// "rate=2:8,max_concurrency=16,isl=32-64,osl=16,duration=30". Lists separate load points with
// ':'; a length "A-B" is drawn uniformly from [A, B] per request.
struct ServeSpec {
  std::vector<int> concurrency;    // closed-loop load points: requests in flight
  std::vector<double> rate;        // open-loop load points: Poisson arrivals, requests/s
  int max_concurrency = 0;         // open loop: cap on requests in flight (0: none)
  int isl_min = 64, isl_max = 64;  // input (prompt) length, tokens
  int osl_min = 16, osl_max = 16;  // output length, tokens
  int requests = 0;                // timed requests per load point (or duration_s)
  double duration_s = 0;           // issue timed requests for this long instead (or requests)
  int warmup = 0;  // requests served first at each load point, left out of the figures
  int chunk = 0;   // prefill tokens a step takes (chunked prefill); 0: a whole prompt
  // Prompt tokens a step feeds over every prefilling sequence (vLLM's max_num_batched_tokens,
  // less the decode rows): each takes its next chunk (or whole prompt) while the sum stays
  // within it, the oldest first, one at least. 0: one chunk a step (chunk > 0) or every
  // waiting prompt whole (chunk 0).
  int prefill_tokens = 0;
  uint64_t seed = 1;
};

// Errors name the field: "--serve field 'isl': ...".
absl::StatusOr<ServeSpec> ParseServeSpec(std::string_view text);
// The ranges of every field and the rules between fields (a load is given; exactly one of
// requests and duration; max_concurrency only with rate). Messages name the field as
// "<what> field 'NAME'" or say "<what> needs ...".
absl::Status ValidateServeSpec(const ServeSpec& spec, std::string_view what = "--serve");
// The text ParseServeSpec reads back to the same spec (every field written).
std::string ServeSpecString(const ServeSpec& spec);

// The SLO a request or a load point meets: each bound given must hold.
struct Slo {
  std::optional<double> ttft_ms, tpot_ms;
  double percentile = 99;  // a load point meets the SLO when this percentile of each does
  bool empty() const { return !ttft_ms && !tpot_ms; }
};
// "ttft_ms=2000,tpot_ms=50[,percentile=99]"; errors name the field.
absl::StatusOr<Slo> ParseSlo(std::string_view text);
// The bounds positive and finite, the percentile in (0, 100]; an empty SLO is valid.
absl::Status ValidateSlo(const Slo& slo, std::string_view what = "--slo");
// "ttft_ms=2000,tpot_ms=50,percentile=99", or "" for an empty SLO.
std::string SloString(const Slo& slo);

struct LoadPoint {
  bool open_loop = false;
  int concurrency = 0;  // closed loop: in flight; open loop: the cap (0: none)
  double rate = 0;      // open loop, requests/s
};
// "concurrency=4", "rate=2", "rate=2,max_concurrency=8": a load point's part of a result's
// identity.
std::string LoadPointName(const LoadPoint& point);
std::vector<LoadPoint> LoadPoints(const ServeSpec& spec);

// KV slots a load point reserves (Model::StartServing): a closed loop's concurrency; an open
// loop's cap, or without one its warm-up and timed requests, at most kUncappedServingSlots (a
// duration-bound spec: that many).
inline constexpr int kUncappedServingSlots = 256;
int ServingSlots(const ServeSpec& spec, const LoadPoint& point);
// The most rows one ragged step feeds with `slots` sequences in flight (the serving scheduler,
// harness/serving.cc): a decode row a sequence plus the prompt tokens the step takes: every
// waiting prompt whole (chunk 0 and no prefill_tokens), one chunk (chunk > 0), or up to
// prefill_tokens (one chunk or prompt at least).
int64_t LargestRaggedStepRows(const ServeSpec& spec, int slots);

// The spec's part of a serving result's identity: what changes its figures, less the load
// points (each figure carries its own): "serve:isl=64,osl=16,requests=8,warmup=0,chunk=0,seed=1"
// (",prefill_tokens=N" after the chunk when set)
// with ";slo:ttft_ms=2000,tpot_ms=50,percentile=99" when an SLO gives the goodput.
std::string ServeWorkloadKey(const ServeSpec& spec, const Slo& slo);
// A ServeWorkloadKey text back into its canonical form (for validating --workload arguments).
absl::StatusOr<std::string> CanonicalServeWorkloadKey(std::string_view text);
inline constexpr char kServeWorkloadKeyPrefix[] = "serve:";

// As JSON objects: {"concurrency": [...], "rate": [...], "max_concurrency", "isl_min",
// "isl_max", "osl_min", "osl_max", "requests", "duration_s", "warmup", "chunk",
// "prefill_tokens" (optional), "seed"} and
// {"ttft_ms", "tpot_ms", "percentile"} (bounds null when absent). Parsers check types and
// validate; errors name the field under `where`.
nlohmann::json ToJson(const ServeSpec& spec);
nlohmann::json ToJson(const Slo& slo);
absl::StatusOr<ServeSpec> ServeSpecFromJson(const nlohmann::json& j, std::string_view where);
absl::StatusOr<Slo> SloFromJson(const nlohmann::json& j, std::string_view where);

}  // namespace infersweep
