// Bad input at the coordinator's edges: rejected with a clear gRPC status or an Error message,
// nothing stored changes, and the coordinator keeps serving everyone else.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "api/trial.h"
#include "coordinator/agent_identity.h"
#include "coordinator/client.h"
#include "coordinator/server.h"
#include "proto/infersweep.grpc.pb.h"
#include "proto/rpc.h"
#include "storage/store.h"
#include "tests/raw_agent.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kValidSweep[] = R"(name: waits
model: preset:tiny-moe
layers: 1
matrix:
  device: [cpu]
  matmul: [naive]
workload: {prompt: 8, output: 4, batch: [1], repeats: 1}
selector: {sm: [75]}
)";

struct Counts {
  int64_t sweeps = 0, trials = 0, results = 0;
  bool operator==(const Counts& o) const {
    return sweeps == o.sweeps && trials == o.trials && results == o.results;
  }
};

std::ostream& operator<<(std::ostream& os, const Counts& c) {
  return os << "{sweeps " << c.sweeps << ", trials " << c.trials << ", results " << c.results << "}";
}

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "bad-input-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    CoordinatorOptions o;
    o.max_trials_per_sweep = 8;
    o.tick_ms = 50;
    o.log = [this](const std::string& line) { log_.Add("coordinator", line); };
    Configure(o);
    server_ = std::make_unique<CoordinatorServer>(o);
    auto port = server_->Start("127.0.0.1:0", dir_ + "/c.db");
    ASSERT_TRUE(port.ok()) << port.status();
    address_ = absl::StrCat("127.0.0.1:", *port);
    client_ = std::make_unique<ServiceClient>(address_, 10'000);
  }
  void TearDown() override {
    client_.reset();
    server_->Stop();
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  virtual void Configure(CoordinatorOptions&) {}

  Counts Count() {
    Counts c;
    Store* store = server_->store();
    auto sweeps = store->ListSweeps();
    EXPECT_TRUE(sweeps.ok());
    for (const SweepRecord& s : *sweeps) {
      ++c.sweeps;
      c.trials += s.trials_total;
    }
    ResultQuery q;
    q.limit = 100000;
    auto results = store->QueryResults(q);
    EXPECT_TRUE(results.ok());
    c.results = static_cast<int64_t>(results->size());
    return c;
  }

  // Submits `yaml` and expects INVALID_ARGUMENT naming `source:line` and `needle`.
  void ExpectRejected(const std::string& yaml, const std::string& source, int line,
                      const std::string& needle) {
    const Counts before = Count();
    auto r = client_->SubmitSweep(yaml, source);
    ASSERT_FALSE(r.ok()) << "accepted: " << yaml;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(absl::StrCat(source, ":", line)));
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(needle));
    EXPECT_EQ(Count(), before);
    // The coordinator logs the refusal with the caller and the reason.
    EXPECT_THAT(log_.Text(),
                HasSubstr(absl::StrCat("submit of '", source, "' from ipv4:127.0.0.1:")));
    EXPECT_THAT(log_.Text(), HasSubstr(absl::StrCat(" refused: INVALID_ARGUMENT: ", source, ":")));
  }

  std::string dir_, address_;
  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<ServiceClient> client_;
  LineLog log_;
};

TEST_F(BadInput, MalformedSpecIsInvalidArgumentWithLine) {
  ExpectRejected("name: broken\nmodel: preset:tiny-moe\nmatrix: {device: [cpu]]\nworkload: {}\n",
                 "broken.yaml", 3, "malformed YAML");
  ExpectRejected("name: indent\nmodel: preset:tiny-moe\n  matrix: x\nworkload: {prompt: 8}\n",
                 "indent.yaml", 3, "malformed YAML");
  // Well-formed YAML of the wrong shape.
  ExpectRejected("name: shape\nmodel: preset:tiny-moe\nmatrix: [cpu]\n", "shape.yaml", 3, "matrix");
}

// A selector regex of 20,000 nested groups in a 40 KB spec: refused with the line and the bound
// it breaks, and the coordinator keeps serving (a recursive regex compiler overflows its stack).
TEST_F(BadInput, DeeplyNestedSelectorRegexIsRefusedAndTheCoordinatorKeepsServing) {
  const std::string nested = std::string(20000, '(') + "a" + std::string(20000, ')');
  ExpectRejected(absl::StrCat("name: nest\nmodel: preset:tiny-moe\nmatrix: {device: [cuda]}\n",
                              "selector:\n  gpu_name: \"", nested, "\"\n"),
                 "nest.yaml", 5, "selector.gpu_name: the pattern is 40001 characters");
  auto ok = client_->SubmitSweep(kValidSweep, "valid.yaml");
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST_F(BadInput, UnknownAxisIsInvalidArgumentWithLine) {
  ExpectRejected(
      "name: x\nmodel: preset:tiny-moe\nmatrix:\n  device: [cpu]\n  flux_capacitor: [on]\n",
      "axis.yaml", 5, "flux_capacitor");
}

TEST_F(BadInput, MatrixOverTheCapIsInvalidArgument) {
  // 2 x 5 = 10 combinations; this coordinator takes at most 8 trials per sweep.
  ExpectRejected(
      "name: big\nmodel: preset:tiny-moe\nmatrix:\n  device: [cpu]\n  matmul: [naive, blocked]\n"
      "  threads: [\"1\", \"2\", \"4\", \"8\", all]\n",
      "big.yaml", 3, "cap of 8 trials");
}

// An unknown preset fails at submit (before, every agent failed it), naming the model, the
// spec's line and field, and the known presets; a "@format" suffix on a known one is fine.
TEST_F(BadInput, UnknownPresetIsInvalidArgumentNamingTheKnownPresets) {
  const std::string spec = "name: p\nmodel: preset:tiny-mo\nmatrix: {device: [cpu]}\n";
  ExpectRejected(spec, "preset.yaml", 2, "model: unknown preset 'tiny-mo'");
  ExpectRejected(spec, "preset.yaml", 2, "known presets: qwen3-30b-a3b, ");
  ExpectRejected(spec, "preset.yaml", 2, "tiny-moe");
  ExpectRejected("name: p\nmodel: preset:tiny-mo@nvfp4\nmatrix: {device: [cpu]}\n", "at.yaml", 2,
                 "unknown preset 'tiny-mo'");
  ExpectRejected("name: p\nmodel: preset:tiny-moe@nvfp5\nmatrix: {device: [cpu]}\n", "fmt.yaml", 2,
                 "nvfp5");
  for (const char* model : {"preset:tiny-moe", "preset:tiny-moe@nvfp4", "preset:qwen3-30b-a3b"}) {
    auto ok = client_->SubmitSweep(
        absl::StrCat("name: p\nmodel: ", model, "\nmatrix: {device: [cpu]}\n"), "ok.yaml");
    EXPECT_TRUE(ok.ok()) << model << ": " << ok.status();
  }
}

// A checkpoint folder the coordinator cannot see is accepted (agents may have it), with a
// warning that `submit` prints on stderr; a folder the coordinator sees gets none.
TEST_F(BadInput, CheckpointTheCoordinatorCannotSeeIsAcceptedWithAWarning) {
  const std::string missing = dir_ + "/no-such-checkpoint";
  auto submit = [&](const std::string& model, int* rc) {
    const std::string path = dir_ + "/ckpt.yaml";
    std::ofstream(path) << "name: c\nmodel: " << model << "\nmatrix: {device: [cpu]}\n"
                        << "selector: {sm: [75]}\n";
    return RunCommand(absl::StrCat("'", WorkerBinary(), "' submit '", path, "' --coordinator ",
                                   address_, " 2>&1"),
                      rc);
  };
  int rc = 0;
  const std::string out = submit(missing, &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("trial(s) queued"));
  EXPECT_THAT(out, HasSubstr(absl::StrCat("warning: model '", missing,
                                          "': not a folder on the coordinator; agents must have "
                                          "it")));
  const std::string seen = submit(dir_, &rc);
  EXPECT_EQ(rc, 0) << seen;
  EXPECT_THAT(seen, Not(HasSubstr("warning")));
  // The warning travels in SubmitSweepResponse.warnings; a format suffix names the same folder.
  auto r = client_->SubmitSweep(
      absl::StrCat("name: c\nmodel: ", missing, "@nvfp4\nmatrix: {device: [cpu]}\n"), "w.yaml");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->warnings_size(), 1);
  EXPECT_EQ(r->warnings(0), absl::StrCat("model '", missing,
                                         "@nvfp4': not a folder on the coordinator; agents must "
                                         "have it"));
  auto preset = client_->SubmitSweep(kValidSweep, "v.yaml");
  ASSERT_TRUE(preset.ok()) << preset.status();
  EXPECT_EQ(preset->warnings_size(), 0);
}

TEST_F(BadInput, ResultForATrialTheAgentDoesNotHoldIsRefusedAndNothingIsStored) {
  auto submitted = client_->SubmitSweep(kValidSweep, "waits.yaml");  // sm 75: nobody runs it
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const std::string queued_trial = absl::StrCat(submitted->sweep_id(), "-0");
  const Counts before = Count();

  RawAgent rogue(address_);
  ASSERT_TRUE(rogue.Hello("rogue"));
  ASSERT_TRUE(rogue.Next().has_welcome());

  // A trial that exists but is not leased to this agent.
  ASSERT_TRUE(rogue.Result(queued_trial, 1, ValidResultJson(queued_trial, 1)));
  v1::CoordinatorMessage m = rogue.Next();
  ASSERT_TRUE(m.has_error()) << m.DebugString();
  EXPECT_EQ(m.error().trial_id(), queued_trial);
  EXPECT_TRUE(m.error().permanent());
  EXPECT_THAT(m.error().message(), HasSubstr("rogue"));

  // A trial that does not exist.
  ASSERT_TRUE(rogue.Result("999-0", 1, ValidResultJson("999-0", 1)));
  m = rogue.Next();
  ASSERT_TRUE(m.has_error()) << m.DebugString();
  EXPECT_EQ(m.error().trial_id(), "999-0");

  // Not a TrialResult, and a result_json that names another trial.
  ASSERT_TRUE(rogue.Result(queued_trial, 1, "{not json"));
  m = rogue.Next();
  ASSERT_TRUE(m.has_error());
  EXPECT_THAT(m.error().message(), HasSubstr("not valid JSON"));
  // Two megabytes of nested arrays: refused before any parsing, naming the bound.
  ASSERT_TRUE(rogue.Result(queued_trial, 1, std::string(1 << 20, '[') + std::string(1 << 20, ']')));
  m = rogue.Next();
  ASSERT_TRUE(m.has_error());
  EXPECT_THAT(m.error().message(),
              HasSubstr("result_json: JSON nested deeper than 64 levels (at byte 64); the limit "
                        "is 64"));
  ASSERT_TRUE(rogue.Result(queued_trial, 1, ValidResultJson("other-trial", 1)));
  m = rogue.Next();
  ASSERT_TRUE(m.has_error());
  EXPECT_THAT(m.error().message(), HasSubstr("other-trial"));

  // The stream survives single bad messages: a heartbeat, then one more round trip.
  v1::AgentMessage hb;
  hb.mutable_heartbeat()->set_free_slots(1);
  ASSERT_TRUE(rogue.Send(hb));
  ASSERT_TRUE(rogue.Send(v1::AgentMessage()));  // empty oneof
  m = rogue.Next();
  ASSERT_TRUE(m.has_error());
  EXPECT_THAT(m.error().message(), HasSubstr("empty message"));

  EXPECT_EQ(Count(), before);
  auto trial = server_->store()->GetTrial(queued_trial);
  ASSERT_TRUE(trial.ok());
  EXPECT_EQ(trial->state, TrialState::kQueued);
  EXPECT_EQ(server_->stats().bad_messages, 6);
  EXPECT_TRUE(rogue.End().ok());
}

// A result for an attempt that is stored already: a replay of the same content is acknowledged
// (the agent drops it from its spool); other content is refused with a permanent Error, logged
// and counted, and the stored row stays as it was.
TEST_F(BadInput, AConflictingDuplicateResultIsRefusedAndAnIdenticalReplayAcknowledged) {
  auto submitted = client_->SubmitSweep(
      "name: dup\nmodel: preset:tiny-moe\nlayers: 1\nmatrix: {device: [cpu], matmul: [naive]}\n"
      "workload: {prompt: 8, output: 4, batch: [1], repeats: 1}\n",
      "dup.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  RawAgent agent(address_);
  ASSERT_TRUE(agent.Hello("cpu-host"));
  ASSERT_TRUE(agent.Next().has_welcome());
  v1::CoordinatorMessage assignment = agent.Next();
  ASSERT_TRUE(assignment.has_assignment()) << assignment.DebugString();
  const std::string trial = assignment.assignment().trial_id();
  const int attempt = assignment.assignment().attempt();
  auto result = [&](const std::string& reason) { return ValidResultJson(trial, attempt, reason); };
  ASSERT_TRUE(agent.Result(trial, attempt, result("first")));
  EXPECT_TRUE(agent.Next().has_ack());
  ASSERT_TRUE(agent.Result(trial, attempt, result("first")));  // a replay from the spool
  EXPECT_TRUE(agent.Next().has_ack());
  ASSERT_TRUE(agent.Result(trial, attempt, result("second")));
  v1::CoordinatorMessage m = agent.Next();
  ASSERT_TRUE(m.has_error()) << m.DebugString();
  EXPECT_EQ(m.error().trial_id(), trial);
  EXPECT_TRUE(m.error().permanent());
  EXPECT_EQ(m.error().code(), static_cast<int>(absl::StatusCode::kAlreadyExists));
  EXPECT_THAT(m.error().message(), HasSubstr("stored as OK with other content"));
  EXPECT_EQ(server_->stats().results_conflicting, 1);
  EXPECT_THAT(server_->MetricsText(), HasSubstr("infersweep_result_conflicts_total 1"));
  ResultQuery q;
  auto stored = server_->store()->QueryResults(q);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_EQ(stored->size(), 1u);
  EXPECT_EQ((*stored)[0].result.reason, "first");
  EXPECT_TRUE(agent.End().ok());
}

// The trial counters of a (model, arch) exist at 0 once the coordinator knows the pair: at
// submit for the connected agents' archs, and after a restart for what the database holds.
TEST_F(BadInput, TrialCountersExistFromZeroBeforeTheFirstResult) {
  const std::string series =
      "infersweep_trials_total{model=\"preset:tiny-moe\",sm_arch=\"cpu\",status=\"TIMEOUT\"} 0";
  RawAgent agent(address_);
  ASSERT_TRUE(agent.Hello("cpu-host"));
  ASSERT_TRUE(agent.Next().has_welcome());
  EXPECT_THAT(server_->MetricsText(), Not(HasSubstr("infersweep_trials_total{")));
  auto submitted = client_->SubmitSweep(
      "name: z\nmodel: preset:tiny-moe\nlayers: 1\nmatrix: {device: [cpu], matmul: [naive]}\n",
      "z.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  EXPECT_THAT(server_->MetricsText(), HasSubstr(series));
  v1::CoordinatorMessage assignment = agent.Next();
  ASSERT_TRUE(assignment.has_assignment()) << assignment.DebugString();
  const std::string trial = assignment.assignment().trial_id();
  ASSERT_TRUE(agent.Result(trial, 1, ValidResultJson(trial, 1)));
  ASSERT_TRUE(agent.Next().has_ack());
  EXPECT_TRUE(agent.End().ok());

  // After a restart, the stored (model, arch) is exported from 0 again.
  client_.reset();
  server_->Stop();
  CoordinatorOptions o;
  o.log = [](const std::string&) {};
  server_ = std::make_unique<CoordinatorServer>(o);
  auto port = server_->Start("127.0.0.1:0", dir_ + "/c.db");
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_THAT(server_->MetricsText(), HasSubstr(series));
  EXPECT_THAT(server_->MetricsText(),
              HasSubstr("infersweep_trials_total{model=\"preset:tiny-moe\",sm_arch=\"cpu\","
                        "status=\"OK\"} 0"));
}

// A sweep whose selector no connected agent matches says so, naming the selector, in its status
// and in `status`'s output, instead of waiting without a word.
TEST_F(BadInput, ASweepNoConnectedAgentMatchesSaysSo) {
  auto submitted = client_->SubmitSweep(kValidSweep, "waits.yaml");  // sm 75
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  auto info = client_->GetSweep(submitted->sweep_id());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->waiting(),
            "no connected agent matches the selector {device cpu, sm [75]} of its queued trials "
            "(connected: 0 agent(s))");
  RawAgent agent(address_);
  ASSERT_TRUE(agent.Hello("cpu-host"));
  ASSERT_TRUE(agent.Next().has_welcome());
  info = client_->GetSweep(submitted->sweep_id());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(info->waiting(), HasSubstr("(connected: 1 agent(s): cpu)"));
  int rc = -1;
  const std::string out =
      RunCommand(absl::StrCat(INFERSWEEP_BINARY, " status --coordinator ", address_, " 2>&1"), &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("waiting: no connected agent matches the selector {device cpu, sm "
                             "[75]}"));
  // A sweep an agent can take has nothing to say.
  auto runnable = client_->SubmitSweep(
      "name: r\nmodel: preset:tiny-moe\nlayers: 1\nmatrix: {device: [cpu], matmul: [naive]}\n",
      "r.yaml");
  ASSERT_TRUE(runnable.ok()) << runnable.status();
  info = client_->GetSweep(runnable->sweep_id());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->waiting(), "");
  EXPECT_TRUE(agent.End().ok());
}

TEST_F(BadInput, ResultBeforeHelloClosesTheStreamAndOthersAreStillServed) {
  const Counts before = Count();
  RawAgent early(address_);
  ASSERT_TRUE(early.Result("1-0", 1, ValidResultJson("1-0", 1)));
  v1::CoordinatorMessage m = early.Next();
  ASSERT_TRUE(m.has_error()) << m.DebugString();
  EXPECT_THAT(m.error().message(), HasSubstr("first message"));
  grpc::Status status = early.End();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("Hello"));

  // A second Hello on one stream is a protocol error too.
  RawAgent twice(address_);
  ASSERT_TRUE(twice.Hello("twice"));
  ASSERT_TRUE(twice.Next().has_welcome());
  ASSERT_TRUE(twice.Hello("twice"));
  m = twice.Next();
  ASSERT_TRUE(m.has_error());
  status = twice.End();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("second Hello"));

  // A Hello that is not valid: refused with INVALID_ARGUMENT.
  RawAgent bad_id(address_);
  ASSERT_TRUE(bad_id.Hello("no spaces allowed"));
  EXPECT_TRUE(bad_id.Next().has_error());
  EXPECT_EQ(bad_id.End().error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // Everyone else is still served.
  RawAgent good(address_);
  ASSERT_TRUE(good.Hello("good"));
  EXPECT_TRUE(good.Next().has_welcome());
  auto sweeps = client_->ListSweeps();
  EXPECT_TRUE(sweeps.ok()) << sweeps.status();
  auto agents = client_->ListAgents();
  ASSERT_TRUE(agents.ok());
  bool good_connected = false;
  for (const v1::AgentInfo& a : agents->agents())
    if (a.agent_id() == "good") good_connected = a.connected();
  EXPECT_TRUE(good_connected);
  EXPECT_TRUE(good.End().ok());
  EXPECT_EQ(Count(), before);
  EXPECT_EQ(server_->stats().streams_rejected, 3);
}

TEST_F(BadInput, QueryArgumentsAreChecked) {
  v1::QueryResultsRequest q;
  q.set_status("FINE");
  auto r = client_->QueryResults(q);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("FINE"));
  v1::BestRequest b;
  b.set_model("preset:tiny-moe");
  b.set_sm(90);
  b.set_metric("vibes");
  auto best = client_->Best(b);
  ASSERT_FALSE(best.ok());
  EXPECT_EQ(best.status().code(), absl::StatusCode::kInvalidArgument);
  auto missing = client_->GetSweep(12345);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

// The query bounds the CLI checks hold for a client calling gRPC directly too: a limit or batch
// outside its range (an explicit 0 included; unset means the default), an SM that is no arch,
// and free text over its cap are INVALID_ARGUMENT naming the field and the range.
TEST_F(BadInput, QueryBoundsAndFreeTextAreCheckedAtTheServer) {
  auto expect_invalid = [](const absl::Status& status, const std::string& needle) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(needle));
  };
  for (const int limit : {0, -1, 10001}) {
    v1::QueryResultsRequest q;
    q.set_limit(limit);
    expect_invalid(client_->QueryResults(q).status(),
                   absl::StrCat("limit: ", limit, " must lie in [1, 10000]"));
  }
  v1::QueryResultsRequest at_cap;
  at_cap.set_limit(10000);
  EXPECT_TRUE(client_->QueryResults(at_cap).ok());
  EXPECT_TRUE(client_->QueryResults(v1::QueryResultsRequest()).ok());  // unset: the default

  for (const int batch : {0, -1, 1025}) {
    v1::BestRequest b;
    b.set_model("preset:tiny-moe");
    b.set_sm(90);
    b.set_batch(batch);
    expect_invalid(client_->Best(b).status(),
                   absl::StrCat("batch: ", batch, " must lie in [1, 1024]"));
  }
  v1::BestRequest unset_batch;
  unset_batch.set_model("preset:tiny-moe");
  unset_batch.set_sm(90);
  EXPECT_TRUE(client_->Best(unset_batch).ok());

  for (const int limit : {0, -1, 100001}) {
    v1::RegressionsRequest r;
    r.set_limit(limit);
    expect_invalid(client_->Regressions(r).status(),
                   absl::StrCat("limit: ", limit, " must lie in [1, 100000]"));
  }
  EXPECT_TRUE(client_->Regressions(v1::RegressionsRequest()).ok());

  v1::BestRequest bad_sm = unset_batch;
  bad_sm.set_sm(-5);
  expect_invalid(client_->Best(bad_sm).status(), "sm: -5 is not an SM architecture");

  const std::string huge(100000, 'x');
  v1::BestRequest long_model = unset_batch;
  long_model.set_model(huge);
  const absl::Status long_model_status = client_->Best(long_model).status();
  expect_invalid(long_model_status, "model: 100000 bytes; the limit is 4096");
  EXPECT_LT(long_model_status.message().size(), 200u);  // never echoed whole
  v1::QueryResultsRequest long_axis;
  (*long_axis.mutable_axis_values())["matmul"] = huge;
  expect_invalid(client_->QueryResults(long_axis).status(),
                 "axis_values['matmul']: 100000 bytes; the limit is 128");
  v1::QueryResultsRequest long_status;
  long_status.set_status(huge);
  expect_invalid(client_->QueryResults(long_status).status(), "status: 100000 bytes");
  v1::RegressionsRequest long_workload;
  long_workload.set_workload(huge);
  expect_invalid(client_->Regressions(long_workload).status(), "workload: 100000 bytes");
}

// A sweep name over its cap is refused at Submit, naming the line, and nothing is stored.
TEST_F(BadInput, SweepNameOverTheCapIsRefused) {
  std::string yaml = kValidSweep;
  yaml.replace(yaml.find("waits"), 5, std::string(100000, 'w'));
  ExpectRejected(
      yaml, "long.yaml", 1,
      "name: 'wwwwwwwwwwwwwwwwwwwwwwwwwwwwwwww...' is 100000 bytes long; the limit is 128");
}

// ------------------------------------------------------------------------------ authentication

constexpr char kAgentToken[] = "agent-secret-0123456789";
constexpr char kUserToken[] = "user-secret-9876543210";

class Auth : public BadInput {
 protected:
  void Configure(CoordinatorOptions& o) override {
    o.agent_token = kAgentToken;
    o.user_token = kUserToken;
  }
};

TEST_F(Auth, UserApiNeedsTheUserToken) {
  const Counts before = Count();
  // No token (client_ sends none).
  auto none = client_->SubmitSweep(kValidSweep, "waits.yaml");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnauthenticated) << none.status();
  EXPECT_EQ(Count(), before);
  // Every user-API method is guarded, not only SubmitSweep.
  EXPECT_EQ(client_->GetSweep(1).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(client_->ListSweeps().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(client_->CancelSweep(1).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(client_->ListAgents().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(client_->QueryResults(v1::QueryResultsRequest()).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(client_->Best(v1::BestRequest()).status().code(), absl::StatusCode::kUnauthenticated);

  // The agent token does not open the user API; neither does a wrong one, nor a prefix of the
  // right one. The message is the same for all and names no token.
  for (const std::string& token :
       {std::string(kAgentToken), std::string("wrong"), std::string(kUserToken).substr(0, 8),
        std::string(kUserToken) + "x"}) {
    ServiceClient client(address_, 10'000, token);
    auto r = client.SubmitSweep(kValidSweep, "waits.yaml");
    ASSERT_FALSE(r.ok()) << token;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnauthenticated) << token << ": " << r.status();
    EXPECT_EQ(std::string(r.status().message()), std::string(none.status().message()));
    EXPECT_THAT(std::string(r.status().message()), ::testing::Not(HasSubstr("secret")));
  }
  EXPECT_EQ(Count(), before);

  // Metadata without the "Bearer " scheme is refused too.
  {
    auto stub = v1::SweepService::NewStub(rpc::MakeChannel(address_));
    grpc::ClientContext context;
    context.AddMetadata("authorization", kUserToken);
    v1::ListSweepsResponse resp;
    EXPECT_EQ(stub->ListSweeps(&context, v1::ListSweepsRequest(), &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(server_->stats().auth_failures, 12);

  // The user token works, on every method.
  ServiceClient user(address_, 10'000, kUserToken);
  auto ok = user.SubmitSweep(kValidSweep, "waits.yaml");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(Count().sweeps, before.sweeps + 1);
  EXPECT_TRUE(user.GetSweep(ok->sweep_id()).ok());
  EXPECT_TRUE(user.ListSweeps().ok());
  EXPECT_TRUE(user.ListAgents().ok());
  EXPECT_TRUE(user.QueryResults(v1::QueryResultsRequest()).ok());
  EXPECT_TRUE(user.CancelSweep(ok->sweep_id()).ok());
  EXPECT_EQ(server_->stats().auth_failures, 12);
  // Refusals are counted in /metrics too, by API.
  const std::string metrics = server_->MetricsText();
  EXPECT_THAT(metrics, HasSubstr("infersweep_auth_failures_total{api=\"user\"} 12"));
  EXPECT_THAT(metrics, HasSubstr("infersweep_auth_failures_total{api=\"agent\"} 0"));
}

TEST_F(Auth, AgentStreamNeedsTheAgentToken) {
  ServiceClient user(address_, 10'000, kUserToken);
  auto submitted = user.SubmitSweep(kValidSweep, "waits.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const Counts before = Count();

  const std::string tokens[] = {"", kUserToken, "wrong-token", std::string(kAgentToken) + " "};
  int i = 0;
  for (const std::string& token : tokens) {
    RawAgent stranger(address_);
    ASSERT_TRUE(stranger.Hello(absl::StrCat("stranger-", i++), token));
    v1::CoordinatorMessage m = stranger.Next();
    EXPECT_FALSE(m.has_welcome()) << "token '" << token << "' was accepted";
    EXPECT_TRUE(m.has_error()) << m.DebugString();
    const grpc::Status status = stranger.End();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << "token '" << token << "': " << status.error_message();
    EXPECT_THAT(status.error_message(), ::testing::Not(HasSubstr("secret")));
  }
  EXPECT_EQ(server_->stats().auth_failures, 4);
  EXPECT_THAT(server_->MetricsText(), HasSubstr("infersweep_auth_failures_total{api=\"agent\"} 4"));
  EXPECT_EQ(server_->stats().agents_connected, 0);
  EXPECT_EQ(Count(), before);
  auto agents = user.ListAgents();
  ASSERT_TRUE(agents.ok()) << agents.status();
  EXPECT_EQ(agents->agents_size(), 0) << "a refused agent was recorded";

  // The coordinator keeps serving: the right token is welcomed.
  RawAgent good(address_);
  ASSERT_TRUE(good.Hello("good", kAgentToken));
  EXPECT_TRUE(good.Next().has_welcome());
  EXPECT_EQ(server_->stats().auth_failures, 4);
  EXPECT_TRUE(good.End().ok());
}

// Per-agent tokens: a token proves the one agent id it belongs to. Another agent's token, or a
// token for an id the file does not list, is refused with the same words as a wrong token.
class AgentTokens : public BadInput {
 protected:
  void Configure(CoordinatorOptions& o) override {
    o.agent_tokens = {{"gpu-host-1", "token-of-gpu-host-1"}, {"gpu-host-2", "token-of-gpu-host-2"}};
  }
};

TEST_F(AgentTokens, AnAgentsTokenProvesOnlyItsOwnId) {
  const struct {
    const char* id;
    const char* token;
  } refused[] = {{"gpu-host-1", "token-of-gpu-host-2"},
                 {"gpu-host-3", "token-of-gpu-host-1"},
                 {"gpu-host-1", ""}};
  for (const auto& r : refused) {
    RawAgent agent(address_);
    ASSERT_TRUE(agent.Hello(r.id, r.token));
    EXPECT_FALSE(agent.Next().has_welcome()) << r.id << " with " << r.token;
    const grpc::Status status = agent.End();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();
    EXPECT_EQ(status.error_message(), "Hello: missing or invalid credentials");
  }
  EXPECT_EQ(server_->stats().auth_failures, 3);
  RawAgent good(address_);
  ASSERT_TRUE(good.Hello("gpu-host-2", "token-of-gpu-host-2"));
  EXPECT_TRUE(good.Next().has_welcome());
  EXPECT_TRUE(good.End().ok());
}

TEST(AuthOptions, SharedAndPerAgentTokensAreAlternatives) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "auth-opts-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  CoordinatorOptions o;
  o.agent_token = "shared-token-0123456789";
  o.agent_tokens = {{"a", "token-of-a-0123456789"}};
  o.log = [](const std::string&) {};
  CoordinatorServer server(o);
  auto port = server.Start("127.0.0.1:0", tmpl + "/c.db");
  ASSERT_FALSE(port.ok());
  EXPECT_EQ(port.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(port.status().message()), HasSubstr("alternatives"));
  server.Stop();
  std::filesystem::remove_all(tmpl);
}

TEST(AuthHelpers, AgentTokensFileErrorsNameTheLine) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "agent-tokens-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const std::string path = tmpl + "/agents.tokens";
  auto write = [&](const std::string& text) {
    { std::ofstream(path) << text; }
    std::filesystem::permissions(
        path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  };
  write("# id token\n\ngpu-host-1  0123456789abcdef0\ngpu-host-2\t0123456789abcdef1\n");
  auto tokens = ReadAgentTokensFile(path);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(tokens->size(), 2u);
  EXPECT_EQ(tokens->at("gpu-host-2"), "0123456789abcdef1");
  const std::pair<std::string, std::string> bad[] = {
      {"gpu-host-1\n", ":1: expected 'AGENT_ID TOKEN', got 1 field(s)"},
      {"gpu host 1 0123456789abcdef0\n", ":1: expected 'AGENT_ID TOKEN', got 4 field(s)"},
      {"a/b 0123456789abcdef0\n", ":1: agent id 'a/b' is not"},
      {"a short\n", ":1: the token of 'a' has 5 characters; at least 16"},
      {"a 0123456789abcdef0\n# x\na 0123456789abcdef1\n", ":3: agent id 'a' given twice"},
      {"a 0123456789abcdef0\nb 0123456789abcdef0\n", ":2: the token of 'b' is another agent's"},
      {"# nobody\n", "lists no agent"},
  };
  for (const auto& [text, message] : bad) {
    write(text);
    auto r = ReadAgentTokensFile(path);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(message)) << text;
    EXPECT_THAT(std::string(r.status().message()), Not(HasSubstr("0123456789abcdef"))) << text;
  }
  write("a 0123456789abcdef0\n");
  std::filesystem::permissions(path, std::filesystem::perms::others_read,
                               std::filesystem::perm_options::add);
  EXPECT_EQ(ReadAgentTokensFile(path).status().code(), absl::StatusCode::kPermissionDenied);
  std::filesystem::remove_all(tmpl);
}

TEST(AuthOptions, EqualAgentAndUserTokensAreRefusedAtStart) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "auth-opts-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  CoordinatorOptions o;
  o.agent_token = "same";
  o.user_token = "same";
  o.log = [](const std::string&) {};
  CoordinatorServer server(o);
  auto port = server.Start("127.0.0.1:0", tmpl + "/c.db");
  EXPECT_FALSE(port.ok());
  EXPECT_EQ(port.status().code(), absl::StatusCode::kInvalidArgument);
  server.Stop();
  std::filesystem::remove_all(tmpl);
}

TEST(AuthHelpers, ConstantTimeEqualsAndTokenFiles) {
  EXPECT_TRUE(rpc::ConstantTimeEquals("abc", "abc"));
  EXPECT_TRUE(rpc::ConstantTimeEquals("", ""));
  EXPECT_FALSE(rpc::ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(rpc::ConstantTimeEquals("abc", "ab"));
  EXPECT_FALSE(rpc::ConstantTimeEquals("", "a"));

  std::string tmpl = (std::filesystem::temp_directory_path() / "auth-files-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const std::string good = tmpl + "/good", empty = tmpl + "/empty", blank = tmpl + "/blank";
  { std::ofstream(good) << "s3cret token\n \t\r\n"; }
  { std::ofstream(empty) << ""; }
  { std::ofstream(blank) << "  \n\n"; }
  std::filesystem::permissions(good, std::filesystem::perms::owner_read |
                                         std::filesystem::perms::owner_write |
                                         std::filesystem::perms::group_read);
  auto t = rpc::ReadTokenFile(good);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, "s3cret token");
  for (const std::string& path : {empty, blank, tmpl + "/missing"}) {
    auto r = rpc::ReadTokenFile(path);
    ASSERT_FALSE(r.ok()) << path;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(path));
  }
  // A token other users can read is refused, naming the file and its mode.
  std::filesystem::permissions(good, std::filesystem::perms::others_read,
                               std::filesystem::perm_options::add);
  auto exposed = rpc::ReadTokenFile(good);
  ASSERT_FALSE(exposed.ok());
  EXPECT_EQ(exposed.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(exposed.status().message()), HasSubstr(good));
  EXPECT_THAT(std::string(exposed.status().message()), HasSubstr("mode 0644"));
  std::filesystem::remove_all(tmpl);
}

// "--metrics-listen=" (empty) turns the /metrics endpoint off, for the coordinator and the
// agent, and is not read as a missing value that takes the next word.
TEST(ServiceCli, EmptyMetricsListenTurnsTheEndpointOff) {
  const std::string dir = MakeTempDir("metrics-off");
  int rc = 0;
  const std::string coordinator = RunCommand(
      absl::StrCat("timeout 3 '", WorkerBinary(), "' coordinator --metrics-listen= --listen ",
                   "127.0.0.1:0 --db '", dir, "/c.db' 2>&1"),
      &rc);
  EXPECT_THAT(coordinator, HasSubstr("listening on"));
  EXPECT_THAT(coordinator, Not(HasSubstr("metrics on")));
  const std::string agent = RunCommand(
      absl::StrCat("timeout 3 '", WorkerBinary(), "' agent --metrics-listen= --coordinator ",
                   "127.0.0.1:1 --spool '", dir, "/a.db' 2>&1"),
      &rc);
  EXPECT_THAT(agent, Not(HasSubstr("metrics on")));
  EXPECT_THAT(agent, Not(HasSubstr("not expected")));
  const std::string with = RunCommand(
      absl::StrCat("timeout 3 '", WorkerBinary(), "' coordinator --metrics-listen=127.0.0.1:0 ",
                   "--listen 127.0.0.1:0 --db '", dir, "/d.db' 2>&1"),
      &rc);
  EXPECT_THAT(with, HasSubstr("metrics on"));
  std::filesystem::remove_all(dir);
}

// A TLS private key other users can read is refused by both credential makers before it is
// read, naming the file and its mode; owner- and group-only keys get past that check.
TEST(AuthHelpers, TlsPrivateKeyReadableByOthersIsRefused) {
  std::string dir = (std::filesystem::temp_directory_path() / "tls-key-XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string cert = dir + "/cert.pem", key = dir + "/key.pem";
  { std::ofstream(cert) << "-----BEGIN CERTIFICATE-----\nnot really\n-----END CERTIFICATE-----\n"; }
  { std::ofstream(key) << "-----BEGIN PRIVATE KEY-----\nnot really\n-----END PRIVATE KEY-----\n"; }
  namespace fs = std::filesystem;
  rpc::TlsOptions tls;
  tls.cert_file = cert;
  tls.key_file = key;
  fs::permissions(key, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                           fs::perms::others_read);
  auto server = rpc::MakeServerCredentials(tls);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kPermissionDenied) << server.status();
  EXPECT_THAT(std::string(server.status().message()), HasSubstr(key));
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("mode 0644"));
  auto client = rpc::MakeChannelCredentials(tls);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kPermissionDenied) << client.status();
  fs::permissions(key, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  EXPECT_NE(rpc::MakeServerCredentials(tls).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(rpc::MakeChannelCredentials(tls).status().code(), absl::StatusCode::kPermissionDenied);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace infersweep
