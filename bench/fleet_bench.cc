// fleet_bench: one coordinator and a thousand agents. How many results a second the coordinator
// ingests, how long an agent waits for the Ack, and how much memory the coordinator needs.
//
//   fleet_bench [--agents 1000] [--trials-per-agent 10] [--channels 8] [--trial-ms 0]
//               [--binary PATH] [--db PATH] [--keep]    (--help: every flag and its default)
//
// Starts `infersweep coordinator` as a child process on a fresh SQLite file (rate limits off:
// every simulated agent comes from 127.0.0.1), submits sweeps of agents x trials-per-agent CPU
// trials, and connects the agents. Each is one AgentService.Connect stream speaking the real
// protocol (Hello, Heartbeats at the Welcome's interval, one Result per Assignment; one CPU
// slot), all multiplexed over --channels TCP connections through gRPC's callback API, so a
// 2-core machine can hold them. An agent answers an Assignment with a synthetic OK result of
// the size of a real one, about --trial-ms after it arrived (0: at once; else uniform in
// [0.5, 1.5) x --trial-ms, seeded per agent, so that trials do not end in lockstep), so the
// coordinator (scheduling, SQLite, acks) is what is measured, not the engine. With --trial-ms 0
// every agent always has a result in flight: the coordinator is saturated, and the latency is
// mostly queueing (agents / throughput). A --trial-ms that offers less than the saturated rate
// shows the latency of an ingest that keeps up.
//
// Prints (nccl-tests style: '#' lines are metadata):
//   results_per_s   acknowledged results / (last Ack - first Result written)
//   ingest_p50/p99  Result written by the agent -> its Ack read by the agent, ms
//   rss/hwm         the coordinator's VmRSS at the end and VmHWM (peak), from /proc/PID/status
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/utsname.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "api/trial.h"
#include "coordinator/client.h"
#include "proto/infersweep.grpc.pb.h"
#include "proto/rpc.h"
#include "testing/http_get.h"
#include "testing/process_util.h"

namespace infersweep {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "fleet_bench: %s\n", what.c_str());
  std::exit(1);
}

struct Options {
  int agents = 1000;
  int trials_per_agent = 10;
  int channels = 8;
  int trial_ms = 0;
  std::string binary = INFERSWEEP_BINARY;
  std::string db = "/tmp/infersweep_fleet_bench.db";
  bool keep = false;
};

// What --help prints: every flag with its meaning and default (from Options).
std::string Usage() {
  const Options d;
  std::string out =
      "usage: fleet_bench [--agents N] [--trials-per-agent T] [--channels C] [--trial-ms MS]\n"
      "                   [--binary PATH] [--db PATH] [--keep]\n"
      "One infersweep coordinator process and N simulated agents: results ingested per second,\n"
      "Result-to-Ack latency, the coordinator's memory.\n";
  auto flag = [&out](std::string name, const std::string& meaning) {
    name.resize(std::max<size_t>(name.size() + 1, 22), ' ');
    absl::StrAppend(&out, "  ", name, meaning, "\n");
  };
  flag("--agents N", absl::StrCat("simulated agents, one CPU slot each (default ", d.agents, ")"));
  flag("--trials-per-agent T",
       absl::StrCat("trials submitted per agent (default ", d.trials_per_agent, ")"));
  flag("--channels C",
       absl::StrCat("TCP connections the agents' streams share (default ", d.channels, ")"));
  flag("--trial-ms MS",
       absl::StrCat("an agent answers an Assignment after about MS ms (uniform in [0.5, 1.5) x "
                    "MS); 0 answers at once and saturates the coordinator (default ",
                    d.trial_ms, ")"));
  flag("--binary PATH",
       absl::StrCat("the infersweep binary that runs the coordinator (default ", d.binary, ")"));
  flag("--db PATH", absl::StrCat("the coordinator's database, made fresh (default ", d.db, ")"));
  flag("--keep", "keep the database afterwards (default: removed)");
  flag("--help", "print this and exit");
  return out;
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    auto value = [&](const char* flag) -> std::string {
      if (i + 1 >= argc) Die(absl::StrCat(flag, " needs a value"));
      return argv[++i];
    };
    const std::string a = argv[i];
    if (a == "--agents") {
      o.agents = std::atoi(value("--agents").c_str());
    } else if (a == "--trials-per-agent") {
      o.trials_per_agent = std::atoi(value("--trials-per-agent").c_str());
    } else if (a == "--channels") {
      o.channels = std::atoi(value("--channels").c_str());
    } else if (a == "--trial-ms") {
      o.trial_ms = std::atoi(value("--trial-ms").c_str());
    } else if (a == "--binary") {
      o.binary = value("--binary");
    } else if (a == "--db") {
      o.db = value("--db");
    } else if (a == "--keep") {
      o.keep = true;
    } else if (a == "--help" || a == "-h") {
      std::printf("%s", Usage().c_str());
      std::exit(0);
    } else {
      std::fprintf(stderr, "fleet_bench: unknown flag '%s'\n%s", a.c_str(), Usage().c_str());
      std::exit(2);
    }
  }
  if (o.agents < 1 || o.trials_per_agent < 1 || o.channels < 1 || o.trial_ms < 0)
    Die("--agents, --trials-per-agent and --channels must be >= 1, --trial-ms >= 0");
  return o;
}

// VmRSS and VmHWM of `pid`, in MiB.
std::pair<double, double> Memory(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  double rss = 0, hwm = 0;
  while (std::getline(in, line)) {
    auto kib = [&](const char* key, double* out) {
      if (line.rfind(key, 0) != 0) return;
      int64_t v = 0;
      std::string digits;
      for (char c : line)
        if (c >= '0' && c <= '9') digits += c;
      if (absl::SimpleAtoi(digits, &v)) *out = static_cast<double>(v) / 1024.0;
    };
    kib("VmRSS:", &rss);
    kib("VmHWM:", &hwm);
  }
  return {rss, hwm};
}

// A finished trial's result as a real agent would send it: one batch of figures and a verdict.
std::string ResultJson(const std::string& trial_id, int attempt, const std::string& request_json) {
  TrialResult r;
  r.trial_id = trial_id;
  r.attempt = attempt;
  r.status = TrialStatus::kOk;
  auto req = nlohmann::json::parse(request_json, nullptr, false);
  if (!req.is_discarded()) {
    if (auto parsed = TrialRequestFromJson(req); parsed.ok()) {
      r.model = parsed->model;
      r.config = parsed->config;
    }
  }
  r.device = "cpu";
  r.engine_version = "fleet_bench";
  r.verdict.precision_class = "fp32";
  r.verdict.top1_agreement = 1;
  r.verdict.free_run_agreement = 1;
  BatchFigures b;
  b.batch = 1;
  b.ttft_ms = {0.57, 0.55, 0.60};
  b.tpot_ms = {0.15, 0.14, 0.16};
  b.latency_ms = {1.0, 0.9, 1.1};
  b.prefill_tok_s = {13933, 13000, 14000};
  b.output_tok_s = {3910, 3800, 4000};
  b.output_tok_s_per_seq = {3910, 3800, 4000};
  b.itl_ms = {0.15, 0.16, 0.2};
  b.decode_bytes_per_step = 336000;
  b.achieved_gb_s = 2.24;
  r.batches = {b};
  r.started_unix_ms = 1'700'000'000'000;
  r.finished_unix_ms = 1'700'000'000'001;
  return ToJson(r).dump();
}

// Runs callbacks at their due time, on one thread (the simulated trials' ends).
class Delayer {
 public:
  Delayer() : thread_([this] { Loop(); }) {}
  ~Delayer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void At(Clock::time_point when, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      due_.emplace(when, std::move(fn));
    }
    cv_.notify_all();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (due_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const Clock::time_point next = due_.begin()->first;
      if (Clock::now() < next) {
        cv_.wait_until(lock, next);
        continue;
      }
      std::function<void()> fn = std::move(due_.begin()->second);
      due_.erase(due_.begin());
      lock.unlock();
      fn();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::multimap<Clock::time_point, std::function<void()>> due_;
  std::thread thread_;
};

class Bench;

// One simulated agent: one stream, one CPU slot. Callbacks may run on several gRPC threads at
// once; mu_ guards the write queue and the send times.
class SimAgent : public grpc::ClientBidiReactor<v1::AgentMessage, v1::CoordinatorMessage> {
 public:
  SimAgent(Bench* bench, v1::AgentService::Stub* stub, std::string id, uint64_t seed)
      : bench_(bench), stub_(stub), id_(std::move(id)), rng_(seed) {}

  void Start() {
    v1::AgentMessage hello;
    v1::Hello* h = hello.mutable_hello();
    h->set_agent_id(id_);
    h->set_host("fleet-bench");
    h->set_cpu_only(true);
    h->set_engine_version("fleet_bench");
    h->set_protocol_version(rpc::kProtocolVersion);
    stub_->async()->Connect(&context_, this);
    Enqueue(std::move(hello));
    StartRead(&in_);
    StartCall();
  }
  void Heartbeat() {
    v1::AgentMessage m;
    m.mutable_heartbeat()->set_free_slots(1);
    Enqueue(std::move(m));
  }
  void Cancel() { context_.TryCancel(); }
  void WaitDone() {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_; });
  }
  std::vector<double> TakeLatencies() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(latencies_ms_);
  }

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) return;  // the stream is over; OnDone follows
    StartNextWriteLocked();
  }
  void OnDone(const grpc::Status& status) override;

 private:
  void Enqueue(v1::AgentMessage m) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(m));
    if (!writing_) StartNextWriteLocked();
  }
  void StartNextWriteLocked() {
    if (queue_.empty() || done_) return;
    out_ = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    if (out_.has_result()) sent_[out_.result().trial_id()] = Clock::now();
    StartWrite(&out_);
  }

  Bench* bench_;
  v1::AgentService::Stub* stub_;
  const std::string id_;
  std::mt19937_64 rng_;  // trial durations (read thread only)
  grpc::ClientContext context_;
  v1::CoordinatorMessage in_;
  v1::AgentMessage out_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  bool writing_ = false;
  bool done_ = false;
  std::deque<v1::AgentMessage> queue_;
  std::map<std::string, Clock::time_point> sent_;  // Result written -> waiting for its Ack
  std::vector<double> latencies_ms_;
};

class Bench {
 public:
  int trial_ms = 0;
  Delayer delayer;
  std::atomic<int> welcomed{0};
  std::atomic<int64_t> acked{0};
  std::atomic<int64_t> errors{0};
  std::atomic<int64_t> assignments{0};
  std::atomic<int> ended{0};
  std::atomic<int64_t> heartbeat_ms{0};
  std::mutex mu;
  Clock::time_point first_result = Clock::time_point::max();
  Clock::time_point last_ack = Clock::time_point::min();
  std::string first_end_status;

  void OnFirstResult() {
    std::lock_guard<std::mutex> lock(mu);
    first_result = std::min(first_result, Clock::now());
  }
  void OnAck() {
    const auto now = Clock::now();
    ++acked;
    std::lock_guard<std::mutex> lock(mu);
    last_ack = std::max(last_ack, now);
  }
  void OnEnd(const grpc::Status& s) {
    ++ended;
    std::lock_guard<std::mutex> lock(mu);
    if (!s.ok() && first_end_status.empty())
      first_end_status = absl::StrCat(static_cast<int>(s.error_code()), ": ", s.error_message());
  }
};

void SimAgent::OnReadDone(bool ok) {
  if (!ok) return;  // the stream is over; OnDone follows
  const auto now = Clock::now();
  switch (in_.msg_case()) {
    case v1::CoordinatorMessage::kWelcome:
      bench_->heartbeat_ms = in_.welcome().heartbeat_interval_ms();
      ++bench_->welcomed;
      break;
    case v1::CoordinatorMessage::kAssignment: {
      ++bench_->assignments;
      const v1::Assignment& a = in_.assignment();
      v1::AgentMessage m;
      v1::Result* r = m.mutable_result();
      r->set_trial_id(a.trial_id());
      r->set_attempt(a.attempt());
      r->set_result_json(ResultJson(a.trial_id(), a.attempt(), a.request_json()));
      r->add_slots(0);
      if (bench_->trial_ms > 0) {
        const double ms = bench_->trial_ms * std::uniform_real_distribution<double>(0.5, 1.5)(rng_);
        bench_->delayer.At(now + std::chrono::microseconds(static_cast<int64_t>(ms * 1000)),
                           [this, m = std::move(m)]() mutable {
                             bench_->OnFirstResult();
                             Enqueue(std::move(m));
                           });
      } else {
        bench_->OnFirstResult();
        Enqueue(std::move(m));
      }
      break;
    }
    case v1::CoordinatorMessage::kAck: {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (auto it = sent_.find(in_.ack().trial_id()); it != sent_.end()) {
          latencies_ms_.push_back(Ms(now - it->second));
          sent_.erase(it);
        }
      }
      bench_->OnAck();
      break;
    }
    case v1::CoordinatorMessage::kError:
      ++bench_->errors;
      break;
    default:
      break;
  }
  StartRead(&in_);
}

void SimAgent::OnDone(const grpc::Status& status) {
  bench_->OnEnd(status);
  std::lock_guard<std::mutex> lock(mu_);
  done_ = true;
  done_cv_.notify_all();
}

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<long>(k), v.end());
  return v[k];
}

int Main(int argc, char** argv) {
  const Options o = ParseArgs(argc, argv);
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(o.db + suffix);
  // Trials: sweeps of at most 10,000 (10 configs x up to 1000 repeats).
  const int64_t total = (static_cast<int64_t>(o.agents) * o.trials_per_agent + 9) / 10 * 10;

  utsname u{};
  uname(&u);
  std::printf(
      "# fleet_bench: %d simulated agents over %d channels, %lld trials (%d per agent), each "
      "answered %d ms after its Assignment\n",
      o.agents, o.channels, static_cast<long long>(total), o.trials_per_agent, o.trial_ms);
  std::printf("# machine: %s %s %s, %u hardware threads\n", u.sysname, u.release, u.machine,
              std::thread::hardware_concurrency());
  std::printf("# coordinator: %s, database %s (fresh)\n", o.binary.c_str(), o.db.c_str());
  std::fflush(stdout);

  auto coordinator = ChildProcess::Start(
      {o.binary, "coordinator", "--listen", "127.0.0.1:0", "--db", o.db, "--metrics-listen",
       "127.0.0.1:0", "--lease-s", "600", "--max-trials", "10000", "--agent-rate", "0",
       "--user-rate", "0", "--connect-rate", "0"});
  if (!coordinator) Die("cannot start the coordinator");
  int port = 0;
  for (int i = 0; i < 500 && port == 0; ++i) {
    const std::string out = coordinator->Output();
    const size_t line = out.find("# infersweep coordinator on ");
    const size_t at = line == std::string::npos ? line : out.find("(port ", line);
    const size_t end = at == std::string::npos ? at : out.find(')', at);
    if (end != std::string::npos) (void)absl::SimpleAtoi(out.substr(at + 6, end - at - 6), &port);
    if (port == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (port == 0) Die("the coordinator did not start:\n" + coordinator->Output());
  int metrics_port = 0;
  {
    const std::string out = coordinator->Output();
    const size_t line = out.find("# metrics on ");
    const size_t at = line == std::string::npos ? line : out.find("(port ", line);
    const size_t end = at == std::string::npos ? at : out.find(')', at);
    if (end != std::string::npos)
      (void)absl::SimpleAtoi(out.substr(at + 6, end - at - 6), &metrics_port);
  }
  const std::string address = absl::StrCat("127.0.0.1:", port);
  const auto [rss_start, hwm_start] = Memory(coordinator->pid());
  std::printf("# coordinator started: VmRSS %.1f MiB, VmHWM %.1f MiB (no agent yet)\n", rss_start,
              hwm_start);

  // Agents first (idle), then the sweeps: every agent is connected when trials appear.
  std::vector<std::unique_ptr<v1::AgentService::Stub>> stubs;
  for (int c = 0; c < o.channels; ++c) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(rpc::kMaxMessageBytes);
    args.SetMaxSendMessageSize(rpc::kMaxMessageBytes);
    args.SetInt("infersweep.fleet_bench.channel", c);  // distinct args: one connection each
    stubs.push_back(v1::AgentService::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
  }
  Bench bench;
  bench.trial_ms = o.trial_ms;
  std::vector<std::unique_ptr<SimAgent>> agents;
  const auto connect_start = Clock::now();
  for (int i = 0; i < o.agents; ++i) {
    agents.push_back(std::make_unique<SimAgent>(&bench,
                                                stubs[static_cast<size_t>(i % o.channels)].get(),
                                                absl::StrCat("bench-", i), 1000003 * (i + 1)));
    agents.back()->Start();
  }
  while (bench.welcomed < o.agents) {
    if (Ms(Clock::now() - connect_start) > 120'000 || bench.ended > 0)
      Die(absl::StrCat("only ", bench.welcomed.load(), " of ", o.agents, " agents welcomed (",
                       bench.first_end_status, ")"));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const double connect_ms = Ms(Clock::now() - connect_start);
  const auto [rss_idle, hwm_idle] = Memory(coordinator->pid());
  std::printf("# %d agents connected in %.0f ms; coordinator VmRSS %.1f MiB, VmHWM %.1f MiB\n",
              o.agents, connect_ms, rss_idle, hwm_idle);
  std::fflush(stdout);

  std::atomic<bool> stop{false};
  std::thread heartbeats([&] {
    while (!stop) {
      const int64_t interval = std::max<int64_t>(50, bench.heartbeat_ms.load());
      const auto next = Clock::now() + std::chrono::milliseconds(interval);
      while (!stop && Clock::now() < next)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (stop) return;
      for (auto& a : agents) a->Heartbeat();
    }
  });

  ServiceClient client(address, 60'000);
  const auto submit_start = Clock::now();
  for (int64_t left = total; left > 0;) {
    const int64_t repeats = std::min<int64_t>(1000, left / 10);
    const std::string spec = absl::StrCat(
        "name: fleet-bench\nmodel: preset:tiny-moe\nlayers: 1\n"
        "matrix: {device: [cpu], matmul: [naive, blocked], threads: [\"1\", \"2\", \"4\", \"8\", "
        "all]}\nworkload: {prompt: 8, output: 4, batch: [1], repeats: 1}\nrepeats: ",
        repeats, "\n");
    auto submitted = client.SubmitSweep(spec, "fleet-bench.yaml");
    if (!submitted.ok()) Die(absl::StrCat("submit: ", submitted.status().message()));
    left -= submitted->trial_count();
  }
  const double submit_ms = Ms(Clock::now() - submit_start);

  const auto run_start = Clock::now();
  int64_t last_acked = -1;
  auto last_progress = Clock::now();
  while (bench.acked < total) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (bench.acked != last_acked) {
      last_acked = bench.acked;
      last_progress = Clock::now();
    } else if (Ms(Clock::now() - last_progress) > 60'000) {
      Die(absl::StrCat("stalled at ", last_acked, " of ", total, " acks (", bench.errors.load(),
                       " errors, ", bench.ended.load(), " streams ended)"));
    }
  }
  const double run_ms = Ms(Clock::now() - run_start);
  const auto [rss, hwm] = Memory(coordinator->pid());
  stop = true;
  heartbeats.join();

  std::vector<double> latencies;
  for (auto& a : agents) {
    std::vector<double> l = a->TakeLatencies();
    latencies.insert(latencies.end(), l.begin(), l.end());
  }
  const double ingest_s =
      std::chrono::duration<double>(bench.last_ack - bench.first_result).count();
  const double p50 = Percentile(latencies, 0.50), p99 = Percentile(latencies, 0.99);
  std::printf("# submit %lld trials: %.0f ms; run (first Assignment .. last Ack): %.0f ms\n",
              static_cast<long long>(total), submit_ms, run_ms);
  std::printf("#%9s %9s %13s %10s %10s %10s %10s %8s\n", "agents", "results", "results_per_s",
              "ingest_p50", "ingest_p99", "rss", "hwm", "errors");
  std::printf("#%9s %9s %13s %10s %10s %10s %10s %8s\n", "", "", "(1/s)", "(ms)", "(ms)", "(MiB)",
              "(MiB)", "");
  std::printf(" %9d %9lld %13.0f %10.2f %10.2f %10.1f %10.1f %8lld\n", o.agents,
              static_cast<long long>(bench.acked.load()),
              static_cast<double>(bench.acked) / ingest_s, p50, p99, rss, hwm,
              static_cast<long long>(bench.errors.load()));
  // How many results one group commit stored, on average (the coordinator's histogram).
  if (std::optional<HttpResponse> metrics = HttpGet(metrics_port, "/metrics")) {
    auto value = [&](const std::string& name) {
      const size_t at = metrics->body.find("\n" + name + " ");
      double v = 0;
      if (at != std::string::npos)
        (void)absl::SimpleAtod(metrics->body.substr(at + name.size() + 2, 32), &v);
      return v;
    };
    const double groups = value("infersweep_commit_group_results_count");
    if (groups > 0)
      std::printf("# group commits: %.0f, %.1f results each on average\n", groups,
                  value("infersweep_commit_group_results_sum") / groups);
  }
  std::fflush(stdout);

  for (auto& a : agents) a->Cancel();
  for (auto& a : agents) a->WaitDone();
  coordinator->Signal(SIGTERM);
  if (!coordinator->WaitExit(30))
    std::fprintf(stderr, "fleet_bench: the coordinator did not stop\n");
  if (!o.keep)
    for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(o.db + suffix);
  return bench.errors > 0 ? 1 : 0;
}

}  // namespace
}  // namespace infersweep

int main(int argc, char** argv) { return infersweep::Main(argc, argv); }
