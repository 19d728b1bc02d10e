// A fleet of real processes for the fault tests: `infersweep coordinator` on loopback with a
// SQLite file, `infersweep agent`s with their own spools and results logs, and the checks every
// fault test ends with (tests/service_fault_test.cc, tests/service_limits_test.cc).
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "coordinator/client.h"
#include "storage/codec.h"
#include "testing/process_util.h"
#include "tests/raw_db.h"
#include "tests/test_util.h"

namespace infersweep {

class FleetProcesses : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("fleet-proc");
    ASSERT_FALSE(dir_.empty());
    db_ = dir_ + "/coordinator.db";
  }
  void TearDown() override {
    if (HasFailure()) std::fprintf(stderr, "%s\n", Logs().c_str());
    agents_.clear();
    coordinator_.reset();
    std::filesystem::remove_all(dir_);
  }

  // Starts `infersweep coordinator` on 127.0.0.1:`port` (0: a free one) with the database
  // db_ and `flags`, and waits until it listens. A restart passes the port of the first start.
  void StartCoordinator(const std::vector<std::string>& flags, int port = 0) {
    std::vector<std::string> argv = {
        WorkerBinary(), "coordinator", "--listen",         absl::StrCat("127.0.0.1:", port),
        "--db",         db_,           "--metrics-listen", ""};
    argv.insert(argv.end(), flags.begin(), flags.end());
    if (coordinator_) old_coordinator_output_ += coordinator_->Output();
    coordinator_ = ChildProcess::Start(argv);
    ASSERT_NE(coordinator_, nullptr);
    int bound = 0;
    ASSERT_TRUE(WaitFor(
        [&] {
          const std::string out = coordinator_->Output();
          const size_t line = out.find("# infersweep coordinator on ");
          if (line == std::string::npos) return false;
          const size_t at = out.find("(port ", line);
          if (at == std::string::npos) return false;
          const size_t end = out.find(')', at);
          return end != std::string::npos &&
                 absl::SimpleAtoi(out.substr(at + 6, end - at - 6), &bound);
        },
        20))
        << coordinator_->Output();
    port_ = bound;
    address_ = absl::StrCat("127.0.0.1:", port_);
  }

  // Starts `infersweep agent --id ID` against `coordinator` (default: address_), with its spool
  // and results log in dir_, a short reconnect backoff, and `flags`.
  ChildProcess* StartAgent(const std::string& id, const std::vector<std::string>& flags = {},
                           const std::string& coordinator = "") {
    std::vector<std::string> argv = {WorkerBinary(),
                                     "agent",
                                     "--coordinator",
                                     coordinator.empty() ? address_ : coordinator,
                                     "--id",
                                     id,
                                     "--spool",
                                     SpoolPath(id),
                                     "--results-log",
                                     ResultsLogPath(id),
                                     "--max-backoff-ms",
                                     "300",
                                     "--metrics-listen",
                                     ""};
    argv.insert(argv.end(), flags.begin(), flags.end());
    if (auto it = agents_.find(id); it != agents_.end())
      old_agent_output_[id] += it->second->Output();
    auto p = ChildProcess::Start(argv);
    EXPECT_NE(p, nullptr);
    ChildProcess* raw = p.get();
    agents_[id] = std::move(p);
    return raw;
  }

  std::string SpoolPath(const std::string& id) const { return dir_ + "/" + id + ".spool.db"; }
  std::string ResultsLogPath(const std::string& id) const {
    return dir_ + "/" + id + ".results.jsonl";
  }

  // Results in an agent's spool now (0 before the spool exists).
  int64_t Spooled(const std::string& id) {
    if (!std::filesystem::exists(SpoolPath(id))) return 0;
    RawDb spool(SpoolPath(id));
    const std::string n = spool.Query("SELECT COUNT(*) FROM spooled_results");
    return n.empty() ? 0 : std::stoll(n);
  }

  // One number from the coordinator's database, read by another connection.
  int64_t DbCount(const std::string& sql) {
    RawDb db(db_);
    const std::string n = db.Query(sql);
    return n.empty() ? 0 : std::stoll(n);
  }

  int64_t Submit(const std::string& yaml) {
    ServiceClient client(address_, 10'000);
    auto submitted = client.SubmitSweep(yaml, "fault.yaml");
    EXPECT_TRUE(submitted.ok()) << submitted.status();
    return submitted.ok() ? submitted->sweep_id() : 0;
  }

  bool WaitSweepDone(int64_t sweep_id, double seconds) {
    return WaitFor(
        [&] {
          RawDb db(db_);
          return db.Query(absl::StrCat("SELECT state FROM sweeps WHERE sweep_id = ", sweep_id)) ==
                 "done";
        },
        seconds);
  }

  // The results an agent logged (--results-log): (trial id, attempt) -> TrialResult JSON.
  std::map<std::pair<std::string, int>, nlohmann::json> LoggedResults(const std::string& id) {
    std::map<std::pair<std::string, int>, nlohmann::json> out;
    std::ifstream in(ResultsLogPath(id));
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) {
        ADD_FAILURE() << id << ": results log line is not JSON: " << line;
        continue;
      }
      out[{j.value("trial_id", std::string()), j.value("attempt", 0)}] = j;
    }
    return out;
  }

  // The checks every fault test ends with, over the sweep's stored results:
  //  - the sweep is done and each of its trials is done with exactly one result (no duplicate,
  //    none missing);
  //  - every result an agent made (its results log) is stored, from that agent, and equal to
  //    what it sent: verdict, figures, every field. The only exceptions are attempts listed in
  //    `superseded` (trial ids whose lease was lost, so that attempt's result may be refused);
  //  - every stored result came from an agent's log, or was made by the coordinator;
  //  - every agent's spool is empty (all acknowledged), and the file passes integrity_check.
  // Returns the stored rows: trial id -> (attempt, agent id, status).
  struct StoredRow {
    int attempt = 0;
    std::string agent_id, status;
    nlohmann::json result;
  };
  std::map<std::string, StoredRow> ExpectEveryTrialStoredOnce(
      int64_t sweep_id, const std::vector<std::string>& agents,
      const std::set<std::string>& superseded = {}) {
    std::map<std::string, StoredRow> stored;
    RawDb db(db_);
    EXPECT_EQ(db.Query(absl::StrCat("SELECT state FROM sweeps WHERE sweep_id = ", sweep_id)),
              "done");
    EXPECT_EQ(db.Query("PRAGMA integrity_check"), "ok");
    const int64_t total = std::stoll(
        db.Query(absl::StrCat("SELECT trials_total FROM sweeps WHERE sweep_id = ", sweep_id)));
    EXPECT_EQ(std::stoll(db.Query(absl::StrCat(
                  "SELECT COUNT(*) FROM trials WHERE state = 'done' AND sweep_id = ", sweep_id))),
              total);
    for (const auto& row :
         db.Rows(absl::StrCat("SELECT trial_id, attempt, agent_id, status, hex(result_blob) FROM "
                              "results WHERE sweep_id = ",
                              sweep_id))) {
      EXPECT_EQ(stored.count(row[0]), 0u) << "two results for trial " << row[0];
      StoredRow& s = stored[row[0]];
      s.attempt = std::stoi(row[1]);
      s.agent_id = row[2];
      s.status = row[3];
      absl::StatusOr<std::string> text = DecompressResultJson(absl::HexStringToBytes(row[4]));
      if (text.ok())
        text = ExpandKernelLogRefs(*std::move(text), [&](int64_t id) {
          return db.Query(absl::StrCat("SELECT log FROM kernel_logs WHERE kernel_log_id = ", id));
        });
      EXPECT_TRUE(text.ok()) << row[0] << ": " << text.status();
      s.result = nlohmann::json::parse(text.value_or(""), nullptr, false);
    }
    EXPECT_EQ(static_cast<int64_t>(stored.size()), total);
    std::set<std::pair<std::string, int>> logged;
    for (const std::string& agent : agents) {
      for (const auto& [key, json] : LoggedResults(agent)) {
        logged.insert(key);
        auto it = stored.find(key.first);
        if (superseded.count(key.first) && (it == stored.end() || it->second.attempt != key.second))
          continue;
        if (it == stored.end()) {
          ADD_FAILURE() << "agent " << agent << " produced " << key.first << " attempt "
                        << key.second << " but nothing is stored for that trial";
          continue;
        }
        EXPECT_EQ(it->second.attempt, key.second) << key.first << " from " << agent;
        EXPECT_EQ(it->second.agent_id, agent) << key.first;
        EXPECT_EQ(it->second.result, json)
            << key.first << ": stored differs from what " << agent << " sent";
      }
      // The Ack of the last result may still be on its way.
      EXPECT_TRUE(WaitFor([&] { return Spooled(agent) == 0; }, 10))
          << agent << " still has unacknowledged results";
    }
    for (const auto& [trial, s] : stored) {
      if (s.agent_id.empty()) continue;
      EXPECT_TRUE(logged.count({trial, s.attempt}))
          << trial << " attempt " << s.attempt << " is stored as from " << s.agent_id
          << " but that agent never produced it";
    }
    return stored;
  }

  std::string Logs() {
    std::string out = "--- coordinator\n" + old_coordinator_output_;
    if (coordinator_) out += coordinator_->Output();
    for (auto& [id, p] : agents_)
      out += "--- agent " + id + "\n" + old_agent_output_[id] + p->Output();
    return out;
  }

  std::string dir_, db_;
  int port_ = 0;
  std::string address_;
  std::unique_ptr<ChildProcess> coordinator_;
  std::map<std::string, std::unique_ptr<ChildProcess>> agents_;
  std::string old_coordinator_output_;
  std::map<std::string, std::string> old_agent_output_;
};

// A small CPU sweep: tiny-moe with one layer, the matmul values `matmul` (a YAML list) times
// `repeats` trials, a short workload; `timeout_s` bounds each trial.
inline std::string CpuSweep(int repeats, const std::string& matmul = "[naive, blocked]",
                            int timeout_s = 60) {
  return absl::StrCat("name: fault\nmodel: preset:tiny-moe\nlayers: 1\n",
                      "matrix: {device: [cpu], matmul: ", matmul, "}\n",
                      "workload: {prompt: 8, output: 4, batch: [1], repeats: 1, warmup: 0, "
                      "timeout: ",
                      timeout_s, "}\nrepeats: ", repeats, "\n");
}

}  // namespace infersweep
