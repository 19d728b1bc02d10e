// AgentService.Connect: one bidirectional stream per agent. Hello is validated and answered with
// Welcome; heartbeats renew leases; progress is kept for status; results are checked, stored in
// group commits and answered with Ack or Error; Assignments reach the agent through the stream's
// writer thread (Conn::WriterLoop).
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/trial.h"
#include "api/version.h"
#include "coordinator/agent_identity.h"
#include "coordinator/server_impl.h"

namespace infersweep {

namespace {

using coordinator_internal::GrpcError;
using coordinator_internal::NowMs;
using coordinator_internal::RateLimitMessage;

constexpr size_t kMaxTextField = 256;
constexpr int kMaxSlots = 256;
constexpr size_t kMaxProgressText = 4096;

const char* MessageName(const v1::AgentMessage& m) {
  switch (m.msg_case()) {
    case v1::AgentMessage::kHello: return "Hello";
    case v1::AgentMessage::kHeartbeat: return "Heartbeat";
    case v1::AgentMessage::kProgress: return "Progress";
    case v1::AgentMessage::kResult: return "Result";
    default: return "an empty message";
  }
}

v1::CoordinatorMessage ErrorMessage(const std::string& text, const std::string& trial_id = "",
                                    int attempt = 0, bool permanent = false,
                                    absl::StatusCode code = absl::StatusCode::kUnknown) {
  v1::CoordinatorMessage m;
  v1::Error* e = m.mutable_error();
  e->set_message(text);
  e->set_trial_id(trial_id);
  e->set_attempt(attempt);
  e->set_permanent(permanent);
  e->set_code(static_cast<int32_t>(code));
  return m;
}

}  // namespace

// ------------------------------------------------------------------------------ agent stream

absl::Status CoordinatorServer::Impl::ValidateHello(const v1::Hello& h) const {
  if (h.protocol_version() != rpc::kProtocolVersion)
    return absl::FailedPreconditionError(
        absl::StrCat("Hello: protocol version ", h.protocol_version(), "; this coordinator speaks ",
                     rpc::kProtocolVersion));
  if (!ValidAgentId(h.agent_id()))
    return absl::InvalidArgumentError(absl::StrCat(
        "Hello: agent_id must be 1..", kMaxAgentIdLength,
        " characters of [A-Za-z0-9._:-], got '", h.agent_id().substr(0, kMaxAgentIdLength), "'"));
  if (h.host().size() > kMaxTextField || h.engine_version().size() > kMaxTextField)
    return absl::InvalidArgumentError("Hello: host or engine_version longer than 256 characters");
  if (h.gpus_size() > kMaxSlots)
    return absl::InvalidArgumentError(absl::StrCat("Hello: more than ", kMaxSlots, " GPUs"));
  if (h.cpu_only() && h.gpus_size() > 0)
    return absl::InvalidArgumentError("Hello: cpu_only with a non-empty GPU list");
  for (int i = 0; i < h.gpus_size(); ++i) {
    const v1::Gpu& g = h.gpus(i);
    if (g.index() != i)
      return absl::InvalidArgumentError(
          absl::StrCat("Hello: gpus[", i, "].index is ", g.index(), "; GPUs must be listed 0..n-1"));
    if (g.name().empty() || g.name().size() > kMaxTextField)
      return absl::InvalidArgumentError(absl::StrCat("Hello: gpus[", i, "].name is empty or too long"));
    if (g.sm() < 0 || g.sm() > 1000 || g.memory_bytes() < 0)
      return absl::InvalidArgumentError(absl::StrCat("Hello: gpus[", i, "]: sm or memory out of range"));
    for (const auto* peers : {&g.p2p_peers(), &g.nvlink_peers()})
      for (int peer : *peers)
        if (peer < 0 || peer >= h.gpus_size() || peer == i)
          return absl::InvalidArgumentError(absl::StrCat(
              "Hello: gpus[", i, "].", peers == &g.p2p_peers() ? "p2p_peers" : "nvlink_peers",
              " names GPU ", peer, ", which is not another of the agent's ", h.gpus_size(),
              " GPUs"));
  }
  if (h.backends_size() > 4096 || h.running_size() > 4096)
    return absl::InvalidArgumentError("Hello: too many backends or running trials");
  if (h.spooled_size() > rpc::kMaxHelloSpooled)
    return absl::InvalidArgumentError(
        absl::StrCat("Hello: more than ", rpc::kMaxHelloSpooled, " spooled results listed"));
  return absl::OkStatus();
}

grpc::Status CoordinatorServer::Impl::Connect(grpc::ServerContext* context, AgentStream* stream) {
  if (const std::string peer = PeerHost(context->peer());
      OverRateLimit(connect_limiter_, peer, "connect"))
    return GrpcError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                     RateLimitMessage("agent streams", connect_limiter_.limit(), peer));
  v1::AgentMessage msg;
  if (!stream->Read(&msg)) return grpc::Status::OK;  // gone before saying anything
  // The agent id the stream claims, for the log ("" when its Hello has none that is valid).
  const std::string claimed =
      msg.has_hello() && ValidAgentId(msg.hello().agent_id()) ? msg.hello().agent_id() : "";
  // Closes the stream with `code`: the agent reads `text` and the code in an Error, then the
  // same in the stream's status.
  auto reject = [&](grpc::StatusCode code, const std::string& text) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.streams_rejected;
    }
    Log(absl::StrCat("stream rejected from ", context->peer(),
                     claimed.empty() ? "" : absl::StrCat(" (agent '", claimed, "')"), ": ",
                     absl::StatusCodeToString(static_cast<absl::StatusCode>(code)), ": ", text));
    stream->Write(
        ErrorMessage(text, "", 0, /*permanent=*/false, static_cast<absl::StatusCode>(code)));
    return GrpcError(code, text);
  };
  if (!msg.has_hello())
    return reject(grpc::StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("protocol error: the first message on a stream must be Hello, got ",
                               MessageName(msg)));
  // Authentication comes before any other check, so that a stranger learns nothing else; it
  // also checks that the credentials prove the agent id the Hello names.
  const absl::StatusOr<AgentCredential> credential = agent_auth_.Authenticate(
      msg.hello().agent_id(), msg.hello().auth_token(), PeerCredentialsOf(*context));
  if (!credential.ok()) {
    if (credential.status().code() == absl::StatusCode::kUnauthenticated) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.auth_failures;
      }
      metrics_->CountAuthFailure("agent");
    } else {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.identity_refused;
      }
      metrics_->CountAgentIdentityRefused("certificate");
    }
    return reject(static_cast<grpc::StatusCode>(credential.status().code()),
                  std::string(credential.status().message()));
  }
  if (absl::Status s = ValidateHello(msg.hello()); !s.ok())
    return reject(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));

  auto conn = std::make_shared<Conn>();
  conn->credential = *credential;
  conn->hello = msg.hello();
  conn->hello.clear_auth_token();
  conn->agent_id = conn->hello.agent_id();
  conn->context = context;
  if (conn->hello.gpus_size() == 0) {
    conn->slots.push_back(SlotInfo{0, false, "cpu", 0, 0});
  } else {
    for (const v1::Gpu& g : conn->hello.gpus())
      conn->slots.push_back(SlotInfo{g.index(), true, g.name(), g.sm(), g.memory_bytes(),
                                     {g.p2p_peers().begin(), g.p2p_peers().end()}});
    conn->gpu_count = conn->hello.gpus_size();
  }
  const std::string& id = conn->agent_id;
  const int64_t now = NowMs();
  // Welcome is queued before the connection becomes visible to the scheduler, so no Assignment
  // can overtake it (an agent drops a stream whose first message is not Welcome).
  v1::CoordinatorMessage welcome;
  welcome.mutable_welcome()->set_coordinator_version(EngineVersion());
  welcome.mutable_welcome()->set_protocol_version(rpc::kProtocolVersion);
  welcome.mutable_welcome()->set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  welcome.mutable_welcome()->set_lease_ms(options_.lease_ms);
  conn->Enqueue(std::move(welcome));
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) return GrpcError(grpc::StatusCode::UNAVAILABLE, "coordinator is stopping");
    if (auto it = conns_.find(id); it != conns_.end()) {
      if (it->second->credential.fingerprint != conn->credential.fingerprint) {
        // Another credential claims a connected agent's id: refused, and the connected stream
        // keeps its leases. An agent that really moved reconnects once its old stream is
        // noticed dead (keepalive).
        ++stats_.identity_refused;
        lock.unlock();
        metrics_->CountAgentIdentityRefused("conflict");
        return reject(grpc::StatusCode::ALREADY_EXISTS,
                      absl::StrCat("Hello: agent '", id,
                                   "' is connected with another credential; this stream is "
                                   "refused (the connected one stays)"));
      }
      // The same agent again (it reconnected before its old stream was noticed dead): the new
      // stream replaces the old one.
      it->second->superseded = true;
      it->second->context->TryCancel();
      Log(absl::StrCat("agent ", id, " reconnected; closing its previous stream"));
    }
    conns_[id] = conn;
    ReconcileHeldLocked(*conn, now);
    conn->hello.clear_spooled();  // used up
  }
  {
    v1::Hello stored = conn->hello;
    stored.clear_running();
    stored.clear_spooled();
    std::string json;
    (void)google::protobuf::util::MessageToJsonString(stored, &json);
    AgentRecord rec{id, conn->hello.host(), json, now, true};
    if (absl::Status s = store_->UpsertAgent(rec); !s.ok())
      Log(absl::StrCat("storing agent ", id, ": ", s.message()));
  }
  Log(absl::StrCat("agent ", id, " connected from ", context->peer(), ": ",
                   conn->hello.gpus_size() == 0 ? "cpu-only" : absl::StrCat(conn->hello.gpus_size(), " GPU(s)"),
                   conn->hello.gpus_size() > 0 ? absl::StrCat(", ", conn->hello.gpus(0).name(), " sm_",
                                                              conn->hello.gpus(0).sm())
                                               : ""));

  {
    // The trial counters of what this agent may run start at 0 (coordinator/metrics.h).
    std::set<int> sms;
    for (const SlotInfo& slot : conn->slots) sms.insert(slot.sm);
    std::vector<std::string> models;
    if (auto sweeps = store_->ListSweeps(); sweeps.ok())
      for (const SweepRecord& s : *sweeps)
        if (s.state == "active") models.push_back(s.model);
    for (const std::string& model : models)
      for (int sm : sms) metrics_->DeclareTrialSeries(model, sm);
  }
  std::thread writer([conn, stream] { conn->WriterLoop(stream); });
  Wake();

  grpc::Status end = grpc::Status::OK;
  int64_t dropped = 0;        // messages over the rate limit since the last log line
  int64_t next_drop_log = 0;  // when the next such line may be written
  while (stream->Read(&msg)) {
    if (OverRateLimit(agent_limiter_, id, "agent")) {
      // Nothing is processed or stored. A Result gets a retryable Error: it stays spooled.
      ++dropped;
      const std::string text =
          RateLimitMessage("messages", agent_limiter_.limit(), absl::StrCat("agent ", id));
      if (msg.has_result())
        conn->Enqueue(ErrorMessage(text, msg.result().trial_id(), msg.result().attempt(),
                                   /*permanent=*/false, absl::StatusCode::kResourceExhausted));
      if (const int64_t t = NowMs(); t >= next_drop_log) {
        Log(absl::StrCat(text, " (", dropped, " message(s) dropped)"));
        dropped = 0;
        next_drop_log = t + 5000;
      }
      continue;
    }
    if (msg.has_hello()) {
      const std::string text = "protocol error: a second Hello on the same stream";
      conn->Enqueue(
          ErrorMessage(text, "", 0, /*permanent=*/false, absl::StatusCode::kFailedPrecondition));
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.streams_rejected;
      }
      end = GrpcError(grpc::StatusCode::FAILED_PRECONDITION, text);
      Log(absl::StrCat("agent ", id, ": ", text, "; stream closed"));
      break;
    }
    switch (msg.msg_case()) {
      case v1::AgentMessage::kHeartbeat:
        OnHeartbeat(*conn, msg.heartbeat());
        break;
      case v1::AgentMessage::kProgress:
        OnProgress(*conn, msg.progress());
        break;
      case v1::AgentMessage::kResult:
        OnResult(conn, msg.result());
        break;
      default:
        Reject(*conn, "empty message: no field of AgentMessage is set", "", 0);
        break;
    }
  }

  bool current = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = conns_.find(id); it != conns_.end() && it->second == conn) {
      conns_.erase(it);
      current = true;
    }
    // Its trials keep their leases: they expire unless the agent comes back (docs/SERVICE.md).
    if (current) {
      for (auto& [tid, h] : held_[id])
        if (h.foreign) h.slots.clear();
    }
  }
  if (current) (void)store_->SetAgentConnected(id, false, NowMs());
  conn->CloseOutbound();
  writer.join();
  if (current) Log(absl::StrCat("agent ", id, " disconnected"));
  Wake();
  return end;
}

void CoordinatorServer::Impl::ReconcileHeldLocked(Conn& conn, int64_t now) {
  auto& held = held_[conn.agent_id];
  std::map<std::string, const v1::RunningTrial*> running;
  for (const v1::RunningTrial& r : conn.hello.running()) running[r.trial_id()] = &r;
  std::set<std::pair<std::string, int>> spooled;
  for (const v1::RunningTrial& r : conn.hello.spooled())
    spooled.insert({r.trial_id(), r.attempt()});
  auto valid_slots = [&](const v1::RunningTrial& r) {
    std::vector<int> slots;
    for (int s : r.slots())
      if (s >= 0 && s < static_cast<int>(conn.slots.size())) slots.push_back(s);
    if (slots.empty()) slots.push_back(0);
    return slots;
  };
  for (auto it = held.begin(); it != held.end();) {
    auto& [tid, h] = *it;
    auto r = running.find(tid);
    if (r != running.end() && r->second->attempt() == h.attempt) {
      h.slots = valid_slots(*r->second);
      h.lost_deadline = 0;
      h.confirmed = true;
      ++it;
    } else if (h.foreign) {
      it = held.erase(it);
    } else {
      // Not running any more: its result may be in the agent's spool, replayed right after this
      // Hello; the lease is released if it does not come within the grace period. An agent that
      // lists its spool says whether it is there: if not, the trial is lost now (its Assignment
      // was lost on the way, or the agent restarted without it).
      h.slots.clear();
      const bool lost_now = conn.hello.reports_spool() && !spooled.count({tid, h.attempt});
      h.lost_deadline = lost_now ? now : now + options_.lost_trial_grace_ms;
      ++it;
    }
  }
  for (const auto& [tid, r] : running) {
    if (held.count(tid)) continue;
    Held h;
    h.attempt = r->attempt();
    h.slots = valid_slots(*r);
    auto t = store_->GetTrial(tid);
    if (t.ok() && t->state == TrialState::kLeased && t->leased_to == conn.agent_id &&
        t->attempt == r->attempt()) {
      h.sweep_id = t->sweep_id;
    } else {
      h.foreign = true;  // occupies the slots until its result comes; the result is refused
    }
    held[tid] = std::move(h);
  }
}

void CoordinatorServer::Impl::Reject(Conn& conn, const std::string& message,
                                     const std::string& trial_id, int attempt,
                                     absl::StatusCode code) {
  ++conn.bad_messages;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.bad_messages;
  }
  Log(absl::StrCat("agent ", conn.agent_id, ": rejected: ", message));
  conn.Enqueue(ErrorMessage(message, trial_id, attempt, /*permanent=*/true, code));
}

void CoordinatorServer::Impl::OnHeartbeat(Conn& conn, const v1::Heartbeat& hb) {
  const int64_t now = NowMs();
  if (absl::Status s = store_->RenewLeases(conn.agent_id, now + options_.lease_ms); !s.ok())
    Log(absl::StrCat("renewing leases of ", conn.agent_id, ": ", s.message()));
  (void)store_->SetAgentConnected(conn.agent_id, true, now);
  std::set<std::string> running;
  for (const v1::RunningTrial& r : hb.running()) running.insert(r.trial_id());
  for (const std::string& id : hb.running_trial_ids()) running.insert(id);
  std::lock_guard<std::mutex> lock(mu_);
  auto& held = held_[conn.agent_id];
  for (auto it = held.begin(); it != held.end();) {
    if (it->second.foreign && !running.count(it->first)) {
      it = held.erase(it);
    } else {
      ++it;
    }
  }
}

void CoordinatorServer::Impl::OnProgress(Conn& conn, const v1::Progress& p) {
  // Advisory: kept for status displays, never an error.
  std::lock_guard<std::mutex> lock(mu_);
  auto& held = held_[conn.agent_id];
  if (auto it = held.find(p.trial_id()); it != held.end() && it->second.attempt == p.attempt())
    it->second.last_progress = p.text().substr(0, kMaxProgressText);
}

void CoordinatorServer::Impl::OnResult(const std::shared_ptr<Conn>& conn_ptr, const v1::Result& r) {
  Conn& conn = *conn_ptr;
  const auto received = std::chrono::steady_clock::now();
  const std::string& tid = r.trial_id();
  if (tid.empty()) return Reject(conn, "Result without trial_id", "", r.attempt());
  if (r.attempt() < 1)
    return Reject(conn, absl::StrCat("Result for ", tid, ": attempt must be >= 1, got ", r.attempt()),
                  tid, r.attempt());
  absl::StatusOr<TrialResult> result = TrialResultFromJsonText(r.result_json(), "result_json");
  if (!result.ok())
    return Reject(conn, absl::StrCat("Result for ", tid, ": ", result.status().message()), tid,
                  r.attempt());
  if (result->trial_id != tid || result->attempt != r.attempt())
    return Reject(conn,
                  absl::StrCat("Result names trial ", tid, " attempt ", r.attempt(),
                               " but its result_json names trial ", result->trial_id, " attempt ",
                               result->attempt),
                  tid, r.attempt());

  // The slot that ran it gives the GPU name and arch the result is filed under.
  int slot = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& held = held_[conn.agent_id];
    if (r.slots_size() > 0) {
      slot = r.slots(0);
    } else if (auto it = held.find(tid); it != held.end() && !it->second.slots.empty()) {
      slot = it->second.slots[0];
    }
  }
  if (slot < 0 || slot >= static_cast<int>(conn.slots.size())) slot = 0;
  const SlotInfo& info = conn.slots[slot];
  PendingResult pending{conn_ptr,
                        ResultSubmission{conn.agent_id, info.gpu_name, info.sm, *std::move(result)},
                        received};
  {
    std::lock_guard<std::mutex> lock(commit_mu_);
    if (!commit_stopping_) {
      commit_queue_.push_back(std::move(pending));
      commit_cv_.notify_one();
      return;
    }
  }
  // Stopping: nothing more is stored; the agent keeps the result spooled and sends it again.
  conn.Enqueue(ErrorMessage("the coordinator is stopping; send the result again later", tid,
                            r.attempt(), /*permanent=*/false, absl::StatusCode::kUnavailable));
}

void CoordinatorServer::Impl::CommitLoop() {
  // At most this many results a transaction: a commit stays short (a few ms) while the queue
  // behind it fills for the next one.
  constexpr size_t kMaxGroup = 512;
  for (;;) {
    std::vector<PendingResult> group;
    {
      std::unique_lock<std::mutex> lock(commit_mu_);
      commit_cv_.wait(lock, [&] { return commit_stopping_ || !commit_queue_.empty(); });
      if (commit_queue_.empty()) return;  // stopping, and everything is stored
      while (!commit_queue_.empty() && group.size() < kMaxGroup) {
        group.push_back(std::move(commit_queue_.front()));
        commit_queue_.pop_front();
      }
    }
    std::vector<ResultSubmission> submissions;
    submissions.reserve(group.size());
    for (const PendingResult& p : group) submissions.push_back(p.submission);
    const std::vector<absl::Status> stored = store_->RecordResultsEach(submissions);
    metrics_->ObserveCommitGroup(static_cast<double>(group.size()));
    for (size_t i = 0; i < group.size(); ++i) Answer(group[i], stored[i]);
    Wake();
  }
}

void CoordinatorServer::Impl::Answer(PendingResult& pending, const absl::Status& s) {
  Conn& conn = *pending.conn;
  const TrialResult& result = pending.submission.result;
  const std::string& tid = result.trial_id;
  const int attempt = result.attempt;
  bool fresh = false;  // the attempt was held: not a replay of a result stored before
  {
    // Whatever the store says, the agent is done with this attempt.
    std::lock_guard<std::mutex> lock(mu_);
    auto& held = held_[conn.agent_id];
    if (auto it = held.find(tid); it != held.end() && it->second.attempt == attempt) {
      fresh = true;
      held.erase(it);
    }
    if (s.ok()) ++stats_.results_stored;
  }
  if (s.ok()) {
    metrics_->ObserveIngestSeconds(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - pending.received).count());
    if (fresh) ExportResult(result, pending.submission.gpu_name, pending.submission.sm);
    v1::CoordinatorMessage ack;
    ack.mutable_ack()->set_trial_id(tid);
    ack.mutable_ack()->set_attempt(attempt);
    conn.Enqueue(std::move(ack));
    return;
  }
  switch (s.code()) {
    case absl::StatusCode::kAlreadyExists:
      // The attempt is stored with other content: refused (the stored row stays), logged by
      // Reject and counted, so the disagreement with the agent's own log is visible.
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.results_conflicting;
      }
      metrics_->CountResultConflict();
      return Reject(conn, std::string(s.message()), tid, attempt, s.code());
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
      return Reject(conn, std::string(s.message()), tid, attempt, s.code());
    default: {
      // Storage trouble (busy, full): nothing was stored; the agent keeps the result spooled
      // and sends it again after a backoff.
      Log(absl::StrCat("storing the result of ", tid, " attempt ", attempt, " failed (the agent ",
                       conn.agent_id, " keeps it and retries): ", s.message()));
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.store_errors;
      }
      conn.Enqueue(ErrorMessage(absl::StrCat("could not store the result: ", s.message()), tid,
                                attempt, /*permanent=*/false, s.code()));
    }
  }
}

}  // namespace infersweep
