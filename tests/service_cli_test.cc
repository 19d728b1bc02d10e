// The service commands as a user runs them: `infersweep` processes (submit, status, results,
// best, compare, the coordinator and the agent) against a real coordinator process on loopback
// with a SQLite file (tests/fleet_process.h). What each test holds is in its comment.
#include <sys/stat.h>
#include <sys/wait.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coordinator/sweep_spec.h"
#include "tests/fleet_process.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class Cli : public FleetProcesses {
 protected:
  // Writes `text` to dir_/name and returns the path.
  std::string WriteFile(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  // Runs `infersweep ARGS` to the end; returns stdout and stderr together.
  static std::string Run(const std::string& args, int* rc) {
    return RunCommand(absl::StrCat("'", WorkerBinary(), "' ", args, " 2>&1"), rc);
  }
  int64_t ConnectedAgents() { return DbCount("SELECT COUNT(*) FROM agents WHERE connected = 1"); }
  int64_t Results() { return DbCount("SELECT COUNT(*) FROM results"); }
  // `infersweep submit SPEC --wait` against address_, with `flags`, as a child process; returns
  // once it printed the sweep id.
  std::unique_ptr<ChildProcess> StartSubmitWait(const std::string& spec,
                                                const std::vector<std::string>& flags = {}) {
    std::vector<std::string> argv = {WorkerBinary(), "submit",        spec,
                                     "--wait",       "--coordinator", address_};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto submit = ChildProcess::Start(argv);
    EXPECT_NE(submit, nullptr);
    if (submit == nullptr) return nullptr;
    EXPECT_TRUE(
        WaitFor([&] { return submit->Output().find("trial(s) queued") != std::string::npos; }, 20))
        << submit->Output();
    return submit;
  }
  static bool ExitedWith(int status, int code) {
    return WIFEXITED(status) && WEXITSTATUS(status) == code;
  }
};

// `submit --wait` keeps waiting while the coordinator restarts: it says once that the
// connection is lost and once that it is back, and exits 0 when the sweep is done. The
// coordinator is killed outright mid-sweep and restarted on the same port and database; a CPU
// agent finishes the sweep.
TEST_F(Cli, SubmitWaitSurvivesACoordinatorRestart) {
  const std::vector<std::string> flags = {"--lease-s", "20"};
  ASSERT_NO_FATAL_FAILURE(StartCoordinator(flags));
  StartAgent("cpu1", {"--test-inject-fault", "delay:0.5"});
  ASSERT_TRUE(WaitFor([&] { return ConnectedAgents() == 1; }, 20)) << Logs();
  auto submit = StartSubmitWait(WriteFile("wait.yaml", CpuSweep(3)));  // 6 trials
  ASSERT_NE(submit, nullptr);
  ASSERT_TRUE(WaitFor([&] { return Results() >= 1; }, 60)) << Logs();
  ASSERT_LT(Results(), 6) << "the sweep ended before the restart";

  coordinator_->KillGroup(SIGKILL);
  ASSERT_TRUE(coordinator_->WaitExit(10));
  // The watcher polls every 500 ms: this is long enough for it to have failed a few times.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  ASSERT_TRUE(submit->running()) << "submit --wait gave up while the coordinator was down:\n"
                                 << submit->Output();
  ASSERT_NO_FATAL_FAILURE(StartCoordinator(flags, port_));

  int status = 0;
  ASSERT_TRUE(submit->WaitExit(90, &status)) << submit->Output() << Logs();
  const std::string out = submit->Output();
  EXPECT_TRUE(ExitedWith(status, 0)) << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("lost the connection to the coordinator at ", address_)));
  EXPECT_THAT(out,
              HasSubstr(absl::StrCat("connection to the coordinator at ", address_, " is back")));
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n') < 40, true) << "one line per retry?\n" << out;
  EXPECT_THAT(out, HasSubstr("6/6 done"));
  ASSERT_TRUE(WaitSweepDone(1, 10));
}

// A coordinator that stays away: after --wait-retry-s the watcher gives up with a message
// naming the coordinator and the sweep, and exits 1.
TEST_F(Cli, SubmitWaitGivesUpAfterItsRetryBudget) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({}));
  auto submit = StartSubmitWait(WriteFile("wait.yaml", CpuSweep(1)), {"--wait-retry-s", "2"});
  ASSERT_NE(submit, nullptr);
  coordinator_->KillGroup(SIGKILL);
  ASSERT_TRUE(coordinator_->WaitExit(10));
  int status = 0;
  ASSERT_TRUE(submit->WaitExit(20, &status)) << submit->Output();
  const std::string out = submit->Output();
  EXPECT_TRUE(ExitedWith(status, 1)) << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("the coordinator at ", address_)));
  EXPECT_THAT(out, HasSubstr("sweep 1"));
  EXPECT_THAT(out, HasSubstr("2 s"));
}

// An error that retrying cannot fix ends the wait at once: the coordinator comes back requiring
// a user token this client does not have (UNAUTHENTICATED).
TEST_F(Cli, SubmitWaitFailsAtOnceOnANonTransientError) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({}));
  auto submit = StartSubmitWait(WriteFile("wait.yaml", CpuSweep(1)));
  ASSERT_NE(submit, nullptr);
  coordinator_->KillGroup(SIGKILL);
  ASSERT_TRUE(coordinator_->WaitExit(10));
  const std::string token = WriteFile("user.token", "a-user-token\n");
  ASSERT_EQ(chmod(token.c_str(), 0600), 0);
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({"--user-token-file", token}, port_));
  int status = 0;
  // Well inside the default 120 s retry budget.
  ASSERT_TRUE(submit->WaitExit(20, &status)) << submit->Output();
  EXPECT_TRUE(ExitedWith(status, 1)) << submit->Output();
  EXPECT_THAT(submit->Output(), HasSubstr("missing or invalid credentials"));
}

// Every log line of the coordinator and of the agent starts with an RFC 3339 UTC timestamp with
// milliseconds, then the process's tag; the only other lines are the '#' banners on stdout.
TEST_F(Cli, LogLinesStartWithAnRfc3339UtcTimestamp) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({}));
  ChildProcess* agent = StartAgent("cpu1");
  ASSERT_TRUE(WaitFor([&] { return ConnectedAgents() == 1; }, 20)) << Logs();
  const int64_t sweep = Submit(CpuSweep(1, "[naive]"));
  ASSERT_TRUE(WaitSweepDone(sweep, 60)) << Logs();
  agent->Signal(SIGTERM);
  ASSERT_TRUE(agent->WaitExit(20)) << agent->Output();
  coordinator_->Signal(SIGTERM);
  ASSERT_TRUE(coordinator_->WaitExit(20)) << coordinator_->Output();

  const std::regex stamped(R"(^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) \[([a-z]+[^\]]*)\] .+)");
  auto check = [&](const std::string& output, const std::string& tag, int min_lines) {
    int stamped_lines = 0;
    for (absl::string_view line : absl::StrSplit(output, '\n', absl::SkipEmpty())) {
      const std::string text(line);
      if (text.rfind("# ", 0) == 0) continue;  // the banner on stdout
      std::smatch m;
      if (!std::regex_match(text, m, stamped)) {
        ADD_FAILURE() << tag << " line without a timestamp: " << text;
        continue;
      }
      EXPECT_EQ(m[2].str(), tag) << text;
      absl::Time t;
      std::string err;
      ASSERT_TRUE(absl::ParseTime(absl::RFC3339_full, m[1].str(), &t, &err)) << text << ": " << err;
      // UTC: within a few minutes of now whatever the machine's time zone.
      EXPECT_LT(absl::AbsDuration(absl::Now() - t), absl::Minutes(5)) << text;
      ++stamped_lines;
    }
    EXPECT_GE(stamped_lines, min_lines) << output;
  };
  check(coordinator_->Output(), "coordinator", 4);  // listening, connected, submitted, stopping
  check(agent->Output(), "agent cpu1", 4);          // connected, running, result, stopping
}

// A spec over the size limit is refused by `submit` itself, before anything is sent (no
// coordinator listens here), with the documented message and the usage exit code 2.
TEST_F(Cli, SpecOverTheSizeLimitIsRefusedBeforeSending) {
  for (const size_t size : {kMaxSweepSpecBytes + 1, size_t{4} * 1024 * 1024 + 1}) {
    std::string yaml = CpuSweep(1) + "# ";
    yaml.resize(size - 1, 'x');
    yaml += '\n';
    ASSERT_EQ(yaml.size(), size);
    const std::string path = WriteFile(absl::StrCat("big-", size, ".yaml"), yaml);
    int rc = 0;
    const std::string out = Run(absl::StrCat("submit '", path, "' --coordinator 127.0.0.1:1"), &rc);
    EXPECT_EQ(rc, 2) << out;
    EXPECT_THAT(out, HasSubstr(absl::StrCat(path, ": spec is ", size, " bytes; the limit is ",
                                            kMaxSweepSpecBytes)));
  }
  // At the limit it is sent (and here fails to connect, which is not a usage error).
  std::string yaml = CpuSweep(1) + "# ";
  yaml.resize(kMaxSweepSpecBytes - 1, 'x');
  yaml += '\n';
  int rc = 0;
  const std::string out = Run(
      absl::StrCat("submit '", WriteFile("edge.yaml", yaml), "' --coordinator 127.0.0.1:1"), &rc);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_THAT(out, Not(HasSubstr("the limit is")));
}

// `results --limit` outside 1..10000 is a usage error, not "everything" or a silent cap; the
// help gives the range.
TEST_F(Cli, ResultsLimitOutsideItsRangeIsAUsageError) {
  for (const char* limit : {"0", "-5", "10001"}) {
    int rc = 0;
    const std::string out =
        Run(absl::StrCat("results --limit ", limit, " --coordinator 127.0.0.1:1"), &rc);
    EXPECT_EQ(rc, 2) << out;
    EXPECT_THAT(out, HasSubstr(absl::StrCat("--limit ", limit, ": must lie in [1, 10000]"))) << out;
  }
  int rc = 0;
  EXPECT_THAT(Run("results --help", &rc), HasSubstr("1 to 10000"));
}

// Every bounded flag of the query commands is checked before the coordinator is asked (none
// listens here): exit 2 and an error naming the flag and its range. The bounds are the
// coordinator's (tests/service_bad_input_test.cc holds it to them).
TEST_F(Cli, QueryFlagsOutsideTheirRangeAreUsageErrors) {
  const std::string at = " --coordinator 127.0.0.1:1";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"best --model preset:tiny-moe --sm-arch 90 --batch 0", "--batch 0: must lie in [1, 1024]"},
      {"best --model preset:tiny-moe --sm-arch 90 --batch -1", "--batch -1: must lie in [1, 1024]"},
      {"best --model preset:tiny-moe --sm-arch 90 --batch 1025",
       "--batch 1025: must lie in [1, 1024]"},
      {"compare --model preset:tiny-moe --sm-arch 90 --config matmul=naive --config "
       "matmul=blocked --batch -1",
       "--batch -1: must lie in [1, 1024]"},
      {"compare --model preset:tiny-moe --sm-arch 90 --config matmul=naive --config "
       "matmul=blocked --batch 0",
       "--batch 0: must lie in [1, 1024]"},
      {"regressions --limit 0", "--limit 0: must lie in [1, 100000]"},
      {"regressions --limit -3", "--limit -3: must lie in [1, 100000]"},
      {"regressions --limit 100001", "--limit 100001: must lie in [1, 100000]"},
      {"results --sm-arch ' 90'",
       "--sm-arch: ' 90' is not an SM architecture: did you mean sm_90?"},
      {"results --sm-arch SM_90", "'SM_90' is not an SM architecture: did you mean sm_90?"},
      {"best --model preset:tiny-moe --sm-arch sm90", "did you mean sm_90?"},
      {"compare --model m --config matmul=naive --sm-arch 90 --sm-arch 'sm_120 '",
       "did you mean sm_120?"},
      {"regressions --sm-arch CPU", "'CPU' is not an SM architecture: did you mean cpu?"},
  };
  for (const auto& [args, want] : cases) {
    int rc = 0;
    const std::string out = Run(args + at, &rc);
    EXPECT_EQ(rc, 2) << args << "\n" << out;
    EXPECT_THAT(out, HasSubstr(want)) << args;
  }
  for (const char* command : {"best", "compare"}) {
    int rc = 0;
    EXPECT_THAT(Run(absl::StrCat(command, " --help"), &rc), HasSubstr("1 to 1024")) << command;
  }
  int rc = 0;
  EXPECT_THAT(Run("regressions --help", &rc), HasSubstr("1 to 100000"));
}

// Every user command's --token-file help says that $INFERSWEEP_USER_TOKEN holds the token
// itself, not a path.
TEST_F(Cli, TokenFileHelpSaysTheVariableHoldsTheToken) {
  for (const char* command :
       {"submit", "status", "cancel", "results", "best", "compare", "agents"}) {
    int rc = 0;
    const std::string out = Run(absl::StrCat(command, " --help"), &rc);
    EXPECT_EQ(rc, 0) << command;
    EXPECT_THAT(out, HasSubstr("default: the token in $INFERSWEEP_USER_TOKEN")) << command;
  }
}

// Results of CPU slots (SM 0) read "cpu" wherever an SM is shown, and --sm-arch cpu selects
// them: the results table, best's and compare's headers.
TEST_F(Cli, CpuResultsAreShownAsCpu) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({}));
  StartAgent("cpu1");
  ASSERT_TRUE(WaitFor([&] { return ConnectedAgents() == 1; }, 20)) << Logs();
  const int64_t sweep = Submit(CpuSweep(1, "[naive]"));
  ASSERT_TRUE(WaitSweepDone(sweep, 60)) << Logs();
  const std::string at = absl::StrCat(" --coordinator ", address_);
  int rc = 0;
  const std::string results = Run("results --sm-arch cpu" + at, &rc);
  EXPECT_EQ(rc, 0) << results;
  EXPECT_THAT(results, HasSubstr("# infersweep results: cpu\n"));
  EXPECT_THAT(results, HasSubstr(" cpu1 "));
  EXPECT_TRUE(std::regex_search(results, std::regex(R"(\n +1 1-0 +cpu1 +cpu +cpu +M1 +W1 +device=cpu)")))
      << results;
  EXPECT_THAT(results, HasSubstr("# 1 result(s)"));
  const std::string best = Run("best --model preset:tiny-moe --sm-arch cpu" + at, &rc);
  EXPECT_EQ(rc, 0) << best;
  EXPECT_THAT(best, HasSubstr("for preset:tiny-moe on cpu at batch 1"));
  const std::string compare = Run(
      "compare --model preset:tiny-moe --config matmul=naive --config device=cpu --sm-arch cpu" +
          at,
      &rc);
  EXPECT_EQ(rc, 0) << compare;
  EXPECT_THAT(compare, HasSubstr("# A: matmul=naive on cpu"));
  for (const std::string& out : {results, best, compare}) EXPECT_THAT(out, Not(HasSubstr("sm_0")));
  const std::string none = Run("best --model preset:tiny-moe --sm-arch sm_90" + at, &rc);
  EXPECT_EQ(rc, 1) << none;
  EXPECT_THAT(none, HasSubstr("on sm_90"));
}

// The benchmarks explain their flags: --help prints each with its meaning and default and exits
// 0; an unknown flag prints the usage and exits 2. Skipped where the bench targets are not built.
TEST_F(Cli, BenchmarksExplainTheirFlags) {
  const std::filesystem::path bench =
      std::filesystem::path(WorkerBinary()).parent_path().parent_path() / "bench";
  const std::vector<std::pair<std::string, std::vector<std::string>>> benches = {
      {"fleet_bench",
       {"--agents", "--trials-per-agent", "--channels", "--trial-ms", "--binary", "--db",
        "--keep"}},
      {"store_bench", {"--rows", "--db", "--batch", "--runs", "--keep"}}};
  int found = 0;
  for (const auto& [name, flags] : benches) {
    const std::string path = (bench / name).string();
    if (!std::filesystem::exists(path)) continue;
    ++found;
    int rc = 0;
    const std::string help = RunCommand(absl::StrCat("'", path, "' --help 2>&1"), &rc);
    EXPECT_EQ(rc, 0) << help;
    for (const std::string& flag : flags) {
      // The flag's line has a meaning after it, and the default where it has one.
      std::regex line(absl::StrCat(R"((^|\n) +)", flag, R"([ =][^\n]*[a-z]{3,}[^\n]*)"));
      EXPECT_TRUE(std::regex_search(help, line)) << name << " " << flag << ":\n" << help;
    }
    EXPECT_THAT(help, HasSubstr("default"));
    const std::string bad = RunCommand(absl::StrCat("'", path, "' --bogus 2>&1"), &rc);
    EXPECT_EQ(rc, 2) << bad;
    EXPECT_THAT(bad, HasSubstr("usage"));
    EXPECT_THAT(bad, HasSubstr("--bogus"));
  }
  if (found == 0) GTEST_SKIP() << "no bench binaries next to " << WorkerBinary();
}

}  // namespace
}  // namespace infersweep
