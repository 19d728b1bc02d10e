// The rank supervisor (harness/rank_supervisor.h) on the CPU, with real rank processes of this
// suite's `infersweep rank-worker`: every rank answers with its assignment; a rank that SIGKILLs
// itself mid-trial makes the trial CRASHED naming the rank; a hung rank makes it TIMEOUT naming
// the rank; and in every case no rank process is left (reaped, so kill(pid, 0) finds none).
#include "harness/rank_supervisor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cerrno>
#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "api/backend_config.h"
#include "harness/runner.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using testing::HasSubstr;

TrialRequest Request(const std::string& config, const std::string& fault) {
  TrialRequest r;
  r.trial_id = "ranks";
  r.model = "preset:tiny-dense";
  r.layers = 2;
  r.config = *ParseBackendConfig(config);
  r.workload.prompt_len = 8;
  r.workload.output_len = 4;
  r.workload.repeats = 1;
  r.workload.warmup = 0;
  r.workload.batch_sizes = {1};
  r.workload.timeout_s = 60;
  r.inject_fault = fault;
  return r;
}

RankSupervisorOptions Options() {
  RankSupervisorOptions o;
  o.rank_argv = {WorkerBinary(), "rank-worker"};
  return o;
}

// Every rank process is gone: reaped, so no zombie answers kill(pid, 0) either.
void ExpectNoRankLeft(const SupervisedTrial& t) {
  for (const RankRun& r : t.ranks) {
    ASSERT_GT(r.pid, 0) << "rank " << r.rank;
    errno = 0;
    EXPECT_EQ(kill(r.pid, 0), -1) << "rank " << r.rank << " (pid " << r.pid << ") is still there";
    EXPECT_EQ(errno, ESRCH) << "rank " << r.rank;
  }
}

TEST(RankSupervisor, EveryRankAnswersWithItsAssignment) {
  const SupervisedTrial t = RunRankTrial(Request("device=cpu", ""), 2, "0a1b2c", Options());
  EXPECT_EQ(t.result.status, TrialStatus::kOk) << t.result.reason << "\n" << t.result.stderr_tail;
  ASSERT_EQ(t.ranks.size(), 2u);
  for (const RankRun& r : t.ranks) {
    EXPECT_EQ(r.ended, "answered") << "rank " << r.rank;
    EXPECT_THAT(r.stderr_tail, HasSubstr(absl::StrCat("rank ", r.rank, "/2: handshake '0a1b2c'")));
  }
  ExpectNoRankLeft(t);
}

TEST(RankSupervisor, AKilledRankIsCrashedNamingItAndNoRankIsLeft) {
  const SupervisedTrial t = RunRankTrial(Request("device=cpu", "rank-kill:1"), 2, "", Options());
  EXPECT_EQ(t.result.status, TrialStatus::kCrashed) << t.result.reason;
  EXPECT_THAT(t.result.reason, HasSubstr("rank 1 killed by signal 9 (SIGKILL"));
  ASSERT_EQ(t.ranks.size(), 2u);
  EXPECT_THAT(t.ranks[1].ended, HasSubstr("rank 1 killed by signal 9"));
  ExpectNoRankLeft(t);
}

TEST(RankSupervisor, AHungRankIsTimeoutNamingItAndNoRankIsLeft) {
  TrialRequest request = Request("device=cpu", "rank-hang:1");
  request.workload.timeout_s = 4;
  const auto start = std::chrono::steady_clock::now();
  const SupervisedTrial t = RunRankTrial(request, 3, "", Options());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(t.result.status, TrialStatus::kTimeout) << t.result.reason;
  EXPECT_THAT(t.result.reason, HasSubstr("no result from rank 1 within 4 s"));
  ASSERT_EQ(t.ranks.size(), 3u);
  EXPECT_EQ(t.ranks[0].ended, "answered");
  EXPECT_EQ(t.ranks[2].ended, "answered");
  EXPECT_EQ(t.ranks[1].ended, "killed (SIGKILL) at the timeout");
  ExpectNoRankLeft(t);
}

// Through the trial runner, as `run` and the agent call it: a rank fault puts the trial (here the
// CPU's tp=2) over tp rank processes, and the runner serves the next trial after it.
TEST(RankSupervisor, TheRunnerSupervisesRankFaults) {
  EXPECT_EQ(RankProcesses(Request("device=cpu,tp=2", "")), 0);
  EXPECT_EQ(RankProcesses(Request("device=cpu,tp=2", "rank-kill:1")), 2);
  EXPECT_EQ(RankProcesses(Request("device=cuda,tp=4", "")), 0);  // refused by one worker
  EXPECT_EQ(RankProcesses(Request("device=cuda", "")), 0);
  RunnerOptions options;
  options.worker_argv = {WorkerBinary(), "worker"};
  TrialRunner runner(options);
  const TrialResult killed = runner.Run(Request("device=cpu,tp=2", "rank-kill:1"));
  EXPECT_EQ(killed.status, TrialStatus::kCrashed) << killed.reason;
  EXPECT_THAT(killed.reason, HasSubstr("rank 1 killed by signal 9"));
  const TrialResult ok = runner.Run(Request("device=cpu,tp=2", ""));
  EXPECT_EQ(ok.status, TrialStatus::kOk) << ok.reason;
}

}  // namespace
}  // namespace infersweep
