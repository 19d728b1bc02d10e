// The coordinator's limits (docs/SECURITY.md "Limits"): request rates per caller (user calls
// and agent streams per peer address, messages per agent id), the message size, and the sweep
// size. Over a limit the caller gets RESOURCE_EXHAUSTED (or INVALID_ARGUMENT for a spec over the
// caps) with a message that says which limit, nothing is stored, and everyone else is served.
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "coordinator/client.h"
#include "coordinator/rate_limit.h"
#include "coordinator/server.h"
#include "coordinator/sweep_spec.h"
#include "proto/rpc.h"
#include "storage/store.h"
#include "tests/fleet_process.h"
#include "tests/raw_agent.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;
using Clock = RateLimiter::Clock;

constexpr char kCpuSweep[] = R"(name: limits
model: preset:tiny-moe
layers: 1
matrix: {device: [cpu], matmul: [naive]}
workload: {prompt: 8, output: 4, batch: [1], repeats: 1}
)";

TEST(RateLimiter, TokenBucketPerKey) {
  RateLimiter limiter({/*rate_per_s=*/2, /*burst=*/3});
  const Clock::time_point t0 = Clock::now();
  // A full bucket: the burst passes at once, the next call does not.
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(limiter.Allow("a", t0)) << i;
  EXPECT_FALSE(limiter.Allow("a", t0));
  // Another key has its own bucket.
  EXPECT_TRUE(limiter.Allow("b", t0));
  // 2 per second: one token after 0.5 s, and never more than the burst.
  EXPECT_FALSE(limiter.Allow("a", t0 + std::chrono::milliseconds(400)));
  EXPECT_TRUE(limiter.Allow("a", t0 + std::chrono::milliseconds(520)));
  EXPECT_FALSE(limiter.Allow("a", t0 + std::chrono::milliseconds(530)));
  const Clock::time_point later = t0 + std::chrono::seconds(100);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(limiter.Allow("a", later)) << i;
  EXPECT_FALSE(limiter.Allow("a", later));
  // Disabled: everything passes.
  RateLimiter off({0, 0});
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(off.Allow("a", t0));
}

TEST(RateLimiter, TableStaysBounded) {
  RateLimiter limiter({1, 1}, /*max_keys=*/4);
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(limiter.Allow(absl::StrCat("k", i), t0));
  // Every tracked key is still draining: a fifth caller passes untracked.
  EXPECT_TRUE(limiter.Allow("k4", t0));
  EXPECT_TRUE(limiter.Allow("k4", t0));
  EXPECT_EQ(limiter.tracked(), 4u);
  EXPECT_FALSE(limiter.Allow("k0", t0));  // the tracked ones stay limited
  // Once they have refilled they are forgotten and make room.
  const Clock::time_point later = t0 + std::chrono::seconds(5);
  EXPECT_TRUE(limiter.Allow("k5", later));
  EXPECT_EQ(limiter.tracked(), 1u);
}

TEST(RateLimiter, PeerHostDropsThePort) {
  EXPECT_EQ(PeerHost("ipv4:10.0.0.7:51234"), "ipv4:10.0.0.7");
  EXPECT_EQ(PeerHost("ipv6:[::1]:51234"), "ipv6:[::1]");
  EXPECT_EQ(PeerHost("ipv6:%5B::1%5D:51234"), "ipv6:%5B::1%5D");
  EXPECT_EQ(PeerHost("ipv6:[::1]"), "ipv6:[::1]");
  EXPECT_EQ(PeerHost("unix:/run/x.sock"), "unix:/run/x.sock");
  EXPECT_EQ(PeerHost(""), "");
}

class Limits : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("limits");
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override {
    if (server_) server_->Stop();
    server_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Start(CoordinatorOptions o) {
    o.tick_ms = 50;
    o.log = [this](const std::string& line) { log_.Add("coordinator", line); };
    server_ = std::make_unique<CoordinatorServer>(o);
    auto port = server_->Start("127.0.0.1:0", dir_ + "/c.db");
    ASSERT_TRUE(port.ok()) << port.status();
    address_ = absl::StrCat("127.0.0.1:", *port);
  }
  int64_t Sweeps() {
    auto s = server_->store()->ListSweeps();
    return s.ok() ? static_cast<int64_t>(s->size()) : -1;
  }
  int64_t Results() {
    ResultQuery q;
    q.limit = 10000;
    auto r = server_->store()->QueryResults(q);
    return r.ok() ? static_cast<int64_t>(r->size()) : -1;
  }
  // A channel that sends up to 16 MiB, to get past the client-side limit.
  std::shared_ptr<grpc::Channel> BigChannel() {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(16 << 20);
    args.SetMaxReceiveMessageSize(16 << 20);
    return grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args);
  }

  std::string dir_, address_;
  std::unique_ptr<CoordinatorServer> server_;
  LineLog log_;
};

// A caller over the user-call rate gets RESOURCE_EXHAUSTED naming the limit, and its call has no
// effect; the check comes before authentication, so wrong tokens are limited too. The bucket
// refills: later calls pass.
TEST_F(Limits, UserCallsOverTheRateAreResourceExhaustedAndStoreNothing) {
  CoordinatorOptions o;
  o.user_call_limit = {/*rate_per_s=*/2, /*burst=*/4};
  o.user_token = "user-token";
  Start(o);
  ServiceClient good(address_, 10'000, "user-token");
  ServiceClient guesser(address_, 10'000, "guess");
  // The burst: two good calls and two wrong guesses.
  EXPECT_TRUE(good.ListSweeps().ok());
  EXPECT_TRUE(good.ListSweeps().ok());
  EXPECT_EQ(guesser.ListSweeps().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(guesser.ListSweeps().status().code(), absl::StatusCode::kUnauthenticated);
  // Over: the guesser is refused before its token is looked at, and a submit stores nothing.
  EXPECT_EQ(guesser.ListSweeps().status().code(), absl::StatusCode::kResourceExhausted);
  auto submitted = good.SubmitSweep(kCpuSweep, "limits.yaml");
  ASSERT_EQ(submitted.status().code(), absl::StatusCode::kResourceExhausted) << submitted.status();
  EXPECT_THAT(submitted.status().message(), HasSubstr("rate limit"));
  EXPECT_THAT(submitted.status().message(), HasSubstr("127.0.0.1"));
  EXPECT_EQ(Sweeps(), 0);
  EXPECT_EQ(server_->stats().auth_failures, 2);
  EXPECT_GE(server_->stats().rate_limited, 2);
  EXPECT_THAT(server_->MetricsText(), HasSubstr("infersweep_rate_limited_total{api=\"user\"} 2"));
  // Tokens come back at 2 per second.
  ASSERT_TRUE(WaitFor([&] { return good.SubmitSweep(kCpuSweep, "limits.yaml").ok(); }, 5));
  EXPECT_EQ(Sweeps(), 1);
}

// Agent streams opened over the per-address rate are refused before their Hello is read.
TEST_F(Limits, AgentStreamsOverTheRateAreRefused) {
  CoordinatorOptions o;
  o.connect_limit = {/*rate_per_s=*/0.5, /*burst=*/2};
  Start(o);
  RawAgent a(address_), b(address_);
  ASSERT_TRUE(a.Hello("a"));
  ASSERT_TRUE(a.Next().has_welcome());
  ASSERT_TRUE(b.Hello("b"));
  ASSERT_TRUE(b.Next().has_welcome());
  RawAgent c(address_);
  c.Hello("c");
  EXPECT_FALSE(c.Next().has_welcome());
  const grpc::Status refused = c.End();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("agent streams"));
  EXPECT_EQ(server_->stats().agents_connected, 2);
  EXPECT_TRUE(a.End().ok());
  EXPECT_TRUE(b.End().ok());
}

// An agent over its message rate: its messages are dropped unprocessed; a Result gets a
// retryable Error (RESOURCE_EXHAUSTED, not permanent, so a real agent keeps it spooled) and is
// not stored; the same Result sent again after the bucket refills is stored once.
TEST_F(Limits, AgentMessagesOverTheRateAreDroppedAndResultsStayRetryable) {
  CoordinatorOptions o;
  o.agent_message_limit = {/*rate_per_s=*/2, /*burst=*/3};
  Start(o);
  ServiceClient client(address_, 10'000);
  ASSERT_TRUE(client.SubmitSweep(kCpuSweep, "limits.yaml").ok());
  RawAgent agent(address_);
  ASSERT_TRUE(agent.Hello("flooder"));
  ASSERT_TRUE(agent.Next().has_welcome());
  v1::CoordinatorMessage m = agent.Next();
  ASSERT_TRUE(m.has_assignment()) << m.DebugString();
  const std::string trial = m.assignment().trial_id();
  const int attempt = m.assignment().attempt();

  v1::AgentMessage hb;
  hb.mutable_heartbeat()->set_free_slots(0);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(agent.Send(hb));  // the burst
  ASSERT_TRUE(agent.Result(trial, attempt, ValidResultJson(trial, attempt)));
  m = agent.Next();
  ASSERT_TRUE(m.has_error()) << m.DebugString();
  EXPECT_EQ(m.error().trial_id(), trial);
  EXPECT_FALSE(m.error().permanent());
  EXPECT_EQ(m.error().code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(m.error().message(), HasSubstr("rate limit"));
  EXPECT_EQ(Results(), 0);
  EXPECT_EQ(server_->store()->GetTrial(trial)->state, TrialState::kLeased);

  // 2 tokens a second: the resend half a second later is stored and acked.
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  ASSERT_TRUE(agent.Result(trial, attempt, ValidResultJson(trial, attempt)));
  m = agent.Next();
  ASSERT_TRUE(m.has_ack()) << m.DebugString();
  EXPECT_EQ(Results(), 1);
  EXPECT_GE(server_->stats().rate_limited, 1);
  EXPECT_EQ(server_->stats().bad_messages, 0);
  EXPECT_TRUE(agent.End().ok());
}

// Messages over 4 MiB are refused by gRPC itself (RESOURCE_EXHAUSTED) on both APIs before
// anything reads them; a spec under 4 MiB but over the 1 MiB spec limit is INVALID_ARGUMENT.
// Nothing is stored and the coordinator serves the next caller.
TEST_F(Limits, OversizedMessagesAreRefusedAndNothingIsStored) {
  Start(CoordinatorOptions());
  // The documented limit is 4 MiB (rpc::kMaxMessageBytes); 5 MiB is over it.
  static_assert(rpc::kMaxMessageBytes == 4 * 1024 * 1024);
  const std::string huge(5 * 1024 * 1024, '#');
  {
    auto stub = v1::SweepService::NewStub(BigChannel());
    grpc::ClientContext context;
    v1::SubmitSweepRequest req;
    req.set_spec_yaml(std::string(kCpuSweep) + huge);
    v1::SubmitSweepResponse resp;
    const grpc::Status s = stub->SubmitSweep(&context, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  }
  {
    ServiceClient client(address_, 10'000);
    auto s = client.SubmitSweep(std::string(kCpuSweep) + "#" + std::string(kMaxSweepSpecBytes, 'x'),
                                "big.yaml");
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_THAT(s.status().message(), HasSubstr("the limit is"));
  }
  EXPECT_EQ(Sweeps(), 0);

  ServiceClient client(address_, 10'000);
  ASSERT_TRUE(client.SubmitSweep(kCpuSweep, "limits.yaml").ok());
  RawAgent agent(BigChannel());
  ASSERT_TRUE(agent.Hello("big"));
  ASSERT_TRUE(agent.Next().has_welcome());
  v1::CoordinatorMessage m = agent.Next();
  ASSERT_TRUE(m.has_assignment()) << m.DebugString();
  TrialResult r;
  r.trial_id = m.assignment().trial_id();
  r.attempt = m.assignment().attempt();
  r.status = TrialStatus::kOk;
  r.stderr_tail = huge;
  agent.Result(r.trial_id, r.attempt, ToJson(r).dump());
  const grpc::Status ended = agent.End();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << ended.error_message();
  EXPECT_EQ(Results(), 0);
  // Still serving: a normal agent stream and a user call.
  RawAgent next(address_);
  ASSERT_TRUE(next.Hello("next"));
  EXPECT_TRUE(next.Next().has_welcome());
  EXPECT_TRUE(client.ListSweeps().ok());
  EXPECT_TRUE(next.End().ok());
}

// The sweep-size cap is the coordinator's --max-trials flag: a bigger spec submitted through the
// CLI is refused with the cap in the message (exit 2) and stores nothing.
class SweepCap : public FleetProcesses {};

TEST_F(SweepCap, MaxTrialsFlagRefusesBiggerSweeps) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({"--max-trials", "3"}));
  const std::string spec = dir_ + "/four.yaml";
  std::ofstream(spec) << CpuSweep(2);  // 2 configs x 2 repeats = 4 trials
  int code = -1;
  const std::string out = RunCommand(
      absl::StrCat(WorkerBinary(), " submit --coordinator ", address_, " ", spec, " 2>&1"), &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_THAT(out, HasSubstr("cap of 3 trials"));
  EXPECT_EQ(DbCount("SELECT COUNT(*) FROM sweeps"), 0);
  std::ofstream(spec) << CpuSweep(1, "[naive, blocked]");  // 2 trials
  const std::string ok = RunCommand(
      absl::StrCat(WorkerBinary(), " submit --coordinator ", address_, " ", spec, " 2>&1"), &code);
  EXPECT_EQ(code, 0) << ok;
  EXPECT_EQ(DbCount("SELECT COUNT(*) FROM sweeps"), 1);
}

}  // namespace
}  // namespace infersweep
