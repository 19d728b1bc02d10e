#include "cli/result_rows.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "agent/inventory.h"
#include "core/identity.h"

namespace infersweep::cli {
namespace {

nlohmann::json OrNull(const std::string& s) {
  return s.empty() ? nlohmann::json() : nlohmann::json(s);
}

}  // namespace

absl::StatusOr<Row> ParseRow(const v1::ResultRow& r) {
  absl::StatusOr<TrialResult> result =
      TrialResultFromJsonText(r.result_json(), "the coordinator's result_json");
  if (!result.ok()) return absl::DataLossError(result.status().message());
  Row row;
  row.sweep_id = r.sweep_id();
  row.agent_id = r.agent_id();
  row.gpu_name = r.gpu_name();
  row.sm = r.sm();
  row.model_key = r.has_model_key() ? r.model_key() : ModelIdentityKey(result->model_identity);
  row.workload = r.has_workload() ? r.workload() : result->workload;
  row.engine_version = r.has_engine_version() ? r.engine_version() : result->engine_version;
  row.software_known = r.has_software();
  row.software = r.software();
  row.result = *std::move(result);
  return row;
}

nlohmann::json RowJson(const Row& row) {
  return {{"sweep_id", row.sweep_id},
          {"agent_id", row.agent_id},
          {"gpu_name", row.gpu_name},
          {"sm", row.sm},
          {"model_key", OrNull(row.model_key)},
          {"workload", OrNull(row.workload)},
          {"engine_version", OrNull(row.engine_version)},
          {"software", row.software_known ? nlohmann::json(row.software) : nlohmann::json()},
          {"result", ToJson(row.result)}};
}

const BatchFigures* FindBatch(const TrialResult& r, int batch) {
  for (const BatchFigures& b : r.batches)
    if (b.batch == batch && b.measured()) return &b;
  return nullptr;
}

void AddIdentityFlags(CLI::App* cmd, IdentityArgs* a) {
  cmd->add_option("--sweep", a->sweep, "only this sweep's results");
  cmd->add_option("--workload", a->workload,
                  "only this workload: prompt=N,output=N[,warmup=N] (docs/RESULTS.md "
                  "\"Identity\"; other workload fields are ignored)");
  cmd->add_option("--layers", a->layers, "only models run with this many layers");
  cmd->add_option("--model-key", a->model_key,
                  "only this model identity, exactly as listed (\"unknown\": results stored "
                  "without one)");
}

absl::Status CheckIdentityArgs(IdentityArgs* a) {
  if (a->sweep < 0) return absl::InvalidArgumentError("--sweep must be >= 1");
  if (a->layers < 0) return absl::InvalidArgumentError("--layers must be >= 1");
  if (!a->workload.empty()) {
    absl::StatusOr<std::string> key = CanonicalWorkloadKey(a->workload);
    if (!key.ok())
      return absl::InvalidArgumentError(absl::StrCat("--workload: ", key.status().message()));
    a->workload = *key;
  }
  return absl::OkStatus();
}

std::vector<std::string> IdentityContext(const IdentityArgs& a) {
  std::vector<std::string> out;
  if (a.sweep > 0) out.push_back(absl::StrCat("sweep ", a.sweep));
  if (!a.workload.empty()) out.push_back(absl::StrCat("workload ", a.workload));
  if (a.layers > 0) out.push_back(absl::StrCat("layers ", a.layers));
  if (!a.model_key.empty()) out.push_back(absl::StrCat("model ", a.model_key));
  return out;
}

absl::StatusOr<int> SmArchFlag(const std::string& text) {
  absl::StatusOr<int> sm = ParseSmArch(text);
  if (!sm.ok())
    return absl::InvalidArgumentError(absl::StrCat("--sm-arch: ", sm.status().message()));
  return *sm;
}

absl::Status CheckBatchFlag(int batch) {
  if (batch >= 1 && batch <= kMaxBatchSize) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--batch ", batch, ": must lie in [1, ", kMaxBatchSize, "] (a batch size)"));
}

}  // namespace infersweep::cli
