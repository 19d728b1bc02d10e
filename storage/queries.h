// The Store's read path for results: QueryResults and its unparsed rows, Best over lockstep
// batches and over serving load points, the counts the coordinator's metrics start from.
// Internal to storage/.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "storage/sqlite.h"
#include "storage/store.h"

namespace infersweep {

// Every method runs with the connection's lock held (the Store takes it for the whole call).
class ResultQueries {
 public:
  explicit ResultQueries(Connection& conn) : conn_(conn) {}
  ResultQueries(const ResultQueries&) = delete;
  ResultQueries& operator=(const ResultQueries&) = delete;

  // Store::QueryResults (`parse`) and Store::QueryResultRows.
  absl::StatusOr<std::vector<StoredResult>> Query(const ResultQuery& q, bool parse)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<BestAnswer> Best(const BestQuery& q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<std::map<std::string, int64_t>> CountResults(int64_t sweep_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<std::vector<std::pair<std::string, int>>> ResultModelArchs()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());

 private:
  // Best over serving load points, ranked by the serving_points `column` (from a fixed table).
  absl::StatusOr<BestAnswer> BestServingLocked(const BestQuery& q, absl::string_view column,
                                               bool higher_is_better)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  // The row a bound Best statement selects, parsed; nullopt when there is none.
  absl::StatusOr<std::optional<StoredResult>> BestRowLocked(Stmt& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  // A result row (the columns of kResultCols); `parse` fills StoredResult::result from the JSON.
  absl::StatusOr<StoredResult> ReadResult(const Stmt& q, bool parse, bool with_kernels = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  // A kernel log by id; committed logs never change, so they are cached once read.
  absl::StatusOr<const std::string*> KernelLogLocked(int64_t id, const std::string& where)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());

  Connection& conn_;
  std::unordered_map<int64_t, std::string> kernel_logs_ ABSL_GUARDED_BY(conn_.mu());
};

// The text of the hot query, so tests can check its plan with EXPLAIN QUERY PLAN: the best
// result by a result_batches metric `column` (from a fixed table in queries.cc, never from
// callers) within one result group, optionally one sweep's rows of it. Binds (group_id[,
// sweep_id]).
std::string BestInGroupSql(absl::string_view column, bool higher_is_better, bool in_sweep);
// The same for a serving metric: the best serving_points row by `column` (a fixed table in
// queries.cc) of one (model, sm, load point, model identity, workload), optionally one sweep's.
// Binds (model, sm, load_point, model_key, workload[, sweep_id]).
std::string BestServingPointSql(absl::string_view column, bool higher_is_better, bool in_sweep);

}  // namespace infersweep
