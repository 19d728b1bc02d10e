// Stored results as the query commands read them (docs/RESULTS.md): one decoded row of the
// coordinator's reply, the identity flags that pick which results a query reads, and the checks
// of the flags the queries share.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "api/trial.h"
#include "nlohmann/json.hpp"
#include "proto/infersweep.pb.h"

namespace infersweep::cli {

// One stored result with where it ran.
struct Row {
  int64_t sweep_id = 0;
  std::string agent_id, gpu_name;
  int sm = 0;
  // The stored identity (docs/RESULTS.md "Identity"); "" where unknown.
  std::string model_key, workload, engine_version, software;
  bool software_known = false;
  TrialResult result;
};

// Decodes a reply's row; DATA_LOSS where its result JSON does not parse.
absl::StatusOr<Row> ParseRow(const v1::ResultRow& r);

// A row as `results --format json` and `best --format json` print it (null where unknown).
nlohmann::json RowJson(const Row& row);

// The figures of `batch` in `r`, or null where it has none.
const BatchFigures* FindBatch(const TrialResult& r, int batch);

// --sweep, --workload, --layers, --model-key: which results a query reads, by identity.
struct IdentityArgs {
  int64_t sweep = 0;
  std::string workload;   // as given; canonical after CheckIdentityArgs
  std::string model_key;  // "unknown" selects results whose identity is unknown
  int layers = 0;
};

void AddIdentityFlags(CLI::App* cmd, IdentityArgs* a);

// Checks the identity flags and makes --workload canonical (INVALID_ARGUMENT naming the flag).
absl::Status CheckIdentityArgs(IdentityArgs* a);

// Sets the identity fields of a QueryResultsRequest or a BestRequest.
template <typename Request>
void ApplyIdentity(const IdentityArgs& a, Request* req) {
  if (a.sweep > 0) req->set_sweep_id(a.sweep);
  if (!a.workload.empty()) req->set_workload(a.workload);
  if (a.layers > 0) req->set_layers(a.layers);
  if (!a.model_key.empty()) req->set_model_key(a.model_key == "unknown" ? "" : a.model_key);
}

// The identity flags given, in words ("sweep 3", "workload ..."), for a table's heading.
std::vector<std::string> IdentityContext(const IdentityArgs& a);

// --sm-arch's SM (0 for cpu); INVALID_ARGUMENT naming the flag.
absl::StatusOr<int> SmArchFlag(const std::string& text);

// --batch of best and compare: one lockstep batch size; INVALID_ARGUMENT naming the flag.
absl::Status CheckBatchFlag(int batch);

}  // namespace infersweep::cli
