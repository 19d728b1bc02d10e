// Observability commands (docs/OBSERVABILITY.md): `regressions` judges the latest result of every
// series in a coordinator's database against its history with a noise-aware test.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "cli/client_flags.h"
#include "cli/commands.h"
#include "cli/output.h"
#include "cli/result_rows.h"
#include "coordinator/client.h"
#include "coordinator/regressions.h"
#include "storage/store.h"

namespace infersweep::cli {
namespace {

constexpr int kRegressionsFound = 3;

struct RegressionsArgs {
  std::string coordinator;
  std::string db;
  int window = 10;
  int min_history = 5;
  std::string metric = "output_tok_s";
  std::string test = "z";
  double z_threshold = 3.5;
  double iqr_k = 1.5;
  double min_change_pct = 2;
  std::string model;
  std::string sm_arch;
  int64_t sweep = 0;
  std::string workload;
  std::string model_key;
  int layers = 0;
  int limit = kMaxRegressionResults;
  bool flagged_only = false;
  bool fail_on_regression = false;
};

// The same judgement made by the coordinator over its database (SweepService.Regressions).
absl::StatusOr<std::vector<RegressionRow>> RemoteRegressions(const std::string& coordinator,
                                                             const RegressionQuery& q) {
  v1::RegressionsRequest req;
  req.set_metric(q.metric);
  if (q.model) req.set_model(*q.model);
  if (q.sm) req.set_sm(*q.sm);
  if (q.sweep_id) req.set_sweep_id(*q.sweep_id);
  if (q.model_key) req.set_model_key(*q.model_key);
  if (q.workload) req.set_workload(*q.workload);
  if (q.layers) req.set_layers(*q.layers);
  req.set_window(q.options.window);
  req.set_min_history(q.options.min_history);
  req.set_test(q.options.test == RegressionTest::kIqr ? "iqr" : "z");
  req.set_z_threshold(q.options.z_threshold);
  req.set_iqr_k(q.options.iqr_k);
  req.set_min_change(q.options.min_change);
  req.set_limit(q.limit);
  ASSIGN_OR_RETURN(ServiceClient client, UserClient(coordinator, 120'000));
  ASSIGN_OR_RETURN(const v1::RegressionsResponse resp, client.Regressions(req));
  std::vector<RegressionRow> rows;
  for (const v1::RegressionSeries& s : resp.series()) rows.push_back(FromProto(s));
  return rows;
}

int RunRegressions(const RegressionsArgs& args) {
  if (args.limit < 1 || args.limit > kMaxRegressionResults)
    return Usage(absl::StrCat("--limit ", args.limit, ": must lie in [1, ", kMaxRegressionResults,
                              "] (OK results read)"));
  RegressionQuery q;
  q.metric = args.metric;
  q.limit = args.limit;
  q.options.window = args.window;
  q.options.min_history = args.min_history;
  q.options.z_threshold = args.z_threshold;
  q.options.iqr_k = args.iqr_k;
  q.options.min_change = args.min_change_pct / 100.0;
  absl::StatusOr<RegressionTest> test = ParseRegressionTest(args.test);
  if (!test.ok()) return Usage(absl::StrCat("--test: ", test.status().message()));
  q.options.test = *test;
  if (absl::Status s = ValidateRegressionOptions(q.options); !s.ok())
    return Usage(std::string(s.message()));
  if (absl::StatusOr<Direction> d = MetricDirection(q.metric); !d.ok())
    return Usage(absl::StrCat("--metric: ", d.status().message()));
  if (!args.model.empty()) q.model = args.model;
  if (!args.sm_arch.empty()) {
    absl::StatusOr<int> sm = SmArchFlag(args.sm_arch);
    if (!sm.ok()) return Fail(sm.status());
    q.sm = *sm;
  }
  if (args.sweep < 0 || args.layers < 0) return Usage("--sweep and --layers must be >= 1");
  if (args.sweep > 0) q.sweep_id = args.sweep;
  if (args.layers > 0) q.layers = args.layers;
  if (!args.model_key.empty()) q.model_key = args.model_key == "unknown" ? "" : args.model_key;
  if (!args.workload.empty()) {
    absl::StatusOr<std::string> key = CanonicalWorkloadKey(args.workload);
    if (!key.ok()) return Usage(absl::StrCat("--workload: ", key.status().message()));
    q.workload = *key;
  }
  if (!args.db.empty() && !args.coordinator.empty())
    return Usage("--db and --coordinator are alternatives; give one");
  absl::StatusOr<std::vector<RegressionRow>> rows;
  if (!args.db.empty()) {
    // Store::Open would create an empty database: a typo in --db must be an error instead.
    std::error_code ec;
    if (!std::filesystem::is_regular_file(args.db, ec))
      return Usage(absl::StrCat("--db ", args.db, ": no such database file"));
    absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(args.db);
    if (!store.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(store.status().message()).c_str());
      return 1;
    }
    rows = FindRegressions(**store, q);
  } else {
    rows = RemoteRegressions(args.coordinator.empty() ? DefaultCoordinator() : args.coordinator, q);
  }
  if (!rows.ok()) return Fail(rows.status());
  bool regression = false;
  std::vector<RegressionRow> shown;
  for (RegressionRow& r : *rows) {
    const RegressionVerdict v = r.judgement.verdict;
    regression = regression || v == RegressionVerdict::kRegression;
    if (!args.flagged_only || v == RegressionVerdict::kRegression ||
        v == RegressionVerdict::kImprovement)
      shown.push_back(std::move(r));
  }
  std::fputs(FormatRegressionTable(shown, q).c_str(), stdout);
  return args.fail_on_regression && regression ? kRegressionsFound : 0;
}

}  // namespace

void AddObservabilityCommands(CLI::App& app) {
  static RegressionsArgs args;
  CLI::App* cmd = app.add_subcommand(
      "regressions",
      "judge the latest result of each (model identity, workload, sm, gpu, config, batch) "
      "against its history");
  cmd->add_option("--coordinator", args.coordinator,
                  "coordinator host:port (default: $INFERSWEEP_COORDINATOR or 127.0.0.1:7070)");
  cmd->add_option("--db", args.db,
                  "read this SQLite database directly instead of asking a coordinator");
  AddUserClientFlags(cmd);
  cmd->add_option("--window", args.window, "history: the previous N OK results of each series")
      ->capture_default_str();
  cmd->add_option("--min-history", args.min_history,
                  "fewer history points than this: too-few-points")
      ->capture_default_str();
  cmd->add_option("--metric", args.metric,
                  "output_tok_s, output_tok_s_per_seq, prefill_tok_s (higher is better), "
                  "ttft_ms, tpot_ms, latency_ms, itl_p99_ms (lower is better)")
      ->capture_default_str();
  cmd->add_option("--test", args.test,
                  "z: modified z-score (median, MAD) > --z; iqr: outside Tukey fences "
                  "Q1 - k*IQR, Q3 + k*IQR")
      ->capture_default_str();
  cmd->add_option("--z", args.z_threshold, "robust z threshold")->capture_default_str();
  cmd->add_option("--iqr-k", args.iqr_k, "IQR fence factor k")->capture_default_str();
  cmd->add_option("--min-change-pct", args.min_change_pct,
                  "changes smaller than this % of the history's median are never flagged")
      ->capture_default_str();
  cmd->add_option("--model", args.model, "only this model");
  cmd->add_option("--sm-arch", args.sm_arch,
                  "only this SM architecture: sm_90, 90, sm_90a, or cpu (CPU results)");
  cmd->add_option("--sweep", args.sweep, "only this sweep's results");
  cmd->add_option("--workload", args.workload, "only this workload: prompt=N,output=N[,warmup=N]");
  cmd->add_option("--layers", args.layers, "only models run with this many layers");
  cmd->add_option("--model-key", args.model_key,
                  "only this model identity (\"unknown\": results stored without one)");
  cmd->add_option(
         "--limit", args.limit,
         absl::StrCat("read at most this many newest OK results, 1 to ", kMaxRegressionResults))
      ->capture_default_str();
  cmd->add_flag("--flagged-only", args.flagged_only, "print only regressions and improvements");
  cmd->add_flag("--fail-on-regression", args.fail_on_regression,
                "exit with status 3 when any series regressed (for CI)");
  cmd->callback([] { std::exit(RunRegressions(args)); });
}

}  // namespace infersweep::cli
