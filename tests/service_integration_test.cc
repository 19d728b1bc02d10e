// The fleet end to end: a real coordinator on 127.0.0.1:0 with a SQLite file, three in-process
// agents (two labelled sm_120, one sm_90; trials run on the CPU in `infersweep worker` children),
// a sweep selected for sm_120, and the user API and CLI over the stored results.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agent/agent.h"
#include "api/trial.h"
#include "coordinator/client.h"
#include "coordinator/server.h"
#include "storage/store.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;
using ::testing::UnorderedElementsAreArray;

constexpr char kSweep[] = R"(name: fleet-smoke
model: preset:tiny-moe
layers: 1
matrix:
  device: [cpu]
  matmul: [naive, blocked]
  threads: ["1", "2"]
workload: {prompt: 8, output: 4, batch: [1], repeats: 1, warmup: 0}
selector: {sm: [120]}
)";



// kSweep cut down to a single trial (matmul=naive, threads=1).
std::string OneTrialSweep() {
  std::string one = kSweep;
  one.replace(one.find("[naive, blocked]"), 16, "[naive]");
  one.replace(one.find("[\"1\", \"2\"]"), 10, "[\"1\"]");
  return one;
}

class Fleet : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "fleet-test-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    agents_.clear();  // stop the agents before the coordinator
    if (server_) server_->Stop();
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  CoordinatorOptions QuietOptions() {
    CoordinatorOptions o;
    o.lease_ms = 20'000;
    o.tick_ms = 50;
    o.log = [this](const std::string& line) { Remember("coordinator", line); };
    return o;
  }

  void StartCoordinator(CoordinatorOptions options, const std::string& address = "127.0.0.1:0") {
    server_ = std::make_unique<CoordinatorServer>(std::move(options));
    auto port = server_->Start(address, dir_ + "/coordinator.db");
    ASSERT_TRUE(port.ok()) << port.status();
    port_ = *port;
    address_ = absl::StrCat("127.0.0.1:", port_);
  }

  // An agent with `gpus` copies of `fake_gpu` (none when it is empty: a CPU-only agent).
  Agent* StartAgent(const std::string& id, const std::string& fake_gpu,
                    std::vector<std::string> worker_argv = {INFERSWEEP_BINARY, "worker"},
                    const std::string& auth_token = "", const std::string& inject_fault = "",
                    int gpus = 1) {
    AgentOptions o;
    o.test_inject_fault = inject_fault;
    o.auth_token = auth_token;
    o.coordinator = address_;
    o.agent_id = id;
    o.spool_path = absl::StrCat(dir_, "/", id, ".spool.db");
    if (!fake_gpu.empty()) o.test_fake_gpus.assign(gpus, fake_gpu);
    o.worker_argv = std::move(worker_argv);
    o.initial_backoff_ms = 50;
    o.max_backoff_ms = 300;
    o.log = [this, id](const std::string& line) { Remember(id, line); };
    auto agent = std::make_unique<Agent>(o);
    absl::Status s = agent->Start();
    EXPECT_TRUE(s.ok()) << s;
    agents_.push_back(std::move(agent));
    return agents_.back().get();
  }

  // Polls the sweep until it is done (false after `seconds`).
  bool WaitForSweepDone(ServiceClient& client, int64_t sweep, double seconds) {
    return WaitFor(
        [&] {
          auto s = client.GetSweep(sweep);
          return s.ok() && s->state() == "done";
        },
        seconds);
  }

  void Remember(const std::string& who, const std::string& line) { log_.Add(who, line); }
  std::string Log() { return log_.Text(); }

  std::string dir_;
  int port_ = 0;
  std::string address_;
  std::unique_ptr<CoordinatorServer> server_;
  std::vector<std::unique_ptr<Agent>> agents_;
  LineLog log_;
};

// Trials with selector.gpus: 2 lease two GPUs of one agent: never a 1-GPU agent's, and two of
// them at once on a 4-GPU agent (each delayed 2 s, so running one after the other could not
// make their runs overlap).
TEST_F(Fleet, TwoGpuTrialsLeaseTwoGpusOfOneAgentAndShareAFourGpuAgent) {
  StartCoordinator(QuietOptions());
  const std::string h200 = "NVIDIA H200:90:141";
  const std::vector<std::string> worker = {INFERSWEEP_BINARY, "worker"};
  Agent* one = StartAgent("one-gpu", h200, worker, "", "delay:2", 1);
  ASSERT_TRUE(WaitFor([&] { return server_->stats().agents_connected == 1; }, 10)) << Log();
  // CPU trials with tp=2 (two ranks as threads), judged against tp=1.
  std::string sweep_text = kSweep;
  sweep_text.replace(sweep_text.find("[naive, blocked]"), 16, "[naive]\n  tp: [\"2\"]");
  sweep_text.replace(sweep_text.find("selector: {sm: [120]}"), 21, "selector: {gpus: 2}");
  ServiceClient client(address_);
  auto submitted = client.SubmitSweep(sweep_text, "two-gpu.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const int64_t sweep = submitted->sweep_id();
  ASSERT_EQ(submitted->trial_count(), 2);
  // Many scheduling ticks with only the 1-GPU agent: nothing placed, nothing judged.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_EQ(one->stats().assignments, 0) << Log();
  auto waiting = client.GetSweep(sweep);
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  EXPECT_EQ(waiting->state(), "active");
  EXPECT_EQ(waiting->trials_done(), 0);

  // The 4-GPU agent's workers log the GPUs they are given (CUDA_VISIBLE_DEVICES).
  const std::string visible_log = dir_ + "/visible_devices.log";
  const std::vector<std::string> logging_worker = {
      "/bin/sh", "-c",
      "echo \"${CUDA_VISIBLE_DEVICES-unset}\" >> '" + visible_log + "'; exec '" +
          std::string(INFERSWEEP_BINARY) + "' worker"};
  Agent* four = StartAgent("four-gpu", h200, logging_worker, "", "delay:2", 4);
  ASSERT_TRUE(WaitForSweepDone(client, sweep, 60)) << Log();
  EXPECT_EQ(one->stats().assignments, 0) << Log();
  EXPECT_EQ(four->stats().assignments, 2) << Log();
  ResultQuery all;
  all.sweep_id = sweep;
  auto stored = server_->store()->QueryResults(all);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_EQ(stored->size(), 2u);
  for (const StoredResult& r : *stored) {
    EXPECT_EQ(r.agent_id, "four-gpu");
    EXPECT_EQ(r.result.status, TrialStatus::kOk) << r.result.reason;
    EXPECT_EQ(r.result.config.at("tp"), "2");
  }
  const TrialResult& a = (*stored)[0].result;
  const TrialResult& b = (*stored)[1].result;
  EXPECT_LT(a.started_unix_ms, b.finished_unix_ms) << "the two trials did not run at once";
  EXPECT_LT(b.started_unix_ms, a.finished_unix_ms) << "the two trials did not run at once";
  // Two workers, each on two GPUs of its own: together the agent's four, none shared.
  std::ifstream in(visible_log);
  std::vector<std::string> seen;
  for (std::string line; std::getline(in, line);) seen.push_back(line);
  ASSERT_EQ(seen.size(), 2u) << Log();
  std::multiset<std::string> gpus;
  for (const std::string& line : seen) {
    const std::vector<std::string> pair = absl::StrSplit(line, ',');
    EXPECT_EQ(pair.size(), 2u) << line;
    gpus.insert(pair.begin(), pair.end());
  }
  EXPECT_EQ(gpus, (std::multiset<std::string>{"0", "1", "2", "3"}));
}

// selector.p2p: the leased GPUs must reach each other by peer access. A 4-GPU agent on PCIe
// without peer access never takes such a trial; a 2-GPU NVLink agent takes both, one at a time.
// The agents' inventories reach the user API with their topology.
TEST_F(Fleet, PeerAccessTrialsGoOnlyWhereTheGpusReachEachOther) {
  StartCoordinator(QuietOptions());
  const std::vector<std::string> worker = {INFERSWEEP_BINARY, "worker"};
  Agent* pcie = StartAgent("pcie-four", "NVIDIA RTX PRO 6000:120:96:pcie", worker, "", "", 4);
  Agent* nvlink = StartAgent("nvlink-two", "NVIDIA H200:90:141:nvlink", worker, "", "", 2);
  ASSERT_TRUE(WaitFor([&] { return server_->stats().agents_connected == 2; }, 10)) << Log();
  std::string sweep_text = kSweep;
  sweep_text.replace(sweep_text.find("[naive, blocked]"), 16, "[naive]");
  sweep_text.replace(sweep_text.find("selector: {sm: [120]}"), 21,
                     "selector: {gpus: 2, p2p: true}");
  ServiceClient client(address_);
  auto submitted = client.SubmitSweep(sweep_text, "p2p.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  ASSERT_TRUE(WaitForSweepDone(client, submitted->sweep_id(), 60)) << Log();
  EXPECT_EQ(pcie->stats().assignments, 0) << Log();
  EXPECT_EQ(nvlink->stats().assignments, 2) << Log();

  auto agents = client.ListAgents();
  ASSERT_TRUE(agents.ok()) << agents.status();
  int seen = 0;
  for (const v1::AgentInfo& a : agents->agents()) {
    if (a.agent_id() == "nvlink-two") {
      ASSERT_EQ(a.gpus_size(), 2);
      EXPECT_THAT(a.gpus(0).p2p_peers(), ::testing::ElementsAre(1));
      EXPECT_THAT(a.gpus(1).nvlink_peers(), ::testing::ElementsAre(0));
      ++seen;
    } else if (a.agent_id() == "pcie-four") {
      ASSERT_EQ(a.gpus_size(), 4);
      for (const v1::Gpu& g : a.gpus()) EXPECT_EQ(g.p2p_peers_size(), 0);
      ++seen;
    }
  }
  EXPECT_EQ(seen, 2);
}

TEST_F(Fleet, SweepRunsOnlyOnSelectedArchAndQueriesAgree) {
  const auto t0 = std::chrono::steady_clock::now();
  StartCoordinator(QuietOptions());
  Agent* rtx_a = StartAgent("rtx-a", "NVIDIA RTX PRO 6000:120:96");
  Agent* rtx_b = StartAgent("rtx-b", "NVIDIA RTX PRO 6000:sm_120:96");
  Agent* h200 = StartAgent("h200", "NVIDIA H200:sm_90a:141");
  ASSERT_TRUE(WaitFor([&] { return server_->stats().agents_connected == 3; }, 10)) << Log();

  ServiceClient client(address_);
  auto submitted = client.SubmitSweep(kSweep, "fleet.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const int64_t sweep = submitted->sweep_id();
  ASSERT_EQ(submitted->trial_count(), 4);

  v1::SweepInfo info;
  ASSERT_TRUE(WaitFor(
      [&] {
        auto s = client.GetSweep(sweep);
        if (!s.ok()) return false;
        info = *s;
        return s->state() != "active";
      },
      45))
      << Log();
  EXPECT_EQ(info.state(), "done");
  EXPECT_EQ(info.trials_done(), 4);
  EXPECT_EQ(info.status_counts().at("OK"), 4) << Log();

  // Every trial: done after one attempt, exactly one stored result, from an sm_120 agent.
  Store* store = server_->store();
  ResultQuery all;
  all.sweep_id = sweep;
  all.limit = 100;
  auto stored = store->QueryResults(all);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_EQ(stored->size(), 4u);
  std::vector<std::string> expected_ids, ids;
  std::map<std::string, double> tok_s;  // config -> output tok/s at batch 1
  for (int i = 0; i < 4; ++i) expected_ids.push_back(absl::StrCat(sweep, "-", i));
  for (const StoredResult& r : *stored) {
    ids.push_back(r.result.trial_id);
    EXPECT_THAT(r.agent_id, ::testing::AnyOf("rtx-a", "rtx-b"));
    EXPECT_EQ(r.sm, 120);
    EXPECT_EQ(r.gpu_name, "NVIDIA RTX PRO 6000");
    EXPECT_EQ(r.result.status, TrialStatus::kOk) << r.result.reason;
    EXPECT_EQ(r.result.device, "cpu");
    ASSERT_EQ(r.result.batches.size(), 1u);
    tok_s[BackendConfigString(r.result.config)] = r.result.batches[0].output_tok_s.median;
    auto trial = store->GetTrial(r.result.trial_id);
    ASSERT_TRUE(trial.ok());
    EXPECT_EQ(trial->state, TrialState::kDone);
    EXPECT_EQ(trial->attempt, 1);
  }
  EXPECT_THAT(ids, UnorderedElementsAreArray(expected_ids));
  EXPECT_EQ(tok_s.size(), 4u);
  EXPECT_EQ(h200->stats().assignments, 0) << Log();
  EXPECT_EQ(rtx_a->stats().assignments + rtx_b->stats().assignments, 4);

  // Acks reach the agents: nothing stays spooled.
  EXPECT_TRUE(WaitFor(
      [&] { return rtx_a->stats().spooled + rtx_b->stats().spooled + h200->stats().spooled == 0; },
      5))
      << Log();

  // The user API: by arch, by axis, and the best config.
  v1::QueryResultsRequest q120;
  q120.set_sm(120);
  q120.set_model("preset:tiny-moe");
  auto rows120 = client.QueryResults(q120);
  ASSERT_TRUE(rows120.ok()) << rows120.status();
  EXPECT_EQ(rows120->rows_size(), 4);
  for (const v1::ResultRow& row : rows120->rows()) EXPECT_EQ(row.sm(), 120);
  v1::QueryResultsRequest q90;
  q90.set_sm(90);
  auto rows90 = client.QueryResults(q90);
  ASSERT_TRUE(rows90.ok());
  EXPECT_EQ(rows90->rows_size(), 0);
  v1::QueryResultsRequest blocked = q120;
  (*blocked.mutable_axis_values())["matmul"] = "blocked";
  blocked.set_status("OK");
  auto rows_blocked = client.QueryResults(blocked);
  ASSERT_TRUE(rows_blocked.ok());
  EXPECT_EQ(rows_blocked->rows_size(), 2);
  for (const v1::ResultRow& row : rows_blocked->rows())
    EXPECT_NE(row.result_json().find("\"blocked\""), std::string::npos);

  std::string fastest;
  double fastest_tok_s = -1;
  for (const auto& [config, v] : tok_s)
    if (v > fastest_tok_s) fastest = config, fastest_tok_s = v;
  v1::BestRequest best_req;
  best_req.set_model("preset:tiny-moe");
  best_req.set_sm(120);
  best_req.set_metric("output_tok_s");
  best_req.set_batch(1);
  auto best = client.Best(best_req);
  ASSERT_TRUE(best.ok()) << best.status();
  ASSERT_TRUE(best->found());
  auto best_json = nlohmann::json::parse(best->row().result_json());
  auto best_result = TrialResultFromJson(best_json);
  ASSERT_TRUE(best_result.ok());
  EXPECT_EQ(BackendConfigString(best_result->config), fastest);
  EXPECT_DOUBLE_EQ(best_result->batches.at(0).output_tok_s.median, fastest_tok_s);
  best_req.set_sm(90);
  auto none = client.Best(best_req);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->found());

  // Agents as the coordinator sees them.
  auto agents = client.ListAgents();
  ASSERT_TRUE(agents.ok());
  ASSERT_EQ(agents->agents_size(), 3);
  for (const v1::AgentInfo& a : agents->agents()) {
    EXPECT_TRUE(a.connected());
    ASSERT_EQ(a.gpus_size(), 1);
    EXPECT_EQ(a.gpus(0).sm(), a.agent_id() == "h200" ? 90 : 120);
  }

  // The CLI over the same coordinator: CSV rows and `best`.
  int code = -1;
  const std::string csv = RunCommand(
      absl::StrCat(INFERSWEEP_BINARY, " results --coordinator ", address_,
                   " --sm-arch sm_120a --format csv 2>&1"),
      &code);
  EXPECT_EQ(code, 0) << csv;
  std::vector<std::string> lines = absl::StrSplit(csv, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 5u) << csv;  // header + 4 rows
  EXPECT_EQ(lines[0].rfind("sweep_id,trial_id,", 0), 0u);
  const std::string best_out = RunCommand(
      absl::StrCat(INFERSWEEP_BINARY, " best --coordinator ", address_,
                   " --model preset:tiny-moe --sm-arch 120 2>&1"),
      &code);
  EXPECT_EQ(code, 0) << best_out;
  EXPECT_NE(best_out.find(fastest), std::string::npos) << best_out;
  // The roofline shares: none for a device without measured figures (these agents' results).
  EXPECT_NE(best_out.find("roof p_roof"), std::string::npos) << best_out;
  EXPECT_NE(best_out.find("      -      -\n"), std::string::npos) << best_out;
  const std::string none_out = RunCommand(
      absl::StrCat(INFERSWEEP_BINARY, " results --coordinator ", address_, " --sm-arch 90 2>&1"),
      &code);
  EXPECT_EQ(code, 0) << none_out;
  EXPECT_NE(none_out.find("# 0 result(s)"), std::string::npos) << none_out;

  EXPECT_EQ(server_->stats().bad_messages, 0) << Log();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
}

// A result finished while the coordinator is down waits in the agent's spool and is delivered
// after the agent reconnects to the restarted coordinator (same database, same port).
TEST_F(Fleet, SpooledResultIsDeliveredAfterCoordinatorRestart) {
  StartCoordinator(QuietOptions());
  // The worker starts 2 s late, so the trial is still running when the coordinator stops.
  Agent* agent = StartAgent(
      "slow", "NVIDIA RTX PRO 6000:120:96",
      {"/bin/sh", "-c", absl::StrCat("sleep 2; exec '", INFERSWEEP_BINARY, "' worker")});
  ASSERT_TRUE(WaitFor([&] { return server_->stats().agents_connected == 1; }, 10)) << Log();
  std::string one = kSweep;
  one.replace(one.find("[naive, blocked]"), 16, "[blocked]");
  one.replace(one.find("[\"1\", \"2\"]"), 10, "[\"1\"]");
  ServiceClient client(address_);
  auto submitted = client.SubmitSweep(one, "one.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  ASSERT_EQ(submitted->trial_count(), 1);
  const std::string trial_id = absl::StrCat(submitted->sweep_id(), "-0");

  ASSERT_TRUE(WaitFor([&] { return agent->stats().assignments == 1; }, 10)) << Log();
  server_->Stop();
  server_.reset();
  // The trial ends with nobody to tell: its result is spooled.
  ASSERT_TRUE(WaitFor([&] { return agent->stats().spooled == 1 && !agent->connected(); }, 20))
      << Log();

  StartCoordinator(QuietOptions(), address_);
  ASSERT_TRUE(WaitFor([&] { return agent->stats().spooled == 0; }, 15)) << Log();
  auto trial = server_->store()->GetTrial(trial_id);
  ASSERT_TRUE(trial.ok());
  EXPECT_EQ(trial->state, TrialState::kDone);
  ResultQuery q;
  q.sweep_id = submitted->sweep_id();
  auto rows = server_->store()->QueryResults(q);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].agent_id, "slow");
  EXPECT_EQ((*rows)[0].sm, 120);
  EXPECT_EQ((*rows)[0].result.status, TrialStatus::kOk) << (*rows)[0].result.reason;
  EXPECT_GE(agent->stats().connects, 2);
}

// Preflight judges configs against the agent's inventory: an impossible one is stored as
// UNSUPPORTED by the coordinator and never dispatched.
// A sweep queued before any agent connects: the first message an agent gets must still be
// Welcome (an Assignment that overtakes it makes the agent drop the stream and hang; the README
// demo does this). The race is timing-dependent, so this test guards the scenario without
// reproducing the race on every run.
TEST_F(Fleet, SweepSubmittedBeforeTheAgentConnectsCompletes) {
  StartCoordinator(QuietOptions());
  std::string one = kSweep;
  one.replace(one.find("[naive, blocked]"), 16, "[blocked]");
  ServiceClient client(address_);
  auto submitted = client.SubmitSweep(one, "one.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const int64_t sweep = submitted->sweep_id();
  Agent* agent = StartAgent("late", "NVIDIA RTX PRO 6000:120:96");
  ASSERT_TRUE(WaitForSweepDone(client, sweep, 30)) << Log();
  EXPECT_EQ(agent->stats().connects, 1) << "the agent had to reconnect: " << Log();
}

// The database, the spool and the results log hold results: they are created owner-only
// (their -wal and -shm too) even under a umask that would leave them world-readable.
TEST_F(Fleet, ResultFilesAreOwnerOnlyWhateverTheUmask) {
  const mode_t old_umask = umask(0);
  StartCoordinator(QuietOptions());
  AgentOptions o;
  o.coordinator = address_;
  o.agent_id = "private";
  o.spool_path = dir_ + "/private.spool.db";
  o.results_log_path = dir_ + "/private.results.jsonl";
  o.test_fake_gpus = {"NVIDIA RTX PRO 6000:120:96"};
  o.worker_argv = {INFERSWEEP_BINARY, "worker"};
  o.log = [this](const std::string& line) { Remember("private", line); };
  auto agent = std::make_unique<Agent>(o);
  ASSERT_TRUE(agent->Start().ok());
  agents_.push_back(std::move(agent));
  std::string one = kSweep;
  one.replace(one.find("[naive, blocked]"), 16, "[blocked]");
  ServiceClient client(address_);
  auto submitted = client.SubmitSweep(one, "one.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  ASSERT_TRUE(WaitForSweepDone(client, submitted->sweep_id(), 30)) << Log();
  umask(old_umask);
  int checked = 0;
  for (const std::string& file :
       {dir_ + "/coordinator.db", dir_ + "/coordinator.db-wal", dir_ + "/coordinator.db-shm",
        o.spool_path, o.spool_path + "-wal", o.spool_path + "-shm", o.results_log_path}) {
    struct stat st {};
    if (stat(file.c_str(), &st) != 0) continue;  // a -wal or -shm may be gone
    EXPECT_EQ(st.st_mode & 0777, 0600u) << file;
    ++checked;
  }
  EXPECT_GE(checked, 3);
  EXPECT_TRUE(std::filesystem::file_size(o.results_log_path) > 0);
}

TEST_F(Fleet, UnsupportedConfigIsRecordedWithoutDispatch) {
  StartCoordinator(QuietOptions());
  Agent* h200 = StartAgent("h200", "NVIDIA H200:90:141");
  ASSERT_TRUE(WaitFor([&] { return server_->stats().agents_connected == 1; }, 10)) << Log();
  ServiceClient client(address_);
  // moe=loop cannot be combined with graphs=on, whatever the build.
  auto submitted = client.SubmitSweep(R"(name: impossible
model: preset:tiny-moe
matrix: {device: [cuda], moe: [loop], graphs: ["on"]}
workload: {prompt: 8, output: 4, batch: [1], repeats: 1}
selector: {sm: [90]}
)",
                                      "impossible.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  ASSERT_TRUE(WaitForSweepDone(client, submitted->sweep_id(), 10)) << Log();
  ResultQuery q;
  q.sweep_id = submitted->sweep_id();
  auto rows = server_->store()->QueryResults(q);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].result.status, TrialStatus::kUnsupported);
  EXPECT_FALSE((*rows)[0].result.reason.empty());
  EXPECT_EQ((*rows)[0].agent_id, "");
  EXPECT_EQ((*rows)[0].sm, 90);
  EXPECT_EQ(h200->stats().assignments, 0);
  EXPECT_EQ(server_->stats().unsupported, 1);
}

// A cancelled sweep's queued trials are never dispatched.
TEST_F(Fleet, CancelledSweepIsNotDispatched) {
  StartCoordinator(QuietOptions());
  ServiceClient client(address_);
  auto submitted = client.SubmitSweep(kSweep, "fleet.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  auto cancelled = client.CancelSweep(submitted->sweep_id());
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  Agent* rtx = StartAgent("rtx", "NVIDIA RTX PRO 6000:120:96");
  ASSERT_TRUE(WaitFor([&] { return server_->stats().agents_connected == 1; }, 10)) << Log();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(rtx->stats().assignments, 0);
  auto s = client.GetSweep(submitted->sweep_id());
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->state(), "cancelled");
  EXPECT_EQ(s->trials_done(), 0);
}

// Cancelling a sweep kills its running trial's worker at once: the agent reports ERROR
// "cancelled while running" within seconds, not after the trial's 120 s deadline.
TEST_F(Fleet, CancellingASweepKillsItsRunningTrial) {
  StartCoordinator(QuietOptions());
  Agent* hung = StartAgent("hung", "NVIDIA RTX PRO 6000:120:96", {INFERSWEEP_BINARY, "worker"}, "",
                           "hang");
  ASSERT_TRUE(WaitFor([&] { return server_->stats().agents_connected == 1; }, 10)) << Log();
  std::string one = OneTrialSweep();
  one.replace(one.find("warmup: 0}"), 10, "warmup: 0, timeout: 120}");
  ServiceClient client(address_);
  auto submitted = client.SubmitSweep(one, "one.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  ASSERT_TRUE(WaitFor([&] { return hung->stats().assignments == 1; }, 10)) << Log();
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // the worker is up and hanging
  const auto cancelled_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(client.CancelSweep(submitted->sweep_id()).ok());
  ResultQuery q;
  q.sweep_id = submitted->sweep_id();
  std::vector<StoredResult> rows;
  ASSERT_TRUE(WaitFor(
      [&] {
        auto r = server_->store()->QueryResults(q);
        if (!r.ok() || r->empty()) return false;
        rows = *r;
        return true;
      },
      20))
      << Log();
  EXPECT_LT(std::chrono::steady_clock::now() - cancelled_at, std::chrono::seconds(20));
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].result.status, TrialStatus::kError);
  EXPECT_THAT(rows[0].result.reason, HasSubstr("cancelled while running")) << Log();
}

// An agent that restarts while a trial runs comes back without it; after a grace period the
// coordinator releases the lease (instead of renewing it forever) and the trial runs again, as
// attempt 2, on the restarted agent.
TEST_F(Fleet, TrialLostByARestartedAgentIsRequeuedAndRunsAgain) {
  CoordinatorOptions options = QuietOptions();
  options.lost_trial_grace_ms = 300;
  StartCoordinator(options);
  const std::vector<std::string> slow = {
      "/bin/sh", "-c", absl::StrCat("sleep 1; exec '", INFERSWEEP_BINARY, "' worker")};
  Agent* first = StartAgent("phoenix", "NVIDIA RTX PRO 6000:120:96", slow);
  ASSERT_TRUE(WaitFor([&] { return server_->stats().agents_connected == 1; }, 10)) << Log();
  ServiceClient client(address_);
  auto submitted = client.SubmitSweep(OneTrialSweep(), "one.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  ASSERT_TRUE(WaitFor([&] { return first->stats().assignments == 1; }, 10)) << Log();
  first->Stop();  // the running trial ends unreported
  agents_.clear();
  StartAgent("phoenix", "NVIDIA RTX PRO 6000:120:96");
  ASSERT_TRUE(WaitForSweepDone(client, submitted->sweep_id(), 20)) << Log();
  ResultQuery q;
  q.sweep_id = submitted->sweep_id();
  auto rows = server_->store()->QueryResults(q);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].result.status, TrialStatus::kOk) << (*rows)[0].result.reason;
  EXPECT_EQ((*rows)[0].result.attempt, 2);
  EXPECT_EQ((*rows)[0].agent_id, "phoenix");
  EXPECT_EQ(server_->stats().lost, 1);
  EXPECT_EQ(server_->stats().requeued, 1);
  EXPECT_EQ(server_->stats().attempts_exhausted, 0);
}

TEST_F(Fleet, OnlyAnAgentWithTheAgentTokenRunsTrials) {
  const std::string agent_token = "fleet-agent-token", user_token = "fleet-user-token";
  CoordinatorOptions options = QuietOptions();
  options.agent_token = agent_token;
  options.user_token = user_token;
  StartCoordinator(options);
  const std::vector<std::string> worker = {INFERSWEEP_BINARY, "worker"};
  // Refused: no token, the user token, a wrong token. They keep retrying; none gets in.
  StartAgent("no-token", "NVIDIA RTX PRO 6000:120:96", worker, "");
  StartAgent("user-token", "NVIDIA RTX PRO 6000:120:96", worker, user_token);
  StartAgent("wrong-token", "NVIDIA RTX PRO 6000:120:96", worker, "fleet-agent-tokem");
  ASSERT_TRUE(WaitFor([&] { return server_->stats().auth_failures >= 3; }, 10)) << Log();
  EXPECT_EQ(server_->stats().agents_connected, 0) << Log();

  ServiceClient client(address_, 30'000, user_token);
  std::string one = kSweep;
  one.replace(one.find("[naive, blocked]"), 16, "[blocked]");
  auto submitted = client.SubmitSweep(one, "one.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const int64_t sweep = submitted->sweep_id();

  Agent* good = StartAgent("good", "NVIDIA RTX PRO 6000:120:96", worker, agent_token);
  ASSERT_TRUE(WaitForSweepDone(client, sweep, 30)) << Log();
  EXPECT_GE(good->stats().connects, 1);
  EXPECT_EQ(server_->stats().agents_connected, 1);

  // Every result came from the agent with the right token; the others were never recorded.
  v1::QueryResultsRequest q;
  q.set_sweep_id(sweep);
  auto results = client.QueryResults(q);
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_EQ(results->rows_size(), 2);
  for (const v1::ResultRow& row : results->rows()) EXPECT_EQ(row.agent_id(), "good");
  auto agents = client.ListAgents();
  ASSERT_TRUE(agents.ok()) << agents.status();
  ASSERT_EQ(agents->agents_size(), 1);
  EXPECT_EQ(agents->agents(0).agent_id(), "good");
  // No token is ever logged.
  const std::string log = Log();
  EXPECT_EQ(log.find(agent_token), std::string::npos);
  EXPECT_EQ(log.find(user_token), std::string::npos);
}

// Leases recovered from the database after a coordinator restart count as running (leased)
// until they are requeued or finished: `status` right after the restart does not show them as
// queued. Here the agent is gone too, so the lease is recovered but never confirmed by a Hello;
// once it expires the trial is queued again.
TEST_F(Fleet, RecoveredLeasesCountAsRunningAfterARestart) {
  CoordinatorOptions options = QuietOptions();
  options.lease_ms = 5000;
  // The lease's expiry is polled every 20 ms for over 5 s, faster than the default user-call
  // limit refills: the limit is not what this test is about.
  options.user_call_limit = {0, 0};
  StartCoordinator(options);
  // The "worker" never answers: the trial stays running until the agent stops.
  Agent* agent = StartAgent("holder", "NVIDIA RTX PRO 6000:120:96", {"/bin/sleep", "60"});
  ASSERT_TRUE(WaitFor([&] { return server_->stats().agents_connected == 1; }, 10)) << Log();
  ServiceClient client(address_);
  auto submitted = client.SubmitSweep(OneTrialSweep(), "one.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const int64_t sweep = submitted->sweep_id();
  ASSERT_TRUE(WaitFor([&] { return agent->stats().assignments == 1; }, 10)) << Log();
  // The agent stops without reporting its trial (the lease stays in the database), then the
  // coordinator restarts on the same database and port.
  agents_.clear();
  server_->Stop();
  server_.reset();
  StartCoordinator(options, address_);

  auto status = [&] {
    int rc = 0;
    const std::string out = RunCommand(absl::StrCat("'", INFERSWEEP_BINARY, "' status ", sweep,
                                                    " --once --coordinator ", address_, " 2>&1"),
                                       &rc);
    EXPECT_EQ(rc, 0) << out;
    return out;
  };
  auto info = client.GetSweep(sweep);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->trials_running(), 1) << Log();
  EXPECT_THAT(status(), HasSubstr("0/1 done, 1 running, 0 queued"));
  auto list = client.ListSweeps();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->sweeps_size(), 1);
  EXPECT_EQ(list->sweeps(0).trials_running(), 1);

  // Nobody renews the lease: it expires and the trial is queued again.
  ASSERT_TRUE(WaitFor(
      [&] {
        auto s = client.GetSweep(sweep);
        return s.ok() && s->trials_running() == 0;
      },
      20))
      << Log();
  EXPECT_THAT(status(), HasSubstr("0/1 done, 0 running, 1 queued"));
  EXPECT_EQ(server_->stats().requeued, 1) << Log();
}

// An agent the coordinator refuses logs why: the status code and the coordinator's reason, that
// the refusal does not clear by itself, and the backoff it keeps retrying at (its longest). The
// coordinator's line names the peer and the agent id it claimed.
TEST_F(Fleet, RefusedAgentLogsTheCodeAndTheReason) {
  CoordinatorOptions options = QuietOptions();
  options.agent_token = "the-agent-token";
  StartCoordinator(options);
  StartAgent("stranger", "", {INFERSWEEP_BINARY, "worker"}, "not-the-token");
  ASSERT_TRUE(WaitFor([&] { return server_->stats().auth_failures >= 3; }, 10)) << Log();
  const std::string log = Log();
  EXPECT_THAT(log, HasSubstr("[stranger] coordinator refused the stream: UNAUTHENTICATED: "
                             "Hello: missing or invalid credentials"));
  EXPECT_THAT(log, HasSubstr("retrying every 300 ms"));
  EXPECT_THAT(log, ::testing::Not(HasSubstr("Cancelled")));
  EXPECT_THAT(log, ::testing::Not(HasSubstr("CANCELLED")));
  EXPECT_THAT(log, HasSubstr("[coordinator] stream rejected from ipv4:127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("agent 'stranger'"));
  EXPECT_EQ(log.find("not-the-token"), std::string::npos);
}

}  // namespace
}  // namespace infersweep
