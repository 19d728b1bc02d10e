// The Store's write path for results: a result's checks (its trial, its lease, its content
// digest), its row with the deflated JSON, its batch and serving-point rows, and the interning of
// what results share (configs, result groups, kernel logs). Internal to storage/.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "api/backend_config.h"
#include "api/trial.h"
#include "storage/sqlite.h"
#include "storage/store.h"

namespace infersweep {

// Every method runs with the connection's lock held (the Store takes it for the whole call).
class Ingest {
 public:
  explicit Ingest(Connection& conn) : conn_(conn) {}
  Ingest(const Ingest&) = delete;
  Ingest& operator=(const Ingest&) = delete;

  // Store::RecordResults: every submission in one transaction, all or nothing.
  absl::Status RecordResults(const std::vector<ResultSubmission>& results)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  // Store::RecordResultsEach: one transaction, each submission under its own savepoint.
  std::vector<absl::Status> RecordResultsEach(const std::vector<ResultSubmission>& results)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());

  // One result inside the caller's transaction (also the ERROR that ends a trial whose lease
  // was lost for the last time).
  absl::Status RecordOneLocked(const ResultSubmission& sub)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());

  // The id of a config in `configs`, added with its axes the first time it is seen; inside the
  // caller's transaction.
  absl::StatusOr<int64_t> ConfigIdLocked(const BackendConfig& config,
                                         const std::string& config_string, const std::string& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());

  // Forgets every interned id: a rolled-back transaction can take rows it added with it.
  void ForgetIds() ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu()) { ids_.Clear(); }

 private:
  // The id of a (model, sm, batch, model identity, workload) group, added the first time.
  absl::StatusOr<int64_t> GroupIdLocked(const std::string& model, int sm, int batch,
                                        const std::string& model_key, const std::string& workload,
                                        const std::string& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  // The id of a batch's kernel log (KernelsJson's text) in `kernel_logs`, added the first time
  // it is seen.
  absl::StatusOr<int64_t> KernelLogIdLocked(const BatchFigures& b, const std::string& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());
  absl::StatusOr<int64_t> FindOrAddConfigLocked(const BackendConfig& config,
                                                const std::string& config_string,
                                                const std::string& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_.mu());

  Connection& conn_;
  // Ids of rows that are only ever added (configs, result groups, kernel logs), by their keys:
  // the write path's lookups. Cleared on every rollback (ForgetIds, RecordResultsEach).
  struct IdCache {
    std::unordered_map<std::string, int64_t> configs, groups, kernel_logs;
    void Clear() {
      configs.clear();
      groups.clear();
      kernel_logs.clear();
    }
  };
  IdCache ids_ ABSL_GUARDED_BY(conn_.mu());
};

}  // namespace infersweep
