#include "coordinator/agent_sessions.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "api/trial.h"
#include "api/version.h"
#include "proto/rpc.h"

namespace infersweep::coordinator {

// One agent stream. Messages to the agent go through a queue drained by a writer thread, so that
// no caller (the scheduler above all) blocks on a slow agent.
struct Conn {
  Conn(AgentInventory agent, AgentCredential credential, grpc::ServerContext* context)
      : agent(std::move(agent)), credential(std::move(credential)), context(context) {}

  const AgentInventory agent;
  const AgentCredential credential;  // what a replacing stream must present again
  grpc::ServerContext* const context;
  std::atomic<int64_t> bad_messages{0};

  std::mutex out_mu;
  std::condition_variable out_cv;
  std::deque<v1::CoordinatorMessage> out;  // guarded by out_mu
  bool out_closed = false;                 // guarded by out_mu

  void Enqueue(v1::CoordinatorMessage m) {
    {
      std::lock_guard<std::mutex> lock(out_mu);
      if (out_closed) return;
      out.push_back(std::move(m));
    }
    out_cv.notify_one();
  }
  // Stops the writer after it has written what is queued.
  void CloseOutbound() {
    {
      std::lock_guard<std::mutex> lock(out_mu);
      out_closed = true;
    }
    out_cv.notify_one();
  }
  void WriterLoop(AgentStream* stream) {
    bool ok = true;
    while (true) {
      v1::CoordinatorMessage m;
      {
        std::unique_lock<std::mutex> lock(out_mu);
        out_cv.wait(lock, [&] { return out_closed || !out.empty(); });
        if (out.empty()) return;
        m = std::move(out.front());
        out.pop_front();
      }
      if (ok && !stream->Write(m)) {
        ok = false;
        context->TryCancel();  // the reader sees the end of the stream
      }
    }
  }
};

namespace {

constexpr size_t kMaxTextField = 256;
constexpr int kMaxSlots = 256;
constexpr size_t kMaxProgressText = 4096;

const char* MessageName(const v1::AgentMessage& m) {
  switch (m.msg_case()) {
    case v1::AgentMessage::kHello:
      return "Hello";
    case v1::AgentMessage::kHeartbeat:
      return "Heartbeat";
    case v1::AgentMessage::kProgress:
      return "Progress";
    case v1::AgentMessage::kResult:
      return "Result";
    default:
      return "an empty message";
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

absl::Status ValidateHello(const v1::Hello& h) {
  if (h.protocol_version() != rpc::kProtocolVersion)
    return absl::FailedPreconditionError(
        absl::StrCat("Hello: protocol version ", h.protocol_version(), "; this coordinator speaks ",
                     rpc::kProtocolVersion));
  if (!ValidAgentId(h.agent_id()))
    return absl::InvalidArgumentError(absl::StrCat("Hello: agent_id must be 1..", kMaxAgentIdLength,
                                                   " characters of [A-Za-z0-9._:-], got '",
                                                   h.agent_id().substr(0, kMaxAgentIdLength), "'"));
  if (h.host().size() > kMaxTextField || h.engine_version().size() > kMaxTextField)
    return absl::InvalidArgumentError("Hello: host or engine_version longer than 256 characters");
  if (h.gpus_size() > kMaxSlots)
    return absl::InvalidArgumentError(absl::StrCat("Hello: more than ", kMaxSlots, " GPUs"));
  if (h.cpu_only() && h.gpus_size() > 0)
    return absl::InvalidArgumentError("Hello: cpu_only with a non-empty GPU list");
  for (int i = 0; i < h.gpus_size(); ++i) {
    const v1::Gpu& g = h.gpus(i);
    if (g.index() != i)
      return absl::InvalidArgumentError(absl::StrCat("Hello: gpus[", i, "].index is ", g.index(),
                                                     "; GPUs must be listed 0..n-1"));
    if (g.name().empty() || g.name().size() > kMaxTextField)
      return absl::InvalidArgumentError(
          absl::StrCat("Hello: gpus[", i, "].name is empty or too long"));
    if (g.sm() < 0 || g.sm() > 1000 || g.memory_bytes() < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("Hello: gpus[", i, "]: sm or memory out of range"));
    for (const auto* peers : {&g.p2p_peers(), &g.nvlink_peers()})
      for (int peer : *peers)
        if (peer < 0 || peer >= h.gpus_size() || peer == i)
          return absl::InvalidArgumentError(
              absl::StrCat("Hello: gpus[", i, "].",
                           peers == &g.p2p_peers() ? "p2p_peers" : "nvlink_peers", " names GPU ",
                           peer, ", which is not another of the agent's ", h.gpus_size(), " GPUs"));
  }
  if (h.backends_size() > 4096 || h.running_size() > 4096)
    return absl::InvalidArgumentError("Hello: too many backends or running trials");
  if (h.spooled_size() > rpc::kMaxHelloSpooled)
    return absl::InvalidArgumentError(
        absl::StrCat("Hello: more than ", rpc::kMaxHelloSpooled, " spooled results listed"));
  return absl::OkStatus();
}

AgentSessions::AgentSessions(const CoordinatorServices& services, AgentAuthenticator authenticator,
                             Committer& committer)
    : services_(services),
      committer_(committer),
      authenticator_(std::move(authenticator)),
      agent_limiter_(services_.options.agent_message_limit),
      connect_limiter_(services_.options.connect_limit) {}

AgentSessions::~AgentSessions() = default;

std::string AgentSessions::DescribeIdentity() const {
  return authenticator_.Describe(services_.options.tls.server_enabled() &&
                                 !services_.options.tls.client_ca_file.empty());
}

// ------------------------------------------------------------------------------ the stream

grpc::Status AgentSessions::Connect(grpc::ServerContext* context, AgentStream* stream) {
  if (const std::string peer = PeerHost(context->peer());
      services_.OverRateLimit(connect_limiter_, peer, "connect", counts_.rate_limited))
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        RateLimitMessage("agent streams", connect_limiter_.limit(), peer));
  v1::AgentMessage msg;
  if (!stream->Read(&msg)) return grpc::Status::OK;  // gone before saying anything
  // The agent id the stream claims, for the log ("" when its Hello has none that is valid).
  const std::string claimed =
      msg.has_hello() && ValidAgentId(msg.hello().agent_id()) ? msg.hello().agent_id() : "";
  // Closes the stream with `refusal`: the agent reads its text and code in an Error, then the
  // same in the stream's status.
  auto reject = [&](const absl::Status& refusal) {
    ++counts_.streams_rejected;
    const std::string text(refusal.message());
    services_.Log(absl::StrCat("stream rejected from ", context->peer(),
                               claimed.empty() ? "" : absl::StrCat(" (agent '", claimed, "')"),
                               ": ", absl::StatusCodeToString(refusal.code()), ": ", text));
    stream->Write(ErrorMessage(text, "", 0, /*permanent=*/false, refusal.code()));
    return rpc::ToGrpcStatus(refusal);
  };
  if (!msg.has_hello())
    return reject(absl::FailedPreconditionError(absl::StrCat(
        "protocol error: the first message on a stream must be Hello, got ", MessageName(msg))));
  // Authentication comes before any other check, so that a stranger learns nothing else; it
  // also checks that the credentials prove the agent id the Hello names.
  absl::StatusOr<AgentCredential> credential = Authenticate(*context, msg.hello());
  if (!credential.ok()) return reject(credential.status());
  if (absl::Status s = ValidateHello(msg.hello()); !s.ok()) return reject(s);

  auto conn = std::make_shared<Conn>(InventoryOf(msg.hello()), *std::move(credential), context);
  const int64_t now = NowMs();
  // Welcome is queued before the connection becomes visible to the scheduler, so no Assignment
  // can overtake it (an agent drops a stream whose first message is not Welcome).
  v1::CoordinatorMessage welcome;
  welcome.mutable_welcome()->set_coordinator_version(EngineVersion());
  welcome.mutable_welcome()->set_protocol_version(rpc::kProtocolVersion);
  welcome.mutable_welcome()->set_heartbeat_interval_ms(services_.options.heartbeat_interval_ms);
  welcome.mutable_welcome()->set_lease_ms(services_.options.lease_ms);
  conn->Enqueue(std::move(welcome));
  if (absl::Status s = Register(conn, msg.hello(), now); !s.ok()) {
    if (absl::IsUnavailable(s)) return rpc::ToGrpcStatus(s);  // stopping: not a refusal
    return reject(s);
  }
  RecordAgent(*conn, context->peer(), now);
  std::thread writer([conn, stream] { conn->WriterLoop(stream); });
  services_.wake();

  const absl::Status end = ServeMessages(conn, stream);
  const bool current = Leave(conn);
  conn->CloseOutbound();
  writer.join();
  if (current) services_.Log(absl::StrCat("agent ", conn->agent.agent_id, " disconnected"));
  services_.wake();
  return rpc::ToGrpcStatus(end);
}

absl::StatusOr<AgentCredential> AgentSessions::Authenticate(grpc::ServerContext& context,
                                                            const v1::Hello& hello) {
  absl::StatusOr<AgentCredential> credential =
      authenticator_.Authenticate(hello.agent_id(), hello.auth_token(), PeerCredentialsOf(context));
  if (credential.ok()) return credential;
  if (credential.status().code() == absl::StatusCode::kUnauthenticated) {
    ++counts_.auth_failures;
    services_.metrics.CountAuthFailure("agent");
  } else {
    ++counts_.identity_refused;
    services_.metrics.CountAgentIdentityRefused("certificate");
  }
  return credential;
}

absl::Status AgentSessions::Register(const std::shared_ptr<Conn>& conn, const v1::Hello& hello,
                                     int64_t now) {
  const std::string& id = conn->agent.agent_id;
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) return absl::UnavailableError("coordinator is stopping");
  if (auto it = conns_.find(id); it != conns_.end()) {
    if (it->second->credential.fingerprint != conn->credential.fingerprint) {
      // Another credential claims a connected agent's id: refused, and the connected stream
      // keeps its leases. An agent that really moved reconnects once its old stream is noticed
      // dead (keepalive).
      ++counts_.identity_refused;
      lock.unlock();
      services_.metrics.CountAgentIdentityRefused("conflict");
      return absl::AlreadyExistsError(absl::StrCat(
          "Hello: agent '", id,
          "' is connected with another credential; this stream is refused (the connected one "
          "stays)"));
    }
    // The same agent again (it reconnected before its old stream was noticed dead): the new
    // stream replaces the old one.
    it->second->context->TryCancel();
    services_.Log(absl::StrCat("agent ", id, " reconnected; closing its previous stream"));
  }
  conns_[id] = conn;
  ReconcileHeldLocked(conn->agent, hello, now);
  return absl::OkStatus();
}

void AgentSessions::RecordAgent(const Conn& conn, const std::string& peer, int64_t now) {
  const AgentInventory& agent = conn.agent;
  const std::string& id = agent.agent_id;
  {
    v1::Hello stored = agent.hello;
    stored.clear_running();
    std::string json;
    (void)google::protobuf::util::MessageToJsonString(stored, &json);
    AgentRecord rec{id, agent.hello.host(), json, now, true};
    if (absl::Status s = services_.store.UpsertAgent(rec); !s.ok())
      services_.Log(absl::StrCat("storing agent ", id, ": ", s.message()));
  }
  services_.Log(absl::StrCat(
      "agent ", id, " connected from ", peer, ": ",
      agent.hello.gpus_size() == 0 ? "cpu-only" : absl::StrCat(agent.hello.gpus_size(), " GPU(s)"),
      agent.hello.gpus_size() > 0
          ? absl::StrCat(", ", agent.hello.gpus(0).name(), " sm_", agent.hello.gpus(0).sm())
          : ""));
  // The trial counters of what this agent may run start at 0 (coordinator/metrics.h).
  std::set<int> sms;
  for (const SlotInfo& slot : agent.slots) sms.insert(slot.sm);
  std::vector<std::string> models;
  if (auto sweeps = services_.store.ListSweeps(); sweeps.ok())
    for (const SweepRecord& s : *sweeps)
      if (s.state == "active") models.push_back(s.model);
  for (const std::string& model : models)
    for (int sm : sms) services_.metrics.DeclareTrialSeries(model, sm);
}

absl::Status AgentSessions::ServeMessages(const std::shared_ptr<Conn>& conn, AgentStream* stream) {
  const std::string& id = conn->agent.agent_id;
  int64_t dropped = 0;        // messages over the rate limit since the last log line
  int64_t next_drop_log = 0;  // when the next such line may be written
  v1::AgentMessage msg;
  while (stream->Read(&msg)) {
    if (services_.OverRateLimit(agent_limiter_, id, "agent", counts_.rate_limited)) {
      // Nothing is processed or stored. A Result gets a retryable Error: it stays spooled.
      ++dropped;
      const std::string text =
          RateLimitMessage("messages", agent_limiter_.limit(), absl::StrCat("agent ", id));
      if (msg.has_result())
        conn->Enqueue(ErrorMessage(text, msg.result().trial_id(), msg.result().attempt(),
                                   /*permanent=*/false, absl::StatusCode::kResourceExhausted));
      if (const int64_t t = NowMs(); t >= next_drop_log) {
        services_.Log(absl::StrCat(text, " (", dropped, " message(s) dropped)"));
        dropped = 0;
        next_drop_log = t + 5000;
      }
      continue;
    }
    if (msg.has_hello()) {
      const std::string text = "protocol error: a second Hello on the same stream";
      conn->Enqueue(
          ErrorMessage(text, "", 0, /*permanent=*/false, absl::StatusCode::kFailedPrecondition));
      ++counts_.streams_rejected;
      services_.Log(absl::StrCat("agent ", id, ": ", text, "; stream closed"));
      return absl::FailedPreconditionError(text);
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
  return absl::OkStatus();
}

bool AgentSessions::Leave(const std::shared_ptr<Conn>& conn) {
  const std::string& id = conn->agent.agent_id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = conns_.find(id);
    if (it == conns_.end() || it->second != conn) return false;  // replaced by a newer stream
    conns_.erase(it);
    // Its trials keep their leases: they expire unless the agent comes back (docs/SERVICE.md).
    for (auto& [tid, h] : held_[id])
      if (h.foreign) h.slots.clear();
  }
  (void)services_.store.SetAgentConnected(id, false, NowMs());
  return true;
}

void AgentSessions::ReconcileHeldLocked(const AgentInventory& agent, const v1::Hello& hello,
                                        int64_t now) {
  HeldByTrial& held = held_[agent.agent_id];
  std::map<std::string, const v1::RunningTrial*> running;
  for (const v1::RunningTrial& r : hello.running()) running[r.trial_id()] = &r;
  std::set<std::pair<std::string, int>> spooled;
  for (const v1::RunningTrial& r : hello.spooled()) spooled.insert({r.trial_id(), r.attempt()});
  auto valid_slots = [&](const v1::RunningTrial& r) {
    std::vector<int> slots;
    for (int s : r.slots())
      if (s >= 0 && s < static_cast<int>(agent.slots.size())) slots.push_back(s);
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
      const bool lost_now = hello.reports_spool() && !spooled.count({tid, h.attempt});
      h.lost_deadline = lost_now ? now : now + services_.options.lost_trial_grace_ms;
      ++it;
    }
  }
  for (const auto& [tid, r] : running) {
    if (held.count(tid)) continue;
    Held h;
    h.attempt = r->attempt();
    h.slots = valid_slots(*r);
    auto t = services_.store.GetTrial(tid);
    if (t.ok() && t->state == TrialState::kLeased && t->leased_to == agent.agent_id &&
        t->attempt == r->attempt()) {
      h.sweep_id = t->sweep_id;
    } else {
      h.foreign = true;  // occupies the slots until its result comes; the result is refused
    }
    held[tid] = std::move(h);
  }
}

void AgentSessions::RecoverHeld() {
  // Leases outlive a coordinator restart; rebuild which agent holds what, so a reconnecting agent
  // that lost a trial is noticed. Trial ids are "<sweep>-<index>" (Store::CreateSweep).
  auto sweeps = services_.store.ListSweeps();
  if (!sweeps.ok()) return;
  int recovered = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (const SweepRecord& s : *sweeps) {
    if (s.state != "active" && s.state != "cancelled") continue;
    for (int64_t i = 0; i < s.trials_total; ++i) {
      auto t = services_.store.GetTrial(absl::StrCat(s.id, "-", i));
      if (!t.ok() || t->state != TrialState::kLeased || t->leased_to.empty()) continue;
      Held h;
      h.attempt = t->attempt;
      h.sweep_id = s.id;
      h.confirmed = false;
      held_[t->leased_to][t->trial_id] = h;
      ++recovered;
    }
  }
  if (recovered > 0)
    services_.Log(absl::StrCat(recovered, " leased trial(s) recovered from the database"));
}

void AgentSessions::StopAccepting() {
  std::lock_guard<std::mutex> lock(mu_);
  stopping_ = true;
}

void AgentSessions::CancelStreams() {
  // Under mu_: a stream still in conns_ has not finished, so its context is alive.
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, c] : conns_) c->context->TryCancel();
}

// ------------------------------------------------------------------------------ messages

void AgentSessions::Reject(Conn& conn, const std::string& message, const std::string& trial_id,
                           int attempt, absl::StatusCode code) {
  ++conn.bad_messages;
  ++counts_.bad_messages;
  services_.Log(absl::StrCat("agent ", conn.agent.agent_id, ": rejected: ", message));
  conn.Enqueue(ErrorMessage(message, trial_id, attempt, /*permanent=*/true, code));
}

void AgentSessions::OnHeartbeat(Conn& conn, const v1::Heartbeat& hb) {
  const std::string& id = conn.agent.agent_id;
  const int64_t now = NowMs();
  if (absl::Status s = services_.store.RenewLeases(id, now + services_.options.lease_ms); !s.ok())
    services_.Log(absl::StrCat("renewing leases of ", id, ": ", s.message()));
  (void)services_.store.SetAgentConnected(id, true, now);
  std::set<std::string> running;
  for (const v1::RunningTrial& r : hb.running()) running.insert(r.trial_id());
  for (const std::string& tid : hb.running_trial_ids()) running.insert(tid);
  std::lock_guard<std::mutex> lock(mu_);
  HeldByTrial& held = held_[id];
  for (auto it = held.begin(); it != held.end();) {
    if (it->second.foreign && !running.count(it->first)) {
      it = held.erase(it);
    } else {
      ++it;
    }
  }
}

void AgentSessions::OnProgress(Conn& conn, const v1::Progress& p) {
  // Advisory: kept for status displays, never an error.
  std::lock_guard<std::mutex> lock(mu_);
  HeldByTrial& held = held_[conn.agent.agent_id];
  if (auto it = held.find(p.trial_id()); it != held.end() && it->second.attempt == p.attempt())
    it->second.last_progress = p.text().substr(0, kMaxProgressText);
}

void AgentSessions::OnResult(const std::shared_ptr<Conn>& conn_ptr, const v1::Result& r) {
  Conn& conn = *conn_ptr;
  const auto received = std::chrono::steady_clock::now();
  const std::string& tid = r.trial_id();
  if (tid.empty()) return Reject(conn, "Result without trial_id", "", r.attempt());
  if (r.attempt() < 1)
    return Reject(conn,
                  absl::StrCat("Result for ", tid, ": attempt must be >= 1, got ", r.attempt()),
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
  const AgentInventory& agent = conn.agent;
  int slot = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    HeldByTrial& held = held_[agent.agent_id];
    if (r.slots_size() > 0) {
      slot = r.slots(0);
    } else if (auto it = held.find(tid); it != held.end() && !it->second.slots.empty()) {
      slot = it->second.slots[0];
    }
  }
  if (slot < 0 || slot >= static_cast<int>(agent.slots.size())) slot = 0;
  const SlotInfo& info = agent.slots[static_cast<size_t>(slot)];
  if (committer_.Submit(PendingResult{
          conn_ptr, ResultSubmission{agent.agent_id, info.gpu_name, info.sm, *std::move(result)},
          received}))
    return;
  // Stopping: nothing more is stored; the agent keeps the result spooled and sends it again.
  conn.Enqueue(ErrorMessage("the coordinator is stopping; send the result again later", tid,
                            r.attempt(), /*permanent=*/false, absl::StatusCode::kUnavailable));
}

void AgentSessions::Answer(PendingResult& pending, const absl::Status& s) {
  Conn& conn = *pending.conn;
  const TrialResult& result = pending.submission.result;
  const std::string& tid = result.trial_id;
  const int attempt = result.attempt;
  bool fresh = false;  // the attempt was held: not a replay of a result stored before
  {
    // Whatever the store says, the agent is done with this attempt.
    std::lock_guard<std::mutex> lock(mu_);
    HeldByTrial& held = held_[conn.agent.agent_id];
    if (auto it = held.find(tid); it != held.end() && it->second.attempt == attempt) {
      fresh = true;
      held.erase(it);
    }
  }
  if (s.ok()) {
    ++counts_.results_stored;
    services_.metrics.ObserveIngestSeconds(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - pending.received).count());
    if (fresh) services_.ExportResult(result, pending.submission.gpu_name, pending.submission.sm);
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
      ++counts_.results_conflicting;
      services_.metrics.CountResultConflict();
      return Reject(conn, std::string(s.message()), tid, attempt, s.code());
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
      return Reject(conn, std::string(s.message()), tid, attempt, s.code());
    default:
      // Storage trouble (busy, full): nothing was stored; the agent keeps the result spooled
      // and sends it again after a backoff.
      services_.Log(absl::StrCat("storing the result of ", tid, " attempt ", attempt,
                                 " failed (the agent ", conn.agent.agent_id,
                                 " keeps it and retries): ", s.message()));
      ++counts_.store_errors;
      conn.Enqueue(ErrorMessage(absl::StrCat("could not store the result: ", s.message()), tid,
                                attempt, /*permanent=*/false, s.code()));
  }
}

// ------------------------------------------------------------------------------ the scheduler's
// view

std::vector<const AgentInventory*> AgentSessions::Fleet::Agents(size_t rotate) const {
  std::vector<const AgentInventory*> agents;
  agents.reserve(sessions_.conns_.size());
  for (const auto& [id, c] : sessions_.conns_) agents.push_back(&c->agent);
  if (!agents.empty())
    std::rotate(agents.begin(), agents.begin() + static_cast<long>(rotate % agents.size()),
                agents.end());
  return agents;
}

FreeSlots AgentSessions::Fleet::Free() const { return sessions_.FreeSlotsLocked(); }

void AgentSessions::Fleet::Assign(const std::string& agent_id, int64_t sweep_id,
                                  v1::CoordinatorMessage assignment) {
  const v1::Assignment& a = assignment.assignment();
  Held h;
  h.attempt = a.attempt();
  h.sweep_id = sweep_id;
  h.slots.assign(a.slots().begin(), a.slots().end());
  sessions_.held_[agent_id][a.trial_id()] = std::move(h);
  if (auto c = sessions_.conns_.find(agent_id); c != sessions_.conns_.end())
    c->second->Enqueue(std::move(assignment));
}

void AgentSessions::WithFleet(absl::FunctionRef<void(Fleet&)> pass) {
  std::lock_guard<std::mutex> lock(mu_);
  Fleet fleet(*this);
  pass(fleet);
}

FreeSlots AgentSessions::FreeSlotsLocked() const {
  FreeSlots free;
  std::vector<bool> busy;
  for (const auto& [id, conn] : conns_) {
    const std::vector<SlotInfo>& slots = conn->agent.slots;
    busy.assign(slots.size(), false);
    if (auto h = held_.find(id); h != held_.end())
      for (const auto& [tid, held] : h->second)
        for (int slot : held.slots)
          if (slot >= 0 && static_cast<size_t>(slot) < busy.size()) busy[slot] = true;
    std::vector<int> indices;
    for (const SlotInfo& slot : slots)
      if (!busy[static_cast<size_t>(slot.index)]) indices.push_back(slot.index);
    if (!indices.empty()) free.emplace_hint(free.end(), id, std::move(indices));
  }
  return free;
}

size_t AgentSessions::FreeSlotCount() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [agent, slots] : FreeSlotsLocked()) n += slots.size();
  return n;
}

int AgentSessions::ConnectedCount() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(conns_.size());
}

void AgentSessions::ForgetExpired(const std::vector<LostLease>& expired) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const LostLease& l : expired) {
    auto held = held_.find(l.agent_id);
    if (held == held_.end()) continue;
    if (auto it = held->second.find(l.trial_id); it != held->second.end() && !it->second.foreign)
      held->second.erase(it);
  }
}

std::vector<AgentSessions::LostTrial> AgentSessions::LostTrialsDue(int64_t now) {
  std::vector<LostTrial> lost;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [agent, held] : held_) {
    if (!conns_.count(agent)) continue;  // away: its leases run out instead
    for (const auto& [tid, h] : held)
      if (h.lost_deadline > 0 && h.lost_deadline <= now) lost.push_back({agent, tid, h.attempt});
  }
  return lost;
}

void AgentSessions::SettleLost(const LostTrial& lost, bool settled, int64_t retry_at_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  HeldByTrial& held = held_[lost.agent_id];
  if (auto it = held.find(lost.trial_id); it != held.end() && it->second.attempt == lost.attempt) {
    if (settled) {
      held.erase(it);
    } else {
      it->second.lost_deadline = retry_at_ms;
    }
  }
}

// ------------------------------------------------------------------------------ status

std::vector<std::shared_ptr<const AgentInventory>> AgentSessions::Connected() {
  std::vector<std::shared_ptr<const AgentInventory>> agents;
  std::lock_guard<std::mutex> lock(mu_);
  agents.reserve(conns_.size());
  for (const auto& [id, c] : conns_) agents.emplace_back(c, &c->agent);
  return agents;
}

int64_t AgentSessions::HeldTrials(int64_t sweep_id) {
  int64_t n = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [agent, held] : held_)
    for (const auto& [tid, h] : held)
      if (h.sweep_id == sweep_id && !h.foreign) ++n;
  return n;
}

int64_t AgentSessions::CancelHeld(int64_t sweep_id) {
  int64_t sent = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [agent, held] : held_) {
    auto c = conns_.find(agent);
    if (c == conns_.end()) continue;
    for (const auto& [tid, h] : held) {
      if (h.sweep_id != sweep_id || h.foreign) continue;
      v1::CoordinatorMessage m;
      m.mutable_cancel()->set_trial_id(tid);
      c->second->Enqueue(std::move(m));
      ++sent;
    }
  }
  return sent;
}

std::map<std::string, AgentSessions::LiveAgent> AgentSessions::LiveAgents() {
  std::map<std::string, LiveAgent> live;
  std::lock_guard<std::mutex> lock(mu_);
  const FreeSlots free = FreeSlotsLocked();
  for (const auto& [id, conn] : conns_) {
    LiveAgent& a = live[id];
    a.slots = static_cast<int>(conn->agent.slots.size());
    if (auto f = free.find(id); f != free.end()) a.free_slots = static_cast<int>(f->second.size());
    a.bad_messages = conn->bad_messages.load();
    if (auto h = held_.find(id); h != held_.end())
      for (const auto& [tid, held] : h->second)
        if (!held.slots.empty()) a.running_trial_ids.push_back(tid);
  }
  return live;
}

void AgentSessions::AddStats(CoordinatorStats* stats) {
  stats->agents_connected += ConnectedCount();
  stats->results_stored += counts_.results_stored;
  stats->bad_messages += counts_.bad_messages;
  stats->streams_rejected += counts_.streams_rejected;
  stats->auth_failures += counts_.auth_failures;
  stats->rate_limited += counts_.rate_limited;
  stats->store_errors += counts_.store_errors;
  stats->identity_refused += counts_.identity_refused;
  stats->results_conflicting += counts_.results_conflicting;
}

}  // namespace infersweep::coordinator
