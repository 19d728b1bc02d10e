// The regression detector behind `infersweep regressions`: the robust statistics, the verdict of
// one series under both tests (robust z and IQR fences), the grouping of stored results into
// series, and a round trip through a real Store.
#include "coordinator/regressions.h"

#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;

TEST(RegressionStatsTest, MedianAndQuantilesInterpolateLikeNumpy) {
  EXPECT_DOUBLE_EQ(Median({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(Median({4, 1, 3, 2}), 2.5);
  EXPECT_DOUBLE_EQ(Median({7}), 7);
  EXPECT_TRUE(std::isnan(Median({})));
  // numpy.quantile([1, 2, 3, 4], [0.25, 0.75]) == [1.75, 3.25]
  EXPECT_DOUBLE_EQ(Quantile({4, 3, 2, 1}, 0.25), 1.75);
  EXPECT_DOUBLE_EQ(Quantile({1, 2, 3, 4}, 0.75), 3.25);
  EXPECT_DOUBLE_EQ(Quantile({1, 2, 3, 4}, 0), 1);
  EXPECT_DOUBLE_EQ(Quantile({1, 2, 3, 4}, 1), 4);
}

TEST(RegressionStatsTest, MedianAbsoluteDeviation) {
  // median 2; |deviations| 1 1 0 0 2 4 7 -> median 1
  EXPECT_DOUBLE_EQ(MedianAbsoluteDeviation({1, 1, 2, 2, 4, 6, 9}), 1);
  EXPECT_DOUBLE_EQ(MedianAbsoluteDeviation({5, 5, 5}), 0);
  // One wild value does not move it (unlike the standard deviation).
  EXPECT_DOUBLE_EQ(MedianAbsoluteDeviation({10, 11, 9, 10, 1000}), 1);
}

TEST(RegressionStatsTest, ModifiedZScore) {
  EXPECT_DOUBLE_EQ(ModifiedZScore(12, 10, 1), 0.6745 * 2);
  EXPECT_DOUBLE_EQ(ModifiedZScore(10, 10, 0), 0);
  EXPECT_EQ(ModifiedZScore(9, 10, 0), -std::numeric_limits<double>::infinity());
  EXPECT_EQ(ModifiedZScore(11, 10, 0), std::numeric_limits<double>::infinity());
}

// A noisy but stable history around 100 (MAD 1).
std::vector<double> Noisy(double latest) {
  return {100, 101, 99, 102, 98, 100, 101, 99, 100, 102, latest};
}

TEST(JudgeLatestTest, RobustZFlagsOnlyClearChanges) {
  const RegressionOptions o;
  SeriesJudgement j = JudgeLatest(Noisy(99.5), Direction::kHigherIsBetter, o);
  EXPECT_EQ(j.verdict, RegressionVerdict::kOk);
  EXPECT_EQ(j.history_points, 10);
  EXPECT_DOUBLE_EQ(j.history_median, 100);
  EXPECT_DOUBLE_EQ(j.mad, 1);
  EXPECT_DOUBLE_EQ(j.latest, 99.5);

  j = JudgeLatest(Noisy(80), Direction::kHigherIsBetter, o);
  EXPECT_EQ(j.verdict, RegressionVerdict::kRegression);
  EXPECT_NEAR(j.change_pct, -20, 1e-9);
  EXPECT_LT(j.robust_z, -3.5);

  j = JudgeLatest(Noisy(120), Direction::kHigherIsBetter, o);
  EXPECT_EQ(j.verdict, RegressionVerdict::kImprovement);

  // Just inside the threshold: 0.6745 * 5 / 1 = 3.37 < 3.5.
  EXPECT_EQ(JudgeLatest(Noisy(95), Direction::kHigherIsBetter, o).verdict,
            RegressionVerdict::kOk);
  // Just outside: 0.6745 * 6 = 4.05.
  EXPECT_EQ(JudgeLatest(Noisy(94), Direction::kHigherIsBetter, o).verdict,
            RegressionVerdict::kRegression);
}

TEST(JudgeLatestTest, LowerIsBetterSwapsTheVerdicts) {
  const RegressionOptions o;
  EXPECT_EQ(JudgeLatest(Noisy(120), Direction::kLowerIsBetter, o).verdict,
            RegressionVerdict::kRegression);
  EXPECT_EQ(JudgeLatest(Noisy(80), Direction::kLowerIsBetter, o).verdict,
            RegressionVerdict::kImprovement);
}

TEST(JudgeLatestTest, NeedsMinHistoryPoints) {
  const RegressionOptions o;  // min_history 5
  SeriesJudgement j = JudgeLatest({100, 100, 100, 100, 50}, Direction::kHigherIsBetter, o);
  EXPECT_EQ(j.verdict, RegressionVerdict::kTooFewPoints);
  EXPECT_EQ(j.history_points, 4);
  EXPECT_DOUBLE_EQ(j.history_median, 100);  // still reported
  j = JudgeLatest({100, 100, 100, 100, 100, 50}, Direction::kHigherIsBetter, o);
  EXPECT_EQ(j.verdict, RegressionVerdict::kRegression);
  EXPECT_EQ(JudgeLatest({}, Direction::kHigherIsBetter, o).verdict,
            RegressionVerdict::kTooFewPoints);
  EXPECT_EQ(JudgeLatest({42}, Direction::kHigherIsBetter, o).history_points, 0);
}

TEST(JudgeLatestTest, FlatHistoryUsesTheNoiseFloor) {
  const RegressionOptions o;  // min_change 2%
  // MAD and IQR are 0: without the floor any wobble would be infinitely significant.
  const std::vector<double> tiny = {50, 50, 50, 50, 50, 50, 49.5};
  SeriesJudgement j = JudgeLatest(tiny, Direction::kHigherIsBetter, o);
  EXPECT_TRUE(std::isinf(j.robust_z));
  EXPECT_EQ(j.verdict, RegressionVerdict::kOk);
  EXPECT_EQ(JudgeLatest({50, 50, 50, 50, 50, 50, 45}, Direction::kHigherIsBetter, o).verdict,
            RegressionVerdict::kRegression);
  RegressionOptions iqr = o;
  iqr.test = RegressionTest::kIqr;
  EXPECT_EQ(JudgeLatest(tiny, Direction::kHigherIsBetter, iqr).verdict, RegressionVerdict::kOk);
}

TEST(JudgeLatestTest, OnlyTheWindowCounts) {
  RegressionOptions o;
  o.window = 5;
  // Old values (outside the last 5) were much higher; the recent history is ~50.
  const std::vector<double> v = {200, 210, 190, 205, 50, 51, 49, 50, 52, 50.5};
  SeriesJudgement j = JudgeLatest(v, Direction::kHigherIsBetter, o);
  EXPECT_EQ(j.history_points, 5);
  EXPECT_DOUBLE_EQ(j.history_median, 50);
  EXPECT_EQ(j.verdict, RegressionVerdict::kOk);
}

TEST(JudgeLatestTest, IqrFences) {
  RegressionOptions o;
  o.test = RegressionTest::kIqr;
  // History 100 101 99 102 98 100 101 99 100 102: Q1 99.25, Q3 101, IQR 1.75,
  // fences [96.625, 103.625].
  SeriesJudgement j = JudgeLatest(Noisy(97), Direction::kHigherIsBetter, o);
  EXPECT_DOUBLE_EQ(j.q1, 99.25);
  EXPECT_DOUBLE_EQ(j.q3, 101);
  EXPECT_EQ(j.verdict, RegressionVerdict::kOk);
  EXPECT_EQ(JudgeLatest(Noisy(96), Direction::kHigherIsBetter, o).verdict,
            RegressionVerdict::kRegression);
  EXPECT_EQ(JudgeLatest(Noisy(104), Direction::kHigherIsBetter, o).verdict,
            RegressionVerdict::kImprovement);
  EXPECT_EQ(JudgeLatest(Noisy(104), Direction::kLowerIsBetter, o).verdict,
            RegressionVerdict::kRegression);
}

TEST(RegressionOptionsTest, Validation) {
  EXPECT_TRUE(ValidateRegressionOptions({}).ok());
  RegressionOptions o;
  o.window = 0;
  EXPECT_FALSE(ValidateRegressionOptions(o).ok());
  o = {};
  o.window = 3;  // min_history 5 > window
  EXPECT_THAT(ValidateRegressionOptions(o).message(), HasSubstr("min history"));
  EXPECT_TRUE(ParseRegressionTest("iqr").ok());
  EXPECT_TRUE(ParseRegressionTest("z").ok());
  EXPECT_FALSE(ParseRegressionTest("t-test").ok());
  EXPECT_FALSE(MetricDirection("tokens").ok());
  EXPECT_EQ(*MetricDirection("ttft_ms"), Direction::kLowerIsBetter);
  EXPECT_EQ(*MetricDirection("output_tok_s"), Direction::kHigherIsBetter);
}

StoredResult Make(const std::string& trial, int64_t finished_ms, double tok_s,
                  TrialStatus status = TrialStatus::kOk, int sm = 90,
                  const std::string& config = "device=cuda,graphs=on", int batch = 1) {
  StoredResult s;
  s.gpu_name = "NVIDIA H200";
  s.sm = sm;
  s.result.trial_id = trial;
  s.result.model = "preset:tiny-moe";
  s.result.status = status;
  s.result.config = *ParseBackendConfig(config);
  s.result.finished_unix_ms = finished_ms;
  BatchFigures b;
  b.batch = batch;
  b.output_tok_s = {tok_s, tok_s * 0.9, tok_s * 1.1};
  b.ttft_ms = {10, 9, 11};
  s.result.batches.push_back(b);
  return s;
}

TEST(AnalyzeResultsTest, GroupsSeriesAndOrdersByFinishTime) {
  std::vector<StoredResult> in;
  // Series A (sm_90, graphs=on) given newest first; its latest (t=7000) is a clear drop.
  in.push_back(Make("a7", 7000, 60));
  for (int i = 6; i >= 1; --i) in.push_back(Make(absl::StrCat("a", i), i * 1000, 100 + i % 2));
  // Failures never count, even with figures.
  in.push_back(Make("a8", 8000, 1, TrialStatus::kIncorrect));
  // Series B: another arch, too short.
  in.push_back(Make("b1", 1000, 50, TrialStatus::kOk, 120));
  in.push_back(Make("b2", 2000, 50, TrialStatus::kOk, 120));
  // Series C: same config at another batch size is its own series.
  for (int i = 1; i <= 7; ++i)
    in.push_back(Make(absl::StrCat("c", i), i * 1000, 400, TrialStatus::kOk, 90,
                      "device=cuda,graphs=on", 8));

  const std::vector<RegressionRow> rows = AnalyzeResults(in, "output_tok_s", {});
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].sm, 90);
  EXPECT_EQ(rows[0].batch, 1);
  EXPECT_EQ(rows[0].latest_trial_id, "a7");
  EXPECT_EQ(rows[0].judgement.history_points, 6);
  EXPECT_EQ(rows[0].judgement.verdict, RegressionVerdict::kRegression);
  EXPECT_EQ(rows[1].batch, 8);
  EXPECT_EQ(rows[1].judgement.verdict, RegressionVerdict::kOk);
  EXPECT_EQ(rows[2].sm, 120);
  EXPECT_EQ(rows[2].judgement.verdict, RegressionVerdict::kTooFewPoints);

  // Lower-is-better metric on the same data: ttft is flat, so nothing is flagged.
  for (const RegressionRow& r : AnalyzeResults(in, "ttft_ms", {}))
    EXPECT_NE(r.judgement.verdict, RegressionVerdict::kRegression) << r.config;

  const std::string table = FormatRegressionTable(rows, RegressionQuery{});
  EXPECT_THAT(table, HasSubstr("# infersweep regressions: output_tok_s (higher is better)"));
  EXPECT_THAT(table, HasSubstr("regression"));
  EXPECT_THAT(table, HasSubstr("sm_120"));
  EXPECT_THAT(table, HasSubstr("# 3 series: 1 regression, 0 improvement, 1 ok, 1 with too few"));
}

// A layer change is not a regression: two model identities of one preset are two series, and
// so are two workloads. The old key (model, sm, gpu, config, batch) scored a 2-layer run after
// 8-layer history as a +70 % "improvement".
TEST(AnalyzeResultsTest, IdentitiesAndWorkloadsAreSeparateSeries) {
  std::vector<StoredResult> in;
  for (int i = 1; i <= 6; ++i) {
    StoredResult s = Make(absl::StrCat("l8-", i), i * 1000, 100 + i % 2);
    s.model_key = "preset:tiny-moe layers=8 seed=1 weights=bf16";
    s.workload = "prompt=64,output=16,warmup=1";
    in.push_back(s);
  }
  StoredResult two = Make("l2", 7000, 170);
  two.model_key = "preset:tiny-moe layers=2 seed=1 weights=bf16";
  two.workload = "prompt=64,output=16,warmup=1";
  in.push_back(two);
  StoredResult longer = Make("w2", 8000, 40);
  longer.model_key = "preset:tiny-moe layers=8 seed=1 weights=bf16";
  longer.workload = "prompt=1024,output=16,warmup=1";
  in.push_back(longer);
  const std::vector<RegressionRow> rows = AnalyzeResults(in, "output_tok_s", {});
  ASSERT_EQ(rows.size(), 3u);
  for (const RegressionRow& r : rows) {
    EXPECT_NE(r.judgement.verdict, RegressionVerdict::kRegression) << r.model_key;
    EXPECT_NE(r.judgement.verdict, RegressionVerdict::kImprovement) << r.model_key;
  }
  EXPECT_EQ(rows[0].model_key, "preset:tiny-moe layers=2 seed=1 weights=bf16");
  EXPECT_EQ(rows[0].judgement.verdict, RegressionVerdict::kTooFewPoints);
  EXPECT_EQ(rows[1].workload, "prompt=1024,output=16,warmup=1");
  EXPECT_EQ(rows[2].judgement.history_points, 5);
  EXPECT_EQ(rows[2].judgement.verdict, RegressionVerdict::kOk);
  const std::string table = FormatRegressionTable(rows, RegressionQuery{});
  EXPECT_THAT(table, HasSubstr("preset:tiny-moe layers=2 seed=1 weights=bf16"));
  EXPECT_THAT(table, HasSubstr("prompt=1024,output=16,warmup=1"));
}

// A change the test flags is put down to the engine version or the software stack when the
// latest result ran on one that no history point ran on; a change on the same build has none.
TEST(AnalyzeResultsTest, NamesAChangedEngineOrStackAsTheLikelyCause) {
  auto history = [](std::vector<StoredResult>* in, const std::string& prefix) {
    for (int i = 1; i <= 6; ++i) {
      StoredResult s = Make(absl::StrCat(prefix, i), i * 1000, 100 + i % 2);
      s.engine_version = "infersweep v1";
      s.software = "driver=570.1 cuda=12.8/12.8";
      in->push_back(s);
    }
  };
  std::vector<StoredResult> in;
  history(&in, "a");
  StoredResult latest = Make("a7", 7000, 60);
  latest.engine_version = "infersweep v2";
  latest.software = "driver=570.1 cuda=12.8/12.8";
  in.push_back(latest);
  std::vector<RegressionRow> rows = AnalyzeResults(in, "output_tok_s", {});
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].judgement.verdict, RegressionVerdict::kRegression);
  EXPECT_EQ(rows[0].likely_cause, "engine infersweep v1 -> infersweep v2");
  EXPECT_THAT(FormatRegressionTable(rows, RegressionQuery{}),
              HasSubstr("engine infersweep v1 -> infersweep v2"));

  in.back().engine_version = "infersweep v1";
  in.back().software = "driver=580.2 cuda=13.0/13.0";
  rows = AnalyzeResults(in, "output_tok_s", {});
  EXPECT_EQ(rows[0].likely_cause,
            "software driver=570.1 cuda=12.8/12.8 -> driver=580.2 cuda=13.0/13.0");

  in.back().software = "driver=570.1 cuda=12.8/12.8";
  rows = AnalyzeResults(in, "output_tok_s", {});
  EXPECT_EQ(rows[0].judgement.verdict, RegressionVerdict::kRegression);
  EXPECT_EQ(rows[0].likely_cause, "");

  // The wire form carries every field.
  in.back().engine_version = "infersweep v2";
  rows = AnalyzeResults(in, "output_tok_s", {});
  const RegressionRow back = FromProto(ToProto(rows[0]));
  EXPECT_EQ(back.likely_cause, rows[0].likely_cause);
  EXPECT_EQ(back.judgement.verdict, RegressionVerdict::kRegression);
  EXPECT_EQ(back.judgement.history_points, 6);
  EXPECT_DOUBLE_EQ(back.judgement.latest, 60);
}

TEST(FindRegressionsTest, ReadsTheStore) {
  std::string dir_template =
      (std::filesystem::temp_directory_path() / "regressions_test.XXXXXX").string();
  ASSERT_NE(mkdtemp(dir_template.data()), nullptr);
  const std::filesystem::path dir = dir_template;
  {
    auto store = Store::Open((dir / "r.db").string());
    ASSERT_TRUE(store.ok()) << store.status();
    SweepRecord sweep;
    sweep.name = "history";
    sweep.spec_yaml = "{}";
    sweep.model = "preset:tiny-moe";
    std::vector<TrialRecord> trials(8);
    for (auto& t : trials) {
      t.model = "preset:tiny-moe";
      t.config = *ParseBackendConfig("device=cpu,threads=2");
    }
    auto id = (*store)->CreateSweep(sweep, trials);
    ASSERT_TRUE(id.ok()) << id.status();
    const double tok_s[8] = {100, 102, 98, 101, 99, 100, 101, 70};
    for (int i = 0; i < 8; ++i) {
      StoredResult s = Make(absl::StrCat(*id, "-", i), 1'700'000'000'000 + i * 1000, tok_s[i],
                            TrialStatus::kOk, 0, "device=cpu,threads=2");
      ASSERT_TRUE((*store)->RecordResult("", "cpu", 0, s.result).ok());
    }
    RegressionQuery q;
    q.options.window = 10;
    auto rows = FindRegressions(**store, q);
    ASSERT_TRUE(rows.ok()) << rows.status();
    ASSERT_EQ(rows->size(), 1u);
    EXPECT_EQ((*rows)[0].gpu, "cpu");
    EXPECT_EQ((*rows)[0].config, "device=cpu,threads=2");
    EXPECT_EQ((*rows)[0].judgement.history_points, 7);
    EXPECT_DOUBLE_EQ((*rows)[0].judgement.latest, 70);
    EXPECT_EQ((*rows)[0].judgement.verdict, RegressionVerdict::kRegression);
    for (const int limit : {0, kMaxRegressionResults + 1}) {
      RegressionQuery bounded = q;
      bounded.limit = limit;
      const absl::Status s = FindRegressions(**store, bounded).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << limit;
      EXPECT_NE(s.message().find("must lie in [1, 100000]"), std::string::npos) << s;
    }
    q.metric = "nope";
    EXPECT_FALSE(FindRegressions(**store, q).ok());

    // Store::CountTrials (the coordinator's queue and lease gauges): 8 done trials, then a
    // second sweep of 3 queued ones, one of them leased.
    auto more = (*store)->CreateSweep(sweep, std::vector<TrialRecord>(3, trials[0]));
    ASSERT_TRUE(more.ok()) << more.status();
    ASSERT_TRUE((*store)->LeaseTrial(absl::StrCat(*more, "-0"), "agent-1", 1).ok());
    absl::StatusOr<TrialCounts> counts = (*store)->CountTrials();
    ASSERT_TRUE(counts.ok()) << counts.status();
    EXPECT_EQ(counts->done, 8);
    EXPECT_EQ(counts->queued, 2);
    EXPECT_EQ(counts->leased, 1);
    EXPECT_EQ(counts->cancelled, 0);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace infersweep
