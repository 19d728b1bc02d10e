// Faults on a real fleet: `infersweep coordinator` and `infersweep agent` processes on loopback
// gRPC with a real SQLite file. Each test breaks something (an agent or the coordinator killed
// outright, a network partition, a locked database, a full disk), lets the fleet recover, and
// ends with tests/fleet_process.h's check: every trial exactly one result, no duplicate, every
// result an agent produced stored unchanged, every spool drained. docs/RELIABILITY.md explains
// what each one proves.
#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "coordinator/client.h"
#include "tests/fleet_process.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;

class FaultTest : public FleetProcesses {
 protected:
  int64_t ConnectedAgents() { return DbCount("SELECT COUNT(*) FROM agents WHERE connected = 1"); }
  int64_t Results(int64_t sweep) {
    return DbCount(absl::StrCat("SELECT COUNT(*) FROM results WHERE sweep_id = ", sweep));
  }
  int64_t Leased() { return DbCount("SELECT COUNT(*) FROM trials WHERE state = 'leased'"); }
  // The trial leased to `agent` now, once there is one ("" after `seconds`).
  std::string WaitLeasedTo(const std::string& agent, int attempt, double seconds) {
    std::string trial;
    WaitFor(
        [&] {
          RawDb db(db_);
          trial =
              db.Query(absl::StrCat("SELECT trial_id FROM trials WHERE state = 'leased' AND "
                                    "leased_to = '",
                                    agent, "' AND attempt = ", attempt));
          return !trial.empty();
        },
        seconds);
    return trial;
  }
  // Waits until `agent` says it runs `trial` attempt `attempt`: its Assignment arrived.
  bool WaitRunning(ChildProcess* agent, const std::string& trial, int attempt, double seconds) {
    const std::string line = absl::StrCat("running ", trial, " attempt ", attempt, " ");
    return WaitFor([&] { return agent->Output().find(line) != std::string::npos; }, seconds);
  }
  // True when some trial is leased and its agent says it runs it (so it will finish even if the
  // coordinator goes away now).
  bool SomeLeasedTrialRuns() {
    RawDb db(db_);
    for (const auto& t :
         db.Rows("SELECT trial_id, attempt, leased_to FROM trials WHERE state = 'leased'")) {
      auto agent = agents_.find(t[2]);
      if (agent != agents_.end() && WaitRunning(agent->second.get(), t[0], std::stoi(t[1]), 0))
        return true;
    }
    return false;
  }
  // A user call made while the database cannot be written is refused with `code` and `needle`.
  void ExpectSubmitRefused(absl::StatusCode code, const std::string& needle) {
    ServiceClient client(address_, 10'000);
    auto refused = client.SubmitSweep(CpuSweep(1), "refused.yaml");
    EXPECT_EQ(refused.status().code(), code) << refused.status();
    EXPECT_THAT(refused.status().message(), HasSubstr(needle));
  }
  // The two running trials end while the database cannot be written: both results are refused
  // as retryable (the coordinator says `reason`), both agents keep them to send again, nothing
  // more is stored and the file is intact.
  void ExpectResultsRefusedAndKept(int64_t sweep, int64_t results, const std::string& reason) {
    ASSERT_TRUE(WaitFor(
        [&] {
          const std::string out = Logs();
          return Count(out, "failed (the agent") >= 2 && Count(out, "sending it again") >= 2;
        },
        30))
        << Logs();
    EXPECT_THAT(coordinator_->Output(), HasSubstr(reason));
    EXPECT_EQ(Results(sweep), results);
    RawDb check(db_);
    EXPECT_EQ(check.Query("PRAGMA integrity_check"), "ok");
  }
  // Once the database can be written again: every result lands once, the refused submit left
  // nothing, and the coordinator is still the one that ran through the fault.
  void ExpectRecovered(int64_t sweep, const std::vector<std::string>& agents) {
    ASSERT_TRUE(WaitSweepDone(sweep, 60)) << Logs();
    ExpectEveryTrialStoredOnce(sweep, agents);
    EXPECT_EQ(DbCount("SELECT COUNT(*) FROM sweeps"), 1) << "the refused submit stored something";
    EXPECT_TRUE(coordinator_->running());
  }
  static int Count(const std::string& text, const std::string& needle) {
    int n = 0;
    for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1))
      ++n;
    return n;
  }
};

// An agent killed with SIGKILL in the middle of a trial (its worker hangs in the first forward,
// so the kill is certainly mid-trial): nobody renews the lease, it expires after --lease-s, the
// trial is requeued as attempt 2 and another agent completes it.
TEST_F(FaultTest, AgentKilledMidTrialIsRequeuedAndCompletedByAnotherAgent) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({"--lease-s", "3", "--max-attempts", "3"}));
  ChildProcess* doomed = StartAgent("doomed", {"--test-inject-fault", "hang"});
  ASSERT_TRUE(WaitFor([&] { return ConnectedAgents() == 1; }, 20)) << Logs();
  const int64_t sweep = Submit(CpuSweep(2));
  const std::string hung = WaitLeasedTo("doomed", 1, 20);
  ASSERT_FALSE(hung.empty()) << Logs();
  StartAgent("rescuer");
  ASSERT_TRUE(WaitFor([&] { return ConnectedAgents() == 2; }, 20)) << Logs();
  ASSERT_TRUE(WaitRunning(doomed, hung, 1, 20)) << Logs();

  doomed->KillGroup(SIGKILL);
  ASSERT_TRUE(doomed->WaitExit(10));

  ASSERT_TRUE(WaitSweepDone(sweep, 60)) << Logs();
  auto stored = ExpectEveryTrialStoredOnce(sweep, {"doomed", "rescuer"});
  ASSERT_TRUE(stored.count(hung));
  EXPECT_EQ(stored[hung].attempt, 2);
  EXPECT_EQ(stored[hung].agent_id, "rescuer");
  EXPECT_EQ(stored[hung].status, "OK");
  EXPECT_TRUE(LoggedResults("doomed").empty());
  EXPECT_THAT(coordinator_->Output(),
              HasSubstr(absl::StrCat("trial ", hung, " attempt 1 lost (expired")));
}

// A trial whose every attempt dies with its agent is not retried forever: after --max-attempts
// lost leases it is stored once, as ERROR "lease lost N times", and the sweep completes.
TEST_F(FaultTest, TrialLostOnEveryAttemptIsStoredAsErrorAtTheAttemptCap) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({"--lease-s", "2", "--max-attempts", "2"}));
  const int64_t sweep = Submit(CpuSweep(1, "[naive]"));
  std::string trial;
  for (int attempt = 1; attempt <= 2; ++attempt) {
    const std::string id = absl::StrCat("doomed-", attempt);
    ChildProcess* agent = StartAgent(id, {"--test-inject-fault", "hang"});
    trial = WaitLeasedTo(id, attempt, 30);
    ASSERT_FALSE(trial.empty()) << Logs();
    ASSERT_TRUE(WaitRunning(agent, trial, attempt, 20)) << Logs();
    agent->KillGroup(SIGKILL);
    ASSERT_TRUE(agent->WaitExit(10));
  }
  ASSERT_TRUE(WaitSweepDone(sweep, 30)) << Logs();
  auto stored = ExpectEveryTrialStoredOnce(sweep, {"doomed-1", "doomed-2"});
  ASSERT_TRUE(stored.count(trial));
  EXPECT_EQ(stored[trial].status, "ERROR");
  EXPECT_EQ(stored[trial].attempt, 2);
  EXPECT_EQ(stored[trial].agent_id, "");
  EXPECT_THAT(stored[trial].result.value("reason", ""), HasSubstr("lease lost 2 times"));
  EXPECT_THAT(stored[trial].result.value("reason", ""), HasSubstr("doomed-2"));
  EXPECT_EQ(DbCount("SELECT attempt FROM trials WHERE trial_id = '" + trial + "'"), 2);
}

// The coordinator killed with SIGKILL in the middle of a sweep and restarted on the same
// database and port: the agents reconnect, replay what they finished meanwhile, and the sweep
// completes with every result stored before the crash still there, once.
TEST_F(FaultTest, CoordinatorKilledMidSweepRestartsWithoutLossOrDuplicates) {
  const std::vector<std::string> flags = {"--lease-s", "20"};
  ASSERT_NO_FATAL_FAILURE(StartCoordinator(flags));
  for (const char* id : {"a1", "a2"}) StartAgent(id, {"--test-inject-fault", "delay:0.4"});
  ASSERT_TRUE(WaitFor([&] { return ConnectedAgents() == 2; }, 20)) << Logs();
  const int64_t sweep = Submit(CpuSweep(5));  // 10 trials
  ASSERT_TRUE(WaitFor([&] { return Results(sweep) >= 3 && SomeLeasedTrialRuns(); }, 60)) << Logs();
  ASSERT_LT(Results(sweep), 10) << "the sweep ended before the crash";

  coordinator_->KillGroup(SIGKILL);
  ASSERT_TRUE(coordinator_->WaitExit(10));
  RawDb before(db_);
  const auto stored_before =
      before.Rows(absl::StrCat("SELECT trial_id, attempt FROM results WHERE sweep_id = ", sweep));
  // Results finished while it is down wait in the agents' spools.
  ASSERT_TRUE(WaitFor([&] { return Spooled("a1") + Spooled("a2") >= 1; }, 30)) << Logs();

  ASSERT_NO_FATAL_FAILURE(StartCoordinator(flags, port_));
  ASSERT_TRUE(WaitSweepDone(sweep, 60)) << Logs();
  auto stored = ExpectEveryTrialStoredOnce(sweep, {"a1", "a2"});
  for (const auto& row : stored_before) {
    ASSERT_TRUE(stored.count(row[0])) << row[0];
    EXPECT_EQ(stored[row[0]].attempt, std::stoi(row[1])) << row[0] << " was stored again";
  }
  EXPECT_THAT(Logs(), HasSubstr("replaying"));  // a spool was replayed
}

// An agent cut off from the coordinator (a proxy between them resets every connection and
// refuses new ones) keeps running its trial, spools the result, reconnects when the network
// comes back and delivers it: complete, no duplicate.
TEST_F(FaultTest, PartitionedAgentSpoolsAndCatchesUp) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({"--lease-s", "20"}));
  TcpProxy proxy(port_);
  ASSERT_GT(proxy.port(), 0);
  StartAgent("far", {"--test-inject-fault", "delay:1"}, absl::StrCat("127.0.0.1:", proxy.port()));
  const int64_t sweep = Submit(CpuSweep(2));  // 4 trials of about 1 s, one at a time
  ASSERT_TRUE(WaitFor([&] { return Results(sweep) >= 1; }, 60)) << Logs();
  // Cut while the agent is running a trial (its Assignment arrived).
  ASSERT_TRUE(WaitFor([&] { return SomeLeasedTrialRuns(); }, 30)) << Logs();

  proxy.Cut();
  ASSERT_TRUE(WaitFor([&] { return ConnectedAgents() == 0; }, 20)) << Logs();
  const int64_t during = Results(sweep);
  // The running trial ends while the agent is cut off: its result waits in the spool.
  ASSERT_TRUE(WaitFor([&] { return Spooled("far") >= 1; }, 30)) << Logs();
  EXPECT_EQ(Results(sweep), during);

  proxy.Restore();
  ASSERT_TRUE(WaitSweepDone(sweep, 60)) << Logs();
  ExpectEveryTrialStoredOnce(sweep, {"far"});
  EXPECT_GE(Count(agents_["far"]->Output(), "connected to "), 2) << Logs();
}

// Another connection holds the database's write lock (BEGIN EXCLUSIVE): the coordinator's
// writes fail after --db-busy-timeout-ms with a clear error, a user call gets UNAVAILABLE, the
// agents' results are refused as retryable and stay in their spools; nothing is corrupted, and
// once the lock is released every result lands exactly once.
TEST_F(FaultTest, LockedDatabaseIsRetryableAndResultsLandOnceAfterRelease) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({"--lease-s", "30", "--db-busy-timeout-ms", "100"}));
  for (const char* id : {"b1", "b2"}) StartAgent(id, {"--test-inject-fault", "delay:1.5"});
  const int64_t sweep = Submit(CpuSweep(2));
  ASSERT_TRUE(WaitFor([&] { return Leased() == 2; }, 60)) << Logs();
  {
    RawDb locker(db_);
    ASSERT_EQ(locker.Exec("BEGIN EXCLUSIVE"), SQLITE_OK);
    const int64_t results = Results(sweep);
    ExpectSubmitRefused(absl::StatusCode::kUnavailable, "database is busy");
    ASSERT_NO_FATAL_FAILURE(ExpectResultsRefusedAndKept(sweep, results, "database is busy"));
    ASSERT_EQ(locker.Exec("COMMIT"), SQLITE_OK);
  }
  ExpectRecovered(sweep, {"b1", "b2"});
}

// The disk fills up under the coordinator. Its file size limit, RLIMIT_FSIZE, is lowered to the
// size of a write-ahead-log header (32 bytes), so the kernel refuses every page write with EFBIG
// as a full disk refuses new blocks with ENOSPC. (A limit at the log's current size would not
// do: the background checkpointer lets the log restart from its start, within the file.) Its
// writes fail with "disk full", a user call gets RESOURCE_EXHAUSTED, the results stay spooled;
// the daemon survives, the file stays intact, and when space comes back (the limit is lifted)
// every result lands once.
TEST_F(FaultTest, FullDiskIsRetryableAndResultsLandOnceWhenSpaceReturns) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({"--lease-s", "30"}));
  for (const char* id : {"f1", "f2"}) StartAgent(id, {"--test-inject-fault", "delay:1.5"});
  const int64_t sweep = Submit(CpuSweep(2));
  ASSERT_TRUE(WaitFor([&] { return Leased() == 2; }, 60)) << Logs();

  ASSERT_TRUE(std::filesystem::exists(db_ + "-wal"));
  constexpr rlim_t kWalHeaderBytes = 32;
  rlimit full{kWalHeaderBytes, RLIM_INFINITY};
  ASSERT_EQ(prlimit(coordinator_->pid(), RLIMIT_FSIZE, &full, nullptr), 0) << strerror(errno);
  const int64_t results = Results(sweep);
  ExpectSubmitRefused(absl::StatusCode::kResourceExhausted, "disk full");
  ASSERT_NO_FATAL_FAILURE(ExpectResultsRefusedAndKept(sweep, results, "disk full"));

  rlimit roomy{RLIM_INFINITY, RLIM_INFINITY};
  ASSERT_EQ(prlimit(coordinator_->pid(), RLIMIT_FSIZE, &roomy, nullptr), 0) << strerror(errno);
  ExpectRecovered(sweep, {"f1", "f2"});
}

}  // namespace
}  // namespace infersweep
