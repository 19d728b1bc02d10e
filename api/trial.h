// The unit of work of the whole system: one model x one backend config x one workload, ending in
// a verdict and figures. These types cross process and network boundaries as JSON
// (docs/RESULTS.md documents the schema).
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "api/backend_config.h"
#include "api/serve_spec.h"
#include "core/identity.h"
#include "core/launch_log.h"

namespace infersweep {

enum class TrialStatus { kOk, kIncorrect, kCrashed, kUnsupported, kTimeout, kError };
std::string_view TrialStatusName(TrialStatus s);  // "OK", "INCORRECT", ...
std::optional<TrialStatus> TrialStatusFromName(std::string_view name);

// A lockstep workload (B sequences start, advance and stop together, timed per batch size), or,
// with `serve`, a serving one: requests arrive, join the running batch and leave when done, at
// each load point of the spec (api/serve_spec.h); then the lockstep fields other than the
// timeout are not used.
struct Workload {
  int prompt_len = 128;
  int output_len = 32;
  std::vector<int> batch_sizes = {1};
  int repeats = 3;
  int warmup = 1;
  double timeout_s = 600;  // per trial, wall clock, enforced by the parent
  std::optional<ServeSpec> serve;
  Slo slo;  // serving only: the goodput's bounds and the SLO search's (empty: neither)
};

// The largest batch size a workload, and a query at one batch size, takes.
inline constexpr int kMaxBatchSize = 1024;

// Bounds: prompt 1..65536, output 2..65536, batch 1..1024 each (at most 16 sizes),
// repeats 1..100, warmup 0..100, timeout 1..86400 s; a serving workload's spec and SLO as
// ValidateServeSpec and ValidateSlo check them. Errors name the field.
absl::Status ValidateWorkload(const Workload& w);
// "prompt=128,output=32,batch=1:8:64,repeats=3,warmup=1,timeout=600": every key optional and
// given once, a key left out keeps Workload{}'s default, batch sizes increase.
absl::StatusOr<Workload> ParseWorkload(std::string_view text);
// The lockstep fields as ParseWorkload reads them back, every key written:
// "prompt=128,output=32,batch=1,repeats=3,warmup=1,timeout=600".
std::string WorkloadString(const Workload& w);

// The workload's part of a result's identity: what changes its figures (the prompt and output
// lengths, and whether a warm-up ran), not the procedure (repeats, timeout) or the batch list
// (each figure is keyed by its own batch): "prompt=128,output=32,warmup=1". A serving
// workload's is ServeWorkloadKey ("serve:isl=64,..."), without its load points (each figure
// is keyed by its own), so no serving key equals a lockstep one.
std::string WorkloadKey(const Workload& w);
// The same text back into its fields, for validating --workload arguments; also takes a
// ParseWorkload string and keeps only the key's fields, and serving keys.
absl::StatusOr<std::string> CanonicalWorkloadKey(std::string_view text);

struct TrialRequest {
  std::string trial_id;
  int attempt = 1;
  std::string model;  // checkpoint folder or preset:NAME
  int layers = 0;     // preset layer override
  uint64_t seed = 1;  // preset weight seed
  BackendConfig config;
  Workload workload;
  std::string inject_fault;  // TEST ONLY: see engine/fault_injection.h; empty in production
};

struct Spread {
  double median = 0, min = 0, max = 0;
};
struct Percentiles {
  double p50 = 0, p90 = 0, p99 = 0;
};

// What the engine ran in one untimed step of a phase, from its launch log (core/launch_log.h):
// the kernels (GPU) or op implementations (CPU) launched in that one step with their counts, in
// the order each was first launched; whether the step was a replayed CUDA graph (then the
// kernels are the ones its capture launched); and every fallback taken, where something other
// than what the config's axis value names ran (docs/RESULTS.md).
struct PhaseKernels {
  bool graph = false;
  std::vector<KernelCount> kernels;
  std::vector<std::string> fallbacks;
};

// Why a requested batch size has no figures (docs/VERDICTS.md "Memory"): the memory plan says
// it does not fit in the device's free memory, so it never ran; or an allocation failed while it
// ran. The trial's other batch sizes keep their figures either way.
enum class BatchMemoryVerdict { kDoesNotFit, kOutOfMemory };
std::string_view BatchMemoryVerdictName(BatchMemoryVerdict v);  // "DOES_NOT_FIT", "OUT_OF_MEMORY"
std::optional<BatchMemoryVerdict> BatchMemoryVerdictFromName(std::string_view name);

// The device memory the plan (engine/plan/memory_plan.h) gives a batch size, in all and by pool
// ("weights", "copies", "KV", ...; docs/MEMORY.md).
struct PlannedMemory {
  int64_t total_bytes = 0;
  std::map<std::string, int64_t> pool_bytes;
};

// Figures for one batch size; each Spread is over repeats (median, min, max).
struct BatchFigures {
  int batch = 1;
  // Set: the batch has no figures, and memory_reason says why ("needs 80.12 GiB on the device
  // (...), 12.00 GiB free" or the allocation that failed). Every figure below is then zero.
  std::optional<BatchMemoryVerdict> memory_verdict;
  std::string memory_reason;
  // CUDA configs: what the memory plan gave this batch size (absent where no plan was made); the
  // device memory in use (total - free, every process's) once the batch ran; and what this
  // trial held then: in use less what was in use before the trial (the CUDA context, other
  // tenants), planned against measured.
  std::optional<PlannedMemory> planned_memory;
  std::optional<int64_t> device_memory_used_bytes;
  std::optional<int64_t> measured_memory_bytes;
  Spread ttft_ms;               // request start -> first token
  Spread tpot_ms;               // (latency - ttft) / (output_len - 1)
  Spread latency_ms;            // request start -> last token
  Spread prefill_tok_s;         // batch * prompt_len / prefill time
  Spread output_tok_s;          // total: batch * output_len / duration
  Spread output_tok_s_per_seq;  // output_len / latency
  Percentiles itl_ms;           // every inter-token gap, pooled over repeats
  // Decode roofline: bytes read per decode step (docs/METRICS.md), achieved rate, and the
  // fraction of the memory roofline when the device's bandwidth is known.
  double decode_bytes_per_step = 0;
  double achieved_gb_s = 0;
  std::optional<double> roofline_tok_s;
  std::optional<double> roofline_fraction;
  // Prefill (compute) roofline: the FLOPs of the prefill (docs/METRICS.md) and, when the device's
  // bf16 tensor rate is known, the prefill rate at that rate and the fraction of it reached.
  double prefill_flops = 0;
  std::optional<double> prefill_roofline_tok_s;
  std::optional<double> prefill_roofline_fraction;
  // Energy from the GPU's NVML energy counter over each repeat (prefill + decode), median of
  // repeats; absent on the CPU or without NVML. J/token = energy / (batch * output_len).
  std::optional<double> avg_power_w;
  std::optional<double> joules_per_output_token;
  // What timed the steps: "cuda_events" (device time of each step, events on the model's
  // stream; host sampling between steps excluded) or "wall_clock" (around each Forward).
  std::string timer = "wall_clock";
  // With cuda_events: the same two figures by the host's wall clock, for comparison.
  std::optional<Spread> wall_ttft_ms;
  std::optional<Spread> wall_tpot_ms;
  // One prefill step and one steady-state decode step, recorded outside the timed repeats
  // (MeasureBatch); absent in results written before the launch log existed.
  std::optional<PhaseKernels> prefill_kernels;
  std::optional<PhaseKernels> decode_kernels;

  // Whether the batch ran and has figures (no memory verdict).
  bool measured() const { return !memory_verdict.has_value(); }
};

struct VerdictMetrics {
  std::string precision_class;  // fp32, bf16, fp8, fp4: picks the thresholds
  double max_rel_error = 0;     // max|test - ref| / max|ref| over every teacher-forced logit
  double top1_agreement = 0;    // fraction of positions with the same argmax
  double kl_mean = 0;           // mean KL(ref || test) per position, nats
  double kl_max = 0;
  int64_t non_finite = 0;   // NaN or Inf logits in the test config
  bool degenerate = false;  // free-running generation of the test config is degenerate
  bool reference_degenerate = false;
  double free_run_agreement = 0;  // fraction of greedy tokens equal to the reference's
  // Measured only when the test's free runs loop where the reference's do not: the fraction of
  // the looping runs' tokens that the reference picks too, fed the same runs (a loop the
  // reference walks too is the model's, not the config's: docs/VERDICTS.md).
  std::optional<double> loop_reference_agreement;
  // Set when the thresholds were widened to the model's own drift under its inputs' rounding:
  // the yardstick's kl_mean against the reference (harness/verdict.h, WidenedToYardstick), and
  // which yardstick ("bf16", "e4m3": CreateYardstick).
  std::optional<double> yardstick_kl_mean;
  std::string yardstick;
  std::string worst_pass;             // the forward pass with the largest kl_mean of its own
  double worst_pass_kl_mean = 0;      // that pass's kl_mean, nats
  std::vector<std::string> failures;  // which thresholds failed, human-readable
};

// One served load point's figures, named as `vllm bench serve` names them (docs/RESULTS.md
// "serving"): TTFT, TPOT, ITL and end-to-end latency distributions, throughputs, goodput under
// the workload's SLO, and its verdict (every served request's tokens against its lone run).
struct ServingDistribution {
  double mean = 0, median = 0, p90 = 0, p99 = 0;
};
struct ServingPoint {
  LoadPoint point;
  // UNSUPPORTED: the memory plan refused the point's KV slots (reason: its breakdown) and
  // nothing was served; every figure is zero.
  TrialStatus verdict = TrialStatus::kOk;
  std::string reason;
  // An open-loop point served with fewer KV slots than it asked for: the memory plan's cap on
  // the requests in flight (docs/VERDICTS.md "Memory").
  std::optional<int> slots_capped_at;
  int requests_checked = 0, requests_matching = 0;
  std::string first_mismatch;  // the first served request that parted from its lone run
  int steps = 0, peak_running = 0;
  int completed = 0;
  int64_t total_input_tokens = 0, total_output_tokens = 0;
  double duration_s = 0;
  double request_throughput = 0;      // requests/s
  double output_throughput = 0;       // output tok/s
  double total_token_throughput = 0;  // (input + output) tok/s
  double output_tok_s_per_user = 0;   // mean over requests of 1000 / tpot_ms
  ServingDistribution ttft_ms, tpot_ms, itl_ms, e2el_ms;
  std::optional<double> request_goodput;  // with an SLO
  std::optional<bool> meets_slo;          // with an SLO: its percentiles meet the bounds
  // With an SLO: the SLO's percentile (99 unless it says) of TTFT and of TPOT, which
  // meets_slo holds against the bounds.
  std::optional<double> ttft_ms_at_slo_percentile, tpot_ms_at_slo_percentile;
  std::optional<double> energy_j_per_output_token;
  // Configs below fp32, judged on a sample of served requests teacher-forced against the
  // reference: the sample's KL to it (mean, nats) and top-1 agreement.
  std::optional<double> reference_kl_mean, reference_top1;
  // Set when the ceilings were widened to the model's own drift: the yardstick's KL to the
  // reference on the same requests (mean, nats), and which yardstick ("bf16", "e4m3").
  std::optional<double> yardstick_kl_mean;
  std::string yardstick;
};
// The SLO search's answer: the highest load whose percentiles meet the SLO, with every probe.
struct ServingSloSearch {
  bool found = false;
  std::optional<ServingPoint> best;  // when found
  std::vector<ServingPoint> probes;  // in the order they ran
};

struct TrialResult {
  std::string trial_id;
  int attempt = 1;
  TrialStatus status = TrialStatus::kError;
  std::string reason;       // unsupported/crash/timeout/error detail
  std::string stderr_tail;  // last lines of the worker's stderr on CRASHED/TIMEOUT/ERROR
  std::string model;
  BackendConfig config;
  std::string device;  // "cpu" or the GPU's name
  int sm = 0;
  std::string engine_version;  // the build: "infersweep <git describe>"
  // Identity (docs/RESULTS.md "Identity"): with model, config, device and sm, what the figures
  // depend on. Results made without loading the model carry what the request says.
  ModelIdentity model_identity;
  std::string workload;  // WorkloadKey of the trial's workload
  SoftwareStack software;
  double load_seconds = 0;
  double graph_capture_seconds = 0;
  // GPU configs: device memory in use at its highest reading (total - free, after each repeat);
  // CPU configs: the worker's peak RSS.
  int64_t peak_memory_bytes = 0;
  // CUDA configs with a memory plan: what the trial held on the device once the model under test
  // was built, before any batch ran (weights, copies, library handles; BatchFigures'
  // measured_memory_bytes says how it is measured).
  std::optional<int64_t> model_memory_bytes;
  VerdictMetrics verdict;
  std::vector<BatchFigures> batches;
  // Serving workloads: one entry per load point of the spec, in its order (also when a point
  // is INCORRECT), and the SLO search's answer when the workload has an SLO.
  std::vector<ServingPoint> serving;
  std::optional<ServingSloSearch> slo_search;
  int64_t started_unix_ms = 0;
  int64_t finished_unix_ms = 0;
};

nlohmann::json ToJson(const Workload& w);
nlohmann::json ToJson(const TrialRequest& r);
nlohmann::json ToJson(const TrialResult& r);
// A batch's "kernels" object as ToJson writes it: {"prefill": PHASE, "decode": PHASE}.
nlohmann::json KernelsJson(const BatchFigures& b);
// A load point under its `vllm bench serve` names ("load_point", "mode", "max_concurrency",
// "request_rate", "median_ttft_ms", "p99_tpot_ms", "output_throughput", ...).
nlohmann::json ToJson(const ServingPoint& p);
absl::StatusOr<ServingPoint> ServingPointFromJson(const nlohmann::json& j, std::string_view where);
// Parsers validate types and ranges; errors name the field.
absl::StatusOr<Workload> WorkloadFromJson(const nlohmann::json& j);
absl::StatusOr<TrialRequest> TrialRequestFromJson(const nlohmann::json& j);
absl::StatusOr<TrialResult> TrialResultFromJson(const nlohmann::json& j);
// The same from JSON text that comes from another process (an agent's Result, an Assignment, a
// stored row): ParseUntrustedJson (api/untrusted_json.h), then the parser above. Errors start
// with `what`: "result_json: not valid JSON: ...", "result_json: result.status: unknown 'X'".
absl::StatusOr<TrialRequest> TrialRequestFromJsonText(std::string_view text, std::string_view what);
absl::StatusOr<TrialResult> TrialResultFromJsonText(std::string_view text, std::string_view what);

}  // namespace infersweep
