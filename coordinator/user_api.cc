#include "coordinator/user_api.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/backend_config.h"
#include "api/model_description.h"
#include "api/status_macros.h"
#include "coordinator/regressions.h"
#include "coordinator/sweep_spec.h"
#include "proto/rpc.h"

namespace infersweep::coordinator {

namespace {

// A page of results stays below the message limit with room for the envelope.
constexpr size_t kMaxResultPageBytes = rpc::kMaxMessageBytes - 256 * 1024;

// Caps on the free text of a query, in bytes, at or above what is stored (a sweep's model is at
// most kMaxSweepModelBytes, docs/SWEEPS.md): text over one is refused, so that replies, errors
// and logs never carry it whole.
constexpr size_t kMaxQueryModelBytes = kMaxSweepModelBytes;
constexpr size_t kMaxQueryModelKeyBytes = kMaxSweepModelBytes + 256;  // the model, then its shape
constexpr size_t kMaxQueryWorkloadBytes = 1024;
constexpr size_t kMaxQueryWordBytes = kMaxSweepWordBytes;  // status, metric, axis, load point
constexpr size_t kMaxQueryGpuNameBytes = 256;
constexpr size_t kMaxQueryAxes = 64;
// Results `best` reads for the memory verdicts beside its answer, newest first: a sweep's worth
// and more, parsed without their kernel logs.
constexpr int kMaxMemoryVerdictResults = 2000;

absl::Status CheckText(absl::string_view field, const std::string& value, size_t max_bytes) {
  if (value.size() <= max_bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", value.size(), " bytes; the limit is ", max_bytes));
}

// An SM as results store it: 0 for CPU results, else a compute capability of 10..1000.
absl::Status CheckSm(int sm) {
  if (sm == 0 || (sm >= 10 && sm <= 1000)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("sm: ", sm, " is not an SM architecture (0 for CPU results, or 10..1000)"));
}

// The identity filters QueryResults, Best and Regressions share.
template <typename Request>
absl::Status CheckIdentityFilters(const Request& req) {
  if (req.has_model_key())
    RETURN_IF_ERROR(CheckText("model_key", req.model_key(), kMaxQueryModelKeyBytes));
  if (req.has_workload())
    RETURN_IF_ERROR(CheckText("workload", req.workload(), kMaxQueryWorkloadBytes));
  if (req.has_layers() && req.layers() < 1)
    return absl::InvalidArgumentError(absl::StrCat("layers: ", req.layers(), " must be >= 1"));
  return absl::OkStatus();
}

void FillRow(const StoredResult& r, std::string json, v1::ResultRow* row) {
  row->set_sweep_id(r.sweep_id);
  row->set_agent_id(r.agent_id);
  row->set_gpu_name(r.gpu_name);
  row->set_sm(r.sm);
  row->set_result_json(std::move(json));
  if (r.model_key) row->set_model_key(*r.model_key);
  if (r.workload) row->set_workload(*r.workload);
  if (r.engine_version) row->set_engine_version(*r.engine_version);
  if (r.software) row->set_software(*r.software);
}

}  // namespace

UserApi::UserApi(const CoordinatorServices& services, AgentSessions& sessions,
                 SelectorMatcher& matcher)
    : services_(services),
      sessions_(sessions),
      matcher_(matcher),
      user_limiter_(services_.options.user_call_limit) {}

void UserApi::AddStats(CoordinatorStats* stats) const {
  stats->auth_failures += auth_failures_;
  stats->rate_limited += rate_limited_;
}

// ------------------------------------------------------------------------------ the RPC edge

grpc::Status UserApi::SubmitSweep(grpc::ServerContext* context, const v1::SubmitSweepRequest* req,
                                  v1::SubmitSweepResponse* resp) {
  absl::Status s = CheckUser(*context);
  if (s.ok()) s = Submit(*req, resp);
  if (!s.ok()) LogRefusedSubmit(context->peer(), req->source(), s);
  return rpc::ToGrpcStatus(s);
}
grpc::Status UserApi::GetSweep(grpc::ServerContext* context, const v1::GetSweepRequest* req,
                               v1::SweepInfo* resp) {
  return Serve(*context, [&] { return Get(*req, resp); });
}
grpc::Status UserApi::ListSweeps(grpc::ServerContext* context, const v1::ListSweepsRequest*,
                                 v1::ListSweepsResponse* resp) {
  return Serve(*context, [&] { return List(resp); });
}
grpc::Status UserApi::CancelSweep(grpc::ServerContext* context, const v1::CancelSweepRequest* req,
                                  v1::CancelSweepResponse* resp) {
  return Serve(*context, [&] { return Cancel(*req, resp); });
}
grpc::Status UserApi::ListAgents(grpc::ServerContext* context, const v1::ListAgentsRequest*,
                                 v1::ListAgentsResponse* resp) {
  return Serve(*context, [&] { return Agents(resp); });
}
grpc::Status UserApi::QueryResults(grpc::ServerContext* context, const v1::QueryResultsRequest* req,
                                   v1::QueryResultsResponse* resp) {
  return Serve(*context, [&] { return Query(*req, resp); });
}
grpc::Status UserApi::Best(grpc::ServerContext* context, const v1::BestRequest* req,
                           v1::BestResponse* resp) {
  return Serve(*context, [&] { return BestOf(*req, resp); });
}
grpc::Status UserApi::Regressions(grpc::ServerContext* context, const v1::RegressionsRequest* req,
                                  v1::RegressionsResponse* resp) {
  return Serve(*context, [&] { return RegressionsOf(*req, resp); });
}

grpc::Status UserApi::Serve(grpc::ServerContext& context, absl::FunctionRef<absl::Status()> call) {
  absl::Status s = CheckUser(context);
  if (s.ok()) s = call();
  return rpc::ToGrpcStatus(s);
}

absl::Status UserApi::CheckUser(grpc::ServerContext& context) {
  // The rate limit comes first, so that guessing tokens is limited too.
  if (const std::string peer = PeerHost(context.peer());
      services_.OverRateLimit(user_limiter_, peer, "user", rate_limited_))
    return absl::ResourceExhaustedError(
        RateLimitMessage("user-API calls", user_limiter_.limit(), peer));
  if (services_.options.user_token.empty()) return absl::OkStatus();
  bool ok = false;
  const auto& md = context.client_metadata();
  auto it = md.find(rpc::kAuthMetadataKey);
  if (it != md.end()) {
    const std::string_view value(it->second.data(), it->second.size());
    const std::string_view prefix(rpc::kBearerPrefix);
    if (value.size() > prefix.size() && value.substr(0, prefix.size()) == prefix)
      ok = rpc::ConstantTimeEquals(value.substr(prefix.size()), services_.options.user_token);
  }
  if (ok) return absl::OkStatus();
  ++auth_failures_;
  services_.metrics.CountAuthFailure("user");
  return absl::UnauthenticatedError("missing or invalid credentials");
}

// ------------------------------------------------------------------------------ sweeps

absl::Status UserApi::Submit(const v1::SubmitSweepRequest& req, v1::SubmitSweepResponse* resp) {
  const std::string source = req.source().empty() ? "<request>" : req.source().substr(0, 256);
  if (req.spec_yaml().size() > kMaxSweepSpecBytes)
    return absl::InvalidArgumentError(absl::StrCat(source, ": spec is ", req.spec_yaml().size(),
                                                   " bytes; the limit is ", kMaxSweepSpecBytes));
  ASSIGN_OR_RETURN(const SweepSpec spec, ParseSweepSpec(req.spec_yaml(), source));
  ASSIGN_OR_RETURN(const std::vector<std::string> warnings, CheckSweepModel(spec));
  ASSIGN_OR_RETURN(std::vector<TrialRecord> trials,
                   ExpandSweep(spec, 0, services_.options.max_trials_per_sweep));
  // A preset's identity is known here (a pure function of name, layers, seed and format), so
  // every result of its trials is filed under it, also those made without an agent. A
  // checkpoint's needs its files: the agent that runs it says.
  std::map<std::tuple<std::string, int, uint64_t>, std::string> preset_keys;
  for (TrialRecord& t : trials) {
    if (!absl::StartsWith(t.model, "preset:")) continue;
    auto [it, fresh] = preset_keys.try_emplace({t.model, t.layers, t.seed});
    if (fresh) {
      absl::StatusOr<ModelDescription> d = ParseModelDescription(t.model);
      absl::StatusOr<ModelIdentity> id =
          d.ok() ? DescribePreset(d->model.substr(7), t.layers, t.seed, d->quantize) : d.status();
      if (id.ok()) it->second = ModelIdentityKey(*id);
    }
    t.model_key = it->second;
  }
  ASSIGN_OR_RETURN(const int64_t id, services_.store.CreateSweep(MakeSweepRecord(spec), trials));
  {
    // The trial counters of the connected archs start at 0 (coordinator/metrics.h).
    std::set<int> sms;
    for (const auto& agent : sessions_.Connected())
      for (const SlotInfo& slot : agent->slots) sms.insert(slot.sm);
    std::set<std::string> models;
    for (const TrialRecord& t : trials) models.insert(t.model);
    for (const std::string& model : models)
      for (int sm : sms) services_.metrics.DeclareTrialSeries(model, sm);
  }
  resp->set_sweep_id(id);
  resp->set_trial_count(static_cast<int64_t>(trials.size()));
  for (const std::string& w : warnings) resp->add_warnings(w);
  services_.Log(absl::StrCat("sweep ", id, " '", spec.name, "' submitted: ", trials.size(),
                             " trial(s)",
                             warnings.empty() ? "" : "; warning: ", absl::StrJoin(warnings, "; ")));
  services_.wake();
  return absl::OkStatus();
}

void UserApi::LogRefusedSubmit(const std::string& peer, const std::string& source,
                               const absl::Status& status) {
  if (absl::IsResourceExhausted(status)) return;
  constexpr size_t kMaxShown = 512;
  std::string why(status.message());
  if (why.size() > kMaxShown) why = absl::StrCat(why.substr(0, kMaxShown), "...");
  services_.Log(absl::StrCat("submit of '", source.substr(0, 128), "' from ", peer,
                             " refused: ", absl::StatusCodeToString(status.code()), ": ", why));
}

std::string UserApi::UnmatchedSelectors(int64_t sweep_id) {
  absl::StatusOr<std::vector<Selector>> selectors = services_.store.QueuedSelectors(sweep_id);
  if (!selectors.ok() || selectors->empty()) return "";
  const std::vector<std::shared_ptr<const AgentInventory>> agents = sessions_.Connected();
  std::vector<std::string> unmatched;
  for (const Selector& sel : *selectors) {
    bool matched = false;
    for (const auto& agent : agents) {
      int slots = 0;
      for (const SlotInfo& slot : agent->slots) slots += matcher_.Matches(sel, slot) ? 1 : 0;
      // A CPU trial takes one slot; a GPU trial its GPU count (peer access aside).
      matched = matched || slots >= (sel.device == Device::kCpu ? 1 : sel.gpus_needed);
    }
    if (!matched) unmatched.push_back(absl::StrCat("{", DescribeSelector(sel), "}"));
  }
  if (unmatched.empty()) return "";
  std::set<std::string> devices;
  for (const auto& agent : agents)
    for (const SlotInfo& slot : agent->slots)
      devices.insert(slot.gpu ? absl::StrCat(slot.gpu_name, " sm_", slot.sm) : "cpu");
  return absl::StrCat("no connected agent matches the selector ", absl::StrJoin(unmatched, " or "),
                      " of its queued trials (connected: ", agents.size(), " agent(s)",
                      devices.empty() ? "" : absl::StrCat(": ", absl::StrJoin(devices, ", ")), ")");
}

void UserApi::FillSweepInfo(const SweepRecord& s, bool with_counts, v1::SweepInfo* out) {
  out->set_sweep_id(s.id);
  out->set_name(s.name);
  out->set_model(s.model);
  out->set_state(s.state);
  out->set_created_unix_ms(s.created_unix_ms);
  out->set_trials_total(s.trials_total);
  out->set_trials_done(s.trials_done);
  out->set_priority(s.priority);
  // Running = leased: every lease the coordinator holds for the sweep, including those
  // recovered from the database after a restart (no slots until their agent's Hello confirms
  // them) and those of an agent that came back without the trial (released after a grace
  // period), so that queued = total - done - running counts only trials waiting for a slot.
  const int64_t running = sessions_.HeldTrials(s.id);
  out->set_trials_running(running);
  if (s.state == "active" && s.trials_done + running < s.trials_total)
    out->set_waiting(UnmatchedSelectors(s.id));
  if (!with_counts) return;
  if (auto counts = services_.store.CountResults(s.id); counts.ok())
    for (const auto& [status, n] : *counts) (*out->mutable_status_counts())[status] = n;
}

absl::Status UserApi::Get(const v1::GetSweepRequest& req, v1::SweepInfo* resp) {
  ASSIGN_OR_RETURN(const SweepRecord s, services_.store.GetSweep(req.sweep_id()));
  FillSweepInfo(s, /*with_counts=*/true, resp);
  resp->set_spec_yaml(s.spec_yaml);
  return absl::OkStatus();
}

absl::Status UserApi::List(v1::ListSweepsResponse* resp) {
  ASSIGN_OR_RETURN(const std::vector<SweepRecord> sweeps, services_.store.ListSweeps());
  for (const SweepRecord& s : sweeps) FillSweepInfo(s, /*with_counts=*/false, resp->add_sweeps());
  return absl::OkStatus();
}

absl::Status UserApi::Cancel(const v1::CancelSweepRequest& req, v1::CancelSweepResponse* resp) {
  RETURN_IF_ERROR(services_.store.CancelSweep(req.sweep_id()));
  const int64_t sent = sessions_.CancelHeld(req.sweep_id());
  resp->set_trials_cancelled_running(sent);
  services_.Log(
      absl::StrCat("sweep ", req.sweep_id(), " cancelled (", sent, " running trial(s) told)"));
  return absl::OkStatus();
}

absl::Status UserApi::Agents(v1::ListAgentsResponse* resp) {
  ASSIGN_OR_RETURN(const std::vector<AgentRecord> agents, services_.store.ListAgents());
  const std::map<std::string, AgentSessions::LiveAgent> live = sessions_.LiveAgents();
  for (const AgentRecord& a : agents) {
    v1::AgentInfo* info = resp->add_agents();
    info->set_agent_id(a.agent_id);
    info->set_host(a.host);
    info->set_last_seen_unix_ms(a.last_seen_unix_ms);
    v1::Hello hello;
    google::protobuf::util::JsonParseOptions opts;
    opts.ignore_unknown_fields = true;
    if (google::protobuf::util::JsonStringToMessage(a.inventory_json, &hello, opts).ok()) {
      *info->mutable_gpus() = hello.gpus();
      info->set_cpu_only(hello.gpus_size() == 0);
      info->set_engine_version(hello.engine_version());
    }
    auto l = live.find(a.agent_id);
    info->set_connected(l != live.end());
    if (l == live.end()) continue;
    info->set_slots(l->second.slots);
    info->set_free_slots(l->second.free_slots);
    info->set_bad_messages(l->second.bad_messages);
    for (const std::string& tid : l->second.running_trial_ids) info->add_running_trial_ids(tid);
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------------------ queries

absl::Status UserApi::Query(const v1::QueryResultsRequest& req, v1::QueryResultsResponse* resp) {
  if (req.has_sm()) RETURN_IF_ERROR(CheckSm(req.sm()));
  if (req.has_gpu_name())
    RETURN_IF_ERROR(CheckText("gpu_name", req.gpu_name(), kMaxQueryGpuNameBytes));
  if (req.has_model()) RETURN_IF_ERROR(CheckText("model", req.model(), kMaxQueryModelBytes));
  if (req.has_status()) RETURN_IF_ERROR(CheckText("status", req.status(), kMaxQueryWordBytes));
  RETURN_IF_ERROR(CheckIdentityFilters(req));
  if (req.axis_values_size() > static_cast<int>(kMaxQueryAxes))
    return absl::InvalidArgumentError(absl::StrCat("axis_values: ", req.axis_values_size(),
                                                   " axes; the limit is ", kMaxQueryAxes));
  for (const auto& [axis, value] : req.axis_values()) {
    RETURN_IF_ERROR(CheckText("axis_values key", axis, kMaxQueryWordBytes));
    RETURN_IF_ERROR(
        CheckText(absl::StrCat("axis_values['", axis, "']"), value, kMaxQueryWordBytes));
  }
  if (req.has_limit() && (req.limit() < 1 || req.limit() > rpc::kMaxQueryRows))
    return absl::InvalidArgumentError(absl::StrCat("limit: ", req.limit(), " must lie in [1, ",
                                                   rpc::kMaxQueryRows,
                                                   "] (unset: ", rpc::kDefaultQueryRows, ")"));
  ResultQuery q;
  if (req.has_sm()) q.sm = req.sm();
  if (req.has_gpu_name()) q.gpu_name = req.gpu_name();
  if (req.has_model()) q.model = req.model();
  if (req.has_model_key()) q.model_key = req.model_key();
  if (req.has_workload()) q.workload = req.workload();
  if (req.has_layers()) q.layers = req.layers();
  if (req.has_sweep_id()) q.sweep_id = req.sweep_id();
  q.with_kernels = req.with_kernels();
  if (req.has_status()) {
    std::optional<TrialStatus> st = TrialStatusFromName(req.status());
    if (!st)
      return absl::InvalidArgumentError(
          absl::StrCat("unknown status '", req.status(),
                       "' (known: OK, INCORRECT, CRASHED, UNSUPPORTED, TIMEOUT, ERROR)"));
    q.status = *st;
  }
  for (const auto& [axis, value] : req.axis_values()) q.axis_values[axis] = value;
  if (req.has_since_unix_ms()) q.since_unix_ms = req.since_unix_ms();
  if (req.has_until_unix_ms()) q.until_unix_ms = req.until_unix_ms();
  q.limit = req.has_limit() ? req.limit() : rpc::kDefaultQueryRows;
  // The stored JSON goes out as it is: the client parses it (the store's parse and a second
  // serialisation here would be most of a query's time).
  ASSIGN_OR_RETURN(std::vector<StoredResult> rows, services_.store.QueryResultRows(q));
  size_t bytes = 0;
  for (StoredResult& r : rows) {
    bytes += r.result_json.size() + r.agent_id.size() + r.gpu_name.size() + 256;
    if (bytes > kMaxResultPageBytes) {
      resp->set_truncated(true);
      break;
    }
    FillRow(r, std::move(r.result_json), resp->add_rows());
  }
  return absl::OkStatus();
}

absl::Status UserApi::BestOf(const v1::BestRequest& req, v1::BestResponse* resp) {
  RETURN_IF_ERROR(CheckText("model", req.model(), kMaxQueryModelBytes));
  RETURN_IF_ERROR(CheckText("metric", req.metric(), kMaxQueryWordBytes));
  if (req.has_load_point())
    RETURN_IF_ERROR(CheckText("load_point", req.load_point(), kMaxQueryWordBytes));
  RETURN_IF_ERROR(CheckSm(req.sm()));
  RETURN_IF_ERROR(CheckIdentityFilters(req));
  if (req.has_batch() && (req.batch() < 1 || req.batch() > kMaxBatchSize))
    return absl::InvalidArgumentError(
        absl::StrCat("batch: ", req.batch(), " must lie in [1, ", kMaxBatchSize, "] (unset: 1)"));
  BestQuery q;
  q.model = req.model();
  if (req.has_sweep_id()) {
    q.sweep_id = req.sweep_id();
    ASSIGN_OR_RETURN(const SweepRecord sweep, services_.store.GetSweep(req.sweep_id()));
    if (q.model.empty()) q.model = sweep.model;
  }
  if (q.model.empty()) return absl::InvalidArgumentError("best: model (or sweep_id) is required");
  q.sm = req.sm();
  q.metric = req.metric().empty() ? "output_tok_s" : req.metric();
  q.batch = req.has_batch() ? req.batch() : 1;
  if (req.has_model_key()) q.model_key = req.model_key();
  if (req.has_workload()) q.workload = req.workload();
  if (req.has_layers()) q.layers = req.layers();
  q.serving = req.serving();
  if (req.has_load_point()) q.load_point = req.load_point();
  ASSIGN_OR_RETURN(BestAnswer best, services_.store.Best(q));
  resp->set_model(q.model);
  for (const ResultGroup& g : best.groups) {
    v1::ResultGroup* out = resp->add_groups();
    out->set_model_key(g.model_key);
    out->set_workload(g.workload);
    out->set_load_point(g.load_point);
    out->set_ok_results(g.ok_results);
    out->set_first_sweep(g.first_sweep);
    out->set_last_sweep(g.last_sweep);
    out->set_last_finished_unix_ms(g.last_finished_unix_ms);
  }
  if (!q.serving && !q.load_point) RETURN_IF_ERROR(AddMemoryVerdicts(q, resp));
  if (!best.best) return absl::OkStatus();
  resp->set_found(true);
  FillRow(*best.best, std::move(best.best->result_json), resp->mutable_row());
  return absl::OkStatus();
}

absl::Status UserApi::AddMemoryVerdicts(const BestQuery& best, v1::BestResponse* resp) {
  ResultQuery q;
  q.model = best.model;
  q.sm = best.sm;
  q.model_key = best.model_key;
  q.workload = best.workload;
  q.layers = best.layers;
  q.sweep_id = best.sweep_id;
  q.with_kernels = false;
  q.limit = kMaxMemoryVerdictResults;
  // The ranking stands without them: a result that no longer parses (DataLoss) or a busy store
  // leaves the verdicts out rather than failing the answer.
  absl::StatusOr<std::vector<StoredResult>> read = services_.store.QueryResults(q);
  if (!read.ok()) {
    services_.Log(
        absl::StrCat("best for ", best.model, " on sm_", best.sm,
                     ": answered without its memory verdicts: ", read.status().ToString()));
    return absl::OkStatus();
  }
  const std::vector<StoredResult>& results = *read;
  // Newest first: a (config, GPU)'s first result with an entry at the batch size decides.
  std::set<std::pair<std::string, std::string>> decided;
  for (const StoredResult& stored : results) {
    const TrialResult& r = stored.result;
    const auto entry = std::find_if(r.batches.begin(), r.batches.end(),
                                    [&](const BatchFigures& b) { return b.batch == best.batch; });
    if (entry == r.batches.end()) continue;
    const std::string config = BackendConfigString(r.config);
    if (!decided.insert({config, stored.gpu_name}).second || entry->measured()) continue;
    v1::MemoryVerdictRow* row = resp->add_does_not_fit();
    row->set_config(config);
    row->set_gpu_name(stored.gpu_name);
    row->set_batch(entry->batch);
    row->set_verdict(std::string(BatchMemoryVerdictName(*entry->memory_verdict)));
    row->set_reason(entry->memory_reason);
    row->set_trial_id(r.trial_id);
    row->set_sweep_id(stored.sweep_id);
  }
  return absl::OkStatus();
}

absl::Status UserApi::RegressionsOf(const v1::RegressionsRequest& req,
                                    v1::RegressionsResponse* resp) {
  RETURN_IF_ERROR(CheckText("metric", req.metric(), kMaxQueryWordBytes));
  RETURN_IF_ERROR(CheckText("test", req.test(), kMaxQueryWordBytes));
  if (req.has_model()) RETURN_IF_ERROR(CheckText("model", req.model(), kMaxQueryModelBytes));
  if (req.has_sm()) RETURN_IF_ERROR(CheckSm(req.sm()));
  RETURN_IF_ERROR(CheckIdentityFilters(req));
  if (req.has_limit() && (req.limit() < 1 || req.limit() > kMaxRegressionResults))
    return absl::InvalidArgumentError(absl::StrCat("limit: ", req.limit(), " must lie in [1, ",
                                                   kMaxRegressionResults,
                                                   "] (unset: ", kMaxRegressionResults, ")"));
  RegressionQuery q;
  if (!req.metric().empty()) q.metric = req.metric();
  if (req.has_model()) q.model = req.model();
  if (req.has_sm()) q.sm = req.sm();
  if (req.has_sweep_id()) q.sweep_id = req.sweep_id();
  if (req.has_model_key()) q.model_key = req.model_key();
  if (req.has_workload()) q.workload = req.workload();
  if (req.has_layers()) q.layers = req.layers();
  if (req.window() != 0) q.options.window = req.window();
  if (req.min_history() != 0) q.options.min_history = req.min_history();
  if (!req.test().empty()) {
    ASSIGN_OR_RETURN(q.options.test, ParseRegressionTest(req.test()));
  }
  if (req.z_threshold() != 0) q.options.z_threshold = req.z_threshold();
  if (req.iqr_k() != 0) q.options.iqr_k = req.iqr_k();
  if (req.has_min_change()) q.options.min_change = req.min_change();
  if (req.has_limit()) q.limit = req.limit();
  ASSIGN_OR_RETURN(const std::vector<RegressionRow> rows, FindRegressions(services_.store, q));
  for (const RegressionRow& r : rows) *resp->add_series() = ToProto(r);
  return absl::OkStatus();
}

}  // namespace infersweep::coordinator
