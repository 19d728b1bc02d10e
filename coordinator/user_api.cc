// SweepService, the user API: every call passes CheckUser (rate limit, then the bearer token),
// then submits, reads or cancels sweeps, lists agents, and answers result, best and regression
// queries from the store.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/model_description.h"
#include "coordinator/regressions.h"
#include "coordinator/server_impl.h"
#include "coordinator/sweep_spec.h"

namespace infersweep {

namespace {

using coordinator_internal::GrpcError;
using coordinator_internal::RateLimitMessage;

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

grpc::Status InvalidArgument(const std::string& message) {
  return GrpcError(grpc::StatusCode::INVALID_ARGUMENT, message);
}

grpc::Status CheckText(absl::string_view field, const std::string& value, size_t max_bytes) {
  if (value.size() <= max_bytes) return grpc::Status::OK;
  return InvalidArgument(
      absl::StrCat(field, ": ", value.size(), " bytes; the limit is ", max_bytes));
}

// An SM as results store it: 0 for CPU results, else a compute capability of 10..1000.
grpc::Status CheckSm(int sm) {
  if (sm == 0 || (sm >= 10 && sm <= 1000)) return grpc::Status::OK;
  return InvalidArgument(
      absl::StrCat("sm: ", sm, " is not an SM architecture (0 for CPU results, or 10..1000)"));
}

// The identity filters QueryResults, Best and Regressions share.
template <typename Request>
grpc::Status CheckIdentityFilters(const Request& req) {
  if (req.has_model_key())
    if (grpc::Status s = CheckText("model_key", req.model_key(), kMaxQueryModelKeyBytes); !s.ok())
      return s;
  if (req.has_workload())
    if (grpc::Status s = CheckText("workload", req.workload(), kMaxQueryWorkloadBytes); !s.ok())
      return s;
  if (req.has_layers() && req.layers() < 1)
    return InvalidArgument(absl::StrCat("layers: ", req.layers(), " must be >= 1"));
  return grpc::Status::OK;
}

}  // namespace

// ------------------------------------------------------------------------------ authentication

grpc::Status CoordinatorServer::Impl::CheckUser(grpc::ServerContext* context) {
  // The rate limit comes first, so that guessing tokens is limited too.
  if (const std::string peer = PeerHost(context->peer());
      OverRateLimit(user_limiter_, peer, "user"))
    return GrpcError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                     RateLimitMessage("user-API calls", user_limiter_.limit(), peer));
  if (options_.user_token.empty()) return grpc::Status::OK;
  bool ok = false;
  const auto& md = context->client_metadata();
  auto it = md.find(rpc::kAuthMetadataKey);
  if (it != md.end()) {
    const std::string_view value(it->second.data(), it->second.size());
    const std::string_view prefix(rpc::kBearerPrefix);
    if (value.size() > prefix.size() && value.substr(0, prefix.size()) == prefix)
      ok = rpc::ConstantTimeEquals(value.substr(prefix.size()), options_.user_token);
  }
  if (ok) return grpc::Status::OK;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.auth_failures;
  }
  metrics_->CountAuthFailure("user");
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid credentials");
}

// ------------------------------------------------------------------------------ user API

grpc::Status CoordinatorServer::Impl::SubmitSweep(const v1::SubmitSweepRequest& req,
                                                  v1::SubmitSweepResponse* resp) {
  const std::string source = req.source().empty() ? "<request>" : req.source().substr(0, 256);
  if (req.spec_yaml().size() > kMaxSweepSpecBytes)
    return GrpcError(grpc::StatusCode::INVALID_ARGUMENT,
                     absl::StrCat(source, ": spec is ", req.spec_yaml().size(),
                                  " bytes; the limit is ", kMaxSweepSpecBytes));
  absl::StatusOr<SweepSpec> spec = ParseSweepSpec(req.spec_yaml(), source);
  if (!spec.ok()) return rpc::ToGrpcStatus(spec.status());
  absl::StatusOr<std::vector<std::string>> warnings = CheckSweepModel(*spec);
  if (!warnings.ok()) return rpc::ToGrpcStatus(warnings.status());
  absl::StatusOr<std::vector<TrialRecord>> trials =
      ExpandSweep(*spec, 0, options_.max_trials_per_sweep);
  if (!trials.ok()) return rpc::ToGrpcStatus(trials.status());
  // A preset's identity is known here (a pure function of name, layers, seed and format), so
  // every result of its trials is filed under it, also those made without an agent. A
  // checkpoint's needs its files: the agent that runs it says.
  std::map<std::tuple<std::string, int, uint64_t>, std::string> preset_keys;
  for (TrialRecord& t : *trials) {
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
  absl::StatusOr<int64_t> id = store_->CreateSweep(MakeSweepRecord(*spec), *trials);
  if (!id.ok()) return rpc::ToGrpcStatus(id.status());
  {
    // The trial counters of the connected archs start at 0 (coordinator/metrics.h).
    std::set<int> sms;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [agent, conn] : conns_)
        for (const SlotInfo& slot : conn->slots) sms.insert(slot.sm);
    }
    std::set<std::string> models;
    for (const TrialRecord& t : *trials) models.insert(t.model);
    for (const std::string& model : models)
      for (int sm : sms) metrics_->DeclareTrialSeries(model, sm);
  }
  resp->set_sweep_id(*id);
  resp->set_trial_count(static_cast<int64_t>(trials->size()));
  for (const std::string& w : *warnings) resp->add_warnings(w);
  Log(absl::StrCat("sweep ", *id, " '", spec->name, "' submitted: ", trials->size(), " trial(s)",
                   warnings->empty() ? "" : "; warning: ", absl::StrJoin(*warnings, "; ")));
  Wake();
  return grpc::Status::OK;
}

void CoordinatorServer::Impl::LogRefusedSubmit(const std::string& peer, const std::string& source,
                                               const grpc::Status& status) {
  if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) return;
  constexpr size_t kMaxShown = 512;
  std::string why = status.error_message();
  if (why.size() > kMaxShown) why = absl::StrCat(why.substr(0, kMaxShown), "...");
  Log(absl::StrCat("submit of '", source.substr(0, 128), "' from ", peer, " refused: ",
                   absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                   ": ", why));
}

namespace {

std::string DescribeSelector(const Selector& s) {
  std::vector<std::string> parts = {absl::StrCat("device ", s.device)};
  if (!s.sm_archs.empty())
    parts.push_back(absl::StrCat("sm [", absl::StrJoin(s.sm_archs, ", "), "]"));
  if (!s.gpu_name_regex.empty()) parts.push_back(absl::StrCat("gpu_name '", s.gpu_name_regex, "'"));
  if (s.min_memory_bytes > 0)
    parts.push_back(absl::StrCat("min_memory_gb ", static_cast<double>(s.min_memory_bytes) / 1e9));
  if (s.gpus_needed > 1) parts.push_back(absl::StrCat("gpus ", s.gpus_needed));
  if (s.needs_p2p) parts.push_back("p2p");
  return absl::StrJoin(parts, ", ");
}

}  // namespace

std::string CoordinatorServer::Impl::UnmatchedSelectors(int64_t sweep_id) {
  absl::StatusOr<std::vector<Selector>> selectors = store_->QueuedSelectors(sweep_id);
  if (!selectors.ok() || selectors->empty()) return "";
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> unmatched;
  for (const Selector& sel : *selectors) {
    bool matched = false;
    for (const auto& [id, conn] : conns_) {
      int slots = 0;
      for (const SlotInfo& slot : conn->slots) slots += MatchesLocked(sel, slot) ? 1 : 0;
      // A CPU trial takes one slot; a GPU trial its GPU count (peer access aside).
      matched = matched || slots >= (sel.device == "cpu" ? 1 : sel.gpus_needed);
    }
    if (!matched) unmatched.push_back(absl::StrCat("{", DescribeSelector(sel), "}"));
  }
  if (unmatched.empty()) return "";
  std::set<std::string> devices;
  for (const auto& [id, conn] : conns_)
    for (const SlotInfo& slot : conn->slots)
      devices.insert(slot.gpu ? absl::StrCat(slot.gpu_name, " sm_", slot.sm) : "cpu");
  return absl::StrCat("no connected agent matches the selector ", absl::StrJoin(unmatched, " or "),
                      " of its queued trials (connected: ", conns_.size(), " agent(s)",
                      devices.empty() ? "" : absl::StrCat(": ", absl::StrJoin(devices, ", ")), ")");
}

void CoordinatorServer::Impl::FillSweepInfo(const SweepRecord& s, bool with_counts,
                                            v1::SweepInfo* out) {
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
  int64_t running = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [agent, held] : held_)
      for (const auto& [tid, h] : held)
        if (h.sweep_id == s.id && !h.foreign) ++running;
  }
  out->set_trials_running(running);
  if (s.state == "active" && s.trials_done + running < s.trials_total)
    out->set_waiting(UnmatchedSelectors(s.id));
  if (!with_counts) return;
  if (auto counts = store_->CountResults(s.id); counts.ok())
    for (const auto& [status, n] : *counts) (*out->mutable_status_counts())[status] = n;
}

grpc::Status CoordinatorServer::Impl::GetSweep(const v1::GetSweepRequest& req, v1::SweepInfo* resp) {
  absl::StatusOr<SweepRecord> s = store_->GetSweep(req.sweep_id());
  if (!s.ok()) return rpc::ToGrpcStatus(s.status());
  FillSweepInfo(*s, /*with_counts=*/true, resp);
  resp->set_spec_yaml(s->spec_yaml);
  return grpc::Status::OK;
}

grpc::Status CoordinatorServer::Impl::ListSweeps(v1::ListSweepsResponse* resp) {
  absl::StatusOr<std::vector<SweepRecord>> sweeps = store_->ListSweeps();
  if (!sweeps.ok()) return rpc::ToGrpcStatus(sweeps.status());
  for (const SweepRecord& s : *sweeps) FillSweepInfo(s, /*with_counts=*/false, resp->add_sweeps());
  return grpc::Status::OK;
}

grpc::Status CoordinatorServer::Impl::CancelSweep(const v1::CancelSweepRequest& req,
                                                  v1::CancelSweepResponse* resp) {
  if (absl::Status s = store_->CancelSweep(req.sweep_id()); !s.ok()) return rpc::ToGrpcStatus(s);
  int64_t sent = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [agent, held] : held_) {
    auto c = conns_.find(agent);
    if (c == conns_.end()) continue;
    for (const auto& [tid, h] : held) {
      if (h.sweep_id != req.sweep_id() || h.foreign) continue;
      v1::CoordinatorMessage m;
      m.mutable_cancel()->set_trial_id(tid);
      c->second->Enqueue(std::move(m));
      ++sent;
    }
  }
  resp->set_trials_cancelled_running(sent);
  Log(absl::StrCat("sweep ", req.sweep_id(), " cancelled (", sent, " running trial(s) told)"));
  return grpc::Status::OK;
}

grpc::Status CoordinatorServer::Impl::ListAgents(v1::ListAgentsResponse* resp) {
  absl::StatusOr<std::vector<AgentRecord>> agents = store_->ListAgents();
  if (!agents.ok()) return rpc::ToGrpcStatus(agents.status());
  std::lock_guard<std::mutex> lock(mu_);
  for (const AgentRecord& a : *agents) {
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
    auto c = conns_.find(a.agent_id);
    info->set_connected(c != conns_.end());
    if (c == conns_.end()) continue;
    const Conn& conn = *c->second;
    info->set_slots(static_cast<int32_t>(conn.slots.size()));
    int free = 0;
    for (const SlotInfo& s : conn.slots)
      if (!SlotBusyLocked(a.agent_id, s.index)) ++free;
    info->set_free_slots(free);
    info->set_bad_messages(conn.bad_messages.load());
    if (auto h = held_.find(a.agent_id); h != held_.end())
      for (const auto& [tid, held] : h->second)
        if (!held.slots.empty()) info->add_running_trial_ids(tid);
  }
  return grpc::Status::OK;
}

namespace {

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

grpc::Status CoordinatorServer::Impl::QueryResults(const v1::QueryResultsRequest& req,
                                                   v1::QueryResultsResponse* resp) {
  if (req.has_sm())
    if (grpc::Status s = CheckSm(req.sm()); !s.ok()) return s;
  if (req.has_gpu_name())
    if (grpc::Status s = CheckText("gpu_name", req.gpu_name(), kMaxQueryGpuNameBytes); !s.ok())
      return s;
  if (req.has_model())
    if (grpc::Status s = CheckText("model", req.model(), kMaxQueryModelBytes); !s.ok()) return s;
  if (req.has_status())
    if (grpc::Status s = CheckText("status", req.status(), kMaxQueryWordBytes); !s.ok()) return s;
  if (grpc::Status s = CheckIdentityFilters(req); !s.ok()) return s;
  if (req.axis_values_size() > static_cast<int>(kMaxQueryAxes))
    return InvalidArgument(absl::StrCat("axis_values: ", req.axis_values_size(),
                                        " axes; the limit is ", kMaxQueryAxes));
  for (const auto& [axis, value] : req.axis_values()) {
    if (grpc::Status s = CheckText("axis_values key", axis, kMaxQueryWordBytes); !s.ok()) return s;
    if (grpc::Status s =
            CheckText(absl::StrCat("axis_values['", axis, "']"), value, kMaxQueryWordBytes);
        !s.ok())
      return s;
  }
  if (req.has_limit() && (req.limit() < 1 || req.limit() > rpc::kMaxQueryRows))
    return InvalidArgument(absl::StrCat("limit: ", req.limit(), " must lie in [1, ",
                                        rpc::kMaxQueryRows, "] (unset: ", rpc::kDefaultQueryRows,
                                        ")"));
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
      return GrpcError(grpc::StatusCode::INVALID_ARGUMENT,
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
  absl::StatusOr<std::vector<StoredResult>> rows = store_->QueryResultRows(q);
  if (!rows.ok()) return rpc::ToGrpcStatus(rows.status());
  size_t bytes = 0;
  for (StoredResult& r : *rows) {
    bytes += r.result_json.size() + r.agent_id.size() + r.gpu_name.size() + 256;
    if (bytes > kMaxResultPageBytes) {
      resp->set_truncated(true);
      break;
    }
    FillRow(r, std::move(r.result_json), resp->add_rows());
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorServer::Impl::Best(const v1::BestRequest& req, v1::BestResponse* resp) {
  if (grpc::Status s = CheckText("model", req.model(), kMaxQueryModelBytes); !s.ok()) return s;
  if (grpc::Status s = CheckText("metric", req.metric(), kMaxQueryWordBytes); !s.ok()) return s;
  if (req.has_load_point())
    if (grpc::Status s = CheckText("load_point", req.load_point(), kMaxQueryWordBytes); !s.ok())
      return s;
  if (grpc::Status s = CheckSm(req.sm()); !s.ok()) return s;
  if (grpc::Status s = CheckIdentityFilters(req); !s.ok()) return s;
  if (req.has_batch() && (req.batch() < 1 || req.batch() > kMaxBatchSize))
    return InvalidArgument(
        absl::StrCat("batch: ", req.batch(), " must lie in [1, ", kMaxBatchSize, "] (unset: 1)"));
  BestQuery q;
  q.model = req.model();
  if (req.has_sweep_id()) {
    q.sweep_id = req.sweep_id();
    absl::StatusOr<SweepRecord> sweep = store_->GetSweep(req.sweep_id());
    if (!sweep.ok()) return rpc::ToGrpcStatus(sweep.status());
    if (q.model.empty()) q.model = sweep->model;
  }
  if (q.model.empty())
    return GrpcError(grpc::StatusCode::INVALID_ARGUMENT, "best: model (or sweep_id) is required");
  q.sm = req.sm();
  q.metric = req.metric().empty() ? "output_tok_s" : req.metric();
  q.batch = req.has_batch() ? req.batch() : 1;
  if (req.has_model_key()) q.model_key = req.model_key();
  if (req.has_workload()) q.workload = req.workload();
  if (req.has_layers()) q.layers = req.layers();
  q.serving = req.serving();
  if (req.has_load_point()) q.load_point = req.load_point();
  absl::StatusOr<BestAnswer> best = store_->Best(q);
  if (!best.ok()) return rpc::ToGrpcStatus(best.status());
  resp->set_model(q.model);
  for (const ResultGroup& g : best->groups) {
    v1::ResultGroup* out = resp->add_groups();
    out->set_model_key(g.model_key);
    out->set_workload(g.workload);
    out->set_load_point(g.load_point);
    out->set_ok_results(g.ok_results);
    out->set_first_sweep(g.first_sweep);
    out->set_last_sweep(g.last_sweep);
    out->set_last_finished_unix_ms(g.last_finished_unix_ms);
  }
  if (!best->best) return grpc::Status::OK;
  resp->set_found(true);
  FillRow(*best->best, std::move(best->best->result_json), resp->mutable_row());
  return grpc::Status::OK;
}

grpc::Status CoordinatorServer::Impl::Regressions(const v1::RegressionsRequest& req,
                                                  v1::RegressionsResponse* resp) {
  if (grpc::Status s = CheckText("metric", req.metric(), kMaxQueryWordBytes); !s.ok()) return s;
  if (grpc::Status s = CheckText("test", req.test(), kMaxQueryWordBytes); !s.ok()) return s;
  if (req.has_model())
    if (grpc::Status s = CheckText("model", req.model(), kMaxQueryModelBytes); !s.ok()) return s;
  if (req.has_sm())
    if (grpc::Status s = CheckSm(req.sm()); !s.ok()) return s;
  if (grpc::Status s = CheckIdentityFilters(req); !s.ok()) return s;
  if (req.has_limit() && (req.limit() < 1 || req.limit() > kMaxRegressionResults))
    return InvalidArgument(absl::StrCat("limit: ", req.limit(), " must lie in [1, ",
                                        kMaxRegressionResults, "] (unset: ", kMaxRegressionResults,
                                        ")"));
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
    absl::StatusOr<RegressionTest> test = ParseRegressionTest(req.test());
    if (!test.ok()) return rpc::ToGrpcStatus(test.status());
    q.options.test = *test;
  }
  if (req.z_threshold() != 0) q.options.z_threshold = req.z_threshold();
  if (req.iqr_k() != 0) q.options.iqr_k = req.iqr_k();
  if (req.has_min_change()) q.options.min_change = req.min_change();
  if (req.has_limit()) q.limit = req.limit();
  absl::StatusOr<std::vector<RegressionRow>> rows = FindRegressions(*store_, q);
  if (!rows.ok()) return rpc::ToGrpcStatus(rows.status());
  for (const RegressionRow& r : *rows) *resp->add_series() = ToProto(r);
  return grpc::Status::OK;
}

}  // namespace infersweep
