#include "storage/queries.h"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "storage/codec.h"

namespace infersweep {
namespace {

using nlohmann::json;

// Columns every query returning a StoredResult selects, in this order (ReadResult's).
constexpr char kResultCols[] =
    "sweep_id, agent_id, gpu_name, sm, result_json, result_id, result_blob, model_key, workload, "
    "engine_version, software";

// A best query's group row from column `first` on: model key, workload, its OK results, first
// and last sweep, last finish time.
ResultGroup ReadResultGroup(Stmt& g, int first) {
  ResultGroup group;
  group.model_key = g.Text(first);
  group.workload = g.Text(first + 1);
  group.ok_results = g.Int(first + 2);
  group.first_sweep = g.Int(first + 3);
  group.last_sweep = g.Int(first + 4);
  group.last_finished_unix_ms = g.Int(first + 5);
  return group;
}

// Newest first: the group a fleet measured last leads the list a user chooses from; ties in
// name order.
bool NewerGroupFirst(const ResultGroup& a, const ResultGroup& b) {
  return std::tie(b.last_sweep, b.last_finished_unix_ms, a.model_key, a.workload, a.load_point) <
         std::tie(a.last_sweep, a.last_finished_unix_ms, b.model_key, b.workload, b.load_point);
}

// The N of " layers=N" in a ModelIdentityKey; 0 when it names none.
int ModelKeyLayers(const std::string& key) {
  const size_t at = key.find(" layers=");
  if (at == std::string::npos) return 0;
  return std::atoi(key.c_str() + at + 8);
}

struct MetricInfo {
  const char* name;
  const char* batch_column;  // its result_batches column
  bool higher_is_better;
};
constexpr MetricInfo kMetrics[] = {
    {"output_tok_s", "output_tok_s", true},
    {"ttft_ms", "ttft_ms", false},
    {"tpot_ms", "tpot_ms", false},
    {"prefill_tok_s", "prefill_tok_s", true},
};

// Serving metrics: their serving_points column. Goodput and the percentiles exist only for
// serving points, so naming one ranks serving points.
struct ServingMetricInfo {
  const char* name;
  const char* column;
  bool higher_is_better;
  bool serving_only;
};
constexpr ServingMetricInfo kServingMetrics[] = {
    {"goodput", "request_goodput", true, true},
    {"output_tok_s", "output_throughput", true, false},
    {"output_tok_s_per_user", "output_tok_s_per_user", true, true},
    {"p99_ttft_ms", "p99_ttft_ms", false, true},
    {"p99_tpot_ms", "p99_tpot_ms", false, true},
};

}  // namespace

absl::StatusOr<std::vector<StoredResult>> ResultQueries::Query(const ResultQuery& q, bool parse) {
  if (q.limit < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("QueryResults: limit must be >= 1, got ", q.limit));
  std::string sql = absl::StrCat("SELECT ", kResultCols, " FROM results WHERE 1");
  if (q.sm) absl::StrAppend(&sql, " AND sm = ?");
  if (q.gpu_name) absl::StrAppend(&sql, " AND gpu_name = ?");
  if (q.model) absl::StrAppend(&sql, " AND model = ?");
  if (q.model_key)
    absl::StrAppend(&sql, q.model_key->empty() ? " AND model_key IS NULL" : " AND model_key = ?");
  if (q.workload) absl::StrAppend(&sql, " AND workload = ?");
  if (q.layers) absl::StrAppend(&sql, " AND model_layers = ?");
  if (q.sweep_id) absl::StrAppend(&sql, " AND sweep_id = ?");
  if (q.status) absl::StrAppend(&sql, " AND status = ?");
  // Each axis narrows the configs (a few thousand rows at most), not the results.
  for (size_t i = 0; i < q.axis_values.size(); ++i)
    absl::StrAppend(&sql,
                    " AND config_id IN (SELECT config_id FROM config_axes "
                    "WHERE axis = ? AND value = ?)");
  if (q.since_unix_ms) absl::StrAppend(&sql, " AND finished_ms >= ?");
  if (q.until_unix_ms) absl::StrAppend(&sql, " AND finished_ms < ?");
  absl::StrAppend(&sql, " ORDER BY finished_ms DESC, result_id DESC LIMIT ?");

  ASSIGN_OR_RETURN(Stmt s, conn_.Prepare(sql, "querying results"));
  if (q.sm) s.Bind(*q.sm);
  if (q.gpu_name) s.Bind(*q.gpu_name);
  if (q.model) s.Bind(*q.model);
  if (q.model_key && !q.model_key->empty()) s.Bind(*q.model_key);
  if (q.workload) s.Bind(*q.workload);
  if (q.layers) s.Bind(*q.layers);
  if (q.sweep_id) s.Bind(*q.sweep_id);
  if (q.status) s.Bind(TrialStatusName(*q.status));
  for (const auto& [axis, value] : q.axis_values) s.Bind(axis).Bind(value);
  if (q.since_unix_ms) s.Bind(*q.since_unix_ms);
  if (q.until_unix_ms) s.Bind(*q.until_unix_ms);
  s.Bind(q.limit);
  std::vector<StoredResult> out;
  for (;;) {
    ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) break;
    ASSIGN_OR_RETURN(StoredResult r, ReadResult(s, parse, q.with_kernels));
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<StoredResult> ResultQueries::ReadResult(const Stmt& q, bool parse,
                                                       bool with_kernels) {
  StoredResult r;
  r.sweep_id = q.Int(0);
  r.agent_id = q.Text(1);
  r.gpu_name = q.Text(2);
  r.sm = static_cast<int>(q.Int(3));
  r.result_id = q.Int(5);
  const std::string where = absl::StrCat("result row ", r.result_id);
  if (q.IsNull(6)) {
    r.result_json = q.Text(4);  // stored before results were compressed
  } else {
    absl::StatusOr<std::string> text = DecompressResultJson(q.Blob(6));
    if (!text.ok()) return absl::DataLossError(absl::StrCat(where, ": ", text.status().message()));
    if (!with_kernels) {
      r.result_json = StripKernelLogRefs(*std::move(text));
    } else {
      ASSIGN_OR_RETURN(
          r.result_json,
          ExpandKernelLogRefs(*std::move(text), [&](int64_t id) -> absl::StatusOr<std::string> {
            conn_.mu().AssertHeld();  // called back within this call
            ASSIGN_OR_RETURN(const std::string* log, KernelLogLocked(id, where));
            return *log;
          }));
    }
  }
  auto optional_text = [&q](int col) -> std::optional<std::string> {
    if (q.IsNull(col)) return std::nullopt;
    return q.Text(col);
  };
  r.model_key = optional_text(7);
  r.workload = optional_text(8);
  r.engine_version = optional_text(9);
  r.software = optional_text(10);
  if (!parse) return r;
  ASSIGN_OR_RETURN(json j, ParseStoredJson(r.result_json, where));
  absl::StatusOr<TrialResult> result = TrialResultFromJson(j);
  if (!result.ok())
    return absl::DataLossError(absl::StrCat(where, ": ", result.status().message()));
  r.result = std::move(*result);
  // The columns are the identity of record: old results' JSON lacks what the migration derived.
  if (r.result.workload.empty() && r.workload) r.result.workload = *r.workload;
  return r;
}

absl::StatusOr<BestAnswer> ResultQueries::Best(const BestQuery& q) {
  const ServingMetricInfo* serving = nullptr;
  for (const ServingMetricInfo& m : kServingMetrics)
    if (q.metric == m.name) serving = &m;
  if (q.serving || q.load_point || (serving != nullptr && serving->serving_only)) {
    if (serving == nullptr)
      return absl::InvalidArgumentError(absl::StrCat(
          "Best: unknown serving metric '", q.metric,
          "' (known: goodput, output_tok_s, output_tok_s_per_user, p99_ttft_ms, p99_tpot_ms)"));
    return BestServingLocked(q, serving->column, serving->higher_is_better);
  }
  const MetricInfo* info = nullptr;
  for (const MetricInfo& m : kMetrics)
    if (q.metric == m.name) info = &m;
  if (info == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("Best: unknown metric '", q.metric,
                                                   "' (known: output_tok_s, ttft_ms, tpot_ms, "
                                                   "prefill_tok_s)"));
  if (q.batch < 1 || q.batch > kMaxBatchSize)
    return absl::InvalidArgumentError(
        absl::StrCat("Best: batch ", q.batch, " must lie in [1, ", kMaxBatchSize, "]"));
  const std::string op = absl::StrCat("finding the best ", q.metric, " at batch ", q.batch, " for ",
                                      q.model, " on sm ", q.sm);
  BestAnswer answer;
  std::vector<int64_t> group_ids;  // parallel to answer.groups
  {
    // The groups with OK figures: the kept counts, or (within one sweep) the sweep's own rows
    // of each group, one key range each.
    std::string sql =
        q.sweep_id ? "SELECT g.group_id, g.model_key, g.workload, COUNT(*), MIN(b.sweep_id), "
                     "MAX(b.sweep_id), MAX(r.finished_ms) FROM result_groups AS g "
                     "JOIN result_batches AS b ON b.group_id = g.group_id AND b.sweep_id = ? "
                     "JOIN results AS r ON r.result_id = b.result_id "
                     "WHERE g.model = ? AND g.sm = ? AND g.batch = ? AND b.ok = 1"
                   : "SELECT g.group_id, g.model_key, g.workload, g.ok_results, g.first_sweep, "
                     "g.last_sweep, g.last_finished_ms FROM result_groups AS g "
                     "WHERE g.model = ? AND g.sm = ? AND g.batch = ? AND g.ok_results > 0";
    if (q.model_key) absl::StrAppend(&sql, " AND g.model_key = ?");
    if (q.workload) absl::StrAppend(&sql, " AND g.workload = ?");
    if (q.sweep_id) absl::StrAppend(&sql, " GROUP BY g.group_id");
    ASSIGN_OR_RETURN(Stmt g, conn_.Prepare(sql, op));
    if (q.sweep_id) g.Bind(*q.sweep_id);
    g.Bind(q.model).Bind(q.sm).Bind(q.batch);
    if (q.model_key) g.Bind(*q.model_key);
    if (q.workload) g.Bind(*q.workload);
    std::vector<std::pair<ResultGroup, int64_t>> found;
    for (;;) {
      ASSIGN_OR_RETURN(bool row, g.Step());
      if (!row) break;
      ResultGroup group = ReadResultGroup(g, 1);
      if (q.layers && ModelKeyLayers(group.model_key) != *q.layers) continue;
      found.emplace_back(std::move(group), g.Int(0));
    }
    std::sort(found.begin(), found.end(),
              [](const auto& x, const auto& y) { return NewerGroupFirst(x.first, y.first); });
    for (auto& [group, id] : found) {
      answer.groups.push_back(std::move(group));
      group_ids.push_back(id);
    }
  }
  if (answer.groups.size() != 1) return answer;
  ASSIGN_OR_RETURN(Stmt p, conn_.Prepare(BestInGroupSql(info->batch_column, info->higher_is_better,
                                                        q.sweep_id.has_value()),
                                         op));
  p.Bind(group_ids[0]);
  if (q.sweep_id) p.Bind(*q.sweep_id);
  ASSIGN_OR_RETURN(answer.best, BestRowLocked(p));
  return answer;
}

// Best over serving load points: the groups are (model identity, workload, load point) of one
// model and sm; a lockstep batch is never among the rows (result_batches is not read).
absl::StatusOr<BestAnswer> ResultQueries::BestServingLocked(const BestQuery& q,
                                                            absl::string_view column,
                                                            bool higher_is_better) {
  const std::string op = absl::StrCat("finding the best serving ", q.metric,
                                      q.load_point ? absl::StrCat(" at ", *q.load_point) : "",
                                      " for ", q.model, " on sm ", q.sm);
  std::string sql =
      "SELECT model_key, workload, COUNT(*), MIN(sweep_id), MAX(sweep_id), MAX(finished_ms), "
      "load_point FROM serving_points WHERE model = ? AND sm = ? AND ok = 1";
  if (q.sweep_id) absl::StrAppend(&sql, " AND sweep_id = ?");
  if (q.load_point) absl::StrAppend(&sql, " AND load_point = ?");
  if (q.model_key) absl::StrAppend(&sql, " AND model_key = ?");
  if (q.workload) absl::StrAppend(&sql, " AND workload = ?");
  absl::StrAppend(&sql, " GROUP BY model_key, workload, load_point");
  BestAnswer answer;
  {
    ASSIGN_OR_RETURN(Stmt g, conn_.Prepare(sql, op));
    g.Bind(q.model).Bind(q.sm);
    if (q.sweep_id) g.Bind(*q.sweep_id);
    if (q.load_point) g.Bind(*q.load_point);
    if (q.model_key) g.Bind(*q.model_key);
    if (q.workload) g.Bind(*q.workload);
    for (;;) {
      ASSIGN_OR_RETURN(bool row, g.Step());
      if (!row) break;
      ResultGroup group = ReadResultGroup(g, 0);
      group.load_point = g.Text(6);
      if (q.layers && ModelKeyLayers(group.model_key) != *q.layers) continue;
      answer.groups.push_back(std::move(group));
    }
  }
  std::sort(answer.groups.begin(), answer.groups.end(), NewerGroupFirst);
  if (answer.groups.size() != 1) return answer;
  const ResultGroup& group = answer.groups[0];
  ASSIGN_OR_RETURN(
      Stmt p,
      conn_.Prepare(BestServingPointSql(column, higher_is_better, q.sweep_id.has_value()), op));
  p.Bind(q.model).Bind(q.sm).Bind(group.load_point).Bind(group.model_key).Bind(group.workload);
  if (q.sweep_id) p.Bind(*q.sweep_id);
  ASSIGN_OR_RETURN(answer.best, BestRowLocked(p));
  return answer;
}

absl::StatusOr<std::optional<StoredResult>> ResultQueries::BestRowLocked(Stmt& p) {
  ASSIGN_OR_RETURN(bool row, p.Step());
  if (!row) return std::nullopt;
  return ReadResult(p, /*parse=*/true);
}

absl::StatusOr<const std::string*> ResultQueries::KernelLogLocked(int64_t id,
                                                                  const std::string& where) {
  if (auto it = kernel_logs_.find(id); it != kernel_logs_.end()) return &it->second;
  ASSIGN_OR_RETURN(Stmt q,
                   conn_.Prepare("SELECT log FROM kernel_logs WHERE kernel_log_id = ?", where));
  q.Bind(id);
  ASSIGN_OR_RETURN(bool row, q.Step());
  if (!row) return absl::DataLossError(absl::StrCat(where, ": kernel log ", id, " is missing"));
  return &(kernel_logs_[id] = q.Text(0));
}

absl::StatusOr<std::map<std::string, int64_t>> ResultQueries::CountResults(int64_t sweep_id) {
  ASSIGN_OR_RETURN(
      Stmt q,
      conn_.Prepare("SELECT status, COUNT(*) FROM results WHERE sweep_id = ? GROUP BY status",
                    absl::StrCat("counting the results of sweep ", sweep_id)));
  q.Bind(sweep_id);
  std::map<std::string, int64_t> out;
  for (;;) {
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row) break;
    out[q.Text(0)] = q.Int(1);
  }
  return out;
}

absl::StatusOr<std::vector<std::pair<std::string, int>>> ResultQueries::ResultModelArchs() {
  // A scan of the results_best index, (model, sm) first.
  ASSIGN_OR_RETURN(Stmt q, conn_.Prepare("SELECT DISTINCT model, sm FROM results",
                                         "listing the (model, sm) of stored results"));
  std::vector<std::pair<std::string, int>> out;
  for (;;) {
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row) break;
    out.emplace_back(q.Text(0), static_cast<int>(q.Int(1)));
  }
  return out;
}

std::string BestServingPointSql(absl::string_view column, bool higher_is_better, bool in_sweep) {
  const char* dir = higher_is_better ? "DESC" : "ASC";
  return absl::StrCat(
      "SELECT ", kResultCols,
      " FROM results WHERE result_id = (SELECT result_id "
      "FROM serving_points WHERE model = ? AND sm = ? AND ok = 1 AND load_point = ? "
      "AND model_key = ? AND workload = ? AND ",
      in_sweep ? "sweep_id = ? AND " : "", column, " IS NOT NULL ORDER BY ", column, " ", dir,
      ", sweep_id DESC, result_id DESC LIMIT 1)");
}

std::string BestInGroupSql(absl::string_view column, bool higher_is_better, bool in_sweep) {
  const char* dir = higher_is_better ? "DESC" : "ASC";
  return absl::StrCat("SELECT ", kResultCols,
                      " FROM results WHERE result_id = (SELECT result_id FROM result_batches"
                      " WHERE group_id = ? AND ok = 1 AND ",
                      in_sweep ? "sweep_id = ? AND " : "", column, " IS NOT NULL ORDER BY ", column,
                      " ", dir, ", sweep_id DESC, result_id DESC LIMIT 1)");
}

}  // namespace infersweep
