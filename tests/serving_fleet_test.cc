// Serving workloads through the fleet: the sweep YAML (`workload: {mode: serving, ...}`) and its
// errors, the workload and result JSON, the worker-isolated trial (CRASHED, TIMEOUT, INCORRECT
// under kv-slot-swap), SQLite rows per load point with their migration, `best` never ranking a
// serving point against a lockstep batch, the Prometheus gauges, and a sweep over real loopback
// gRPC.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/agent.h"
#include "api/serve_spec.h"
#include "api/trial.h"
#include "coordinator/client.h"
#include "coordinator/metrics.h"
#include "coordinator/server.h"
#include "coordinator/sweep_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "harness/runner.h"
#include "storage/schema.h"
#include "storage/store.h"
#include "tests/raw_db.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;

constexpr char kServingSweep[] = R"(name: serving
model: preset:tiny-moe
layers: 1
device: cpu
matrix:
  matmul: [naive, blocked]
workload:
  mode: serving
  concurrency: [1, 4]
  isl: 8
  osl: 4
  requests: 4
  slo: {ttft_ms: 100000, tpot_ms: 100000}
  timeout: 120
)";

// ---------------------------------------------------------------------------------------------
// Sweep YAML

TEST(ServingSweepSpec, ParsesTheIssueExampleIntoTrialsThatCarryTheSpec) {
  const std::string yaml = R"(name: s
model: preset:tiny-moe
device: cpu
matrix: {matmul: [naive]}
workload: {mode: serving, concurrency: [1, 4], isl: 64, osl: 16, requests: 8, slo: {ttft_ms: 2000, tpot_ms: 50}}
)";
  absl::StatusOr<SweepSpec> spec = ParseSweepSpec(yaml, "s.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(spec->workload.serve.has_value());
  const ServeSpec& serve = *spec->workload.serve;
  EXPECT_EQ(serve.concurrency, (std::vector<int>{1, 4}));
  EXPECT_TRUE(serve.rate.empty());
  EXPECT_EQ(serve.isl_min, 64);
  EXPECT_EQ(serve.isl_max, 64);
  EXPECT_EQ(serve.osl_min, 16);
  EXPECT_EQ(serve.requests, 8);
  EXPECT_EQ(spec->workload.slo.ttft_ms, 2000);
  EXPECT_EQ(spec->workload.slo.tpot_ms, 50);
  EXPECT_EQ(WorkloadKey(spec->workload),
            "serve:isl=64,osl=16,requests=8,warmup=0,chunk=0,seed=1;slo:ttft_ms=2000,tpot_ms=50,"
            "percentile=99");
  absl::StatusOr<std::vector<TrialRecord>> trials = ExpandSweep(*spec, 7);
  ASSERT_TRUE(trials.ok()) << trials.status();
  ASSERT_EQ(trials->size(), 1u);
  ASSERT_TRUE((*trials)[0].workload.serve.has_value());
  EXPECT_EQ((*trials)[0].workload.serve->concurrency, (std::vector<int>{1, 4}));
}

TEST(ServingSweepSpec, RatesRangesAndTheOtherFields) {
  const std::string yaml = R"(model: preset:tiny-moe
device: cpu
matrix: {matmul: [naive]}
workload:
  mode: serving
  rate: [0.5, 2]
  max_concurrency: 8
  isl: 32-64
  osl: "4-12"
  duration: 2.5
  warmup: 3
  chunk: 16
  seed: 9
  timeout: 90
)";
  absl::StatusOr<SweepSpec> spec = ParseSweepSpec(yaml, "r.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const ServeSpec& serve = *spec->workload.serve;
  EXPECT_EQ(serve.rate, (std::vector<double>{0.5, 2}));
  EXPECT_EQ(serve.max_concurrency, 8);
  EXPECT_EQ(serve.isl_min, 32);
  EXPECT_EQ(serve.isl_max, 64);
  EXPECT_EQ(serve.osl_min, 4);
  EXPECT_EQ(serve.osl_max, 12);
  EXPECT_EQ(serve.duration_s, 2.5);
  EXPECT_EQ(serve.requests, 0);
  EXPECT_EQ(serve.warmup, 3);
  EXPECT_EQ(serve.chunk, 16);
  EXPECT_EQ(serve.seed, 9u);
  EXPECT_EQ(spec->workload.timeout_s, 90);
  EXPECT_TRUE(spec->workload.slo.empty());
  const std::vector<LoadPoint> points = LoadPoints(serve);
  ASSERT_EQ(points.size(), 2u);
  EXPECT_EQ(LoadPointName(points[0]), "rate=0.5,max_concurrency=8");
  // An explicit lockstep mode is the default workload.
  absl::StatusOr<SweepSpec> lockstep = ParseSweepSpec(
      "model: preset:tiny-moe\ndevice: cpu\nmatrix: {matmul: [naive]}\n"
      "workload: {mode: lockstep, prompt: 8, batch: [1, 2]}\n",
      "l.yaml");
  ASSERT_TRUE(lockstep.ok()) << lockstep.status();
  EXPECT_FALSE(lockstep->workload.serve.has_value());
  EXPECT_EQ(lockstep->workload.prompt_len, 8);
}

struct YamlError {
  std::string workload;  // the lines after "workload:", each indented by two spaces
  std::string want;      // a substring of the error: "w.yaml:LINE: field: ..."
};

class ServingSweepSpecError : public ::testing::TestWithParam<YamlError> {};

// The workload block starts on line 4; its first key is on line 5.
TEST_P(ServingSweepSpecError, NamesTheFieldAndTheLine) {
  const std::string yaml =
      absl::StrCat("model: preset:tiny-moe\ndevice: cpu\n",
                   "matrix: {matmul: [naive]}\nworkload:\n", GetParam().workload);
  absl::StatusOr<SweepSpec> spec = ParseSweepSpec(yaml, "w.yaml");
  ASSERT_FALSE(spec.ok()) << yaml;
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(), HasSubstr(GetParam().want)) << yaml;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ServingSweepSpecError,
    ::testing::Values(
        YamlError{"  mode: serving\n  concurrency: [1, 0]\n  requests: 2\n",
                  "w.yaml:6: workload.concurrency: 0 is outside [1, 4096]"},
        YamlError{"  mode: serving\n  concurrency: 4\n  requests: 2\n  isl: abc\n",
                  "w.yaml:8: workload.isl: 'abc' is not a length N or a range A-B"},
        YamlError{"  mode: serving\n  concurrency: 4\n  requests: 2\n  osl: 9-3\n",
                  "w.yaml:8: workload.osl: '9-3' must lie in [1, 65536]"},
        YamlError{"  mode: batch\n", "w.yaml:5: workload.mode: unknown mode 'batch'"},
        YamlError{"  mode: serving\n  concurrency: 4\n",
                  "w.yaml:4: workload needs exactly one of 'requests'"},
        YamlError{"  mode: serving\n  isl: 8\n  requests: 2\n", "w.yaml:4: workload needs a load"},
        YamlError{"  mode: serving\n  concurrency: 4\n  requests: 2\n  prompt: 8\n",
                  "w.yaml:8: workload: unknown key 'prompt' for mode serving"},
        YamlError{"  concurrency: [1, 4]\n",
                  "w.yaml:5: workload: unknown key 'concurrency' (a serving workload's key: it "
                  "needs mode: serving)"},
        YamlError{"  mode: serving\n  concurrency: 4\n  requests: 2\n  slo: {ttft_ms: -1}\n",
                  "w.yaml:8: workload.slo.ttft_ms: -1 is outside"},
        YamlError{"  mode: serving\n  concurrency: 4\n  requests: 2\n  slo: {p99: 3}\n",
                  "w.yaml:8: workload.slo: unknown key 'p99'"},
        YamlError{"  mode: serving\n  concurrency: 4\n  requests: 2\n  slo: {percentile: 90}\n",
                  "w.yaml:8: workload.slo: needs a bound"},
        YamlError{"  mode: serving\n  concurrency: 4\n  requests: 2\n  max_concurrency: 8\n",
                  "w.yaml:8: workload field 'max_concurrency' caps an open loop: it needs 'rate'"},
        YamlError{"  mode: serving\n  rate: [2, 0]\n  requests: 2\n",
                  "w.yaml:6: workload.rate: a request rate must be positive"},
        YamlError{"  mode: serving\n  concurrency: 4\n  requests: 2\n  duration: 5\n",
                  "w.yaml:4: workload needs exactly one of 'requests'"},
        YamlError{"  mode: serving\n  concurrency: 4\n  requests: 2\n  timeout: 0\n",
                  "w.yaml:8: workload field 'timeout'"}));

// ---------------------------------------------------------------------------------------------
// JSON

ServingPoint MakePoint(int concurrency, double tok_s, double goodput, TrialStatus verdict) {
  ServingPoint p;
  p.point = {false, concurrency, 0};
  p.verdict = verdict;
  p.requests_checked = p.requests_matching = p.completed = 4;
  if (verdict != TrialStatus::kOk) {
    p.requests_matching = 3;
    p.first_mismatch = "request 2: served tokens part at 1";
  }
  p.total_input_tokens = 32;
  p.total_output_tokens = 16;
  p.duration_s = 16 / tok_s;
  p.request_throughput = 4 / p.duration_s;
  p.output_throughput = tok_s;
  p.total_token_throughput = 48 / p.duration_s;
  p.output_tok_s_per_user = tok_s / concurrency;
  p.ttft_ms = {2, 1.5, 3, 4};
  p.tpot_ms = {1, 0.9, 1.2, 1.5};
  p.itl_ms = {1, 0.8, 1.4, 2};
  p.e2el_ms = {5, 4.5, 6, 7};
  p.request_goodput = goodput;
  p.meets_slo = true;
  return p;
}

TEST(ServingJson, WorkloadAndResultRoundTrip) {
  TrialRequest request;
  request.trial_id = "1-0";
  request.model = "preset:tiny-moe";
  request.workload.serve = *ParseServeSpec("rate=0.5:2,max_concurrency=8,isl=4-9,osl=3,duration=2");
  request.workload.slo = *ParseSlo("tpot_ms=50,percentile=90");
  absl::StatusOr<TrialRequest> back = TrialRequestFromJson(ToJson(request));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(back->workload.serve.has_value());
  EXPECT_EQ(ServeSpecString(*back->workload.serve), ServeSpecString(*request.workload.serve));
  EXPECT_EQ(SloString(back->workload.slo), "tpot_ms=50,percentile=90");
  EXPECT_EQ(WorkloadKey(back->workload), WorkloadKey(request.workload));
  // A serving key reads back through the --workload check; a lockstep one is unchanged.
  EXPECT_EQ(*CanonicalWorkloadKey(WorkloadKey(request.workload)), WorkloadKey(request.workload));
  EXPECT_EQ(*CanonicalWorkloadKey("prompt=8"), "prompt=8,output=32,warmup=1");
  EXPECT_FALSE(CanonicalWorkloadKey("serve:isl=4,concurrency=2,requests=1").ok());

  TrialResult r;
  r.status = TrialStatus::kIncorrect;
  r.serving = {MakePoint(1, 100, 2, TrialStatus::kOk),
               MakePoint(4, 300, 5, TrialStatus::kIncorrect)};
  r.serving[0].slots_capped_at = 3;  // the memory plan's cap and a refused point's words
  ServingPoint refused;
  refused.point = {false, 64, 0};
  refused.verdict = TrialStatus::kUnsupported;
  refused.reason = "64 KV slots: needs 90.00 GiB on the device (...), 80.00 GiB free";
  r.serving.push_back(refused);
  ServingSloSearch search;
  search.found = true;
  search.best = MakePoint(3, 250, 4, TrialStatus::kOk);
  search.probes = {*search.best};
  r.slo_search = search;
  const nlohmann::json j = ToJson(r);
  EXPECT_EQ(j["serving"][1]["load_point"], "concurrency=4");
  EXPECT_EQ(j["serving"][1]["p99_tpot_ms"], 1.5);
  EXPECT_EQ(j["serving"][1]["verdict"], "INCORRECT");
  absl::StatusOr<TrialResult> parsed = TrialResultFromJson(j);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->serving.size(), 3u);
  EXPECT_EQ(ToJson(*parsed), j);
  EXPECT_EQ(parsed->serving[0].slots_capped_at, 3);
  EXPECT_FALSE(parsed->serving[1].slots_capped_at.has_value());
  EXPECT_EQ(parsed->serving[2].verdict, TrialStatus::kUnsupported);
  EXPECT_EQ(parsed->serving[2].reason, refused.reason);
  EXPECT_FALSE(j["serving"][1].contains("reason"));
  // A lockstep result's JSON has neither key.
  EXPECT_FALSE(ToJson(TrialResult{}).contains("serving"));

  nlohmann::json bad = j;
  bad["serving"][0]["mode"] = "burst";
  EXPECT_THAT(TrialResultFromJson(bad).status().message(),
              HasSubstr("result.serving[].mode: unknown 'burst'"));
  bad = j;
  bad["serving"][0]["slots_capped_at"] = 0;
  EXPECT_THAT(TrialResultFromJson(bad).status().message(),
              HasSubstr("result.serving[].slots_capped_at: not a positive slot count"));
  bad = j;
  bad["serving"][0]["p99_ttft_ms"] = "slow";
  EXPECT_THAT(TrialResultFromJson(bad).status().message(),
              HasSubstr("result.serving[].p99_ttft_ms: wrong type"));
  nlohmann::json bad_request = ToJson(request);
  bad_request["workload"]["serve"]["requests"] = 5;  // and a duration: exactly one is allowed
  EXPECT_THAT(TrialRequestFromJson(bad_request).status().message(),
              HasSubstr("needs exactly one of 'requests'"));
}

// ---------------------------------------------------------------------------------------------
// The trial worker

TrialRequest ServingRequest(const std::string& fault = "") {
  TrialRequest r;
  r.trial_id = "serve";
  r.model = "preset:tiny-moe";
  r.layers = 2;
  r.config = *ParseBackendConfig("device=cpu");
  r.workload.serve = *ParseServeSpec("concurrency=1:4,isl=12,osl=6,requests=4,warmup=1");
  r.workload.slo = *ParseSlo("ttft_ms=100000,tpot_ms=100000");
  r.workload.timeout_s = 120;
  r.inject_fault = fault;
  return r;
}

RunnerOptions WorkerOptions() {
  RunnerOptions options;
  options.worker_argv = {WorkerBinary(), "worker"};
  return options;
}

TEST(ServingWorker, LoadPointsRunIsolatedAndFaultsAreClassified) {
  TrialRunner runner(WorkerOptions());
  const TrialResult ok = runner.Run(ServingRequest());
  ASSERT_EQ(ok.status, TrialStatus::kOk) << ok.reason << "\n" << ok.stderr_tail;
  EXPECT_EQ(ok.workload, WorkloadKey(ServingRequest().workload));
  EXPECT_TRUE(ok.batches.empty());
  ASSERT_EQ(ok.serving.size(), 2u);
  EXPECT_EQ(LoadPointName(ok.serving[0].point), "concurrency=1");
  EXPECT_EQ(LoadPointName(ok.serving[1].point), "concurrency=4");
  for (const ServingPoint& p : ok.serving) {
    SCOPED_TRACE(LoadPointName(p.point));
    EXPECT_EQ(p.verdict, TrialStatus::kOk) << p.first_mismatch;
    EXPECT_EQ(p.completed, 4);
    EXPECT_EQ(p.requests_checked, 5);  // the warm-up request is checked too
    EXPECT_EQ(p.requests_matching, 5);
    EXPECT_EQ(p.total_output_tokens, 4 * 6);
    EXPECT_LE(p.ttft_ms.median, p.ttft_ms.p90);
    EXPECT_LE(p.ttft_ms.p90, p.ttft_ms.p99);
    EXPECT_LE(p.tpot_ms.median, p.tpot_ms.p99);
    EXPECT_GT(p.output_throughput, 0);
    ASSERT_TRUE(p.request_goodput.has_value());
    EXPECT_GT(*p.request_goodput, 0);
    EXPECT_EQ(p.meets_slo, true);
  }
  EXPECT_EQ(ok.serving[1].peak_running, 4);
  ASSERT_TRUE(ok.slo_search.has_value());
  EXPECT_TRUE(ok.slo_search->found);
  ASSERT_TRUE(ok.slo_search->best.has_value());
  EXPECT_EQ(LoadPointName(ok.slo_search->best->point), "concurrency=4");

  // A wrong KV slot mid-run: the served tokens part from the lone runs.
  const TrialResult swapped = runner.Run(ServingRequest("kv-slot-swap:2"));
  EXPECT_EQ(swapped.status, TrialStatus::kIncorrect) << swapped.reason;
  ASSERT_EQ(swapped.serving.size(), 2u);
  EXPECT_EQ(swapped.serving[1].verdict, TrialStatus::kIncorrect);
  EXPECT_LT(swapped.serving[1].requests_matching, swapped.serving[1].requests_checked);
  // The listed point that parted is named first, then any SLO probe that did.
  EXPECT_THAT(swapped.reason, ::testing::StartsWith("concurrency=4: "));
  EXPECT_FALSE(swapped.verdict.failures.empty());

  const TrialResult segv = runner.Run(ServingRequest("segv"));
  EXPECT_EQ(segv.status, TrialStatus::kCrashed);
  EXPECT_THAT(segv.reason, HasSubstr("SIGSEGV"));

  TrialRequest hang = ServingRequest("hang");
  hang.workload.timeout_s = 3;
  const auto start = std::chrono::steady_clock::now();
  const TrialResult hung = runner.Run(hang);
  EXPECT_EQ(hung.status, TrialStatus::kTimeout);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));

  // The runner carries on with a fresh worker: an open loop at a Poisson rate, without an SLO.
  TrialRequest poisson = ServingRequest();
  poisson.workload.serve =
      *ParseServeSpec("rate=200,max_concurrency=3,isl=6-12,osl=3-6,requests=6");
  poisson.workload.slo = Slo{};
  const TrialResult open_loop = runner.Run(poisson);
  ASSERT_EQ(open_loop.status, TrialStatus::kOk) << open_loop.reason << "\n"
                                                << open_loop.stderr_tail;
  ASSERT_EQ(open_loop.serving.size(), 1u);
  EXPECT_EQ(LoadPointName(open_loop.serving[0].point), "rate=200,max_concurrency=3");
  EXPECT_EQ(open_loop.serving[0].completed, 6);
  EXPECT_EQ(open_loop.serving[0].requests_matching, 6);
  EXPECT_LE(open_loop.serving[0].peak_running, 3);
  EXPECT_FALSE(open_loop.serving[0].request_goodput.has_value());
  EXPECT_FALSE(open_loop.slo_search.has_value());

  // A device whose engine runs no ragged steps (or no such device here) is UNSUPPORTED.
  TrialRequest cuda = ServingRequest();
  cuda.config = *ParseBackendConfig("device=cuda");
  const TrialResult unsupported = runner.Run(cuda);
  EXPECT_EQ(unsupported.status, TrialStatus::kUnsupported) << unsupported.reason;
  EXPECT_TRUE(unsupported.serving.empty());
}

// `run --serve` runs each config's load points in a worker too: a crash there is CRASHED and
// the command goes on to the next config.
TEST(ServingWorker, RunServeIsolatesEachConfig) {
  int code = -1;
  const std::string out =
      RunCommand(WorkerBinary() +
                     " run --model preset:tiny-moe --layers 1 --config 'matmul=naive|blocked'"
                     " --serve concurrency=2,isl=8,osl=3,requests=2 --test-inject-fault segv 2>&1",
                 &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("each in a worker process"));
  size_t crashed = 0;
  for (size_t at = out.find("CRASHED"); at != std::string::npos; at = out.find("CRASHED", at + 1))
    ++crashed;
  EXPECT_EQ(crashed, 2u) << out;
  EXPECT_THAT(out, HasSubstr("SIGSEGV"));
}

// ---------------------------------------------------------------------------------------------
// Storage and best

class ServingStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("serving-store");
    ASSERT_FALSE(dir_.empty());
    path_ = dir_ + "/coord.db";
    Open();
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Open() {
    store_.reset();
    absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
  }

  // A sweep of one trial per config with `workload`; returns the trial ids.
  std::vector<std::string> Sweep(const Workload& workload,
                                 const std::vector<BackendConfig>& configs) {
    std::vector<TrialRecord> trials;
    for (const BackendConfig& c : configs) {
      TrialRecord t;
      t.model = "preset:tiny-moe";
      t.layers = 1;
      t.config = c;
      t.workload = workload;
      t.selector.device = Device::kCpu;
      trials.push_back(t);
    }
    SweepRecord s;
    s.name = "s";
    s.spec_yaml = "name: s\n";
    s.model = "preset:tiny-moe";
    absl::StatusOr<int64_t> id = store_->CreateSweep(s, trials);
    EXPECT_TRUE(id.ok()) << id.status();
    std::vector<std::string> ids;
    for (size_t i = 0; i < configs.size(); ++i) ids.push_back(absl::StrCat(id.value_or(0), "-", i));
    return ids;
  }

  // A result the coordinator stores without a lease (agent ""), on the CPU.
  void Record(const std::string& trial, const BackendConfig& config, TrialStatus status,
              std::vector<ServingPoint> serving, std::vector<BatchFigures> batches = {}) {
    TrialResult r;
    r.trial_id = trial;
    r.attempt = 1;
    r.status = status;
    r.model = "preset:tiny-moe";
    r.config = config;
    r.device = "cpu";
    r.serving = std::move(serving);
    r.batches = std::move(batches);
    r.finished_unix_ms = 1000 + (++clock_);
    absl::Status s = store_->RecordResult("", "cpu", 0, r);
    ASSERT_TRUE(s.ok()) << s;
  }

  BestQuery Query(const std::string& metric) {
    BestQuery q;
    q.model = "preset:tiny-moe";
    q.sm = 0;
    q.metric = metric;
    return q;
  }

  std::string dir_, path_;
  std::unique_ptr<Store> store_;
  int clock_ = 0;
};

const BackendConfig kNaive = {{"device", "cpu"}, {"matmul", "naive"}};
const BackendConfig kBlocked = {{"device", "cpu"}, {"matmul", "blocked"}};

Workload ServingWorkload() {
  Workload w;
  w.serve = *ParseServeSpec("concurrency=1:4,isl=8,osl=4,requests=4");
  w.slo = *ParseSlo("ttft_ms=1000,tpot_ms=100");
  return w;
}

BatchFigures Batch(int batch, double tok_s) {
  BatchFigures b;
  b.batch = batch;
  b.output_tok_s = {tok_s, tok_s, tok_s};
  b.ttft_ms = b.tpot_ms = {1, 1, 1};
  return b;
}

TEST_F(ServingStoreTest, OneRowPerLoadPointAndTheResultReadsBack) {
  const std::vector<std::string> ids = Sweep(ServingWorkload(), {kNaive});
  Record(ids[0], kNaive, TrialStatus::kOk,
         {MakePoint(1, 100, 2, TrialStatus::kOk), MakePoint(4, 300, 5, TrialStatus::kOk)});
  RawDb raw(path_);
  EXPECT_EQ(raw.Count("serving_points"), 2);
  EXPECT_EQ(raw.Query("SELECT group_concat(load_point || ':' || output_throughput || ':' || "
                      "request_goodput || ':' || ok, ' ') FROM (SELECT * FROM serving_points "
                      "ORDER BY point_index)"),
            "concurrency=1:100.0:2.0:1 concurrency=4:300.0:5.0:1");
  EXPECT_EQ(raw.Query("SELECT DISTINCT workload FROM serving_points"),
            WorkloadKey(ServingWorkload()));
  EXPECT_EQ(raw.Count("result_batches"), 0);  // nothing lockstep to rank

  ResultQuery q;
  q.workload = WorkloadKey(ServingWorkload());
  absl::StatusOr<std::vector<StoredResult>> rows = store_->QueryResults(q);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 1u);
  const TrialResult& back = (*rows)[0].result;
  ASSERT_EQ(back.serving.size(), 2u);
  EXPECT_EQ(back.serving[1].output_throughput, 300);
  EXPECT_EQ(back.serving[1].tpot_ms.p99, 1.5);
  EXPECT_EQ(back.serving[1].request_goodput, 5);
  // The trial's serving workload survives the trials table too.
  absl::StatusOr<TrialRecord> trial = store_->GetTrial(ids[0]);
  ASSERT_TRUE(trial.ok()) << trial.status();
  ASSERT_TRUE(trial->workload.serve.has_value());
  EXPECT_EQ(trial->workload.serve->concurrency, (std::vector<int>{1, 4}));
}

// A lockstep batch and a serving point are never ranked together, whatever their figures; a
// serving metric ranks within one load point; an INCORRECT result's points never win.
TEST_F(ServingStoreTest, BestNeverRanksAServingPointAgainstALockstepBatch) {
  Workload lockstep;
  lockstep.batch_sizes = {1, 4};
  const std::vector<std::string> lockstep_ids = Sweep(lockstep, {kNaive});
  Record(lockstep_ids[0], kNaive, TrialStatus::kOk, {}, {Batch(1, 1e6), Batch(4, 4e6)});
  const std::vector<std::string> serving_ids = Sweep(ServingWorkload(), {kNaive, kBlocked});
  Record(serving_ids[0], kNaive, TrialStatus::kOk,
         {MakePoint(1, 100, 2, TrialStatus::kOk), MakePoint(4, 300, 5, TrialStatus::kOk)});
  Record(serving_ids[1], kBlocked, TrialStatus::kOk,
         {MakePoint(1, 120, 1, TrialStatus::kOk), MakePoint(4, 280, 7, TrialStatus::kOk)});
  const std::vector<std::string> bad_ids = Sweep(ServingWorkload(), {kBlocked});
  Record(
      bad_ids[0], kBlocked, TrialStatus::kIncorrect,
      {MakePoint(1, 1e9, 1e9, TrialStatus::kOk), MakePoint(4, 1e9, 1e9, TrialStatus::kIncorrect)});

  // Lockstep: the lockstep result, one group, no load point.
  absl::StatusOr<BestAnswer> a = store_->Best(Query("output_tok_s"));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->groups.size(), 1u);
  EXPECT_EQ(a->groups[0].load_point, "");
  ASSERT_TRUE(a->best.has_value());
  EXPECT_EQ(a->best->result.trial_id, lockstep_ids[0]);

  // Serving without a load point: two groups (concurrency=1 and 4) listed, nothing ranked.
  BestQuery q = Query("output_tok_s");
  q.serving = true;
  a = store_->Best(q);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->groups.size(), 2u);
  EXPECT_FALSE(a->best.has_value());
  for (const ResultGroup& g : a->groups) {
    EXPECT_EQ(g.workload, WorkloadKey(ServingWorkload()));
    EXPECT_EQ(g.ok_results, 2);  // the INCORRECT result's points are not OK
  }
  q = Query("goodput");
  a = store_->Best(q);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->groups.size(), 2u);
  EXPECT_FALSE(a->best.has_value());

  // Within one load point: the serving results only, by the metric's direction.
  auto best_at = [&](const std::string& metric, const std::string& point) -> std::string {
    BestQuery bq = Query(metric);
    bq.load_point = point;
    absl::StatusOr<BestAnswer> answer = store_->Best(bq);
    EXPECT_TRUE(answer.ok()) << answer.status();
    if (!answer.ok() || !answer->best) return "none";
    EXPECT_EQ(answer->groups.size(), 1u);
    EXPECT_EQ(answer->groups[0].load_point, point);
    return answer->best->result.trial_id;
  };
  EXPECT_EQ(best_at("output_tok_s", "concurrency=4"), serving_ids[0]);  // 300 > 280
  EXPECT_EQ(best_at("output_tok_s", "concurrency=1"), serving_ids[1]);  // 120 > 100
  EXPECT_EQ(best_at("goodput", "concurrency=4"), serving_ids[1]);       // 7 > 5
  EXPECT_EQ(best_at("output_tok_s_per_user", "concurrency=1"), serving_ids[1]);
  EXPECT_EQ(best_at("p99_tpot_ms", "concurrency=8"), "none");

  // Lockstep batch 4 still answers from the lockstep result alone.
  BestQuery b4 = Query("output_tok_s");
  b4.batch = 4;
  a = store_->Best(b4);
  ASSERT_TRUE(a.ok() && a->best.has_value());
  EXPECT_EQ(a->best->result.trial_id, lockstep_ids[0]);
  // A serving-only metric on lockstep batches is refused by name.
  EXPECT_THAT(store_->Best(Query("p50_tpot_ms")).status().message(),
              HasSubstr("unknown metric 'p50_tpot_ms'"));
  BestQuery unknown = Query("prefill_tok_s");
  unknown.serving = true;
  EXPECT_THAT(store_->Best(unknown).status().message(),
              HasSubstr("unknown serving metric 'prefill_tok_s'"));
}

// A result whose figures do not fit its trial's workload is refused whole: load points for a
// lockstep trial, lockstep batches for a serving one.
TEST_F(ServingStoreTest, AResultOfTheOtherKindIsRefusedAndNothingIsStored) {
  Workload lockstep;
  const std::vector<std::string> lockstep_ids = Sweep(lockstep, {kNaive});
  const std::vector<std::string> serving_ids = Sweep(ServingWorkload(), {kNaive});
  TrialResult r;
  r.trial_id = lockstep_ids[0];
  r.attempt = 1;
  r.status = TrialStatus::kOk;
  r.config = kNaive;
  r.serving = {MakePoint(4, 1e9, 1e9, TrialStatus::kOk)};
  absl::Status s = store_->RecordResult("", "cpu", 0, r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("result.serving: 1 load point(s) for a lockstep trial"));
  r.trial_id = serving_ids[0];
  r.serving.clear();
  r.batches = {Batch(1, 1e9)};
  s = store_->RecordResult("", "cpu", 0, r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("result.batches: 1 lockstep batch(es) for a serving trial"));
  RawDb raw(path_);
  EXPECT_EQ(raw.Count("results"), 0);
  EXPECT_EQ(raw.Count("serving_points"), 0);
  EXPECT_EQ(raw.Count("result_batches"), 0);
  EXPECT_EQ(store_->GetTrial(lockstep_ids[0])->state, TrialState::kQueued);
}

// A database from the build before serving points (no serving_points table nor anything newer)
// opens, keeps its results and its ranking, and takes serving results from then on.
TEST_F(ServingStoreTest, ADatabaseFromBeforeServingPointsIsMigrated) {
  Workload lockstep;
  const std::vector<std::string> ids = Sweep(lockstep, {kNaive});
  Record(ids[0], kNaive, TrialStatus::kOk, {}, {Batch(1, 42)});
  store_.reset();
  {
    RawDb raw(path_);
    ASSERT_EQ(raw.Exec("DROP TABLE serving_points"), SQLITE_OK);
    ASSERT_EQ(raw.Exec("ALTER TABLE results DROP COLUMN result_digest"), SQLITE_OK);
    ASSERT_EQ(raw.Exec(absl::StrCat("PRAGMA user_version = ", LatestSchemaVersion() - 2)),
              SQLITE_OK);
  }
  Open();
  RawDb raw(path_);
  EXPECT_EQ(raw.Query("PRAGMA user_version"), std::to_string(LatestSchemaVersion()));
  EXPECT_EQ(raw.Query("PRAGMA integrity_check"), "ok");
  EXPECT_EQ(raw.Count("serving_points"), 0);
  absl::StatusOr<BestAnswer> a = store_->Best(Query("output_tok_s"));
  ASSERT_TRUE(a.ok() && a->best.has_value());
  EXPECT_EQ(a->best->result.trial_id, ids[0]);
  EXPECT_EQ(a->best->result.batches[0].output_tok_s.median, 42);

  const std::vector<std::string> serving = Sweep(ServingWorkload(), {kNaive});
  Record(serving[0], kNaive, TrialStatus::kOk, {MakePoint(4, 300, 5, TrialStatus::kOk)});
  BestQuery q = Query("goodput");
  q.load_point = "concurrency=4";
  a = store_->Best(q);
  ASSERT_TRUE(a.ok() && a->best.has_value());
  EXPECT_EQ(a->best->result.trial_id, serving[0]);
}

// ---------------------------------------------------------------------------------------------
// Metrics

TEST(ServingMetrics, OneSeriesPerConfigAndLoadPointOfOkResults) {
  CoordinatorMetrics m;
  TrialResult r;
  r.status = TrialStatus::kOk;
  r.serving = {MakePoint(1, 100, 2, TrialStatus::kOk), MakePoint(4, 300, 5, TrialStatus::kOk)};
  m.OnResult("preset:tiny-moe", 0, "cpu", kNaive, r);
  TrialResult bad = r;
  bad.status = TrialStatus::kIncorrect;
  m.OnResult("preset:tiny-moe", 0, "cpu", kBlocked, bad);
  const std::string text = m.Serialize();
  const std::string labels = absl::StrCat("config=\"", BackendConfigString(kNaive),
                                          "\",gpu=\"cpu\",load_point=\"concurrency=4\",mode="
                                          "\"closed_loop\",model=\"preset:tiny-moe\",sm_arch="
                                          "\"cpu\"}");
  EXPECT_THAT(text, HasSubstr("infersweep_serving_output_tokens_per_second{" + labels + " 300"));
  EXPECT_THAT(text,
              HasSubstr("infersweep_serving_output_tokens_per_second_per_user{" + labels + " 75"));
  EXPECT_THAT(text, HasSubstr("infersweep_serving_ttft_p99_seconds{" + labels + " 0.004"));
  EXPECT_THAT(text, HasSubstr("infersweep_serving_tpot_p99_seconds{" + labels + " 0.0015"));
  EXPECT_THAT(text, HasSubstr("infersweep_serving_goodput_requests_per_second{" + labels + " 5"));
  EXPECT_THAT(text, HasSubstr("infersweep_serving_load{" + labels + " 4"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr(BackendConfigString(kBlocked) + "\",gpu")));
}

// ---------------------------------------------------------------------------------------------
// The fleet over loopback gRPC

TEST(ServingFleet, ASweepWithAServingWorkloadIsStoredAndBestAnswersFromIt) {
  const std::string dir = MakeTempDir("serving-fleet");
  ASSERT_FALSE(dir.empty());
  LineLog log;
  CoordinatorOptions options;
  options.lease_ms = 60'000;
  options.tick_ms = 50;
  options.log = [&](const std::string& line) { log.Add("coordinator", line); };
  CoordinatorServer server(std::move(options));
  absl::StatusOr<int> port = server.Start("127.0.0.1:0", dir + "/coordinator.db");
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string address = absl::StrCat("127.0.0.1:", *port);
  std::unique_ptr<Agent> agent;
  {
    AgentOptions o;
    o.coordinator = address;
    o.agent_id = "cpu-agent";
    o.spool_path = dir + "/agent.spool.db";
    o.worker_argv = {WorkerBinary(), "worker"};
    o.initial_backoff_ms = 50;
    o.max_backoff_ms = 300;
    o.log = [&](const std::string& line) { log.Add("agent", line); };
    agent = std::make_unique<Agent>(o);
    ASSERT_TRUE(agent->Start().ok());
  }
  ServiceClient client(address);
  auto submitted = client.SubmitSweep(kServingSweep, "serving.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const int64_t sweep = submitted->sweep_id();
  ASSERT_TRUE(WaitFor(
      [&] {
        auto s = client.GetSweep(sweep);
        return s.ok() && s->state() == "done";
      },
      120))
      << log.Text();

  v1::QueryResultsRequest results;
  results.set_sweep_id(sweep);
  auto rows = client.QueryResults(results);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->rows_size(), 2);
  for (const v1::ResultRow& row : rows->rows()) {
    absl::StatusOr<TrialResult> r = TrialResultFromJson(nlohmann::json::parse(row.result_json()));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status, TrialStatus::kOk) << r->reason << "\n" << r->stderr_tail;
    EXPECT_EQ(r->serving.size(), 2u);
    EXPECT_TRUE(r->slo_search.has_value());
    EXPECT_EQ(row.workload(),
              "serve:isl=8,osl=4,requests=4,warmup=0,chunk=0,seed=1;slo:ttft_ms=100000,"
              "tpot_ms=100000,percentile=99");
  }

  v1::BestRequest best;
  best.set_sweep_id(sweep);
  best.set_sm(0);
  best.set_metric("goodput");
  auto answer = client.Best(best);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_FALSE(answer->found());  // two load points: two groups, listed
  ASSERT_EQ(answer->groups_size(), 2);
  best.set_load_point("concurrency=4");
  answer = client.Best(best);
  ASSERT_TRUE(answer.ok()) << answer.status();
  ASSERT_TRUE(answer->found());
  ASSERT_EQ(answer->groups_size(), 1);
  EXPECT_EQ(answer->groups(0).load_point(), "concurrency=4");
  EXPECT_EQ(answer->groups(0).ok_results(), 2);
  // The lockstep ranking has nothing from this sweep.
  v1::BestRequest lockstep;
  lockstep.set_sweep_id(sweep);
  lockstep.set_sm(0);
  answer = client.Best(lockstep);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_FALSE(answer->found());
  EXPECT_EQ(answer->groups_size(), 0);

  // The CLI prints the serving point that won.
  int code = -1;
  const std::string out =
      RunCommand(absl::StrCat(WorkerBinary(), " best --coordinator ", address, " --sweep ", sweep,
                              " --sm-arch cpu --metric goodput --load-point concurrency=4 2>&1"),
                 &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("serving at concurrency=4"));
  EXPECT_THAT(out, HasSubstr("# serving       concurrency=4 OK"));
  const std::string listed = RunCommand(
      absl::StrCat(WorkerBinary(), " results --coordinator ", address, " --sweep ", sweep, " 2>&1"),
      &code);
  EXPECT_EQ(code, 0) << listed;
  EXPECT_THAT(listed, HasSubstr(" concurrency=1 OK: output_tok_s="));
  EXPECT_THAT(listed, HasSubstr("slo search: highest load meeting it concurrency=4"));

  agent.reset();
  server.Stop();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace infersweep
