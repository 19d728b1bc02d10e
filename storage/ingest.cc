#include "storage/ingest.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "api/digest.h"
#include "api/status_macros.h"
#include "core/wall_clock.h"
#include "storage/codec.h"

namespace infersweep {
namespace {

using nlohmann::json;

const BatchFigures* FindBatch(const TrialResult& r, int batch) {
  for (const BatchFigures& b : r.batches)
    if (b.batch == batch && b.measured()) return &b;
  return nullptr;
}

}  // namespace

absl::Status Ingest::RecordResults(const std::vector<ResultSubmission>& results) {
  const std::string op =
      results.size() == 1
          ? absl::StrCat("recording the result of trial '", results[0].result.trial_id,
                         "' attempt ", results[0].result.attempt)
          : absl::StrCat("recording ", results.size(), " results");
  Txn txn(conn_);
  RETURN_IF_ERROR(txn.Begin(op));
  for (const ResultSubmission& r : results) RETURN_IF_ERROR(RecordOneLocked(r));
  return txn.Commit(op);
}

std::vector<absl::Status> Ingest::RecordResultsEach(const std::vector<ResultSubmission>& results) {
  const std::string op = absl::StrCat("recording ", results.size(), " results (group commit)");
  std::vector<absl::Status> out(results.size());
  Txn txn(conn_);
  if (absl::Status s = txn.Begin(op); !s.ok()) {
    std::fill(out.begin(), out.end(), s);
    return out;
  }
  for (size_t i = 0; i < results.size(); ++i) {
    // A savepoint per result: a refused one (wrong agent, unknown trial) rolls back alone.
    if (absl::Status s = conn_.Exec("SAVEPOINT one_result", op); !s.ok()) {
      std::fill(out.begin(), out.end(), s);
      return out;
    }
    out[i] = RecordOneLocked(results[i]);
    if (!out[i].ok()) ids_.Clear();  // the rollback below may take rows it added
    const char* end =
        out[i].ok() ? "RELEASE one_result" : "ROLLBACK TO one_result; RELEASE one_result";
    if (absl::Status s = conn_.Exec(end, op); !s.ok()) {
      std::fill(out.begin(), out.end(), s);
      return out;
    }
  }
  if (absl::Status s = txn.Commit(op); !s.ok()) std::fill(out.begin(), out.end(), s);
  return out;
}

absl::Status Ingest::RecordOneLocked(const ResultSubmission& sub) {
  const TrialResult& result = sub.result;
  const std::string op = absl::StrCat("recording the result of trial '", result.trial_id,
                                      "' attempt ", result.attempt);
  if (result.trial_id.empty())
    return absl::InvalidArgumentError("recording a result: empty trial id");
  // What a duplicate of an agent's result must repeat: its content as sent, canonical JSON.
  // The first 16 bytes of its SHA-256 are kept (a 2^-128 chance that other content matches).
  const std::string digest =
      sub.agent_id.empty() ? "" : Sha256(ToJson(result).dump()).substr(0, 16);

  int64_t sweep_id = 0;
  std::string model, config_string, state, leased_to, workload_key, trial_model_key;
  int64_t attempt = 0, trial_layers = 0;
  {
    ASSIGN_OR_RETURN(
        Stmt q, conn_.Prepare("SELECT sweep_id, model, (SELECT config_string FROM configs AS c "
                              "WHERE c.config_id = trials.config_id), state, attempt, leased_to, "
                              "workload_key, model_key, layers FROM trials WHERE trial_id = ?",
                              op));
    q.Bind(result.trial_id);
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (!row)
      return absl::NotFoundError(
          absl::StrCat(op, ": no trial '", result.trial_id, "' in this database"));
    sweep_id = q.Int(0);
    model = q.Text(1);
    config_string = q.Text(2);
    state = q.Text(3);
    attempt = q.Int(4);
    leased_to = q.Text(5);
    workload_key = q.Text(6);
    trial_model_key = q.Text(7);
    trial_layers = q.Int(8);
  }
  {
    ASSIGN_OR_RETURN(Stmt q, conn_.Prepare("SELECT agent_id, status, result_digest FROM results "
                                           "WHERE trial_id = ? AND attempt = ?",
                                           op));
    q.Bind(result.trial_id).Bind(result.attempt);
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (row) {
      // Already stored: a replay of the same content is idempotent. Other content for the same
      // attempt is refused, so the stored row and the agent's own log cannot silently
      // disagree (rows stored before digests existed have none and stay idempotent). When the
      // coordinator stored that attempt itself (its lease was lost for the last time), the
      // agent's late result is refused, not acknowledged and dropped.
      if (sub.agent_id.empty()) return absl::OkStatus();
      if (q.Text(0) == sub.agent_id) {
        if (q.IsNull(2) || q.Blob(2) == digest) return absl::OkStatus();
        return absl::AlreadyExistsError(absl::StrCat(
            op, " from agent '", sub.agent_id, "' refused: that attempt is stored as ", q.Text(1),
            " with other content (a replay must be identical; sha256 ", HexOf(digest.substr(0, 6)),
            " against the stored ", HexOf(q.Blob(2).substr(0, 6)), ")"));
      }
      return absl::PermissionDeniedError(absl::StrCat(
          op, " from agent '", sub.agent_id, "' rejected: that attempt is already recorded as ",
          q.Text(1),
          q.Text(0).empty() ? " by the coordinator" : absl::StrCat(" by agent '", q.Text(0), "'")));
    }
  }
  if (!sub.agent_id.empty() && (leased_to != sub.agent_id || attempt != result.attempt)) {
    std::string holder;
    if (leased_to.empty()) {
      holder = absl::StrCat("the trial is ", state, " and held by no agent");
    } else {
      holder = absl::StrCat("the trial is ", state, ", attempt ", attempt, " held by agent '",
                            leased_to, "'");
    }
    return absl::PermissionDeniedError(
        absl::StrCat(op, " from agent '", sub.agent_id, "' rejected: ", holder));
  }

  // What the result describes: fill what coordinator-made results leave out from the trial.
  TrialResult stored = result;
  if (stored.model.empty()) stored.model = model;
  if (stored.config.empty()) {
    absl::StatusOr<BackendConfig> config = ParseBackendConfig(config_string);
    if (!config.ok())
      return absl::DataLossError(
          absl::StrCat(op, ": stored trial config: ", config.status().message()));
    stored.config = *std::move(config);
  }
  // The identity (docs/STORAGE.md "Identity"). The workload is the trial's: what was asked
  // for is what ran. The model's is the result's own, else what the trial knew at submit.
  stored.workload = workload_key;
  // Serving figures belong to serving trials and batch figures to lockstep ones: a result
  // that mixes them up is refused, so neither ranking ever holds the other's rows.
  const bool serving_trial = absl::StartsWith(workload_key, kServeWorkloadKeyPrefix);
  if (!stored.serving.empty() && !serving_trial)
    return absl::InvalidArgumentError(absl::StrCat(op, ": result.serving: ", stored.serving.size(),
                                                   " load point(s) for a lockstep trial (workload ",
                                                   workload_key, ")"));
  if (!stored.batches.empty() && serving_trial)
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": result.batches: ", stored.batches.size(),
                     " lockstep batch(es) for a serving trial (workload ", workload_key, ")"));
  std::optional<std::string> model_key;
  std::optional<int64_t> model_layers;
  if (std::string key = ModelIdentityKey(stored.model_identity); !key.empty()) {
    model_key = std::move(key);
    if (stored.model_identity.layers > 0) model_layers = stored.model_identity.layers;
  } else if (!trial_model_key.empty()) {
    model_key = trial_model_key;
    if (trial_layers > 0) model_layers = trial_layers;
  }
  std::optional<std::string> engine_version;
  if (!stored.engine_version.empty()) engine_version = stored.engine_version;
  // A result that says nothing of its model was made by a build that did not record the stack
  // either: unknown, not "none".
  std::optional<std::string> software;
  if (!stored.model_identity.source.empty()) software = SoftwareStackKey(stored.software);
  const std::string result_config = BackendConfigString(stored.config);
  ASSIGN_OR_RETURN(int64_t config_id, ConfigIdLocked(stored.config, result_config, op));

  const int64_t finished = stored.finished_unix_ms != 0 ? stored.finished_unix_ms : NowUnixMs();
  std::optional<double> tok_s_b1, ttft_b1, tpot_b1, tok_s_max;
  std::optional<int64_t> max_batch;
  if (const BatchFigures* b1 = FindBatch(stored, 1)) {
    tok_s_b1 = b1->output_tok_s.median;
    ttft_b1 = b1->ttft_ms.median;
    tpot_b1 = b1->tpot_ms.median;
  }
  const BatchFigures* largest = nullptr;
  for (const BatchFigures& b : stored.batches)
    if (b.measured() && (largest == nullptr || b.batch > largest->batch)) largest = &b;
  if (largest != nullptr) {
    tok_s_max = largest->output_tok_s.median;
    max_batch = largest->batch;
  }
  // Each batch's kernel log is stored once for the whole database (kernel_logs): results of
  // one config repeat it. The result keeps its id ("kernels_ref"); reads put the log back.
  std::vector<std::optional<int64_t>> log_ids;
  TrialResult slim = stored;
  for (BatchFigures& b : slim.batches) {
    log_ids.emplace_back();
    if (!b.prefill_kernels && !b.decode_kernels) continue;
    ASSIGN_OR_RETURN(log_ids.back(), KernelLogIdLocked(b, op));
    b.prefill_kernels.reset();
    b.decode_kernels.reset();
  }
  json stored_json = ToJson(slim);
  for (size_t i = 0; i < log_ids.size(); ++i)
    if (log_ids[i]) stored_json["batches"][i]["kernels_ref"] = *log_ids[i];
  const std::string blob = CompressResultJson(stored_json.dump());
  if (blob.empty()) return absl::InternalError(absl::StrCat(op, ": compressing the result"));
  int64_t result_id = 0;
  {
    ASSIGN_OR_RETURN(
        Stmt ins,
        conn_.Prepare(
            "INSERT INTO results (trial_id, attempt, sweep_id, agent_id, gpu_name, sm, "
            "model, status, config_string, result_json, output_tok_s, "
            "output_tok_s_max_batch, max_batch, ttft_ms_p50, tpot_ms, finished_ms, "
            "config_id, model_key, model_layers, workload, engine_version, software, "
            "result_blob, result_digest) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, '', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            op));
    ins.Bind(stored.trial_id)
        .Bind(stored.attempt)
        .Bind(sweep_id)
        .Bind(sub.agent_id)
        .Bind(sub.gpu_name)
        .Bind(sub.sm)
        .Bind(model)
        .Bind(TrialStatusName(stored.status))
        .Bind(result_config)
        .Bind(tok_s_b1)
        .Bind(tok_s_max)
        .Bind(max_batch)
        .Bind(ttft_b1)
        .Bind(tpot_b1)
        .Bind(finished)
        .Bind(config_id)
        .Bind(model_key)
        .Bind(model_layers)
        .Bind(stored.workload)
        .Bind(engine_version)
        .Bind(software)
        .BindBlob(blob)
        .BindBlobOrNull(digest);
    RETURN_IF_ERROR(ins.Run());
    result_id = conn_.LastInsertRowid();
  }
  const bool ok = stored.status == TrialStatus::kOk;
  const std::string group_key = model_key.value_or("");
  {  // one row per batch size (the first entry of a size wins), for Best at any batch
    ASSIGN_OR_RETURN(
        Stmt ins,
        conn_.Prepare("INSERT OR IGNORE INTO result_batches (group_id, sweep_id, result_id, "
                      "ok, output_tok_s, ttft_ms, tpot_ms, prefill_tok_s) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                      op + ": batches"));
    ASSIGN_OR_RETURN(Stmt count,
                     conn_.Prepare("UPDATE result_groups SET ok_results = ok_results + 1, "
                                   "first_sweep = MIN(COALESCE(first_sweep, ?1), ?1), "
                                   "last_sweep = MAX(COALESCE(last_sweep, ?1), ?1), "
                                   "last_finished_ms = MAX(COALESCE(last_finished_ms, ?2), ?2) "
                                   "WHERE group_id = ?3",
                                   op + ": groups"));
    for (const BatchFigures& b : stored.batches) {
      // A memory verdict's batch has no figures to rank; the result's JSON keeps it.
      if (!b.measured()) continue;
      ASSIGN_OR_RETURN(int64_t group_id,
                       GroupIdLocked(model, sub.sm, b.batch, group_key, stored.workload, op));
      ins.Reset();
      ins.Bind(group_id)
          .Bind(sweep_id)
          .Bind(result_id)
          .Bind(ok ? 1 : 0)
          .Bind(b.output_tok_s.median)
          .Bind(b.ttft_ms.median)
          .Bind(b.tpot_ms.median)
          .Bind(b.prefill_tok_s.median);
      RETURN_IF_ERROR(ins.Run());
      if (!ok || conn_.Changes() == 0) continue;
      count.Reset();
      count.Bind(sweep_id).Bind(finished).Bind(group_id);
      RETURN_IF_ERROR(count.Run());
    }
  }
  if (!stored.serving.empty()) {  // one row per load point, for Best over serving points
    ASSIGN_OR_RETURN(
        Stmt ins,
        conn_.Prepare(
            "INSERT INTO serving_points (result_id, point_index, sweep_id, model, sm, "
            "model_key, workload, load_point, mode, concurrency, request_rate, verdict, ok, "
            "completed, duration_s, request_throughput, output_throughput, "
            "total_token_throughput, output_tok_s_per_user, median_ttft_ms, p99_ttft_ms, "
            "median_tpot_ms, p99_tpot_ms, p99_itl_ms, p99_e2el_ms, request_goodput, "
            "meets_slo, finished_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
            "?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            op + ": serving points"));
    for (size_t i = 0; i < stored.serving.size(); ++i) {
      const ServingPoint& point = stored.serving[i];
      ins.Reset();
      ins.Bind(result_id)
          .Bind(static_cast<int64_t>(i))
          .Bind(sweep_id)
          .Bind(model)
          .Bind(sub.sm)
          .Bind(group_key)
          .Bind(stored.workload)
          .Bind(LoadPointName(point.point))
          .Bind(point.point.open_loop ? "poisson" : "closed_loop")
          .Bind(point.point.concurrency)
          .Bind(point.point.open_loop ? std::optional<double>(point.point.rate) : std::nullopt)
          .Bind(TrialStatusName(point.verdict))
          .Bind(ok && point.verdict == TrialStatus::kOk ? 1 : 0)
          .Bind(point.completed)
          .Bind(point.duration_s)
          .Bind(point.request_throughput)
          .Bind(point.output_throughput)
          .Bind(point.total_token_throughput)
          .Bind(point.output_tok_s_per_user)
          .Bind(point.ttft_ms.median)
          .Bind(point.ttft_ms.p99)
          .Bind(point.tpot_ms.median)
          .Bind(point.tpot_ms.p99)
          .Bind(point.itl_ms.p99)
          .Bind(point.e2el_ms.p99)
          .Bind(point.request_goodput);
      if (point.meets_slo) {
        ins.Bind(*point.meets_slo ? 1 : 0);
      } else {
        ins.BindNull();
      }
      ins.Bind(finished);
      RETURN_IF_ERROR(ins.Run());
    }
  }
  if (state != "done") {
    {
      ASSIGN_OR_RETURN(Stmt u,
                       conn_.Prepare("UPDATE trials SET state = 'done', lease_expires_ms = NULL "
                                     "WHERE trial_id = ?",
                                     op));
      u.Bind(stored.trial_id);
      RETURN_IF_ERROR(u.Run());
    }
    ASSIGN_OR_RETURN(
        Stmt u,
        conn_.Prepare("UPDATE sweeps SET trials_done = trials_done + 1, "
                      "state = CASE WHEN state = 'active' AND trials_done + 1 >= trials_total "
                      "THEN 'done' ELSE state END WHERE sweep_id = ?",
                      op));
    u.Bind(sweep_id);
    RETURN_IF_ERROR(u.Run());
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Ingest::GroupIdLocked(const std::string& model, int sm, int batch,
                                              const std::string& model_key,
                                              const std::string& workload, const std::string& op) {
  std::string key = absl::StrCat(model.size(), ":", model, sm, ":", batch, ":", model_key.size(),
                                 ":", model_key, workload);
  if (auto it = ids_.groups.find(key); it != ids_.groups.end()) return it->second;
  int64_t id = 0;
  {
    ASSIGN_OR_RETURN(
        Stmt q, conn_.Prepare("SELECT group_id FROM result_groups WHERE model = ? AND sm = ? AND "
                              "batch = ? AND model_key = ? AND workload = ?",
                              op));
    q.Bind(model).Bind(sm).Bind(batch).Bind(model_key).Bind(workload);
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (row) id = q.Int(0);
  }
  if (id == 0) {
    ASSIGN_OR_RETURN(Stmt ins,
                     conn_.Prepare("INSERT INTO result_groups (model, sm, batch, model_key, "
                                   "workload) VALUES (?, ?, ?, ?, ?)",
                                   op));
    ins.Bind(model).Bind(sm).Bind(batch).Bind(model_key).Bind(workload);
    RETURN_IF_ERROR(ins.Run());
    id = conn_.LastInsertRowid();
  }
  ids_.groups.emplace(std::move(key), id);
  return id;
}

// The id of a batch's kernel log (KernelsJson's text) in `kernel_logs`, added the first time
// it is seen. Known logs are found by a key made from the figures themselves, without
// building their JSON.
absl::StatusOr<int64_t> Ingest::KernelLogIdLocked(const BatchFigures& b, const std::string& op) {
  std::string key;
  for (const std::optional<PhaseKernels>* phase : {&b.prefill_kernels, &b.decode_kernels}) {
    // Length-prefixed, so no two logs share a key whatever their names hold.
    auto add = [&key](const std::string& text) { absl::StrAppend(&key, text.size(), ":", text); };
    if (!*phase) {
      key += '-';
      continue;
    }
    key += (*phase)->graph ? 'G' : 'g';
    absl::StrAppend(&key, (*phase)->kernels.size(), "k");
    for (const KernelCount& k : (*phase)->kernels) {
      add(k.name);
      absl::StrAppend(&key, k.count, ";");
    }
    absl::StrAppend(&key, (*phase)->fallbacks.size(), "f");
    for (const std::string& f : (*phase)->fallbacks) add(f);
  }
  if (auto it = ids_.kernel_logs.find(key); it != ids_.kernel_logs.end()) return it->second;
  const std::string log = KernelsJson(b).dump();
  int64_t id = 0;
  {
    ASSIGN_OR_RETURN(Stmt q,
                     conn_.Prepare("SELECT kernel_log_id FROM kernel_logs WHERE log = ?", op));
    q.Bind(log);
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (row) id = q.Int(0);
  }
  if (id == 0) {
    ASSIGN_OR_RETURN(Stmt ins, conn_.Prepare("INSERT INTO kernel_logs (log) VALUES (?)", op));
    ins.Bind(log);
    RETURN_IF_ERROR(ins.Run());
    id = conn_.LastInsertRowid();
  }
  ids_.kernel_logs.emplace(std::move(key), id);
  return id;
}

absl::StatusOr<int64_t> Ingest::ConfigIdLocked(const BackendConfig& config,
                                               const std::string& config_string,
                                               const std::string& op) {
  if (auto it = ids_.configs.find(config_string); it != ids_.configs.end()) return it->second;
  ASSIGN_OR_RETURN(int64_t id, FindOrAddConfigLocked(config, config_string, op));
  ids_.configs.emplace(config_string, id);
  return id;
}

absl::StatusOr<int64_t> Ingest::FindOrAddConfigLocked(const BackendConfig& config,
                                                      const std::string& config_string,
                                                      const std::string& op) {
  {
    ASSIGN_OR_RETURN(Stmt q,
                     conn_.Prepare("SELECT config_id FROM configs WHERE config_string = ?", op));
    q.Bind(config_string);
    ASSIGN_OR_RETURN(bool row, q.Step());
    if (row) return q.Int(0);
  }
  int64_t id = 0;
  {
    ASSIGN_OR_RETURN(Stmt ins, conn_.Prepare("INSERT INTO configs (config_string) VALUES (?)", op));
    ins.Bind(config_string);
    RETURN_IF_ERROR(ins.Run());
    id = conn_.LastInsertRowid();
  }
  ASSIGN_OR_RETURN(
      Stmt axes,
      conn_.Prepare("INSERT OR IGNORE INTO config_axes (axis, value, config_id) VALUES (?, ?, ?)",
                    op + ": config axes"));
  for (const auto& [axis, value] : config) {
    axes.Reset();
    axes.Bind(axis).Bind(value).Bind(id);
    RETURN_IF_ERROR(axes.Run());
  }
  return id;
}

}  // namespace infersweep
