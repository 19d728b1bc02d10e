// What the service commands print, shared by every group of them: errors and their exit codes,
// times, sizes, devices, a sweep's progress line, a serving load point's line, and the short
// names under a results table.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "api/trial.h"
#include "proto/infersweep.pb.h"

namespace infersweep::cli {

// The exit code of a usage error (a bad flag or argument).
inline constexpr int kUsageError = 2;

// Prints "error: MESSAGE" to stderr; returns kUsageError for an INVALID_ARGUMENT, else 1.
int Fail(const absl::Status& status);

// Prints "error: MESSAGE" to stderr; returns kUsageError.
int Usage(const std::string& message);

// A command's exit code: its own on success, Fail's on an error.
int ExitCode(const absl::StatusOr<int>& code);

inline std::string S(std::string_view v) { return std::string(v); }

// "unknown" for an empty identity or workload.
inline std::string Unknown(const std::string& s) { return s.empty() ? "unknown" : s; }

// Local time "2025-01-31 12:00:00", or "-" for none (0).
std::string FormatUnixMs(int64_t ms);

// Whole GiB ("80 GiB"), or "-" for none (0).
std::string FormatBytes(int64_t bytes);

// An SM as the tables' sm column shows it: "90", or "cpu" for SM 0 (CPU results are stored under
// SM 0). In words elsewhere: SmArchLabel ("sm_90", "cpu").
std::string SmColumn(int sm);

// A result's device in words: "NVIDIA H200 sm_90", or "cpu" for a CPU slot's result.
std::string DeviceText(const std::string& gpu_name, int sm);

// One line of a sweep's progress: a bar of done (#) and running (>) trials, the counts, the
// verdicts so far, the state and what the sweep waits for.
std::string ProgressLine(const v1::SweepInfo& s);

// A serving load point on one line: its verdict and its headline figures (docs/METRICS.md).
std::string ServingPointText(const ServingPoint& p);

// A CSV field, quoted when it holds a comma, a quote or a newline.
std::string CsvField(const std::string& s);

// Short names for the identities and workloads of a table's rows ("M1", "W1"), listed under it.
class Legend {
 public:
  std::string Model(const std::string& key) { return Name(models_, "M", key); }
  std::string Workload(const std::string& key) { return Name(workloads_, "W", key); }
  // "# M1 = KEY" lines, models first, each kind in the order of its names.
  void Print() const;

 private:
  static std::string Name(std::map<std::string, std::string>& names, const char* prefix,
                          const std::string& key);
  static std::vector<std::pair<std::string, std::string>> Sorted(
      const std::map<std::string, std::string>& names);
  std::map<std::string, std::string> models_, workloads_;
};

}  // namespace infersweep::cli
