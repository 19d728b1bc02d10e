#include "harness/report.h"

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/plan/memory_plan.h"

namespace infersweep {
namespace {

int64_t TotalLaunches(const PhaseKernels& p) {
  int64_t total = 0;
  for (const KernelCount& k : p.kernels) total += k.count;
  return total;
}

void AppendPhase(const char* phase, const std::optional<PhaseKernels>& p, int batch,
                 std::string* out) {
  if (!p) {
    absl::StrAppendFormat(out, "#   %s at batch %d: not recorded\n", phase, batch);
    return;
  }
  absl::StrAppendFormat(out, "#   %s at batch %d: one step, %s%d launches\n", phase, batch,
                        p->graph ? "a CUDA graph replay, " : "", TotalLaunches(*p));
  for (const KernelCount& k : p->kernels)
    absl::StrAppendFormat(out, "#     %6d  %s\n", k.count, k.name);
  for (const std::string& f : p->fallbacks) absl::StrAppend(out, "#     fallback: ", f, "\n");
}

// The differences of one phase (KernelDifferences).
void PhaseDifferences(const char* phase, const std::optional<PhaseKernels>& a,
                      const std::optional<PhaseKernels>& b, const std::string& a_name,
                      const std::string& b_name, std::vector<std::string>* out) {
  if (!a || !b) {
    if (a || b) out->push_back(absl::StrCat(phase, ": recorded in ", a ? a_name : b_name, " only"));
    return;
  }
  if (a->graph != b->graph)
    out->push_back(
        absl::StrCat(phase, ": a CUDA graph replay in ", a->graph ? a_name : b_name, " only"));
  std::map<std::string, int64_t> in_a, in_b;
  for (const KernelCount& k : a->kernels) in_a[k.name] += k.count;
  for (const KernelCount& k : b->kernels) in_b[k.name] += k.count;
  auto only = [&](const std::vector<KernelCount>& side, const std::map<std::string, int64_t>& other,
                  const std::string& name) {
    std::vector<std::string> names;
    for (const KernelCount& k : side)
      if (!other.count(k.name)) names.push_back(absl::StrCat(k.name, " x", k.count));
    if (!names.empty())
      out->push_back(absl::StrCat(phase, ": only in ", name, ": ", absl::StrJoin(names, ", ")));
  };
  only(a->kernels, in_b, a_name);
  only(b->kernels, in_a, b_name);
  for (const KernelCount& k : a->kernels)
    if (auto it = in_b.find(k.name); it != in_b.end() && it->second != in_a[k.name])
      out->push_back(absl::StrCat(phase, ": ", k.name, " x", in_a[k.name], " in ", a_name, ", x",
                                  it->second, " in ", b_name));
  for (const auto& [side, other, name] : {std::tuple{&a->fallbacks, &b->fallbacks, &a_name},
                                          std::tuple{&b->fallbacks, &a->fallbacks, &b_name}})
    for (const std::string& f : *side)
      if (std::find(other->begin(), other->end(), f) == other->end())
        out->push_back(absl::StrCat(phase, ": fallback in ", *name, " only: ", f));
}

}  // namespace

std::string FormatReportHeader(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += "# " + l + "\n";
  return out;
}

std::string FormatColumnHeader() {
  return absl::StrFormat(
      "#%-40s %5s %-11s %10s %9s %10s %11s %9s %8s %6s %6s %9s %9s\n"
      "#%-40s %5s %-11s %10s %9s %10s %11s %9s %8s %6s %6s %9s %9s\n",
      " config", "batch", "status", "ttft", "tpot", "out", "prefill", "itl_p99", "decode", "roof",
      "top1", "kl_mean", "max_rel", "", "", "", "(ms)", "(ms)", "(tok/s)", "(tok/s)", "(ms)",
      "(GB/s)", "(%)", "(%)", "(nats)", "err");
}

namespace {

// Where the verdict's ceilings were widened to the model's own drift (docs/VERDICTS.md).
std::string YardstickLine(const VerdictMetrics& v) {
  if (!v.yardstick_kl_mean) return "";
  const std::string& name = v.yardstick.empty() ? std::string("bf16") : v.yardstick;
  return absl::StrFormat(
      "#   judged by ceilings widened to this model's %s drift: the %s yardstick's kl_mean "
      "%.3g against the reference\n",
      name, name, *v.yardstick_kl_mean);
}

}  // namespace

std::string FormatResultRows(const TrialResult& r) {
  const std::string config = BackendConfigString(r.config);
  const VerdictMetrics& v = r.verdict;
  std::string out;
  if (r.batches.empty()) {
    out = absl::StrFormat(" %-40s %5s %-11s", config, "-", TrialStatusName(r.status));
    if (r.status == TrialStatus::kIncorrect)
      out +=
          absl::StrFormat(" %10s %9s %10s %11s %9s %8s %6s %6.1f %9.3g %9.3g", "-", "-", "-", "-",
                          "-", "-", "-", 100 * v.top1_agreement, v.kl_mean, v.max_rel_error);
    out += "\n";
    if (!r.reason.empty()) out += "#   reason: " + r.reason + "\n";
    out += YardstickLine(v);
    return out;
  }
  // A trial refused as a whole (the memory plan's UNSUPPORTED) still lists its batch sizes.
  if (r.status != TrialStatus::kOk && !r.reason.empty())
    out += absl::StrFormat("#   %s: %s\n", TrialStatusName(r.status), r.reason);
  for (const BatchFigures& b : r.batches) {
    if (!b.measured()) {  // a memory verdict stands in place of the figures
      const std::string verdict =
          *b.memory_verdict == BatchMemoryVerdict::kDoesNotFit ? "does not fit" : "out of memory";
      out += absl::StrFormat(" %-40s %5d %-11s %s\n", config, b.batch, verdict, "-");
      out += absl::StrFormat("#   batch %d %s: %s\n", b.batch, verdict, b.memory_reason);
      continue;
    }
    out += absl::StrFormat(
        " %-40s %5d %-11s %10.2f %9.3f %10.1f %11.1f %9.3f %8.2f %6s %6.1f %9.3g %9.3g\n", config,
        b.batch, TrialStatusName(r.status), b.ttft_ms.median, b.tpot_ms.median,
        b.output_tok_s.median, b.prefill_tok_s.median, b.itl_ms.p99, b.achieved_gb_s,
        b.roofline_fraction ? absl::StrFormat("%.1f", 100 * *b.roofline_fraction) : "-",
        100 * v.top1_agreement, v.kl_mean, v.max_rel_error);
    out += absl::StrFormat(
        "#   spread over repeats: ttft %.2f-%.2f ms, tpot %.3f-%.3f ms, out %.1f-%.1f tok/s\n",
        b.ttft_ms.min, b.ttft_ms.max, b.tpot_ms.min, b.tpot_ms.max, b.output_tok_s.min,
        b.output_tok_s.max);
    std::string timing = "#   timed by " + b.timer;
    if (b.wall_tpot_ms && b.wall_ttft_ms)
      timing += absl::StrFormat(" (wall clock: ttft %.2f ms, tpot %.3f ms)", b.wall_ttft_ms->median,
                                b.wall_tpot_ms->median);
    if (b.avg_power_w && b.joules_per_output_token)
      timing += absl::StrFormat("; power %.0f W, %.3g J/output token", *b.avg_power_w,
                                *b.joules_per_output_token);
    out += timing + "\n";
    if (b.roofline_tok_s)  // quantized models count their linears' stored bytes (METRICS.md)
      out += absl::StrFormat("#   roofline %.1f tok/s: %.3f GB read a step at %.0f GB/s\n",
                             *b.roofline_tok_s, b.decode_bytes_per_step / 1e9,
                             *b.roofline_tok_s * b.decode_bytes_per_step / b.batch / 1e9);
    if (b.planned_memory) {
      std::string measured = "-";
      if (b.measured_memory_bytes) {
        std::vector<std::string> notes;
        if (b.planned_memory->total_bytes > 0)
          notes.push_back(absl::StrFormat("%.0f %% of the plan",
                                          100.0 * static_cast<double>(*b.measured_memory_bytes) /
                                              static_cast<double>(b.planned_memory->total_bytes)));
        if (b.device_memory_used_bytes)
          notes.push_back(FormatMemoryBytes(*b.device_memory_used_bytes) + " in use on the device");
        measured = FormatMemoryBytes(*b.measured_memory_bytes);
        if (!notes.empty()) absl::StrAppend(&measured, " (", absl::StrJoin(notes, "; "), ")");
      }
      out += absl::StrFormat("#   device memory planned %s, measured %s\n",
                             FormatMemoryBytes(b.planned_memory->total_bytes), measured);
    }
    if (b.prefill_roofline_tok_s && b.prefill_roofline_fraction)
      out += absl::StrFormat(
          "#   prefill roofline %.0f tok/s: %.4g TFLOP a prefill at the device's bf16 tensor rate; "
          "reached %.1f %%\n",
          *b.prefill_roofline_tok_s, b.prefill_flops / 1e12, 100 * *b.prefill_roofline_fraction);
  }
  out += YardstickLine(v);
  out += absl::StrFormat(
      "#   load %.2f s, graph capture %.2f s, peak memory %.2f GiB (%s)%s\n", r.load_seconds,
      r.graph_capture_seconds, r.peak_memory_bytes / (1024.0 * 1024.0 * 1024.0),
      r.device == "cpu" ? "host RSS" : "device",
      r.model_memory_bytes
          ? absl::StrCat(", the model built held ", FormatMemoryBytes(*r.model_memory_bytes))
          : "");
  return out;
}

std::string FormatKernels(const BatchFigures& b) {
  std::string out;
  AppendPhase("prefill", b.prefill_kernels, b.batch, &out);
  AppendPhase("decode", b.decode_kernels, b.batch, &out);
  return out;
}

std::vector<std::string> KernelDifferences(const BatchFigures& a, const BatchFigures& b,
                                           const std::string& a_name, const std::string& b_name) {
  std::vector<std::string> out;
  PhaseDifferences("prefill", a.prefill_kernels, b.prefill_kernels, a_name, b_name, &out);
  PhaseDifferences("decode", a.decode_kernels, b.decode_kernels, a_name, b_name, &out);
  return out;
}

bool SameKernels(const BatchFigures& a, const BatchFigures& b) {
  return a.prefill_kernels && a.decode_kernels && b.prefill_kernels && b.decode_kernels &&
         KernelDifferences(a, b).empty();
}

}  // namespace infersweep
