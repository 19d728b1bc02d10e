// Performance regressions across the stored history (`infersweep regressions`): for each series
// (model identity, workload, sm, gpu, config, batch) of OK results ordered by finish time, the
// latest value is judged against the previous N values of the same series with a noise-aware
// test:
//
//  - robust z (default): modified z-score 0.6745 * (latest - median) / MAD over the history
//    (Iglewicz & Hoaglin); flagged when |z| > z_threshold (3.5);
//  - iqr: Tukey fences like Bencher's; flagged when latest < Q1 - k*IQR (a regression for a
//    higher-is-better metric) or > Q3 + k*IQR (k = 1.5).
//
// Either way a change smaller than min_change (relative to the history's median) is never
// flagged, so a perfectly flat history (MAD or IQR of 0) does not flag every tiny wobble, and a
// series needs at least min_history previous points to be judged at all.
//
// A series never mixes model identities or workloads (a 2-layer and a 48-layer run of one preset
// are two series). The engine version and the software stack are not part of the key: a change
// the test flags is attributed to them ("likely cause") when the latest result ran on a version
// or stack that no point of its history ran on.
//
// The statistics are pure functions (tests/regressions_test.cc); FindRegressions reads the
// results through Store::QueryResults.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "api/trial.h"
#include "proto/infersweep.pb.h"
#include "storage/store.h"

namespace infersweep {

enum class Direction { kHigherIsBetter, kLowerIsBetter };
enum class RegressionTest { kRobustZ, kIqr };
enum class RegressionVerdict { kOk, kRegression, kImprovement, kTooFewPoints };
std::string_view RegressionVerdictName(RegressionVerdict v);  // "ok", "regression", ...
absl::StatusOr<RegressionTest> ParseRegressionTest(std::string_view name);  // "z" or "iqr"

struct RegressionOptions {
  int window = 10;       // the history is the previous `window` values (>= 1)
  int min_history = 5;   // fewer history values: kTooFewPoints
  RegressionTest test = RegressionTest::kRobustZ;
  double z_threshold = 3.5;
  double iqr_k = 1.5;
  double min_change = 0.02;  // fraction of the history's median
};
absl::Status ValidateRegressionOptions(const RegressionOptions& o);

// Statistics over a non-empty sample (callers guarantee it; an empty one gives NaN).
double Median(std::vector<double> values);
// Linear interpolation between closest ranks (R's type 7, numpy's default), q in [0, 1].
double Quantile(std::vector<double> values, double q);
// Median absolute deviation from the median (unscaled).
double MedianAbsoluteDeviation(const std::vector<double>& values);
// 0.6745 * (x - median) / mad; 0 when x == median, +-infinity when mad == 0 and x != median.
double ModifiedZScore(double x, double median, double mad);

struct SeriesJudgement {
  double latest = 0;
  int history_points = 0;  // values the latest was compared with (<= window)
  double history_median = 0;
  double mad = 0;
  double q1 = 0, q3 = 0;
  double robust_z = 0;
  double change_pct = 0;  // 100 * (latest / history_median - 1); 0 when the median is 0
  RegressionVerdict verdict = RegressionVerdict::kTooFewPoints;
};

// Judges the last value of `oldest_first` against the up-to-`window` values before it.
// An empty series is kTooFewPoints with latest 0.
SeriesJudgement JudgeLatest(const std::vector<double>& oldest_first, Direction direction,
                            const RegressionOptions& options);

// The metrics a series can be read on: output_tok_s, output_tok_s_per_seq, prefill_tok_s
// (higher is better), ttft_ms, tpot_ms, latency_ms, itl_p99_ms (lower is better).
absl::StatusOr<Direction> MetricDirection(std::string_view metric);
// The metric's median-over-repeats value in one batch's figures (the p99 for itl_p99_ms).
std::optional<double> MetricValue(const BatchFigures& b, std::string_view metric);

struct RegressionRow {
  std::string model;
  std::string model_key;  // "" when unknown
  std::string workload;   // "" when unknown
  int sm = 0;
  std::string gpu;
  std::string config;  // canonical string
  int batch = 1;
  std::string latest_trial_id;
  int64_t latest_unix_ms = 0;
  SeriesJudgement judgement;
  // For a regression or an improvement: "engine infersweep v1 -> infersweep v2" and/or
  // "software driver=... -> driver=..." when the latest result's differs from every history
  // point's; "" otherwise (or when unknown).
  std::string likely_cause;
};

// Groups OK results into series, orders each by finish time and judges its latest value. Rows
// are sorted by (model, sm, gpu, config, batch). `results` may come in any order.
std::vector<RegressionRow> AnalyzeResults(const std::vector<StoredResult>& results,
                                          std::string_view metric,
                                          const RegressionOptions& options);

// The most OK results one judgement reads (RegressionQuery::limit), and its default.
inline constexpr int kMaxRegressionResults = 100000;

struct RegressionQuery {
  std::string metric = "output_tok_s";
  std::optional<std::string> model;
  std::optional<int> sm;
  std::optional<int64_t> sweep_id;
  std::optional<std::string> model_key;  // as ResultQuery's
  std::optional<std::string> workload;
  std::optional<int> layers;
  int limit = kMaxRegressionResults;  // newest OK results read from the store, >= 1
  RegressionOptions options;
};
absl::StatusOr<std::vector<RegressionRow>> FindRegressions(Store& store, const RegressionQuery& q);

// The CLI's table: a '#' header naming the metric and the test, then one row per series.
std::string FormatRegressionTable(const std::vector<RegressionRow>& rows, const RegressionQuery& q);

// The wire form (SweepService.Regressions), both ways.
v1::RegressionSeries ToProto(const RegressionRow& row);
RegressionRow FromProto(const v1::RegressionSeries& series);

}  // namespace infersweep
