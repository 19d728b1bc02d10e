// Serving load: an in-process load generator that drives a model through ragged steps
// (continuous batching) at a fixed concurrency (closed loop) or a Poisson request rate (open
// loop), measures each load point the way `vllm bench serve` does, and checks that every served
// request's greedy tokens equal the same request run alone.
//
// Requests, their lengths and the arrival schedule are a pure function of the spec's seed;
// timings are the wall clock.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "api/backend_config.h"
#include "api/serve_spec.h"
#include "api/trial.h"
#include "engine/fault_injection.h"
#include "engine/model.h"
#include "engine/options.h"
#include "engine/weights.h"
#include "harness/gpu_sampler.h"
#include "harness/memory_verdict.h"

namespace infersweep {

// One request: its prompt and wanted output length, from (seed, index) alone.
struct ServeRequest {
  int index = 0;
  std::vector<int32_t> prompt;
  int output_len = 0;
};
ServeRequest MakeServeRequest(const ServeSpec& spec, int vocab, int index);

// A served request: what it produced and when (seconds since its phase started).
struct ServedRequest {
  ServeRequest request;
  bool warmup = false;
  std::vector<int32_t> tokens;        // greedy output tokens
  double start_s = 0;                 // arrival (open loop) or issue (closed loop)
  std::vector<double> token_times_s;  // when each output token came back
  double end_s() const { return token_times_s.empty() ? start_s : token_times_s.back(); }
};

struct Distribution {
  double mean = 0, median = 0, p90 = 0, p99 = 0;
};

// A load point's figures, named as `vllm bench serve` names them. TTFT: start to the first
// token; TPOT: (e2el - ttft) / (output - 1) per request; ITL: every gap between tokens, pooled;
// E2EL: start to the last token.
struct ServeMetrics {
  int completed = 0;
  int64_t total_input_tokens = 0, total_output_tokens = 0;
  double duration_s = 0;              // the timed phase: its start to its last token
  double request_throughput = 0;      // requests/s
  double output_throughput = 0;       // output tok/s
  double total_token_throughput = 0;  // (input + output) tok/s
  double output_tok_s_per_user = 0;   // mean over requests of 1000 / tpot_ms
  Distribution ttft_ms, tpot_ms, itl_ms, e2el_ms;
  std::vector<double> ttft_values_ms, tpot_values_ms;  // per request, for SLO percentiles
  std::optional<double> request_goodput;  // requests/s meeting every SLO bound; with an SLO
  std::optional<double> energy_j_per_output_token;  // with a GPU energy counter only
};

// The timed requests' figures (warm-up ones are skipped).
ServeMetrics ComputeServeMetrics(const std::vector<ServedRequest>& served, double duration_s,
                                 const Slo& slo);
// Whether the load point's percentiles meet the SLO (every bound given).
bool MeetsSlo(const ServeMetrics& metrics, const Slo& slo);

struct LoadPointResult {
  LoadPoint point;
  std::vector<ServedRequest> served;  // warm-up first, then timed, in issue order
  ServeMetrics metrics;
  int steps = 0;         // ragged steps taken (warm-up included)
  int peak_running = 0;  // most sequences in one step
  // Correctness: every served request against the same request alone.
  TrialStatus verdict = TrialStatus::kOk;
  int requests_checked = 0, requests_matching = 0;
  std::string mismatch;  // the first mismatch, described
  // CheckServedAgainstReference: the sample's KL to the reference (mean, nats) and top-1 agreement.
  std::optional<double> reference_kl_mean, reference_top1;
  // Set when the ceilings were widened to the model's own drift: the yardstick's KL to the
  // reference on the same sampled requests (mean, nats), and which yardstick ("bf16", "e4m3").
  std::optional<double> yardstick_kl_mean;
  std::string yardstick;
  // The memory plan's part (harness/memory_verdict.h): an UNSUPPORTED point's reason (its slots
  // do not fit; nothing was served), or the KV slots an open-loop point was capped at.
  std::string unsupported_reason;
  std::optional<int> slots_capped_at;
};

// Serves one load point on `model` (StartServing, then admissions, ragged steps, retirements).
// Unimplemented when the model runs no ragged steps. `slot_cap` > 0: at most that many KV slots
// (the memory plan's cap): an open-loop point reserves no more, a closed loop above it is
// refused (FailedPrecondition).
absl::StatusOr<LoadPointResult> RunLoadPoint(Model& model, const ServeSpec& spec,
                                             const LoadPoint& point, const Slo& slo,
                                             GpuEnergyMeter* energy = nullptr, int slot_cap = 0);

// The request run alone: a lockstep batch of 1, its prompt fed as the server feeds a lone
// request (pieces of `chunk` tokens; the whole prompt when 0), then greedy decode.
absl::StatusOr<std::vector<int32_t>> RunAlone(Model& model, const ServeRequest& request, int chunk);

// Sets the result's verdict: INCORRECT unless every served request's tokens equal those of the
// request run alone on `alone` (a model of the same config, without faults). `cache` keeps the
// lone runs by request index across load points of one spec.
absl::Status CheckServedTokens(Model& alone, int chunk, LoadPointResult* result,
                               std::map<int, std::vector<int32_t>>* cache);

// Sets the result's verdict for a config whose served tokens may legitimately differ from its lone
// runs (bf16, fp8 and fp4 arithmetic: a near-tie flips with the batch). The first `sample` timed
// requests are served again on `model`, teacher-forced with their served tokens through ragged
// steps of their own (admitted one a step, so each prompt's prefill shares a step with the
// others' decode rows), and the logits of every output position are held against `reference`'s
// (the fp32 reference of the same weights) on the same tokens: KL mean and max within the
// precision class's ceilings (harness/verdict.h) over the sample, each request's mean within the
// class's pass ceiling (a request's few positions are as noisy as a pass's), and finite. A
// scheduling bug (a wrong KV slot, a stale position) feeds a request another sequence's past and
// moves its distributions. Top-1 agreement is reported, not judged: on near-flat synthetic logits
// at long contexts a correct bf16 config's served tokens are the reference's pick at as few as 0.69
// of the positions (qwen3-30b-a3b, ISL 1024, OSL 256, H200). requests_checked counts the sampled
// requests, requests_matching those within the ceilings. The sample stops before a request that
// would take the reference past kServedReferenceTokens (it keeps one at least): the reference is
// the plain fp32 engine, ~20 s a 1,280-token request of qwen3-30b-a3b on an H200, so the budget
// bounds a load point's judging. `cache` (optional) keeps the reference's logits by fed sequence
// across load points.
// A sample that misses the class's ceilings while finite is judged again, as a run's verdict is
// (harness/verdict.h, WidenedToYardstick), when `yardstick` gives a model: the config's yardstick
// (bf16 or E4M3, engine/backends.h's YardstickFor) runs the same requests, and where its own KL to
// the reference misses the class's ceilings they widen to its drift (yardstick_kl_mean says so).
constexpr int kServedReferenceSample = 4;         // requests a load point's reference check takes
constexpr int64_t kServedReferenceTokens = 2048;  // prompt and output tokens it feeds, at most
using ReferenceLogits = std::map<std::vector<int32_t>, std::vector<float>>;
struct ServedYardstick {
  Yardstick kind = Yardstick::kBf16;              // which (its name in the mismatch and report)
  std::function<absl::StatusOr<Model*>()> model;  // made on first need; empty: none
  ReferenceLogits logits;                         // its logits, by fed sequence
};
absl::Status CheckServedAgainstReference(Model& model, Model& reference, PrecisionClass precision,
                                         int sample, LoadPointResult* result,
                                         ReferenceLogits* cache = nullptr,
                                         ServedYardstick* yardstick = nullptr);

// The highest load that meets the SLO at its percentile, by bisection between the lowest and the
// highest load point of the spec: over integer concurrency (closed loop, when the spec has
// concurrency points) or over the request rate (open loop; geometric midpoints, `rate_probes`
// of them). Every probe is served; the answer alone is judged, like a listed load point, once
// the bisection ends (the other probes steer it and carry requests_checked 0). A load already in
// `served` (the listed points, served with the same SLO) is taken from there, not served again.
struct SloSearch {
  bool found = false;                   // some probed load meets the SLO
  LoadPointResult best;                 // the highest load that met it (when found)
  std::vector<LoadPointResult> probes;  // in the order they ran
};
// `judge` sets the answer's verdict (CheckServedTokens or CheckServedAgainstReference).
using ServedJudge = std::function<absl::Status(LoadPointResult*)>;
// `slot_cap` > 0 (the memory plan's): closed-loop probes stay at or below it, open-loop ones
// reserve no more slots.
absl::StatusOr<SloSearch> SearchSloLoad(Model& model, const ServeSpec& spec, const Slo& slo,
                                        const ServedJudge& judge,
                                        std::span<const LoadPointResult> served = {},
                                        int rate_probes = 5, int slot_cap = 0);

// A serving trial on host weights: the config under test (with `fault`, TEST ONLY) serves each
// load point of the spec, judged by CheckServedTokens against a fault-free model of the same config
// (fp32 configs) or by CheckServedAgainstReference against the reference config (the others);
// with an SLO, then the search for the highest load that meets it.
// UNSUPPORTED (with the reason) where the config cannot serve: a device whose engine runs no
// ragged steps, or a model it cannot serve.
struct ServeTrialResult {
  TrialStatus status = TrialStatus::kOk;  // kOk once the load points ran; see each verdict
  std::string reason;
  std::vector<LoadPointResult> points;
  std::optional<SloSearch> slo_search;  // with an SLO
  // GPU configs: the device's memory in use after the last load point (nothing is freed while
  // serving, so it is the peak reading).
  std::optional<int64_t> device_memory_used_bytes;
};
// `energy` (GPU configs, optional): the listed load points' energy per output token. `memory`
// (CUDA configs, optional): the memory plan's decision; its refused points are UNSUPPORTED with
// its words and not served, and the others run under its slot cap.
ServeTrialResult RunServeTrial(HostModel& host, const BackendConfig& config, const ServeSpec& spec,
                               const Slo& slo, const FaultInjection& fault = {},
                               GpuEnergyMeter* energy = nullptr,
                               const ServingMemoryDecision* memory = nullptr);

// A load point as a result carries it (api/trial.h); with an SLO, whether its percentiles meet it.
ServingPoint ToServingPoint(const LoadPointResult& result, const Slo& slo);

// A serving trial as JSON: its status and reason, and per load point (and SLO probe) the point,
// the verdict, the counts and the figures under their `vllm bench serve` names
// (docs/METRICS.md, "Serving load").
nlohmann::json ToJson(const ServeTrialResult& trial);

// One line per load point: the point, the verdict, the request counts and the figures.
std::string FormatLoadPointLine(const LoadPointResult& result, const Slo& slo);
// The search's answer, as a '#' line: the highest load meeting the SLO and its goodput.
std::string FormatSloSearchLine(const SloSearch& search, const Slo& slo);
// The same two from a result's load points (api/trial.h), as `run --serve` prints a trial that
// ran in a worker.
std::string FormatServingPointLine(const ServingPoint& point, const Slo& slo);
std::string FormatServingSloLine(const ServingSloSearch& search, const Slo& slo);

}  // namespace infersweep
