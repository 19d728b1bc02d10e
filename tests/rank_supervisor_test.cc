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
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/backend_config.h"
#include "api/serve_spec.h"
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

// A serving trial over rank processes: a rank killed mid-serve is CRASHED naming it, a rank that
// hangs in a ragged step is TIMEOUT naming it, and no rank process is left either way; without
// a fault the ranks serve and judge the same steps, and rank 0's result is OK.
TEST(RankSupervisor, ARankThatDiesOrHangsMidServeIsNamed) {
  auto serving = [](const std::string& fault) {
    TrialRequest r = Request("device=cpu,tp=2", fault);
    auto spec = ParseServeSpec("concurrency=3,isl=6-12,osl=3-6,requests=4");
    EXPECT_TRUE(spec.ok()) << spec.status();
    r.workload.serve = *spec;
    r.workload.timeout_s = 6;
    return r;
  };
  const SupervisedTrial ok = RunRankTrial(serving(""), 2, "", Options());
  EXPECT_EQ(ok.result.status, TrialStatus::kOk) << ok.result.reason << ok.result.stderr_tail;
  ASSERT_FALSE(ok.result.serving.empty());
  EXPECT_EQ(ok.result.serving[0].verdict, TrialStatus::kOk);
  EXPECT_EQ(ok.result.serving[0].completed, 4);
  ExpectNoRankLeft(ok);
  const SupervisedTrial killed = RunRankTrial(serving("rank-kill:1"), 2, "", Options());
  EXPECT_EQ(killed.result.status, TrialStatus::kCrashed) << killed.result.reason;
  EXPECT_THAT(killed.result.reason, HasSubstr("rank 1 killed by signal 9 (SIGKILL"));
  ExpectNoRankLeft(killed);
  const SupervisedTrial hung = RunRankTrial(serving("rank-hang:1"), 2, "", Options());
  EXPECT_EQ(hung.result.status, TrialStatus::kTimeout) << hung.result.reason;
  EXPECT_THAT(hung.result.reason, HasSubstr("no result from rank 1 within 6 s"));
  ExpectNoRankLeft(hung);
}

// `logits` and `generate` as rank processes (how the CLI runs a CUDA config with tp > 1): each
// rank joins through its assignment and answers; rank 0 alone writes the command's output (the
// .npy, the tokens line into --rank-output), the same bytes the command writes in one process.
TEST(RankSupervisor, EngineCommandsRunAsRanks) {
  const std::string dir = MakeTempDir("infersweep-rank-cli");
  ASSERT_FALSE(dir.empty());
  const std::string model_args =
      " --model preset:tiny-moe --backend cpu --config tp=2 --tokens 3,1,4,1,5,9";
  int rc = 0;
  RunCommand(WorkerBinary() + " logits" + model_args + " --out " + dir + "/one.npy 2>&1", &rc);
  ASSERT_EQ(rc, 0);
  const std::string tokens =
      RunCommand(WorkerBinary() + " generate" + model_args + " --max-new-tokens 5", &rc);
  ASSERT_EQ(rc, 0);
  for (const std::string command : {"logits", "generate"}) {
    RankSupervisorOptions options;
    options.rank_argv = {WorkerBinary(),    command,         "--model",
                         "preset:tiny-moe", "--backend",     "cpu",
                         "--config",        "tp=2",          "--tokens",
                         "3,1,4,1,5,9",     "--rank-output", dir + "/" + command + ".out"};
    if (command == "logits")
      options.rank_argv.insert(options.rank_argv.end(), {"--out", dir + "/ranks.npy"});
    else
      options.rank_argv.insert(options.rank_argv.end(), {"--max-new-tokens", "5"});
    const SupervisedTrial t = RunRankTrial(Request("device=cpu,tp=2", ""), 2, "", options);
    EXPECT_EQ(t.result.status, TrialStatus::kOk) << command << ": " << t.result.reason;
    ExpectNoRankLeft(t);
  }
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_FALSE(read(dir + "/one.npy").empty());
  EXPECT_EQ(read(dir + "/ranks.npy"), read(dir + "/one.npy"));
  EXPECT_EQ(read(dir + "/generate.out"), tokens);
  EXPECT_THAT(tokens, testing::StartsWith("{\"tokens\":["));
  std::filesystem::remove_all(dir);
}

// CUDA configs with tp > 1 run one rank process a GPU; tp=1 and the CPU's tp (threads of one
// worker) run in one worker.
TEST(RankSupervisor, CudaTensorParallelTrialsTakeOneProcessARank) {
  EXPECT_EQ(RankProcesses(Request("device=cuda,tp=2", "")), 2);
  EXPECT_EQ(RankProcesses(Request("device=cuda,tp=4,allreduce=custom", "")), 4);
  EXPECT_EQ(RankProcesses(Request("device=cuda,tp=8,allreduce=nccl", "")), 8);
  EXPECT_EQ(RankProcesses(Request("device=cuda,tp=1,allreduce=custom", "")), 0);
  EXPECT_EQ(RankProcesses(Request("device=cpu,tp=4", "")), 0);
}

// Stand-in rank processes (sh): each reads its assignment and, per `script`, exchanges a line
// through the supervisor or answers. $r is the rank.
RankSupervisorOptions StandIns(const std::string& script) {
  RankSupervisorOptions o;
  o.rank_argv = {
      "/bin/sh", "-c",
      R"(read -r a; r=$(printf '%s' "$a" | sed 's/.*"rank":\([0-9]*\),"ranks".*/\1/'); )" + script};
  return o;
}

// The two-phase exchange: every rank's line reaches every rank, in rank order, only once all
// ranks have sent theirs; then the ranks answer.
TEST(RankSupervisor, EveryRankGetsEveryRanksExchangeLineInRankOrder) {
  const SupervisedTrial t =
      RunRankTrial(Request("device=cpu", ""), 3, "",
                   StandIns(R"(printf '{"exchange":"handle-%s"}\n' "$r"; read -r all; )"
                            R"(printf '{"status":"OK","reason":"rank %s got %s"}\n' "$r" )"
                            R"sh("$(printf '%s' "$all" | tr -d '"')"; read -r rest)sh"));
  EXPECT_EQ(t.result.status, TrialStatus::kOk) << t.result.reason << "\n" << t.result.stderr_tail;
  EXPECT_EQ(t.result.reason, "rank 0 got {exchange:[handle-0,handle-1,handle-2]}");
  ASSERT_EQ(t.ranks.size(), 3u);
  for (const RankRun& r : t.ranks) EXPECT_EQ(r.ended, "answered") << "rank " << r.rank;
  ExpectNoRankLeft(t);
}

// A rank that fails instead of joining ends the trial with its answer at once: the rank waiting
// in the exchange is killed, not left to the timeout.
TEST(RankSupervisor, ARankThatFailsBeforeTheExchangeEndsTheTrialNamingIt) {
  TrialRequest request = Request("device=cpu", "");
  request.workload.timeout_s = 30;
  const auto start = std::chrono::steady_clock::now();
  const SupervisedTrial t = RunRankTrial(
      request, 2, "",
      StandIns(R"(if [ "$r" = 1 ]; then )"
               R"(printf '{"status":"ERROR","reason":"no peer buffer"}\n'; read -r rest; )"
               R"(else printf '{"exchange":"h"}\n'; read -r all; fi)"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  EXPECT_EQ(t.result.status, TrialStatus::kError) << t.result.reason;
  EXPECT_EQ(t.result.reason, "rank 1: no peer buffer");
  ASSERT_EQ(t.ranks.size(), 2u);
  EXPECT_EQ(t.ranks[0].ended, "killed (SIGKILL) after rank 1 answered ERROR");
  EXPECT_EQ(t.ranks[1].ended, "answered");
  ExpectNoRankLeft(t);
}

std::string Line(const std::string& json) { return json + "\n"; }

// The rank side of a round: its line out, every rank's back; a parent that hangs up or answers
// with the wrong count is an error, not a short list.
TEST(RankSupervisor, ARankReadsTheExchangeItsParentSends) {
  std::istringstream in(Line(R"({"exchange":["00ff","a1"]})"));
  std::ostringstream out;
  auto lines = ExchangeThroughParent(in, out, 2, "a1");
  ASSERT_TRUE(lines.ok()) << lines.status();
  EXPECT_EQ(*lines, (std::vector<std::string>{"00ff", "a1"}));
  EXPECT_EQ(out.str(), Line(R"({"exchange":"a1"})"));

  std::istringstream three(Line(R"({"exchange":["a","b","c"]})"));
  EXPECT_TRUE(absl::IsInvalidArgument(ExchangeThroughParent(three, out, 2, "a").status()));
  std::istringstream number(Line(R"({"exchange":["a",7]})"));
  EXPECT_TRUE(absl::IsInvalidArgument(ExchangeThroughParent(number, out, 2, "a").status()));
  std::istringstream closed("");
  EXPECT_TRUE(absl::IsUnavailable(ExchangeThroughParent(closed, out, 2, "a").status()));
}

}  // namespace
}  // namespace infersweep
