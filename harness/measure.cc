#include "harness/measure.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_format.h"
#include "api/status_macros.h"
#include "core/launch_log.h"
#include "engine/roofline.h"
#include "engine/synthetic.h"

namespace infersweep {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

Spread SpreadOf(const std::vector<double>& v) {
  return {Percentile(v, 50), *std::min_element(v.begin(), v.end()),
          *std::max_element(v.begin(), v.end())};
}

// One repeat. Step times come from the model's device timer when it has one (CUDA events),
// else from the wall clock; the wall-clock figures are kept for comparison either way.
struct RepeatTiming {
  bool device_timed = false;
  double ttft_ms = 0;
  double latency_ms = 0;  // sum of the step times
  std::vector<double> itl_ms;
  double wall_ttft_ms = 0;
  double wall_latency_ms = 0;
  std::optional<double> energy_j;  // GPU energy counter over the repeat
};

// The launch logs of an untimed repeat (core/launch_log.h): its prefill and its last decode step.
struct StepLogs {
  LaunchRecorder prefill, decode;
};

PhaseKernels PhaseOf(const LaunchRecorder& log) {
  return {log.graph_replayed(), log.kernels(), log.fallbacks()};
}

// `logs`, when given, records the repeat's prefill and its last decode step; `decode_steps`, when
// not negative, ends the repeat after that many decode steps (the batch keeps its capacity for
// the whole output, so nothing is reallocated or recaptured).
absl::StatusOr<RepeatTiming> RunOnce(Model& model, const Workload& w, int batch, int repeat,
                                     GpuEnergyMeter* energy, StepLogs* logs = nullptr,
                                     int decode_steps = -1) {
  const int vocab = model.config().vocab_size;
  std::vector<int32_t> prompt(static_cast<size_t>(batch) * w.prompt_len);
  for (size_t i = 0; i < prompt.size(); ++i)
    prompt[i] = static_cast<int32_t>(Mix64(0xbe7c4 + i + 7919ull * repeat) % vocab);
  RETURN_IF_ERROR(model.StartBatch(batch, w.prompt_len + w.output_len));
  RepeatTiming t;
  // Greedy decoding, the token picked where the logits are (Model::ForwardGreedy): what a step
  // costs a serving engine, which hands back token ids, not logits.
  std::vector<int32_t> next(batch);
  // NaN: no reading. (A std::optional<double> here drew GCC 12's maybe-uninitialized false
  // positive at -O2.)
  const double energy_start = energy ? energy->ReadJoules().value_or(NAN) : NAN;
  const int last_step =
      decode_steps < 0 ? w.output_len - 1 : std::min(decode_steps, w.output_len - 1);
  const auto start = Clock::now();
  {
    std::optional<ScopedLaunchRecording> record;
    if (logs) record.emplace(&logs->prefill);
    RETURN_IF_ERROR(model.ForwardGreedy(prompt, w.prompt_len, &next));
  }
  auto last = Clock::now();
  const std::optional<double> prefill_device_ms = model.last_forward_device_ms();
  t.device_timed = prefill_device_ms.has_value();
  t.wall_ttft_ms = Ms(start, last);
  t.ttft_ms = t.device_timed ? *prefill_device_ms : t.wall_ttft_ms;
  t.latency_ms = t.ttft_ms;
  for (int step = 1; step <= last_step; ++step) {
    {
      std::optional<ScopedLaunchRecording> record;
      if (logs && step == last_step) record.emplace(&logs->decode);
      RETURN_IF_ERROR(model.ForwardGreedy(next, 1, &next));
    }
    const auto now = Clock::now();
    const double step_ms =
        t.device_timed ? model.last_forward_device_ms().value_or(0) : Ms(last, now);
    t.itl_ms.push_back(step_ms);
    t.latency_ms += step_ms;
    last = now;
  }
  t.wall_latency_ms = Ms(start, last);
  // NVML's energy counter moves in steps (tens of ms apart): a repeat shorter than a step can read
  // no change, which is no reading, not 0 W (short repeats: a few layers at batch 1).
  if (!std::isnan(energy_start)) {
    if (const std::optional<double> end = energy->ReadJoules(); end && *end > energy_start)
      t.energy_j = *end - energy_start;
  }
  return t;
}

}  // namespace

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = std::ceil(p / 100.0 * values.size());
  const size_t index =
      static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(values.size())));
  return values[index - 1];
}

absl::StatusOr<BatchFigures> MeasureBatch(Model& model, const Workload& w, int batch,
                                          const MeasureOptions& options) {
  // What ran is recorded in the last warm-up repeat (its prefill and its last decode step), never
  // in a timed one: recording costs host time.
  StepLogs logs;
  for (int i = 0; i < w.warmup; ++i)
    if (auto t =
            RunOnce(model, w, batch, -1 - i, options.energy, i == w.warmup - 1 ? &logs : nullptr);
        !t.ok())
      return t.status();
  std::vector<double> ttft, tpot, latency, prefill, output, per_seq, itl;
  std::vector<double> wall_ttft, wall_tpot, power, joules_per_token;
  bool device_timed = false;
  for (int r = 0; r < w.repeats; ++r) {
    ASSIGN_OR_RETURN(auto t, RunOnce(model, w, batch, r, options.energy));
    device_timed = t.device_timed;
    wall_ttft.push_back(t.wall_ttft_ms);
    wall_tpot.push_back((t.wall_latency_ms - t.wall_ttft_ms) / (w.output_len - 1));
    if (t.energy_j) {
      power.push_back(*t.energy_j / (t.wall_latency_ms * 1e-3));
      joules_per_token.push_back(*t.energy_j / (static_cast<double>(batch) * w.output_len));
    }
    ttft.push_back(t.ttft_ms);
    latency.push_back(t.latency_ms);
    tpot.push_back((t.latency_ms - t.ttft_ms) / (w.output_len - 1));
    prefill.push_back(1e3 * batch * w.prompt_len / t.ttft_ms);
    output.push_back(1e3 * batch * w.output_len / t.latency_ms);
    per_seq.push_back(1e3 * w.output_len / t.latency_ms);
    itl.insert(itl.end(), t.itl_ms.begin(), t.itl_ms.end());
    if (options.progress)
      options.progress(absl::StrFormat("batch %d repeat %d/%d: ttft %.2f ms, tpot %.3f ms", batch,
                                       r + 1, w.repeats, t.ttft_ms, tpot.back()));
  }
  if (w.warmup == 0) {
    // No warm-up to record in: one more untimed prefill and decode step after the timed repeats,
    // on the model they warmed (the decode step's graph already captured). Recording in the
    // first timed repeat instead would add its host time to that repeat's figures.
    if (auto t = RunOnce(model, w, batch, w.repeats, nullptr, &logs, /*decode_steps=*/1); !t.ok())
      return t.status();
  }
  BatchFigures f;
  f.batch = batch;
  f.prefill_kernels = PhaseOf(logs.prefill);
  f.decode_kernels = PhaseOf(logs.decode);
  f.ttft_ms = SpreadOf(ttft);
  f.tpot_ms = SpreadOf(tpot);
  f.latency_ms = SpreadOf(latency);
  f.prefill_tok_s = SpreadOf(prefill);
  f.output_tok_s = SpreadOf(output);
  f.output_tok_s_per_seq = SpreadOf(per_seq);
  f.itl_ms = {Percentile(itl, 50), Percentile(itl, 90), Percentile(itl, 99)};
  if (device_timed) {
    f.timer = "cuda_events";
    f.wall_ttft_ms = SpreadOf(wall_ttft);
    f.wall_tpot_ms = SpreadOf(wall_tpot);
  }
  if (power.size() == static_cast<size_t>(w.repeats) && !power.empty()) {
    f.avg_power_w = SpreadOf(power).median;
    f.joules_per_output_token = SpreadOf(joules_per_token).median;
  }
  // Roofline at the mean decode context (prompt + half the output).
  const int64_t context = w.prompt_len + w.output_len / 2;
  const DecodeTraffic traffic =
      DecodeBytesPerStep(model.config(), batch, context, options.bytes_per_weight,
                         options.bytes_per_kv_element, options.quantized_bytes_per_weight);
  f.decode_bytes_per_step = traffic.total();
  f.achieved_gb_s = traffic.total() / (f.tpot_ms.median * 1e-3) / 1e9;
  if (options.bandwidth_gb_s) {
    f.roofline_tok_s = batch * *options.bandwidth_gb_s * 1e9 / traffic.total();
    f.roofline_fraction = f.achieved_gb_s / *options.bandwidth_gb_s;
  }
  f.prefill_flops = PrefillFlops(model.config(), batch, w.prompt_len);
  if (options.bf16_tflops) {
    f.prefill_roofline_tok_s =
        static_cast<double>(batch) * w.prompt_len * *options.bf16_tflops * 1e12 / f.prefill_flops;
    f.prefill_roofline_fraction = f.prefill_tok_s.median / *f.prefill_roofline_tok_s;
  }
  return f;
}

}  // namespace infersweep
