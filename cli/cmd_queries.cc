// The query commands (docs/SERVICE.md, docs/RESULTS.md): `results` lists stored results as a
// table, CSV or JSON; `best` ranks the OK results of one (model identity, workload) group;
// `compare` sets two configs, or one config on two archs, side by side; `agents` lists the
// agents a coordinator knows.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api/status_macros.h"
#include "api/trial.h"
#include "cli/client_flags.h"
#include "cli/commands.h"
#include "cli/output.h"
#include "cli/result_rows.h"
#include "coordinator/client.h"
#include "coordinator/metrics.h"
#include "harness/report.h"
#include "proto/rpc.h"

namespace infersweep::cli {
namespace {

// ------------------------------------------------------------------------------ results

absl::StatusOr<int64_t> ParseTimeArg(const std::string& text, const char* flag) {
  absl::Duration ago;
  if (absl::ParseDuration(text, &ago)) return absl::ToUnixMillis(absl::Now() - ago);
  absl::Time t;
  std::string err;
  if (absl::ParseTime(absl::RFC3339_full, text, &t, &err) ||
      absl::ParseTime("%Y-%m-%d", text, absl::LocalTimeZone(), &t, &err))
    return absl::ToUnixMillis(t);
  return absl::InvalidArgumentError(absl::StrCat(
      flag, " '", text, "': expected a duration ago (24h, 30m), a date (2025-01-31) or RFC 3339"));
}

struct ResultsArgs {
  std::string coordinator = DefaultCoordinator();
  IdentityArgs identity;
  std::string sm_arch, gpu, model, status, since, until, format = "table";
  std::vector<std::string> axes;
  int limit = rpc::kDefaultQueryRows;
  bool show_kernels = false;
};

void PrintResultsTable(const std::vector<Row>& rows, const std::string& context,
                       bool show_kernels) {
  Legend legend;
  std::printf("# infersweep results: %s\n", context.c_str());
  std::printf("#%6s %-10s %-14s %-22s %6s %-5s %-5s %-38s %5s %-11s %9s %9s %10s %10s %6s\n",
              "sweep", " trial", " agent", " gpu", "sm", " model", " load", " config", "batch",
              " status", "ttft", "tpot", "out", "prefill", "top1");
  std::printf("#%6s %-10s %-14s %-22s %6s %-5s %-5s %-38s %5s %-11s %9s %9s %10s %10s %6s\n", "",
              "", "", "", "", " (M#)", " (W#)", "", "", "", "(ms)", "(ms)", "(tok/s)", "(tok/s)",
              "(%)");
  for (const Row& row : rows) {
    const TrialResult& r = row.result;
    const std::string config = BackendConfigString(r.config);
    const std::string status = S(TrialStatusName(r.status));
    const std::string agent = row.agent_id.empty() ? "(coordinator)" : row.agent_id;
    const std::string model = legend.Model(row.model_key);
    const std::string workload = legend.Workload(row.workload);
    if (r.batches.empty()) {
      std::printf(" %6lld %-10s %-14s %-22s %6s %-5s %-5s %-38s %5s %-11s %9s %9s %10s %10s %6s\n",
                  static_cast<long long>(row.sweep_id), r.trial_id.c_str(), agent.c_str(),
                  row.gpu_name.c_str(), SmColumn(row.sm).c_str(), model.c_str(), workload.c_str(),
                  config.c_str(), "-", status.c_str(), "-", "-", "-", "-", "-");
      for (const ServingPoint& p : r.serving)
        std::printf("#   %s %s\n", r.trial_id.c_str(), ServingPointText(p).c_str());
      if (r.slo_search)
        std::printf("#   %s slo search: %s\n", r.trial_id.c_str(),
                    r.slo_search->best ? absl::StrCat("highest load meeting it ",
                                                      ServingPointText(*r.slo_search->best))
                                             .c_str()
                                       : "no probed load meets it");
      if (!r.reason.empty()) std::printf("#   %s: %s\n", r.trial_id.c_str(), r.reason.c_str());
      continue;
    }
    for (const BatchFigures& b : r.batches) {
      if (!b.measured()) {
        std::printf(" %6lld %-10s %-14s %-22s %6s %-5s %-5s %-38s %5d %-11s %s: %s\n",
                    static_cast<long long>(row.sweep_id), r.trial_id.c_str(), agent.c_str(),
                    row.gpu_name.c_str(), SmColumn(row.sm).c_str(), model.c_str(), workload.c_str(),
                    config.c_str(), b.batch, status.c_str(),
                    S(BatchMemoryVerdictName(*b.memory_verdict)).c_str(), b.memory_reason.c_str());
        continue;
      }
      std::printf(
          " %6lld %-10s %-14s %-22s %6s %-5s %-5s %-38s %5d %-11s %9.2f %9.3f %10.1f %10.1f "
          "%6.1f\n",
          static_cast<long long>(row.sweep_id), r.trial_id.c_str(), agent.c_str(),
          row.gpu_name.c_str(), SmColumn(row.sm).c_str(), model.c_str(), workload.c_str(),
          config.c_str(), b.batch, status.c_str(), b.ttft_ms.median, b.tpot_ms.median,
          b.output_tok_s.median, b.prefill_tok_s.median, 100 * r.verdict.top1_agreement);
    }
    if (show_kernels)
      for (const BatchFigures& b : r.batches) {
        std::printf("#   %s batch %d: what ran\n", r.trial_id.c_str(), b.batch);
        std::fputs(FormatKernels(b).c_str(), stdout);
      }
    if (r.status != TrialStatus::kOk && !r.reason.empty())
      std::printf("#   %s: %s\n", r.trial_id.c_str(), r.reason.c_str());
  }
  std::printf("# %zu result(s); model identities (M#) and workloads (W#), ? where unknown:\n",
              rows.size());
  legend.Print();
}

void PrintResultsCsv(const std::vector<Row>& rows) {
  std::printf(
      "sweep_id,trial_id,attempt,agent_id,gpu_name,sm,model,model_key,workload,engine_version,"
      "software,config,status,batch,ttft_ms,tpot_ms,output_tok_s,prefill_tok_s,top1_agreement,"
      "kl_mean,peak_memory_bytes,finished_unix_ms,reason\n");
  for (const Row& row : rows) {
    const TrialResult& r = row.result;
    const std::string prefix = absl::StrCat(
        row.sweep_id, ",", CsvField(r.trial_id), ",", r.attempt, ",", CsvField(row.agent_id), ",",
        CsvField(row.gpu_name), ",", row.sm, ",", CsvField(r.model), ",", CsvField(row.model_key),
        ",", CsvField(row.workload), ",", CsvField(row.engine_version), ",", CsvField(row.software),
        ",", CsvField(BackendConfigString(r.config)), ",", S(TrialStatusName(r.status)));
    const std::string suffix =
        absl::StrCat(absl::StrFormat("%.6g", r.verdict.top1_agreement), ",",
                     absl::StrFormat("%.6g", r.verdict.kl_mean), ",", r.peak_memory_bytes, ",",
                     r.finished_unix_ms, ",", CsvField(r.reason));
    if (r.batches.empty()) {
      std::printf("%s,,,,,,%s\n", prefix.c_str(), suffix.c_str());
      continue;
    }
    for (const BatchFigures& b : r.batches) {
      if (!b.measured()) {  // no figures: the batch's memory verdict in the reason column
        std::printf("%s,%d,,,,,%s\n", prefix.c_str(), b.batch,
                    absl::StrCat(absl::StrFormat("%.6g", r.verdict.top1_agreement), ",",
                                 absl::StrFormat("%.6g", r.verdict.kl_mean), ",",
                                 r.peak_memory_bytes, ",", r.finished_unix_ms, ",",
                                 CsvField(absl::StrCat(S(BatchMemoryVerdictName(*b.memory_verdict)),
                                                       ": ", b.memory_reason)))
                        .c_str());
        continue;
      }
      std::printf("%s,%d,%.6g,%.6g,%.6g,%.6g,%s\n", prefix.c_str(), b.batch, b.ttft_ms.median,
                  b.tpot_ms.median, b.output_tok_s.median, b.prefill_tok_s.median, suffix.c_str());
    }
  }
}

absl::StatusOr<int> RunResults(const ResultsArgs& args) {
  if (args.limit < 1 || args.limit > rpc::kMaxQueryRows)
    return absl::InvalidArgumentError(absl::StrCat(
        "--limit ", args.limit, ": must lie in [1, ", rpc::kMaxQueryRows,
        "] (the coordinator returns at most ", rpc::kMaxQueryRows, " results a query)"));
  v1::QueryResultsRequest req;
  IdentityArgs identity = args.identity;
  RETURN_IF_ERROR(CheckIdentityArgs(&identity));
  ApplyIdentity(identity, &req);
  std::vector<std::string> context = IdentityContext(identity);
  if (!args.sm_arch.empty()) {
    ASSIGN_OR_RETURN(const int sm, SmArchFlag(args.sm_arch));
    req.set_sm(sm);
    context.push_back(SmArchLabel(sm));
  }
  if (!args.gpu.empty()) {
    req.set_gpu_name(args.gpu);
    context.push_back(absl::StrCat("gpu '", args.gpu, "'"));
  }
  if (!args.model.empty()) {
    req.set_model(args.model);
    context.push_back(absl::StrCat("model ", args.model));
  }
  if (!args.status.empty()) {
    req.set_status(args.status);
    context.push_back(absl::StrCat("status ", args.status));
  }
  for (const std::string& a : args.axes) {
    std::pair<std::string, std::string> kv = absl::StrSplit(a, absl::MaxSplits('=', 1));
    if (kv.first.empty() || kv.second.empty())
      return absl::InvalidArgumentError(absl::StrCat("--axis '", a, "': expected axis=value"));
    (*req.mutable_axis_values())[kv.first] = kv.second;
    context.push_back(a);
  }
  if (!args.since.empty()) {
    ASSIGN_OR_RETURN(const int64_t t, ParseTimeArg(args.since, "--since"));
    req.set_since_unix_ms(t);
    context.push_back(absl::StrCat("since ", FormatUnixMs(t)));
  }
  if (!args.until.empty()) {
    ASSIGN_OR_RETURN(const int64_t t, ParseTimeArg(args.until, "--until"));
    req.set_until_unix_ms(t);
    context.push_back(absl::StrCat("until ", FormatUnixMs(t)));
  }
  if (args.format != "table" && args.format != "csv" && args.format != "json")
    return absl::InvalidArgumentError(
        absl::StrCat("--format '", args.format, "': expected table, csv or json"));
  req.set_limit(args.limit);
  req.set_with_kernels(args.show_kernels || args.format == "json");
  ASSIGN_OR_RETURN(ServiceClient client, UserClient(args.coordinator));
  ASSIGN_OR_RETURN(const v1::QueryResultsResponse resp, client.QueryResults(req));
  std::vector<Row> rows;
  for (const v1::ResultRow& r : resp.rows()) {
    ASSIGN_OR_RETURN(Row row, ParseRow(r));
    rows.push_back(std::move(row));
  }
  if (args.format == "json") {
    nlohmann::json out = nlohmann::json::array();
    for (const Row& row : rows) out.push_back(RowJson(row));
    std::printf("%s\n", out.dump(1).c_str());
  } else if (args.format == "csv") {
    PrintResultsCsv(rows);
  } else {
    PrintResultsTable(rows, context.empty() ? "all" : absl::StrJoin(context, ", "),
                      args.show_kernels);
  }
  if (resp.truncated())
    std::fprintf(stderr,
                 "warning: more results matched than fit into one reply; narrow the query\n");
  return 0;
}

// ------------------------------------------------------------------------------ best, compare

// The winner's config and where it ran, as `best` heads its figures.
void PrintWinner(const Row& row) {
  const TrialResult& r = row.result;
  std::printf("# config        %s\n", BackendConfigString(r.config).c_str());
  std::printf("# trial         %s attempt %d (sweep %lld), agent %s, %s\n", r.trial_id.c_str(),
              r.attempt, static_cast<long long>(row.sweep_id), row.agent_id.c_str(),
              DeviceText(row.gpu_name, row.sm).c_str());
}

// A lockstep best's figures: the winning result's row for its batch.
void PrintFigures(const Row& row, int batch) {
  const TrialResult& r = row.result;
  const BatchFigures* b = FindBatch(r, batch);
  PrintWinner(row);
  if (b == nullptr) return;
  // roof: the decode step's share of the memory roofline; p_roof: the prefill's share of the
  // compute roofline (docs/METRICS.md); "-" where the device has no measured figures.
  auto percent = [](const std::optional<double>& f) {
    return f ? absl::StrFormat("%.1f", 100 * *f) : std::string("-");
  };
  std::printf("#%-16s %9s %9s %10s %10s %9s %6s %6s %6s\n", " batch", "ttft", "tpot", "out",
              "prefill", "itl_p99", "top1", "roof", "p_roof");
  std::printf("#%-16s %9s %9s %10s %10s %9s %6s %6s %6s\n", "", "(ms)", "(ms)", "(tok/s)",
              "(tok/s)", "(ms)", "(%)", "(%)", "(%)");
  std::printf(" %-16d %9.2f %9.3f %10.1f %10.1f %9.3f %6.1f %6s %6s\n", b->batch, b->ttft_ms.median,
              b->tpot_ms.median, b->output_tok_s.median, b->prefill_tok_s.median, b->itl_ms.p99,
              100 * r.verdict.top1_agreement, percent(b->roofline_fraction).c_str(),
              percent(b->prefill_roofline_fraction).c_str());
}

// A (model identity, workload) group, as `best` and `compare` list them (and its load point,
// for serving groups).
struct Group {
  std::string model_key, workload, load_point;
  int64_t ok_results = 0;
  int64_t first_sweep = 0, last_sweep = 0;
};

// Lists the groups a query could mean, with the flags that pick each, and returns the usage
// exit code: the tool never ranks across them.
int AskForGroup(const std::string& what, const std::vector<Group>& groups) {
  std::fprintf(stderr,
               "error: %s spans %zu (model identity, workload) groups, which are never ranked "
               "together; choose one with --model-key (or --layers) and --workload, or --sweep:\n",
               what.c_str(), groups.size());
  const bool serving = !groups.empty() && !groups[0].load_point.empty();
  if (serving)
    std::fprintf(stderr, "#  serving groups are keyed by their load point too (--load-point)\n");
  std::fprintf(stderr, "#  %-60s %-30s %s%10s %s\n", "model identity (--model-key)",
               "workload (--workload)", serving ? "load point (--load-point)   " : "", "OK results",
               "sweeps");
  for (const Group& g : groups)
    std::fprintf(
        stderr, "   %-60s %-30s %s%10lld %s\n", Unknown(g.model_key).c_str(),
        Unknown(g.workload).c_str(), serving ? absl::StrFormat("%-28s", g.load_point).c_str() : "",
        static_cast<long long>(g.ok_results),
        g.first_sweep == g.last_sweep ? absl::StrCat(g.first_sweep).c_str()
                                      : absl::StrCat(g.first_sweep, "-", g.last_sweep).c_str());
  return kUsageError;
}

struct BestArgs {
  std::string coordinator = DefaultCoordinator();
  std::string model, sm_arch, metric = "output_tok_s", format = "table";
  int batch = 1;
  bool serving = false;
  std::string load_point;
  IdentityArgs identity;
};

// A serving best's figures: the winning result's row for its load point.
void PrintServingFigures(const Row& row, const std::string& load_point) {
  PrintWinner(row);
  for (const ServingPoint& p : row.result.serving)
    if (LoadPointName(p.point) == load_point)
      std::printf("# serving       %s\n", ServingPointText(p).c_str());
}

absl::StatusOr<int> RunBest(const BestArgs& args) {
  ASSIGN_OR_RETURN(const int sm, SmArchFlag(args.sm_arch));
  RETURN_IF_ERROR(CheckBatchFlag(args.batch));
  if (args.format != "table" && args.format != "json")
    return absl::InvalidArgumentError(
        absl::StrCat("--format '", args.format, "': expected table or json"));
  if (args.model.empty() && args.identity.sweep <= 0)
    return absl::InvalidArgumentError("best needs --model, or --sweep (whose model it ranks)");
  IdentityArgs identity = args.identity;
  RETURN_IF_ERROR(CheckIdentityArgs(&identity));
  v1::BestRequest req;
  req.set_model(args.model);
  req.set_sm(sm);
  req.set_metric(args.metric);
  req.set_batch(args.batch);
  req.set_serving(args.serving);
  if (!args.load_point.empty()) req.set_load_point(args.load_point);
  ApplyIdentity(identity, &req);
  ASSIGN_OR_RETURN(ServiceClient client, UserClient(args.coordinator));
  ASSIGN_OR_RETURN(const v1::BestResponse resp, client.Best(req));
  // The coordinator answers from serving load points when the request names one, asks for
  // them, or names a metric only they have; its groups then carry their load point.
  const bool serving = args.serving || !args.load_point.empty() || args.metric == "goodput" ||
                       args.metric == "output_tok_s_per_user" || args.metric == "p99_ttft_ms" ||
                       args.metric == "p99_tpot_ms" ||
                       (resp.groups_size() > 0 && !resp.groups(0).load_point().empty());
  const std::string scope =
      serving ? absl::StrCat(resp.model(), " on ", SmArchLabel(sm), " serving at ",
                             resp.groups_size() == 1   ? resp.groups(0).load_point()
                             : args.load_point.empty() ? std::string("any load point")
                                                       : args.load_point)
              : absl::StrCat(resp.model(), " on ", SmArchLabel(sm), " at batch ", args.batch);
  if (resp.groups_size() > 1) {
    std::vector<Group> groups;
    for (const v1::ResultGroup& g : resp.groups())
      groups.push_back({g.model_key(), g.workload(), g.load_point(), g.ok_results(),
                        g.first_sweep(), g.last_sweep()});
    return AskForGroup(absl::StrCat("best ", args.metric, " for ", scope), groups);
  }
  // The configs that do not fit at this batch size, per GPU: an answer too, beside the best.
  auto print_does_not_fit = [&] {
    for (const v1::MemoryVerdictRow& m : resp.does_not_fit())
      std::printf("# %s on %s at batch %d: %s (trial %s, sweep %lld): %s\n", m.config().c_str(),
                  m.gpu_name().c_str(), m.batch(),
                  m.verdict() == "DOES_NOT_FIT" ? "does not fit" : "ran out of memory",
                  m.trial_id().c_str(), static_cast<long long>(m.sweep_id()), m.reason().c_str());
  };
  auto does_not_fit_json = [&] {
    nlohmann::json rows = nlohmann::json::array();
    for (const v1::MemoryVerdictRow& m : resp.does_not_fit())
      rows.push_back({{"config", m.config()},
                      {"gpu_name", m.gpu_name()},
                      {"batch", m.batch()},
                      {"verdict", m.verdict()},
                      {"reason", m.reason()},
                      {"trial_id", m.trial_id()},
                      {"sweep_id", m.sweep_id()}});
    return rows;
  };
  if (!resp.found()) {
    if (args.format == "json") {
      std::printf("%s\n",
                  resp.does_not_fit_size() == 0
                      ? "null"
                      : nlohmann::json{{"best", nullptr}, {"does_not_fit", does_not_fit_json()}}
                            .dump(1)
                            .c_str());
    } else {
      std::printf("# no OK result for %s with %s\n", scope.c_str(), args.metric.c_str());
      print_does_not_fit();
    }
    return 1;
  }
  ASSIGN_OR_RETURN(const Row row, ParseRow(resp.row()));
  if (args.format == "json") {
    nlohmann::json out = RowJson(row);
    if (resp.does_not_fit_size() > 0) out["does_not_fit"] = does_not_fit_json();
    std::printf("%s\n", out.dump(1).c_str());
    return 0;
  }
  const v1::ResultGroup& group = resp.groups(0);
  std::printf("# best %s for %s\n", args.metric.c_str(), scope.c_str());
  std::printf("# ranked within: model %s, workload %s (%lld OK results, sweeps %lld-%lld)\n",
              Unknown(group.model_key()).c_str(), Unknown(group.workload()).c_str(),
              static_cast<long long>(group.ok_results()),
              static_cast<long long>(group.first_sweep()),
              static_cast<long long>(group.last_sweep()));
  if (serving) {
    PrintServingFigures(row, group.load_point());
  } else {
    PrintFigures(row, args.batch);
  }
  print_does_not_fit();
  std::printf("%s\n", BackendConfigString(row.result.config).c_str());
  return 0;
}

struct CompareArgs {
  std::string coordinator = DefaultCoordinator();
  std::string model;
  std::vector<std::string> configs;
  std::vector<std::string> sm_archs;
  int batch = 1;
  IdentityArgs identity;
};

// The OK results with figures at `batch` matching a partial config on one arch, grouped by
// (model identity, workload).
using GroupKey = std::pair<std::string, std::string>;
absl::StatusOr<std::map<GroupKey, std::vector<Row>>> MatchingByGroup(ServiceClient& client,
                                                                     const std::string& model,
                                                                     const BackendConfig& config,
                                                                     int sm, int batch,
                                                                     const IdentityArgs& identity) {
  v1::QueryResultsRequest req;
  req.set_model(model);
  req.set_sm(sm);
  req.set_status("OK");
  req.set_limit(rpc::kMaxQueryRows);
  req.set_with_kernels(true);  // compare says what each side ran
  ApplyIdentity(identity, &req);
  for (const auto& [axis, value] : config) (*req.mutable_axis_values())[axis] = value;
  ASSIGN_OR_RETURN(const v1::QueryResultsResponse resp, client.QueryResults(req));
  std::map<GroupKey, std::vector<Row>> out;
  for (const v1::ResultRow& r : resp.rows()) {
    ASSIGN_OR_RETURN(Row row, ParseRow(r));
    if (FindBatch(row.result, batch) == nullptr) continue;
    out[{row.model_key, row.workload}].push_back(std::move(row));
  }
  return out;
}

std::optional<Row> Fastest(const std::vector<Row>& rows, int batch) {
  std::optional<Row> best;
  double best_tok_s = -1;
  for (const Row& row : rows) {
    const BatchFigures* b = FindBatch(row.result, batch);
    if (b != nullptr && b->output_tok_s.median > best_tok_s) {
      best_tok_s = b->output_tok_s.median;
      best = row;
    }
  }
  return best;
}

absl::StatusOr<int> RunCompare(const CompareArgs& args) {
  if (args.model.empty()) return absl::InvalidArgumentError("--model is required");
  RETURN_IF_ERROR(CheckBatchFlag(args.batch));
  IdentityArgs identity = args.identity;
  RETURN_IF_ERROR(CheckIdentityArgs(&identity));
  std::vector<std::pair<std::string, int>> sides;  // config text, sm
  std::vector<int> sms;
  for (const std::string& a : args.sm_archs) {
    ASSIGN_OR_RETURN(const int sm, SmArchFlag(a));
    sms.push_back(sm);
  }
  if (args.configs.size() == 2 && sms.size() == 1) {
    sides = {{args.configs[0], sms[0]}, {args.configs[1], sms[0]}};
  } else if (args.configs.size() == 1 && sms.size() == 2) {
    sides = {{args.configs[0], sms[0]}, {args.configs[0], sms[1]}};
  } else {
    return absl::InvalidArgumentError(
        "compare takes two --config on one --sm-arch, or one --config on two --sm-arch");
  }
  ASSIGN_OR_RETURN(ServiceClient client, UserClient(args.coordinator));
  std::vector<std::map<GroupKey, std::vector<Row>>> by_side;
  for (const auto& [text, sm] : sides) {
    absl::StatusOr<BackendConfig> config = ParseBackendConfig(text);
    if (!config.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("--config '", text, "': ", config.status().message()));
    ASSIGN_OR_RETURN(auto rows,
                     MatchingByGroup(client, args.model, *config, sm, args.batch, identity));
    by_side.push_back(std::move(rows));
  }
  // The two sides are compared within one (model identity, workload) both measured.
  std::vector<GroupKey> common;
  for (const auto& [key, rows] : by_side[0])
    if (by_side[1].count(key)) common.push_back(key);
  auto side_text = [&](size_t i) {
    return absl::StrCat(sides[i].first, " on ", SmArchLabel(sides[i].second));
  };
  auto groups_of = [&](const std::vector<GroupKey>& keys) {
    std::vector<Group> out;
    for (const GroupKey& k : keys) {
      Group g{k.first, k.second, "", 0, 0, 0};
      for (const auto& side : by_side) {
        auto it = side.find(k);
        if (it == side.end()) continue;
        for (const Row& r : it->second) {
          ++g.ok_results;
          g.first_sweep = g.first_sweep == 0 ? r.sweep_id : std::min(g.first_sweep, r.sweep_id);
          g.last_sweep = std::max(g.last_sweep, r.sweep_id);
        }
      }
      out.push_back(g);
    }
    return out;
  };
  if (common.size() > 1)
    return AskForGroup(absl::StrCat("compare of ", args.model, " at batch ", args.batch),
                       groups_of(common));
  std::vector<std::optional<Row>> found(2);
  if (common.size() == 1) {
    for (size_t i = 0; i < 2; ++i) found[i] = Fastest(by_side[i][common[0]], args.batch);
  } else if (!by_side[0].empty() && !by_side[1].empty()) {
    std::fprintf(stderr,
                 "error: A (%s) and B (%s) have OK results at batch %d, but never of the same "
                 "(model identity, workload); they measured different things:\n",
                 side_text(0).c_str(), side_text(1).c_str(), args.batch);
    for (size_t i = 0; i < 2; ++i)
      for (const auto& [key, rows] : by_side[i])
        std::fprintf(stderr, "  %c: %s | %s (%zu results)\n", static_cast<char>('A' + i),
                     Unknown(key.first).c_str(), Unknown(key.second).c_str(), rows.size());
    return 1;
  } else {
    for (size_t i = 0; i < 2; ++i)
      if (by_side[i].size() == 1) found[i] = Fastest(by_side[i].begin()->second, args.batch);
  }
  std::printf(
      "# infersweep compare: %s, batch %d; each side is its fastest OK result (output "
      "tok/s)\n",
      args.model.c_str(), args.batch);
  if (common.size() == 1)
    std::printf("# within: model %s, workload %s\n", Unknown(common[0].first).c_str(),
                Unknown(common[0].second).c_str());
  for (size_t i = 0; i < sides.size(); ++i)
    std::printf("# %c: %s%s\n", static_cast<char>('A' + i), side_text(i).c_str(),
                found[i] ? "" : "  -- no OK result");
  auto cell = [&](size_t i, auto get) -> std::string {
    if (!found[i]) return "-";
    const BatchFigures* b = FindBatch(found[i]->result, args.batch);
    if (b == nullptr) return "-";
    return absl::StrFormat("%.4g", get(found[i]->result, *b));
  };
  auto value = [&](size_t i, auto get) -> std::optional<double> {
    if (!found[i]) return std::nullopt;
    const BatchFigures* b = FindBatch(found[i]->result, args.batch);
    if (b == nullptr) return std::nullopt;
    return get(found[i]->result, *b);
  };
  std::printf("#%-26s %-40s %-40s %8s\n", " metric", " A", " B", "B/A");
  auto text_row = [&](const char* name, auto get) {
    std::printf(" %-26s %-40s %-40s %8s\n", name, found[0] ? get(*found[0]).c_str() : "-",
                found[1] ? get(*found[1]).c_str() : "-", "");
  };
  text_row("config", [](const Row& r) { return BackendConfigString(r.result.config); });
  text_row("gpu", [](const Row& r) { return DeviceText(r.gpu_name, r.sm); });
  text_row("agent", [](const Row& r) { return r.agent_id; });
  text_row("trial", [](const Row& r) {
    return absl::StrCat(r.result.trial_id, " (sweep ", r.sweep_id, ")");
  });
  auto num_row = [&](const char* name, auto get) {
    const auto a = value(0, get), b = value(1, get);
    const std::string ratio = a && b && *a != 0 ? absl::StrFormat("%.3g", *b / *a) : "-";
    std::printf(" %-26s %-40s %-40s %8s\n", name, cell(0, get).c_str(), cell(1, get).c_str(),
                ratio.c_str());
  };
  num_row("ttft (ms)", [](const TrialResult&, const BatchFigures& b) { return b.ttft_ms.median; });
  num_row("tpot (ms)", [](const TrialResult&, const BatchFigures& b) { return b.tpot_ms.median; });
  num_row("output (tok/s)",
          [](const TrialResult&, const BatchFigures& b) { return b.output_tok_s.median; });
  num_row("output per seq (tok/s)",
          [](const TrialResult&, const BatchFigures& b) { return b.output_tok_s_per_seq.median; });
  num_row("prefill (tok/s)",
          [](const TrialResult&, const BatchFigures& b) { return b.prefill_tok_s.median; });
  num_row("itl p99 (ms)", [](const TrialResult&, const BatchFigures& b) { return b.itl_ms.p99; });
  num_row("peak memory (MiB)", [](const TrialResult& r, const BatchFigures&) {
    return static_cast<double>(r.peak_memory_bytes) / (1024.0 * 1024.0);
  });
  num_row("top1 agreement (%)",
          [](const TrialResult& r, const BatchFigures&) { return 100 * r.verdict.top1_agreement; });
  num_row("kl mean (nats)",
          [](const TrialResult& r, const BatchFigures&) { return r.verdict.kl_mean; });
  // What each side launched: a config string names axis values, not the kernels that ran (a
  // fused path can hand rows to a library, a graph can be skipped).
  if (found[0] && found[1]) {
    const BatchFigures* a = FindBatch(found[0]->result, args.batch);
    const BatchFigures* b = FindBatch(found[1]->result, args.batch);
    const bool same_config = BackendConfigString(found[0]->result.config) ==
                             BackendConfigString(found[1]->result.config);
    if (a != nullptr && b != nullptr) {
      if (!a->decode_kernels || !b->decode_kernels) {
        std::printf("# kernels: not compared (%s recorded no launch log)\n",
                    !a->decode_kernels ? "A" : "B");
      } else if (const std::vector<std::string> diff = KernelDifferences(*a, *b); diff.empty()) {
        std::printf("# kernels: A and B ran the same kernels\n");
      } else {
        std::printf("# kernels: %s\n",
                    same_config ? "A and B have the same config string but ran different kernels"
                                : "A and B ran different kernels");
        for (const std::string& line : diff) std::printf("#   %s\n", line.c_str());
      }
    }
  }
  return found[0] && found[1] ? 0 : 1;
}

// ------------------------------------------------------------------------------ agents

absl::StatusOr<int> RunAgents(const std::string& coordinator) {
  ASSIGN_OR_RETURN(ServiceClient client, UserClient(coordinator));
  ASSIGN_OR_RETURN(const v1::ListAgentsResponse resp, client.ListAgents());
  std::printf("# infersweep agents at %s\n", coordinator.c_str());
  std::printf("#%-20s %-16s %-10s %7s %-40s %-19s %s\n", " agent", " host", " state", "free",
              " devices", " last seen", "running");
  std::printf("#%-20s %-16s %-10s %7s %-40s %-19s %s\n", "", "", "", "(slots)", " (name sm memory)",
              " (local time)", "(trials)");
  for (const v1::AgentInfo& a : resp.agents()) {
    std::string devices;
    if (a.gpus_size() == 0) {
      devices = "cpu";
    } else {
      std::vector<std::string> parts;
      for (const v1::Gpu& g : a.gpus())
        parts.push_back(
            absl::StrCat(g.name(), " ", SmArchLabel(g.sm()), " ", FormatBytes(g.memory_bytes())));
      devices = absl::StrJoin(parts, "; ");
    }
    const std::string free =
        a.connected() ? absl::StrCat(a.free_slots(), "/", a.slots()) : std::string("-");
    std::printf(
        " %-20s %-16s %-10s %7s %-40s %-19s %s\n", a.agent_id().c_str(), a.host().c_str(),
        a.connected() ? "connected" : "away", free.c_str(), devices.c_str(),
        FormatUnixMs(a.last_seen_unix_ms()).c_str(),
        a.running_trial_ids().empty() ? "-" : absl::StrJoin(a.running_trial_ids(), ",").c_str());
  }
  if (resp.agents().empty()) std::printf("# no agents have connected yet\n");
  return 0;
}

}  // namespace

void AddQueryCommands(CLI::App& app) {
  {
    static ResultsArgs args;
    CLI::App* cmd = app.add_subcommand("results", "query stored results");
    cmd->add_option("--coordinator", args.coordinator, "coordinator host:port")
        ->capture_default_str();
    AddUserClientFlags(cmd);
    AddIdentityFlags(cmd, &args.identity);
    cmd->add_option("--sm-arch", args.sm_arch,
                    "SM architecture: sm_90, 90, sm_90a, or cpu (CPU results)");
    cmd->add_option("--gpu", args.gpu, "GPU name, exactly as the agent reports it");
    cmd->add_option("--model", args.model, "model (checkpoint folder or preset:NAME)");
    cmd->add_option("--axis", args.axes, "axis=value the config must have (repeatable)");
    cmd->add_option("--status", args.status, "OK, INCORRECT, CRASHED, UNSUPPORTED, TIMEOUT, ERROR");
    cmd->add_option("--since", args.since, "finished at or after: 24h (ago), 2025-01-31, RFC 3339");
    cmd->add_option("--until", args.until, "finished before (same forms as --since)");
    cmd->add_option("--limit", args.limit,
                    absl::StrCat("at most this many results, newest first: 1 to ",
                                 rpc::kMaxQueryRows, " (the coordinator's cap)"))
        ->capture_default_str();
    cmd->add_option("--format", args.format, "table, csv or json")->capture_default_str();
    cmd->add_flag("--show-kernels", args.show_kernels,
                  "table: under each result, the kernels each phase launched at each batch, "
                  "graph replays and fallbacks (docs/RESULTS.md; the JSON always has them)");
    cmd->callback([] { std::exit(ExitCode(RunResults(args))); });
  }
  {
    static BestArgs args;
    CLI::App* cmd = app.add_subcommand(
        "best",
        "the fastest OK config for a model on an arch, within one model identity and "
        "workload");
    cmd->add_option("--coordinator", args.coordinator, "coordinator host:port")
        ->capture_default_str();
    AddUserClientFlags(cmd);
    cmd->add_option("--model", args.model, "model (default with --sweep: the sweep's)");
    cmd->add_option("--sm-arch", args.sm_arch,
                    "SM architecture: sm_90, 90, sm_90a, or cpu (CPU results)")
        ->required();
    cmd->add_option("--metric", args.metric,
                    "lockstep batches: output_tok_s, ttft_ms, tpot_ms or prefill_tok_s; serving "
                    "load points: goodput, output_tok_s, output_tok_s_per_user, p99_ttft_ms or "
                    "p99_tpot_ms")
        ->capture_default_str();
    cmd->add_option("--batch", args.batch,
                    absl::StrCat("lockstep batch size the metric is read at, 1 to ", kMaxBatchSize))
        ->capture_default_str();
    cmd->add_flag("--serving", args.serving,
                  "rank serving load points, never lockstep batches (implied by --load-point "
                  "and by a metric only serving points have)");
    cmd->add_option("--load-point", args.load_point,
                    "the serving load point: concurrency=4, rate=2 or rate=2,max_concurrency=8");
    AddIdentityFlags(cmd, &args.identity);
    cmd->add_option("--format", args.format, "table or json")->capture_default_str();
    cmd->callback([] { std::exit(ExitCode(RunBest(args))); });
  }
  {
    static CompareArgs args;
    CLI::App* cmd = app.add_subcommand(
        "compare", "two configs on one arch, or one config on two archs, side by side");
    cmd->add_option("--coordinator", args.coordinator, "coordinator host:port")
        ->capture_default_str();
    AddUserClientFlags(cmd);
    cmd->add_option("--model", args.model, "model")->required();
    cmd->add_option("--config", args.configs,
                    "axis=value,... (partial configs match any value of "
                    "the axes they leave out)");
    cmd->add_option("--sm-arch", args.sm_archs,
                    "SM architecture(s): sm_90, 90, sm_90a, or cpu (CPU results)");
    cmd->add_option("--batch", args.batch, absl::StrCat("batch size, 1 to ", kMaxBatchSize))
        ->capture_default_str();
    AddIdentityFlags(cmd, &args.identity);
    cmd->callback([] { std::exit(ExitCode(RunCompare(args))); });
  }
  {
    static std::string coordinator = DefaultCoordinator();
    CLI::App* cmd = app.add_subcommand("agents", "agents known to the coordinator");
    cmd->add_option("--coordinator", coordinator, "coordinator host:port")->capture_default_str();
    AddUserClientFlags(cmd);
    cmd->callback([] { std::exit(ExitCode(RunAgents(coordinator))); });
  }
}

}  // namespace infersweep::cli
