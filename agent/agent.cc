#include "agent/agent.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "api/private_file.h"
#include "api/status_macros.h"
#include "core/wall_clock.h"
#include "engine/fault_injection.h"
#include "harness/runner.h"
#include "proto/infersweep.grpc.pb.h"
#include "proto/log_line.h"
#include "proto/rpc.h"

namespace infersweep {

struct Agent::Job {
  std::string trial_id;
  int attempt = 1;
  std::string request_json;
  std::vector<int> slots;
  bool cancelled = false;
};

struct Agent::Slot {
  int index = 0;
  std::deque<Job> queue;       // assigned, not started (normally at most one)
  std::optional<Job> current;  // running now
  int reserved = 0;            // held by multi-slot jobs that run on another slot
  std::unique_ptr<TrialRunner> runner;
  std::thread thread;
};

struct Agent::Link {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AgentMessage, v1::CoordinatorMessage>> stream;
  std::mutex write_mu;
  bool write_ok = true;
  std::atomic<bool> ready{false};  // welcomed: other threads may write
};

namespace {

// Whether the coordinator's refusal of a stream stays the same until someone changes the agent
// or the coordinator: a wrong or missing token, a forbidden agent, another protocol version, a
// Hello it does not accept (an invalid id, too many GPUs).
bool PermanentRefusal(absl::StatusCode code) {
  return code == absl::StatusCode::kUnauthenticated ||
         code == absl::StatusCode::kPermissionDenied ||
         code == absl::StatusCode::kFailedPrecondition ||
         code == absl::StatusCode::kInvalidArgument;
}

// The capability probe's cache file: in the spool's folder, named for the agent.
std::string ProbeCachePath(const AgentOptions& options) {
  const size_t slash = options.spool_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : options.spool_path.substr(0, slash + 1);
  return absl::StrCat(dir, "infersweep-probe-", options.agent_id, ".jsonl");
}

}  // namespace

Agent::Agent(AgentOptions options) : options_(std::move(options)) {
  if (options_.agent_id.empty()) options_.agent_id = HostName();
  if (options_.spool_path.empty())
    options_.spool_path = absl::StrCat("infersweep-spool-", options_.agent_id, ".db");
  options_.initial_backoff_ms = std::max(1, options_.initial_backoff_ms);
  options_.max_backoff_ms = std::max(options_.initial_backoff_ms, options_.max_backoff_ms);
  retry_backoff_ms_ = options_.initial_backoff_ms;
}

Agent::~Agent() { Stop(); }

void Agent::Log(const std::string& line) {
  if (options_.log) {
    options_.log(line);
  } else {
    WriteLogLine(absl::StrCat("agent ", options_.agent_id), line);
  }
}

absl::Status Agent::Start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (started_) return absl::FailedPreconditionError("agent already started");
  }
  if (!options_.test_inject_fault.empty()) {
    if (auto fault = ParseFaultInjection(options_.test_inject_fault); !fault.ok())
      return fault.status();
    Log(absl::StrCat("[TEST-FAULT] every trial runs with the injected fault '",
                     options_.test_inject_fault, "'"));
  }
  ASSIGN_OR_RETURN(auto credentials, rpc::MakeChannelCredentials(options_.tls));
  credentials_ = std::move(credentials);
  ASSIGN_OR_RETURN(auto inventory, DetectInventory(options_.test_fake_gpus));
  inventory_ = std::move(inventory);
  ASSIGN_OR_RETURN(auto spool, Spool::Open(options_.spool_path));
  spool_ = std::move(spool);
  if (auto n = spool_->Count(); n.ok() && *n > 0)
    Log(absl::StrCat(*n, " unacknowledged result(s) in the spool; they are sent after connecting"));
  if (!options_.metrics_listen.empty()) {
    auto metrics = std::make_unique<AgentMetrics>();
    ASSIGN_OR_RETURN(int port, metrics->Listen(options_.metrics_listen));
    metrics_ = std::move(metrics);
    Log(absl::StrCat("metrics on http://", options_.metrics_listen, "/metrics (port ", port, ")"));
    UpdateSpoolMetric();
  }

  std::lock_guard<std::mutex> lock(mu_);
  started_ = true;
  const size_t n_slots = std::max<size_t>(1, inventory_.gpus.size());
  for (size_t i = 0; i < n_slots; ++i) {
    auto slot = std::make_unique<Slot>();
    slot->index = static_cast<int>(i);
    RunnerOptions ro;
    if (!options_.worker_argv.empty()) ro.worker_argv = options_.worker_argv;
    // The capability probe's answers outlive each worker, beside the spool (the agent's state).
    // The infersweep worker takes the file's path; a test's stand-in worker is left its argv.
    if (options_.worker_argv.empty()) ro.probe_cache_path = ProbeCachePath(options_);
    Slot* raw = slot.get();
    ro.on_progress = [this, raw](const std::string& line) {
      v1::AgentMessage m;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!raw->current) return;
        m.mutable_progress()->set_trial_id(raw->current->trial_id);
        m.mutable_progress()->set_attempt(raw->current->attempt);
      }
      m.mutable_progress()->set_text(line);
      Send(m);
    };
    slot->runner = std::make_unique<TrialRunner>(std::move(ro));
    slots_.push_back(std::move(slot));
  }
  for (auto& slot : slots_) slot->thread = std::thread([this, s = slot.get()] { SlotLoop(s); });
  connection_thread_ = std::thread([this] { ConnectionLoop(); });
  return absl::OkStatus();
}

void Agent::Stop() {
  std::shared_ptr<Link> link;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const bool first = !stopping_;
    stopping_ = true;
    link = link_;
    if (!first || !started_) {
      cv_.notify_all();
      return;
    }
  }
  cv_.notify_all();
  if (link) link->context.TryCancel();
  if (connection_thread_.joinable()) connection_thread_.join();
  // A running trial is cut short (its worker killed) and not reported: its lease expires and it
  // runs again.
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& slot : slots_)
      if (slot->current) slot->runner->Cancel();
  }
  for (auto& slot : slots_) {
    if (slot->thread.joinable()) slot->thread.join();
  }
}

void Agent::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return stopping_; });
}

int Agent::metrics_port() const { return metrics_ != nullptr ? metrics_->port() : 0; }

void Agent::UpdateSpoolMetric() {
  if (metrics_ == nullptr) return;
  if (auto n = spool_->Count(); n.ok()) metrics_->SetSpoolDepth(*n);
}

AgentStats Agent::stats() {
  AgentStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = stats_;
  }
  if (spool_) {
    if (auto n = spool_->Count(); n.ok()) s.spooled = *n;
  }
  return s;
}

bool Agent::Send(const v1::AgentMessage& message) {
  std::shared_ptr<Link> link;
  {
    std::lock_guard<std::mutex> lock(mu_);
    link = link_;
  }
  if (!link || !link->ready.load()) return false;
  std::lock_guard<std::mutex> lock(link->write_mu);
  if (!link->write_ok) return false;
  link->write_ok = link->stream->Write(message);
  return link->write_ok;
}

std::vector<v1::RunningTrial> Agent::RunningLocked() const {
  std::vector<v1::RunningTrial> out;
  auto add = [&](const Job& job) {
    v1::RunningTrial r;
    r.set_trial_id(job.trial_id);
    r.set_attempt(job.attempt);
    for (int s : job.slots) r.add_slots(s);
    out.push_back(std::move(r));
  };
  for (const auto& slot : slots_) {
    if (slot->current) add(*slot->current);
    for (const Job& job : slot->queue) add(job);
  }
  return out;
}

int Agent::FreeSlotsLocked() const {
  int free = 0;
  for (const auto& slot : slots_)
    if (!slot->current && slot->queue.empty() && slot->reserved == 0) ++free;
  return free;
}

void Agent::ConnectionLoop() {
  int backoff_ms = options_.initial_backoff_ms;
  while (true) {
    auto link = std::make_shared<Link>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) break;
      link_ = link;
    }
    const bool welcomed = RunStream(link);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (link_ == link) link_ = nullptr;
      connected_ = false;
      if (stopping_) break;
    }
    cv_.notify_all();
    if (welcomed) backoff_ms = options_.initial_backoff_ms;
    // A refusal that will not clear by itself: no point in retrying sooner than the cap.
    if (refused_permanently_) backoff_ms = options_.max_backoff_ms;
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(backoff_ms), [&] { return stopping_; });
    if (stopping_) break;
    backoff_ms = std::min(options_.max_backoff_ms, backoff_ms * 2);
  }
}

bool Agent::RunStream(const std::shared_ptr<Link>& link) {
  auto stub = v1::AgentService::NewStub(
      rpc::MakeChannel(options_.coordinator, credentials_, options_.tls.server_name_override));
  link->stream = stub->Connect(&link->context);

  v1::AgentMessage hello_msg;
  v1::Hello* hello = hello_msg.mutable_hello();
  hello->set_agent_id(options_.agent_id);
  hello->set_host(inventory_.host);
  hello->set_engine_version(inventory_.engine_version);
  hello->set_cpu_only(inventory_.gpus.empty());
  hello->set_cuda_build(inventory_.cuda_build);
  hello->set_auth_token(options_.auth_token);
  hello->set_protocol_version(rpc::kProtocolVersion);
  for (const std::string& b : inventory_.backends) hello->add_backends(b);
  for (const GpuInfo& g : inventory_.gpus) {
    v1::Gpu* gpu = hello->add_gpus();
    gpu->set_index(g.index);
    gpu->set_name(g.name);
    gpu->set_sm(g.sm);
    gpu->set_memory_bytes(g.memory_bytes);
    gpu->set_driver_version(g.driver_version);
    gpu->set_cuda_version(g.cuda_version);
    for (int peer : g.p2p_peers) gpu->add_p2p_peers(peer);
    for (int peer : g.nvlink_peers) gpu->add_nvlink_peers(peer);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& r : RunningLocked()) *hello->add_running() = std::move(r);
  }
  // What the spool holds now; anything that finishes later was listed as running above.
  if (auto spooled = spool_->All();
      spooled.ok() && spooled->size() <= static_cast<size_t>(rpc::kMaxHelloSpooled)) {
    hello->set_reports_spool(true);
    for (const SpooledResult& r : *spooled) {
      v1::RunningTrial* t = hello->add_spooled();
      t->set_trial_id(r.trial_id);
      t->set_attempt(r.attempt);
    }
  }

  bool welcomed = false;
  bool refused = false;      // the coordinator answered the Hello with an Error
  bool other_first = false;  // ... or with something else than Welcome
  bool ok;
  {
    std::lock_guard<std::mutex> lock(link->write_mu);
    ok = link->write_ok = link->stream->Write(hello_msg);
  }
  v1::CoordinatorMessage msg;
  absl::Status refusal;  // the Error's code and message when refused
  if (ok && link->stream->Read(&msg)) {
    if (msg.has_welcome()) {
      welcomed = true;
    } else if (msg.has_error()) {
      refused = true;
      refusal =
          absl::Status(static_cast<absl::StatusCode>(msg.error().code()), msg.error().message());
    } else {
      other_first = true;
      Log("coordinator sent something other than Welcome first; reconnecting");
    }
  }

  std::thread heartbeat;
  if (welcomed) {
    const int64_t interval_ms =
        std::clamp<int64_t>(msg.welcome().heartbeat_interval_ms(), 20, 60'000);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.connects;
      connected_ = true;
    }
    link->ready = true;
    Log(absl::StrCat("connected to ", options_.coordinator, " (heartbeat every ", interval_ms,
                     " ms)"));
    {
      // Everything spooled is sent now, so nothing is waiting for a retry.
      std::lock_guard<std::mutex> lock(mu_);
      retry_keys_.clear();
      retry_at_.reset();
    }
    SendSpooled();
    heartbeat = std::thread([this, link, interval_ms] {
      using Clock = std::chrono::steady_clock;
      std::unique_lock<std::mutex> lock(mu_);
      Clock::time_point next_heartbeat = Clock::now() + std::chrono::milliseconds(interval_ms);
      while (true) {
        const Clock::time_point wake =
            retry_at_ ? std::min(next_heartbeat, *retry_at_) : next_heartbeat;
        cv_.wait_until(lock, wake, [&] {
          return stopping_ || link_ != link || (retry_at_ && *retry_at_ < wake);
        });
        if (stopping_ || link_ != link) return;
        const Clock::time_point now = Clock::now();
        if (retry_at_ && *retry_at_ <= now) {
          // Results the coordinator could not take for a transient reason: send them again.
          const std::set<std::pair<std::string, int>> keys = std::move(retry_keys_);
          retry_keys_.clear();
          retry_at_.reset();
          lock.unlock();
          SendSpooled(&keys);
          lock.lock();
          continue;
        }
        if (now < next_heartbeat) continue;
        next_heartbeat = now + std::chrono::milliseconds(interval_ms);
        v1::AgentMessage m;
        v1::Heartbeat* hb = m.mutable_heartbeat();
        for (auto& r : RunningLocked()) {
          hb->add_running_trial_ids(r.trial_id());
          *hb->add_running() = std::move(r);
        }
        hb->set_free_slots(FreeSlotsLocked());
        lock.unlock();
        Send(m);
        lock.lock();
      }
    });
    while (link->stream->Read(&msg)) {
      switch (msg.msg_case()) {
        case v1::CoordinatorMessage::kAssignment:
          HandleAssignment(msg.assignment());
          break;
        case v1::CoordinatorMessage::kCancel:
          HandleCancel(msg.cancel().trial_id());
          break;
        case v1::CoordinatorMessage::kAck: {
          if (auto s = spool_->Remove(msg.ack().trial_id(), msg.ack().attempt()); !s.ok())
            Log(std::string(s.message()));
          UpdateSpoolMetric();
          std::lock_guard<std::mutex> lock(mu_);
          ++stats_.acks;
          retry_keys_.erase({msg.ack().trial_id(), msg.ack().attempt()});
          retry_backoff_ms_ = options_.initial_backoff_ms;  // the coordinator takes results again
          break;
        }
        case v1::CoordinatorMessage::kError:
          OnError(msg.error());
          break;
        default:
          break;  // a second Welcome, or a message this agent does not know: ignore
      }
    }
  }
  link->ready = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (link_ == link) link_ = nullptr;
    connected_ = false;
  }
  cv_.notify_all();
  if (heartbeat.joinable()) heartbeat.join();
  {
    std::lock_guard<std::mutex> lock(link->write_mu);
    link->write_ok = false;
  }
  // A stream whose first message was neither Welcome nor Error stays open on the server's side:
  // cancel it, or the drain below would block forever. A coordinator that refuses a stream ends
  // it after its Error, with the same code and reason as the stream's status: cancelling it
  // here would only leave CANCELLED to report. Then drain so Finish() may run, and learn why
  // the stream ended.
  if (other_first) link->context.TryCancel();
  while (link->stream->Read(&msg)) {
  }
  const absl::Status status = rpc::FromGrpcStatus(link->stream->Finish());
  if (refused && !status.ok()) refusal = status;
  bool stopping;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping = stopping_;
  }
  refused_permanently_ = refused && PermanentRefusal(refusal.code());
  if (!stopping) {
    // A coordinator that stays down, or keeps refusing, is reported on the first failure and
    // then every 10th.
    if (welcomed) {
      failures_ = 0;
    } else {
      ++failures_;
    }
    const std::string attempts = failures_ > 1 ? absl::StrCat(" (", failures_, " attempts)") : "";
    if (welcomed || failures_ == 1 || failures_ % 10 == 0) {
      if (refused) {
        Log(absl::StrCat("coordinator refused the stream", attempts, ": ",
                         absl::StatusCodeToString(refusal.code()), ": ", refusal.message(),
                         refused_permanently_
                             ? absl::StrCat("; this does not clear by itself (check the agent's "
                                            "token, id and version); retrying every ",
                                            options_.max_backoff_ms, " ms")
                             : ""));
      } else {
        Log(absl::StrCat(welcomed ? "disconnected" : "could not connect", attempts, ": ",
                         status.ok() ? std::string("stream closed") : status.ToString()));
      }
    }
  }
  return welcomed;
}

void Agent::OnError(const v1::Error& e) {
  Log(absl::StrCat("coordinator error", e.trial_id().empty() ? "" : " about ", e.trial_id(),
                   e.trial_id().empty() ? "" : absl::StrCat(" attempt ", e.attempt()), ": ",
                   e.message()));
  if (e.permanent() && !e.trial_id().empty()) {
    Log(absl::StrCat("dropping the result of ", e.trial_id(), " attempt ", e.attempt(),
                     " from the spool: the coordinator will never accept it"));
    (void)spool_->Remove(e.trial_id(), e.attempt());
    UpdateSpoolMetric();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.errors_received;
    if (e.permanent() || e.trial_id().empty()) return;
    // Transient (database busy or full, rate limit): the result stays spooled and is sent again
    // after the backoff, which doubles up to max_backoff_ms until an Ack comes.
    retry_keys_.insert({e.trial_id(), e.attempt()});
    if (!retry_at_) {
      retry_at_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(retry_backoff_ms_);
      Log(absl::StrCat("the result of ", e.trial_id(), " stays spooled; sending it again in ",
                       retry_backoff_ms_, " ms"));
      retry_backoff_ms_ = std::min(options_.max_backoff_ms, retry_backoff_ms_ * 2);
    }
  }
  cv_.notify_all();
}

void Agent::AppendResultsLog(const std::string& result_json) {
  if (options_.results_log_path.empty()) return;
  std::lock_guard<std::mutex> lock(results_log_mu_);
  // A copy of every result: owner-only whatever the umask (docs/SECURITY.md).
  if (absl::Status s = CreatePrivateFile(options_.results_log_path, 0600); !s.ok())
    Log(absl::StrCat("results log: ", s.message()));
  std::ofstream out(options_.results_log_path, std::ios::app);
  out << result_json << '\n';
  out.flush();
  if (!out) Log(absl::StrCat("cannot append to the results log ", options_.results_log_path));
}

void Agent::SendSpooled(const std::set<std::pair<std::string, int>>* only) {
  auto all = spool_->All();
  if (!all.ok()) {
    Log(absl::StrCat("cannot read the spool: ", all.status().message()));
    return;
  }
  if (only == nullptr && !all->empty())
    Log(absl::StrCat("replaying ", all->size(), " unacknowledged result(s) from the spool"));
  for (const SpooledResult& r : *all) {
    if (only != nullptr && !only->count({r.trial_id, r.attempt})) continue;
    v1::AgentMessage m;
    v1::Result* res = m.mutable_result();
    res->set_trial_id(r.trial_id);
    res->set_attempt(r.attempt);
    res->set_result_json(r.result_json);
    for (int s : r.slots) res->add_slots(s);
    if (!Send(m)) return;
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.results_sent;
    if (only != nullptr) ++stats_.retries;
  }
}

void Agent::HandleAssignment(const v1::Assignment& a) {
  Job job;
  job.trial_id = a.trial_id();
  job.attempt = a.attempt();
  job.request_json = a.request_json();
  job.slots.assign(a.slots().begin(), a.slots().end());
  if (job.slots.empty()) job.slots.push_back(0);
  std::string bad;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.assignments;
    for (int s : job.slots) {
      if (s < 0 || s >= static_cast<int>(slots_.size()))
        bad = absl::StrCat("assignment names slot ", s, " but this agent has ", slots_.size());
    }
    if (bad.empty()) {
      for (size_t i = 1; i < job.slots.size(); ++i) ++slots_[job.slots[i]]->reserved;
      slots_[job.slots[0]]->queue.push_back(job);
    }
  }
  if (!bad.empty()) {
    TrialResult result;
    result.status = TrialStatus::kError;
    result.reason = bad;
    Finish(job, std::move(result));
    return;
  }
  cv_.notify_all();
}

void Agent::HandleCancel(const std::string& trial_id) {
  std::vector<Job> dropped;
  bool running = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& slot : slots_) {
      for (auto it = slot->queue.begin(); it != slot->queue.end();) {
        if (it->trial_id == trial_id) {
          for (size_t i = 1; i < it->slots.size(); ++i) --slots_[it->slots[i]]->reserved;
          dropped.push_back(*it);
          it = slot->queue.erase(it);
        } else {
          ++it;
        }
      }
      if (slot->current && slot->current->trial_id == trial_id) {
        slot->current->cancelled = true;
        slot->runner->Cancel();  // kills its worker; Run() returns ERROR "cancelled"
        running = true;
      }
    }
  }
  // A queued trial never starts; it is answered so the coordinator frees the slot. A running one
  // has its worker killed and is reported as ERROR "cancelled while running".
  for (const Job& job : dropped) {
    TrialResult result;
    result.status = TrialStatus::kError;
    result.reason = "cancelled by the coordinator before it started";
    Finish(job, std::move(result));
  }
  if (running || !dropped.empty())
    Log(absl::StrCat("cancelled ", trial_id, running ? " (running: its worker is killed)" : ""));
}

// The CUDA devices of a job's slots, in the job's order (its first slot is the worker's device
// 0, a rank r's device r); none for a CPU-only agent's slot.
std::vector<int> Agent::JobDevices(const Job& job) const {
  std::vector<int> devices;
  if (inventory_.gpus.empty()) return devices;
  for (int s : job.slots) devices.push_back(inventory_.gpus[s].index);
  return devices;
}

void Agent::SlotLoop(Slot* slot) {
  while (true) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !slot->queue.empty(); });
      if (stopping_) return;
      job = slot->queue.front();
      slot->queue.pop_front();
      slot->runner->ClearCancel();  // a cancellation that came after the previous trial ended
      slot->current = job;
    }
    TrialResult result;
    absl::StatusOr<TrialRequest> request =
        TrialRequestFromJsonText(job.request_json, "request_json");
    if (!request.ok()) {
      result.status = TrialStatus::kError;
      result.reason = absl::StrCat("bad assignment: ", request.status().message());
    } else {
      request->trial_id = job.trial_id;
      request->attempt = job.attempt;
      if (!options_.test_inject_fault.empty()) request->inject_fault = options_.test_inject_fault;
      Log(absl::StrCat("running ", job.trial_id, " attempt ", job.attempt, " on slot ", slot->index,
                       ": ", BackendConfigString(request->config)));
      if (metrics_) metrics_->TrialStarted(job.trial_id, BackendConfigString(request->config));
      result = slot->runner->Run(*request, JobDevices(job));
    }
    bool cancelled;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled = slot->current && slot->current->cancelled;
      slot->current.reset();
      for (size_t i = 1; i < job.slots.size(); ++i) --slots_[job.slots[i]]->reserved;
      if (stopping_) {  // cut short by shutdown: not a result
        if (metrics_) metrics_->TrialAbandoned(job.trial_id);
        return;
      }
    }
    Log(absl::StrCat(job.trial_id, " attempt ", job.attempt, cancelled ? " (cancelled)" : "", ": ",
                     std::string(TrialStatusName(result.status)), result.reason.empty() ? "" : " (",
                     result.reason, result.reason.empty() ? "" : ")"));
    Finish(job, std::move(result));
  }
}

void Agent::Finish(const Job& job, TrialResult result) {
  result.trial_id = job.trial_id;
  result.attempt = job.attempt;
  if (result.finished_unix_ms == 0) result.finished_unix_ms = NowUnixMs();
  SpooledResult spooled;
  spooled.trial_id = job.trial_id;
  spooled.attempt = job.attempt;
  spooled.result_json = ToJson(result).dump();
  spooled.slots = job.slots;
  AppendResultsLog(spooled.result_json);
  if (auto seq = spool_->Put(spooled); !seq.ok())
    Log(absl::StrCat("cannot spool ", job.trial_id, ": ", seq.status().message(),
                     " (sending it anyway)"));
  if (metrics_) {
    metrics_->TrialFinished(job.trial_id, result.status);  // ends its running series, counts it
    UpdateSpoolMetric();
  }
  v1::AgentMessage m;
  v1::Result* r = m.mutable_result();
  r->set_trial_id(job.trial_id);
  r->set_attempt(job.attempt);
  r->set_result_json(spooled.result_json);
  for (int s : job.slots) r->add_slots(s);
  if (Send(m)) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.results_sent;
  }
}

}  // namespace infersweep
