#include "coordinator/regressions.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "api/status_macros.h"

namespace infersweep {

std::string_view RegressionVerdictName(RegressionVerdict v) {
  switch (v) {
    case RegressionVerdict::kOk:
      return "ok";
    case RegressionVerdict::kRegression:
      return "regression";
    case RegressionVerdict::kImprovement:
      return "improvement";
    case RegressionVerdict::kTooFewPoints:
      return "too-few-points";
  }
  return "?";
}

absl::StatusOr<RegressionTest> ParseRegressionTest(std::string_view name) {
  if (name == "z" || name == "robust-z" || name == "mad") return RegressionTest::kRobustZ;
  if (name == "iqr") return RegressionTest::kIqr;
  return absl::InvalidArgumentError(absl::StrCat("unknown regression test '",
                                                 absl::string_view(name.data(), name.size()),
                                                 "' (known: z, iqr)"));
}

absl::Status ValidateRegressionOptions(const RegressionOptions& o) {
  if (o.window < 1 || o.window > 100000)
    return absl::InvalidArgumentError(
        absl::StrCat("window must be in [1, 100000], got ", o.window));
  if (o.min_history < 1 || o.min_history > o.window)
    return absl::InvalidArgumentError(
        absl::StrCat("min history must be in [1, window=", o.window, "], got ", o.min_history));
  if (!(o.z_threshold > 0)) return absl::InvalidArgumentError("z threshold must be > 0");
  if (!(o.iqr_k >= 0)) return absl::InvalidArgumentError("IQR factor must be >= 0");
  if (!(o.min_change >= 0)) return absl::InvalidArgumentError("min change must be >= 0");
  return absl::OkStatus();
}

double Quantile(std::vector<double> values, double q) {
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(values.begin(), values.end());
  q = std::clamp(q, 0.0, 1.0);
  const double pos = q * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return values[lo] + frac * (values[hi] - values[lo]);
}

double Median(std::vector<double> values) { return Quantile(std::move(values), 0.5); }

double MedianAbsoluteDeviation(const std::vector<double>& values) {
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  const double m = Median(values);
  std::vector<double> dev;
  dev.reserve(values.size());
  for (double v : values) dev.push_back(std::fabs(v - m));
  return Median(std::move(dev));
}

double ModifiedZScore(double x, double median, double mad) {
  if (x == median) return 0;
  if (mad == 0)
    return x > median ? std::numeric_limits<double>::infinity()
                      : -std::numeric_limits<double>::infinity();
  return 0.6745 * (x - median) / mad;
}

SeriesJudgement JudgeLatest(const std::vector<double>& oldest_first, Direction direction,
                            const RegressionOptions& options) {
  SeriesJudgement j;
  if (oldest_first.empty()) return j;
  j.latest = oldest_first.back();
  const size_t n_before = oldest_first.size() - 1;
  const size_t take = std::min(n_before, static_cast<size_t>(std::max(options.window, 0)));
  std::vector<double> history(oldest_first.end() - 1 - take, oldest_first.end() - 1);
  j.history_points = static_cast<int>(history.size());
  if (history.empty()) return j;
  j.history_median = Median(history);
  j.mad = MedianAbsoluteDeviation(history);
  j.q1 = Quantile(history, 0.25);
  j.q3 = Quantile(history, 0.75);
  j.robust_z = ModifiedZScore(j.latest, j.history_median, j.mad);
  j.change_pct = j.history_median != 0 ? 100.0 * (j.latest / j.history_median - 1.0) : 0.0;
  if (j.history_points < options.min_history) {
    j.verdict = RegressionVerdict::kTooFewPoints;
    return j;
  }
  // Which side of the history the latest value is on, as "up" (larger) or "down" (smaller).
  bool up = false, down = false;
  if (options.test == RegressionTest::kRobustZ) {
    up = j.robust_z > options.z_threshold;
    down = j.robust_z < -options.z_threshold;
  } else {
    const double iqr = j.q3 - j.q1;
    up = j.latest > j.q3 + options.iqr_k * iqr;
    down = j.latest < j.q1 - options.iqr_k * iqr;
  }
  // The noise floor: a change this small is never a verdict, whatever the spread.
  const double rel = j.history_median != 0
                         ? std::fabs(j.latest - j.history_median) / std::fabs(j.history_median)
                         : std::fabs(j.latest - j.history_median);
  if (rel < options.min_change) up = down = false;
  const bool worse = direction == Direction::kHigherIsBetter ? down : up;
  const bool better = direction == Direction::kHigherIsBetter ? up : down;
  j.verdict = worse    ? RegressionVerdict::kRegression
              : better ? RegressionVerdict::kImprovement
                       : RegressionVerdict::kOk;
  return j;
}

absl::StatusOr<Direction> MetricDirection(std::string_view metric) {
  if (metric == "output_tok_s" || metric == "output_tok_s_per_seq" || metric == "prefill_tok_s")
    return Direction::kHigherIsBetter;
  if (metric == "ttft_ms" || metric == "tpot_ms" || metric == "latency_ms" ||
      metric == "itl_p99_ms")
    return Direction::kLowerIsBetter;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown metric '", absl::string_view(metric.data(), metric.size()),
                   "' (known: output_tok_s, output_tok_s_per_seq, prefill_tok_s, ttft_ms, tpot_ms, "
                   "latency_ms, itl_p99_ms)"));
}

std::optional<double> MetricValue(const BatchFigures& b, std::string_view metric) {
  if (metric == "output_tok_s") return b.output_tok_s.median;
  if (metric == "output_tok_s_per_seq") return b.output_tok_s_per_seq.median;
  if (metric == "prefill_tok_s") return b.prefill_tok_s.median;
  if (metric == "ttft_ms") return b.ttft_ms.median;
  if (metric == "tpot_ms") return b.tpot_ms.median;
  if (metric == "latency_ms") return b.latency_ms.median;
  if (metric == "itl_p99_ms") return b.itl_ms.p99;
  return std::nullopt;
}

namespace {

// What ran a result, beyond what its series key fixes; "" where unknown.
struct Environment {
  std::string engine_version;
  std::string software;
};

Environment EnvironmentOf(const StoredResult& s) {
  Environment e;
  e.engine_version = s.engine_version.value_or(s.result.engine_version);
  e.software = s.software.value_or("");
  return e;
}

// "engine A -> B" / "software A -> B" for what the latest ran on that no history point did.
std::string LikelyCause(const std::vector<Environment>& history, const Environment& latest) {
  std::vector<std::string> causes;
  auto changed = [&](auto field, const char* what) {
    const std::string& now = latest.*field;
    if (now.empty() || history.empty()) return;
    for (const Environment& h : history)
      if (h.*field == now) return;  // some history ran on it too: not the change
    const std::string& before = history.back().*field;
    causes.push_back(absl::StrCat(what, " ", before.empty() ? "(unknown)" : before, " -> ", now));
  };
  changed(&Environment::engine_version, "engine");
  changed(&Environment::software, "software");
  return absl::StrJoin(causes, "; ");
}

}  // namespace

std::vector<RegressionRow> AnalyzeResults(const std::vector<StoredResult>& results,
                                          std::string_view metric,
                                          const RegressionOptions& options) {
  absl::StatusOr<Direction> direction = MetricDirection(metric);
  if (!direction.ok()) return {};
  // model, model identity, workload, sm, gpu, config, batch
  using Key = std::tuple<std::string, std::string, std::string, int, std::string, std::string, int>;
  struct Point {
    int64_t finished_ms;
    size_t order;  // position in `results`, to break ties deterministically
    double value;
    const StoredResult* from;
  };
  std::map<Key, std::vector<Point>> series;
  for (size_t i = 0; i < results.size(); ++i) {
    const StoredResult& s = results[i];
    if (s.result.status != TrialStatus::kOk) continue;
    const std::string config = BackendConfigString(s.result.config);
    const std::string model_key = s.model_key.value_or(ModelIdentityKey(s.result.model_identity));
    const std::string workload = s.workload.value_or(s.result.workload);
    for (const BatchFigures& b : s.result.batches) {
      if (!b.measured()) continue;  // a memory verdict: no figures
      std::optional<double> v = MetricValue(b, metric);
      if (!v || !std::isfinite(*v)) continue;
      series[Key{s.result.model, model_key, workload, s.sm, s.gpu_name, config, b.batch}].push_back(
          Point{s.result.finished_unix_ms, i, *v, &s});
    }
  }
  std::vector<RegressionRow> rows;
  rows.reserve(series.size());
  for (auto& [key, points] : series) {
    std::stable_sort(points.begin(), points.end(),
                     [](const Point& a, const Point& b) { return a.finished_ms < b.finished_ms; });
    std::vector<double> values;
    values.reserve(points.size());
    for (const Point& p : points) values.push_back(p.value);
    RegressionRow row;
    std::tie(row.model, row.model_key, row.workload, row.sm, row.gpu, row.config, row.batch) = key;
    row.latest_trial_id = points.back().from->result.trial_id;
    row.latest_unix_ms = points.back().finished_ms;
    row.judgement = JudgeLatest(values, *direction, options);
    if (row.judgement.verdict == RegressionVerdict::kRegression ||
        row.judgement.verdict == RegressionVerdict::kImprovement) {
      const size_t take = std::min(points.size() - 1, static_cast<size_t>(options.window));
      std::vector<Environment> history;
      for (size_t i = points.size() - 1 - take; i + 1 < points.size(); ++i)
        history.push_back(EnvironmentOf(*points[i].from));
      row.likely_cause = LikelyCause(history, EnvironmentOf(*points.back().from));
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

absl::StatusOr<std::vector<RegressionRow>> FindRegressions(Store& store, const RegressionQuery& q) {
  RETURN_IF_ERROR(ValidateRegressionOptions(q.options));
  if (absl::StatusOr<Direction> d = MetricDirection(q.metric); !d.ok()) return d.status();
  if (q.limit < 1 || q.limit > kMaxRegressionResults)
    return absl::InvalidArgumentError(
        absl::StrCat("limit ", q.limit, " must lie in [1, ", kMaxRegressionResults, "]"));
  ResultQuery rq;
  rq.status = TrialStatus::kOk;
  rq.model = q.model;
  rq.sm = q.sm;
  rq.sweep_id = q.sweep_id;
  rq.model_key = q.model_key;
  rq.workload = q.workload;
  rq.layers = q.layers;
  rq.with_kernels = false;  // the figures are all a series needs
  rq.limit = q.limit;
  ASSIGN_OR_RETURN(std::vector<StoredResult> results, store.QueryResults(rq));
  // QueryResults gives the newest first; AnalyzeResults breaks equal finish times by position,
  // so reverse to keep the store's order (oldest first) among ties.
  std::reverse(results.begin(), results.end());
  return AnalyzeResults(results, q.metric, q.options);
}

namespace {

std::string FormatNumber(double v) {
  if (std::isinf(v)) return v > 0 ? "+inf" : "-inf";
  if (std::isnan(v)) return "-";
  return absl::StrFormat("%.4g", v);
}

}  // namespace

std::string FormatRegressionTable(const std::vector<RegressionRow>& rows,
                                  const RegressionQuery& q) {
  const RegressionOptions& o = q.options;
  absl::StatusOr<Direction> direction = MetricDirection(q.metric);
  std::string out = absl::StrCat(
      "# infersweep regressions: ", q.metric, " (",
      direction.ok() && *direction == Direction::kHigherIsBetter ? "higher" : "lower",
      " is better); the latest OK result of each series vs the previous ", o.window, "\n");
  if (o.test == RegressionTest::kRobustZ) {
    absl::StrAppend(&out, "# test: robust z = 0.6745*(latest-median)/MAD, flagged when |z| > ",
                    FormatNumber(o.z_threshold));
  } else {
    absl::StrAppend(&out, "# test: IQR fences, flagged outside [Q1 - ", FormatNumber(o.iqr_k),
                    "*IQR, Q3 + ", FormatNumber(o.iqr_k), "*IQR]");
  }
  absl::StrAppend(&out, " and |change| >= ", FormatNumber(100 * o.min_change), "%; a series needs ",
                  o.min_history, " history points to be judged\n");

  const std::vector<std::string> header = {
      "model", "identity", "workload", "sm_arch", "gpu", "batch",   "config",
      "n",     "latest",   "median",   "change%", "z",   "verdict", "likely_cause"};
  std::vector<std::vector<std::string>> table;
  int counts[4] = {};
  for (const RegressionRow& r : rows) {
    const SeriesJudgement& j = r.judgement;
    ++counts[static_cast<int>(j.verdict)];
    const bool judged = j.history_points > 0;
    table.push_back({r.model, r.model_key.empty() ? "unknown" : r.model_key,
                     r.workload.empty() ? "unknown" : r.workload,
                     r.sm > 0 ? absl::StrCat("sm_", r.sm) : std::string("cpu"), r.gpu,
                     absl::StrCat(r.batch), r.config, absl::StrCat(j.history_points),
                     FormatNumber(j.latest), judged ? FormatNumber(j.history_median) : "-",
                     judged ? absl::StrFormat("%+.1f", j.change_pct) : "-",
                     judged ? FormatNumber(j.robust_z) : "-",
                     std::string(RegressionVerdictName(j.verdict)),
                     r.likely_cause.empty() ? "-" : r.likely_cause});
  }
  std::vector<size_t> width(header.size());
  for (size_t c = 0; c < header.size(); ++c) {
    width[c] = header[c].size();
    for (const auto& row : table) width[c] = std::max(width[c], row[c].size());
  }
  // Rows start with a space, the header with '#', so the columns line up.
  auto line = [&](const std::vector<std::string>& cells, bool is_header) {
    std::string s = is_header ? "#" : " ";
    for (size_t c = 0; c < cells.size(); ++c) {
      if (c > 0) s += "  ";
      s += cells[c];
      if (c + 1 < cells.size()) s.append(width[c] - cells[c].size(), ' ');
    }
    return s + "\n";
  };
  absl::StrAppend(&out, line(header, true));
  for (const auto& row : table) absl::StrAppend(&out, line(row, false));
  absl::StrAppend(&out, "# ", rows.size(),
                  " series: ", counts[static_cast<int>(RegressionVerdict::kRegression)],
                  " regression, ", counts[static_cast<int>(RegressionVerdict::kImprovement)],
                  " improvement, ", counts[static_cast<int>(RegressionVerdict::kOk)], " ok, ",
                  counts[static_cast<int>(RegressionVerdict::kTooFewPoints)],
                  " with too few points\n");
  return out;
}

v1::RegressionSeries ToProto(const RegressionRow& r) {
  v1::RegressionSeries p;
  p.set_model(r.model);
  p.set_model_key(r.model_key);
  p.set_workload(r.workload);
  p.set_sm(r.sm);
  p.set_gpu(r.gpu);
  p.set_config(r.config);
  p.set_batch(r.batch);
  p.set_latest_trial_id(r.latest_trial_id);
  p.set_latest_unix_ms(r.latest_unix_ms);
  const SeriesJudgement& j = r.judgement;
  p.set_latest(j.latest);
  p.set_history_points(j.history_points);
  p.set_history_median(j.history_median);
  p.set_mad(j.mad);
  p.set_q1(j.q1);
  p.set_q3(j.q3);
  p.set_robust_z(j.robust_z);
  p.set_change_pct(j.change_pct);
  p.set_verdict(std::string(RegressionVerdictName(j.verdict)));
  p.set_likely_cause(r.likely_cause);
  return p;
}

RegressionRow FromProto(const v1::RegressionSeries& p) {
  RegressionRow r;
  r.model = p.model();
  r.model_key = p.model_key();
  r.workload = p.workload();
  r.sm = p.sm();
  r.gpu = p.gpu();
  r.config = p.config();
  r.batch = p.batch();
  r.latest_trial_id = p.latest_trial_id();
  r.latest_unix_ms = p.latest_unix_ms();
  SeriesJudgement& j = r.judgement;
  j.latest = p.latest();
  j.history_points = p.history_points();
  j.history_median = p.history_median();
  j.mad = p.mad();
  j.q1 = p.q1();
  j.q3 = p.q3();
  j.robust_z = p.robust_z();
  j.change_pct = p.change_pct();
  for (RegressionVerdict v : {RegressionVerdict::kOk, RegressionVerdict::kRegression,
                              RegressionVerdict::kImprovement, RegressionVerdict::kTooFewPoints})
    if (RegressionVerdictName(v) == p.verdict()) j.verdict = v;
  r.likely_cause = p.likely_cause();
  return r;
}

}  // namespace infersweep
