#include "cli/output.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "coordinator/metrics.h"

namespace infersweep::cli {
namespace {

// The verdicts a sweep has so far, in the verdict vocabulary's order: "OK 3  CRASHED 1".
std::string StatusCounts(const v1::SweepInfo& s) {
  std::vector<std::string> parts;
  static const char* kOrder[] = {"OK", "INCORRECT", "CRASHED", "UNSUPPORTED", "TIMEOUT", "ERROR"};
  for (const char* name : kOrder) {
    auto it = s.status_counts().find(name);
    if (it != s.status_counts().end() && it->second > 0)
      parts.push_back(absl::StrCat(name, " ", it->second));
  }
  return parts.empty() ? "no results yet" : absl::StrJoin(parts, "  ");
}

}  // namespace

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kInvalidArgument ? kUsageError : 1;
}

int Usage(const std::string& message) {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  return kUsageError;
}

int ExitCode(const absl::StatusOr<int>& code) { return code.ok() ? *code : Fail(code.status()); }

std::string FormatUnixMs(int64_t ms) {
  if (ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(ms), absl::LocalTimeZone());
}

std::string FormatBytes(int64_t bytes) {
  if (bytes <= 0) return "-";
  return absl::StrFormat("%.0f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
}

std::string SmColumn(int sm) { return sm <= 0 ? std::string("cpu") : absl::StrCat(sm); }

std::string DeviceText(const std::string& gpu_name, int sm) {
  if (sm <= 0 && (gpu_name.empty() || gpu_name == "cpu")) return "cpu";
  return absl::StrCat(gpu_name.empty() ? "?" : gpu_name, " ", SmArchLabel(sm));
}

std::string ProgressLine(const v1::SweepInfo& s) {
  constexpr int64_t kWidth = 30;
  const int64_t total = std::max<int64_t>(1, s.trials_total());
  const int64_t done = std::clamp<int64_t>(s.trials_done(), 0, total);
  const int64_t running = std::clamp<int64_t>(s.trials_running(), 0, total - done);
  const int64_t filled = kWidth * done / total;
  const int64_t busy =
      std::max<int64_t>(0, (kWidth * (done + running) + total - 1) / total - filled);
  std::string bar = std::string(static_cast<size_t>(filled), '#') +
                    std::string(static_cast<size_t>(std::min(busy, kWidth - filled)), '>');
  bar.resize(kWidth, '.');
  const int64_t queued =
      std::max<int64_t>(0, s.trials_total() - s.trials_done() - s.trials_running());
  return absl::StrFormat("sweep %d [%s] %d/%d done, %d running, %d queued | %s | %s%s",
                         s.sweep_id(), bar, s.trials_done(), s.trials_total(), s.trials_running(),
                         queued, StatusCounts(s), s.state(),
                         s.waiting().empty() ? "" : absl::StrCat(" | waiting: ", s.waiting()));
}

std::string ServingPointText(const ServingPoint& p) {
  if (p.verdict == TrialStatus::kUnsupported)
    return absl::StrCat(LoadPointName(p.point), " UNSUPPORTED: ", p.reason);
  std::string text = absl::StrFormat(
      "%s %s: output_tok_s=%.1f output_tok_s_per_user=%.1f median_ttft_ms=%.3f "
      "p99_ttft_ms=%.3f median_tpot_ms=%.3f p99_tpot_ms=%.3f completed=%d matching=%d/%d",
      LoadPointName(p.point), TrialStatusName(p.verdict), p.output_throughput,
      p.output_tok_s_per_user, p.ttft_ms.median, p.ttft_ms.p99, p.tpot_ms.median, p.tpot_ms.p99,
      p.completed, p.requests_matching, p.requests_checked);
  if (p.request_goodput) absl::StrAppendFormat(&text, " goodput=%.3f", *p.request_goodput);
  if (p.meets_slo) absl::StrAppend(&text, " meets_slo=", *p.meets_slo ? "yes" : "no");
  if (p.slots_capped_at)
    absl::StrAppend(&text, " slots_capped_at=", *p.slots_capped_at, " (memory plan)");
  return text;
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

void Legend::Print() const {
  for (const auto& [name, key] : Sorted(models_))
    std::printf("# %s = %s\n", name.c_str(), key.c_str());
  for (const auto& [name, key] : Sorted(workloads_))
    std::printf("# %s = %s\n", name.c_str(), key.c_str());
}

std::string Legend::Name(std::map<std::string, std::string>& names, const char* prefix,
                         const std::string& key) {
  if (key.empty()) return "?";
  auto [it, fresh] = names.try_emplace(key);
  if (fresh) it->second = absl::StrCat(prefix, names.size());
  return it->second;
}

std::vector<std::pair<std::string, std::string>> Legend::Sorted(
    const std::map<std::string, std::string>& names) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [key, name] : names) out.emplace_back(name, key);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.first.size() != b.first.size() ? a.first.size() < b.first.size() : a.first < b.first;
  });
  return out;
}

}  // namespace infersweep::cli
