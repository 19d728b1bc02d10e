// SqliteStore on real files in a temporary directory: sweeps and trials, leases, results
// (idempotency, ownership), queries, Best, persistence, migrations and a busy database.
#include "storage/store.h"

#include <sqlite3.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "storage/queries.h"
#include "storage/schema.h"
#include "storage/sqlite.h"
#include "tests/raw_db.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "store_test.XXXXXX").string();
    char* made = mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string File(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

std::unique_ptr<Store> OpenOrDie(const std::string& path, StoreOptions options = {}) {
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(path, options);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

TrialRecord MakeTrial(const BackendConfig& config, int priority = 0) {
  TrialRecord t;
  t.model = "preset:tiny";
  t.layers = 2;
  t.seed = 0xfedcba9876543210ull;  // above INT64_MAX: must survive the int64 column
  t.config = config;
  t.workload.batch_sizes = {1, 8};
  t.workload.prompt_len = 64;
  t.selector.sm_archs = {90, 120};
  t.selector.gpu_name_regex = "H200|H100";
  t.selector.min_memory_bytes = 80'000'000'000;
  t.selector.device = ConfigDevice(config);
  t.priority = priority;
  return t;
}

SweepRecord MakeSweep(const std::string& name, int priority = 0) {
  SweepRecord s;
  s.name = name;
  s.spec_yaml = "name: " + name + "\n";
  s.model = "preset:tiny";
  s.priority = priority;
  return s;
}

BatchFigures Figures(int batch, double tok_s, double ttft_ms, double tpot_ms, double prefill) {
  BatchFigures b;
  b.batch = batch;
  b.output_tok_s = {tok_s, tok_s * 0.9, tok_s * 1.1};
  b.ttft_ms = {ttft_ms, ttft_ms, ttft_ms};
  b.tpot_ms = {tpot_ms, tpot_ms, tpot_ms};
  b.prefill_tok_s = {prefill, prefill, prefill};
  return b;
}

TrialResult MakeResult(const std::string& trial_id, int attempt, TrialStatus status,
                       double tok_s_b1, int64_t finished_ms, const BackendConfig& config) {
  TrialResult r;
  r.trial_id = trial_id;
  r.attempt = attempt;
  r.status = status;
  r.model = "preset:tiny";
  r.config = config;
  r.device = "NVIDIA H200";
  r.sm = 90;
  r.batches = {Figures(1, tok_s_b1, 10, 5, 1000), Figures(8, tok_s_b1 * 6, 20, 7, 5000)};
  r.started_unix_ms = finished_ms - 1000;
  r.finished_unix_ms = finished_ms;
  return r;
}

const BackendConfig kFlash = {{"device", "cuda"}, {"attention", "flash"}, {"graphs", "on"}};
const BackendConfig kNaive = {{"device", "cuda"}, {"attention", "naive"}, {"graphs", "off"}};
const BackendConfig kCpu = {{"device", "cpu"}, {"matmul", "blocked"}, {"threads", "4"}};

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.File("coord.db");
    store_ = OpenOrDie(path_);
    ASSERT_NE(store_, nullptr);
  }

  // A sweep of `n` trials alternating the two cuda configs; returns its id.
  int64_t CreateSweep(int n, int priority = 0, const std::string& name = "s") {
    std::vector<TrialRecord> trials;
    for (int i = 0; i < n; ++i) trials.push_back(MakeTrial(i % 2 ? kNaive : kFlash, priority));
    absl::StatusOr<int64_t> id = store_->CreateSweep(MakeSweep(name, priority), trials);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or(0);
  }

  TempDir dir_;
  std::string path_;
  std::unique_ptr<Store> store_;
};

TEST_F(StoreTest, CreateSweepStoresTrialsWithAssignedIds) {
  const int64_t id = CreateSweep(3);
  absl::StatusOr<SweepRecord> sweep = store_->GetSweep(id);
  ASSERT_TRUE(sweep.ok()) << sweep.status();
  EXPECT_EQ(sweep->name, "s");
  EXPECT_EQ(sweep->state, "active");
  EXPECT_EQ(sweep->trials_total, 3);
  EXPECT_EQ(sweep->trials_done, 0);
  EXPECT_GT(sweep->created_unix_ms, 0);

  absl::StatusOr<TrialRecord> t = store_->GetTrial(absl::StrCat(id, "-1"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->sweep_id, id);
  EXPECT_EQ(t->config, kNaive);
  EXPECT_EQ(t->seed, 0xfedcba9876543210ull);
  EXPECT_EQ(t->layers, 2);
  EXPECT_EQ(t->workload.batch_sizes, (std::vector<int>{1, 8}));
  EXPECT_EQ(t->workload.prompt_len, 64);
  EXPECT_EQ(t->selector.sm_archs, (std::vector<int>{90, 120}));
  EXPECT_EQ(t->selector.gpu_name_regex, "H200|H100");
  EXPECT_EQ(t->selector.min_memory_bytes, 80'000'000'000);
  EXPECT_EQ(t->selector.device, Device::kCuda);
  EXPECT_EQ(t->state, TrialState::kQueued);
  EXPECT_EQ(t->attempt, 0);
  EXPECT_TRUE(t->leased_to.empty());

  RawDb raw(path_);
  EXPECT_EQ(
      raw.Query(
          "SELECT config_string FROM trials JOIN configs USING (config_id) WHERE trial_id = '" +
          absl::StrCat(id, "-1") + "'"),
      "attention=naive,device=cuda,graphs=off");

  EXPECT_EQ(store_->GetSweep(id + 100).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->GetTrial("nope").status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::vector<SweepRecord>> all = store_->ListSweeps();
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 1u);
}

TEST_F(StoreTest, CreateSweepRejectsDuplicateTrialIdsAtomically) {
  std::vector<TrialRecord> trials = {MakeTrial(kFlash), MakeTrial(kNaive)};
  trials[0].trial_id = "x";
  trials[1].trial_id = "x";
  absl::StatusOr<int64_t> id = store_->CreateSweep(MakeSweep("dup"), trials);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kAlreadyExists) << id.status();
  RawDb raw(path_);
  EXPECT_EQ(raw.Count("sweeps"), 0);
  EXPECT_EQ(raw.Count("trials"), 0);
}

TEST_F(StoreTest, CreateSweepRejectsAnInvalidWorkload) {
  std::vector<TrialRecord> trials = {MakeTrial(kFlash), MakeTrial(kNaive)};
  trials[1].workload.batch_sizes = {0};
  absl::StatusOr<int64_t> id = store_->CreateSweep(MakeSweep("bad"), trials);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << id.status();
  EXPECT_THAT(id.status().message(), HasSubstr("batch"));
  RawDb raw(path_);
  EXPECT_EQ(raw.Count("sweeps"), 0);
  EXPECT_EQ(raw.Count("trials"), 0);
}

TEST_F(StoreTest, QueuedTrialsHighestPriorityFirstThenOldest) {
  const int64_t low = CreateSweep(2, /*priority=*/0, "low");
  const int64_t high = CreateSweep(2, /*priority=*/5, "high");
  absl::StatusOr<std::vector<TrialRecord>> q = store_->QueuedTrials(10);
  ASSERT_TRUE(q.ok()) << q.status();
  std::vector<std::string> ids;
  for (const TrialRecord& t : *q) ids.push_back(t.trial_id);
  EXPECT_THAT(ids, ElementsAre(absl::StrCat(high, "-0"), absl::StrCat(high, "-1"),
                               absl::StrCat(low, "-0"), absl::StrCat(low, "-1")));
  q = store_->QueuedTrials(1);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->size(), 1u);
}

TEST_F(StoreTest, LeaseRenewAndRequeueExpired) {
  const int64_t id = CreateSweep(3);
  const std::string a = absl::StrCat(id, "-0"), b = absl::StrCat(id, "-1");

  absl::StatusOr<TrialRecord> leased = store_->LeaseTrial(a, "agent-1", 1000);
  ASSERT_TRUE(leased.ok()) << leased.status();
  EXPECT_EQ(leased->state, TrialState::kLeased);
  EXPECT_EQ(leased->attempt, 1);
  EXPECT_EQ(leased->leased_to, "agent-1");
  EXPECT_EQ(leased->lease_expires_unix_ms, 1000);

  absl::StatusOr<TrialRecord> again = store_->LeaseTrial(a, "agent-2", 1000);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("agent-1"));
  EXPECT_EQ(store_->LeaseTrial("missing", "agent-1", 1000).status().code(),
            absl::StatusCode::kNotFound);

  ASSERT_TRUE(store_->LeaseTrial(b, "agent-2", 1000).ok());
  // agent-1 renews; agent-2 does not.
  ASSERT_TRUE(store_->RenewLeases("agent-1", 5000).ok());
  EXPECT_EQ(store_->GetTrial(a)->lease_expires_unix_ms, 5000);

  absl::StatusOr<std::vector<LostLease>> requeued = store_->RequeueExpired(2000, 0);
  ASSERT_TRUE(requeued.ok()) << requeued.status();
  ASSERT_EQ(requeued->size(), 1u);
  EXPECT_EQ((*requeued)[0].trial_id, b);
  EXPECT_EQ((*requeued)[0].agent_id, "agent-2");
  EXPECT_EQ((*requeued)[0].attempt, 1);
  EXPECT_TRUE((*requeued)[0].requeued);
  absl::StatusOr<TrialRecord> tb = store_->GetTrial(b);
  EXPECT_EQ(tb->state, TrialState::kQueued);
  EXPECT_TRUE(tb->leased_to.empty());
  EXPECT_EQ(tb->attempt, 1);  // attempts started so far
  EXPECT_EQ(store_->GetTrial(a)->state, TrialState::kLeased);

  // A requeued trial leases again under the next attempt.
  absl::StatusOr<TrialRecord> re = store_->LeaseTrial(b, "agent-3", 9000);
  ASSERT_TRUE(re.ok());
  EXPECT_EQ(re->attempt, 2);
  requeued = store_->RequeueExpired(6000, 0);
  ASSERT_TRUE(requeued.ok()) << requeued.status();
  ASSERT_EQ(requeued->size(), 1u);
  EXPECT_EQ((*requeued)[0].trial_id, a);
}

// A lost lease requeues the trial as a new attempt until the cap; the last one ends it as an
// ERROR filed under the GPU it was leased for, and the late holder cannot report that attempt.
TEST_F(StoreTest, LostLeasesRequeueUntilTheAttemptCapThenEndAsError) {
  const int64_t id = CreateSweep(2);
  const std::string t = absl::StrCat(id, "-0"), other = absl::StrCat(id, "-1");
  const LeasePlace h200{"NVIDIA H200", 90};
  ASSERT_TRUE(store_->LeaseTrial(t, "agent-1", 1000, h200).ok());
  ASSERT_TRUE(store_->LeaseTrial(other, "agent-1", 99'000, h200).ok());
  EXPECT_EQ(store_->GetTrial(t)->lease_place.gpu_name, "NVIDIA H200");
  EXPECT_EQ(store_->GetTrial(t)->lease_place.sm, 90);

  // Attempt 1 expires: requeued. Only expired leases are touched.
  absl::StatusOr<std::vector<LostLease>> lost = store_->RequeueExpired(2000, 3);
  ASSERT_TRUE(lost.ok()) << lost.status();
  ASSERT_EQ(lost->size(), 1u);
  EXPECT_TRUE((*lost)[0].requeued);
  EXPECT_EQ((*lost)[0].attempt, 1);
  EXPECT_EQ(store_->GetTrial(t)->state, TrialState::kQueued);
  EXPECT_EQ(store_->GetTrial(other)->state, TrialState::kLeased);

  // Attempt 2 is released by its agent: requeued. Releasing a lease the agent does not hold
  // (wrong agent, wrong attempt, not leased) changes nothing.
  ASSERT_TRUE(store_->LeaseTrial(t, "agent-2", 5000, h200).ok());
  EXPECT_EQ(store_->ReleaseLease(t, "agent-1", 2, 3, "gone").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->ReleaseLease(t, "agent-2", 1, 3, "gone").status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<LostLease> released = store_->ReleaseLease(t, "agent-2", 2, 3, "restarted");
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_TRUE(released->requeued);
  EXPECT_EQ(store_->ReleaseLease(t, "agent-2", 2, 3, "again").status().code(),
            absl::StatusCode::kFailedPrecondition);

  // Attempt 3 expires: the cap. The trial is done with one ERROR result, nothing requeued.
  ASSERT_TRUE(store_->LeaseTrial(t, "agent-3", 7000, {"NVIDIA RTX PRO 6000", 120}).ok());
  lost = store_->RequeueExpired(8000, 3);
  ASSERT_TRUE(lost.ok()) << lost.status();
  ASSERT_EQ(lost->size(), 1u);
  EXPECT_FALSE((*lost)[0].requeued);
  EXPECT_EQ((*lost)[0].agent_id, "agent-3");
  EXPECT_THAT((*lost)[0].reason, HasSubstr("lease lost 3 times"));
  EXPECT_EQ(store_->GetTrial(t)->state, TrialState::kDone);
  EXPECT_EQ(store_->GetTrial(t)->attempt, 3);
  EXPECT_EQ(store_->GetSweep(id)->trials_done, 1);
  ResultQuery q;
  q.sweep_id = id;
  absl::StatusOr<std::vector<StoredResult>> rows = store_->QueryResults(q);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].result.status, TrialStatus::kError);
  EXPECT_THAT((*rows)[0].result.reason, HasSubstr("lease lost 3 times"));
  EXPECT_THAT((*rows)[0].result.reason, HasSubstr("agent-3"));
  EXPECT_EQ((*rows)[0].result.attempt, 3);
  EXPECT_EQ((*rows)[0].agent_id, "");
  EXPECT_EQ((*rows)[0].gpu_name, "NVIDIA RTX PRO 6000");
  EXPECT_EQ((*rows)[0].sm, 120);
  EXPECT_EQ((*rows)[0].result.config, kFlash);

  // The last holder's late result for that attempt is refused, not silently acknowledged.
  absl::Status late = store_->RecordResult("agent-3", "NVIDIA RTX PRO 6000", 120,
                                           MakeResult(t, 3, TrialStatus::kOk, 1, 9000, kFlash));
  EXPECT_EQ(late.code(), absl::StatusCode::kPermissionDenied) << late;
  EXPECT_EQ(store_->QueryResults(q)->size(), 1u);
  // Nothing expired is left; without a cap a lease is requeued forever.
  EXPECT_TRUE(store_->RequeueExpired(8000, 3)->empty());
  lost = store_->RequeueExpired(200'000, 0);
  ASSERT_EQ(lost->size(), 1u);
  EXPECT_EQ((*lost)[0].trial_id, other);
  EXPECT_TRUE((*lost)[0].requeued);
  RawDb raw(path_);
  EXPECT_EQ(raw.Query("PRAGMA integrity_check"), "ok");
}

TEST_F(StoreTest, RecordResultIsIdempotentPerAttempt) {
  const int64_t id = CreateSweep(2);
  const std::string t = absl::StrCat(id, "-0");
  ASSERT_TRUE(store_->LeaseTrial(t, "agent-1", 1000).ok());
  const TrialResult r = MakeResult(t, 1, TrialStatus::kOk, 100, 5000, kFlash);
  ASSERT_TRUE(store_->RecordResult("agent-1", "NVIDIA H200", 90, r).ok());
  ASSERT_TRUE(store_->RecordResult("agent-1", "NVIDIA H200", 90, r).ok());

  RawDb raw(path_);
  EXPECT_EQ(raw.Count("results"), 1);
  EXPECT_EQ(raw.Count("configs"), 2);  // the sweep's two configs, each once
  EXPECT_EQ(raw.Count("config_axes"), 6);
  EXPECT_EQ(store_->GetTrial(t)->state, TrialState::kDone);
  absl::StatusOr<SweepRecord> sweep = store_->GetSweep(id);
  EXPECT_EQ(sweep->trials_done, 1);
  EXPECT_EQ(sweep->state, "active");
  EXPECT_EQ(raw.Query("SELECT output_tok_s FROM results"), "100.0");
  EXPECT_EQ(raw.Query("SELECT output_tok_s_max_batch FROM results"), "600.0");
  EXPECT_EQ(raw.Query("SELECT ttft_ms_p50 FROM results"), "10.0");
  EXPECT_EQ(raw.Query("SELECT tpot_ms FROM results"), "5.0");
}

TEST_F(StoreTest, ResultFromTheWrongAgentOrAttemptIsRejectedAndChangesNothing) {
  const int64_t id = CreateSweep(2);
  const std::string t = absl::StrCat(id, "-0");
  ASSERT_TRUE(store_->LeaseTrial(t, "agent-1", 1000).ok());
  RawDb raw(path_);
  const int64_t results = raw.Count("results"), axes = raw.Count("config_axes");

  absl::Status s = store_->RecordResult("agent-2", "NVIDIA H200", 90,
                                        MakeResult(t, 1, TrialStatus::kOk, 100, 5000, kFlash));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("agent-1"));
  s = store_->RecordResult("agent-1", "NVIDIA H200", 90,
                           MakeResult(t, 2, TrialStatus::kOk, 100, 5000, kFlash));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;

  EXPECT_EQ(raw.Count("results"), results);
  EXPECT_EQ(raw.Count("config_axes"), axes);
  absl::StatusOr<TrialRecord> trial = store_->GetTrial(t);
  EXPECT_EQ(trial->state, TrialState::kLeased);
  EXPECT_EQ(trial->leased_to, "agent-1");
  EXPECT_EQ(store_->GetSweep(id)->trials_done, 0);

  // After the lease expires and is requeued, the old holder cannot report either.
  ASSERT_TRUE(store_->RequeueExpired(2000, 0).ok());
  s = store_->RecordResult("agent-1", "NVIDIA H200", 90,
                           MakeResult(t, 1, TrialStatus::kOk, 100, 5000, kFlash));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_EQ(raw.Count("results"), results);
}

TEST_F(StoreTest, ResultForUnknownTrialIsNotFound) {
  CreateSweep(1);
  absl::Status s = store_->RecordResult("agent-1", "NVIDIA H200", 90,
                                        MakeResult("999-0", 1, TrialStatus::kOk, 1, 1, kFlash));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("999-0"));
  RawDb raw(path_);
  EXPECT_EQ(raw.Count("results"), 0);
}

TEST_F(StoreTest, SweepIsDoneWhenEveryTrialIsDone) {
  const int64_t id = CreateSweep(2);
  for (int i = 0; i < 2; ++i) {
    const std::string t = absl::StrCat(id, "-", i);
    ASSERT_TRUE(store_->LeaseTrial(t, "agent-1", 1000).ok());
    ASSERT_TRUE(store_->RecordResult("agent-1", "NVIDIA H200", 90,
                                     MakeResult(t, 1, TrialStatus::kOk, 10, 5000, kFlash))
                    .ok());
    EXPECT_EQ(store_->GetSweep(id)->state, i == 0 ? "active" : "done");
  }
  EXPECT_EQ(store_->GetSweep(id)->trials_done, 2);
}

TEST_F(StoreTest, CoordinatorResultsNeedNoLeaseAndCountOnce) {
  const int64_t id = CreateSweep(1);
  const std::string t = absl::StrCat(id, "-0");
  TrialResult r = MakeResult(t, 0, TrialStatus::kUnsupported, 0, 5000, {});
  r.batches.clear();
  r.model.clear();
  ASSERT_TRUE(store_->RecordResult("", "", 0, r).ok());
  EXPECT_EQ(store_->GetTrial(t)->state, TrialState::kDone);
  EXPECT_EQ(store_->GetSweep(id)->state, "done");
  // The stored result carries the trial's model and config.
  ResultQuery q;
  q.sweep_id = id;
  absl::StatusOr<std::vector<StoredResult>> rows = store_->QueryResults(q);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].result.model, "preset:tiny");
  EXPECT_EQ((*rows)[0].result.config, kFlash);
  EXPECT_EQ((*rows)[0].result.status, TrialStatus::kUnsupported);
  RawDb raw(path_);
  EXPECT_EQ(raw.Query("SELECT output_tok_s IS NULL FROM results"), "1");
}

TEST_F(StoreTest, RecordResultsIsAllOrNothing) {
  const int64_t id = CreateSweep(2);
  std::vector<ResultSubmission> batch = {
      {"", "g", 90, MakeResult(absl::StrCat(id, "-0"), 1, TrialStatus::kOk, 1, 1, kFlash)},
      {"", "g", 90, MakeResult("no-such-trial", 1, TrialStatus::kOk, 1, 1, kFlash)},
  };
  EXPECT_EQ(store_->RecordResults(batch).code(), absl::StatusCode::kNotFound);
  RawDb raw(path_);
  EXPECT_EQ(raw.Count("results"), 0);
  EXPECT_EQ(store_->GetTrial(absl::StrCat(id, "-0"))->state, TrialState::kQueued);
  batch.pop_back();
  ASSERT_TRUE(store_->RecordResults(batch).ok());
  EXPECT_EQ(raw.Count("results"), 1);
}

TEST_F(StoreTest, CancelSweepCancelsOpenTrialsAndStillTakesRunningResults) {
  const int64_t id = CreateSweep(3);
  const std::string running = absl::StrCat(id, "-0");
  ASSERT_TRUE(store_->LeaseTrial(running, "agent-1", 1000).ok());
  ASSERT_TRUE(store_->CancelSweep(id).ok());
  EXPECT_EQ(store_->GetSweep(id)->state, "cancelled");
  EXPECT_EQ(store_->GetTrial(absl::StrCat(id, "-1"))->state, TrialState::kCancelled);
  EXPECT_EQ(store_->GetTrial(running)->state, TrialState::kCancelled);
  EXPECT_TRUE(store_->QueuedTrials(10)->empty());
  EXPECT_EQ(store_->LeaseTrial(absl::StrCat(id, "-1"), "a", 1).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(store_->RecordResult("agent-1", "g", 90,
                                   MakeResult(running, 1, TrialStatus::kOk, 5, 5, kFlash))
                  .ok());
  EXPECT_EQ(store_->GetSweep(id)->state, "cancelled");
  EXPECT_TRUE(store_->CancelSweep(id).ok());
  EXPECT_EQ(store_->CancelSweep(id + 1).code(), absl::StatusCode::kNotFound);
}

// Stores results directly (coordinator-made, so no leases are needed).
class QueryTest : public StoreTest {
 protected:
  void SetUp() override {
    StoreTest::SetUp();
    std::vector<TrialRecord> trials;
    for (int i = 0; i < 6; ++i) trials.push_back(MakeTrial(i < 3 ? kFlash : kNaive));
    SweepRecord sweep = MakeSweep("q");
    absl::StatusOr<int64_t> id = store_->CreateSweep(sweep, trials);
    ASSERT_TRUE(id.ok());
    sweep_ = *id;
    struct Row {
      int sm;
      std::string gpu;
      TrialStatus status;
      double tok_s;
      int64_t finished;
    };
    const std::vector<Row> rows = {
        {90, "NVIDIA H200", TrialStatus::kOk, 100, 1000},         // 0 flash
        {90, "NVIDIA H200", TrialStatus::kOk, 150, 2000},         // 1 flash: best OK on sm 90
        {90, "NVIDIA H200", TrialStatus::kIncorrect, 300, 3000},  // 2 flash: faster, but wrong
        {90, "NVIDIA H100", TrialStatus::kOk, 120, 4000},         // 3 naive
        {120, "RTX 5090", TrialStatus::kOk, 400, 5000},           // 4 naive, other sm
        {90, "NVIDIA H200", TrialStatus::kCrashed, 0, 6000},      // 5 naive
    };
    for (size_t i = 0; i < rows.size(); ++i) {
      const std::string t = absl::StrCat(sweep_, "-", i);
      TrialResult r = MakeResult(t, 1, rows[i].status, rows[i].tok_s, rows[i].finished,
                                 i < 3 ? kFlash : kNaive);
      r.batches[0].ttft_ms = {static_cast<double>(50 - i), 0, 0};  // later rows: lower ttft
      // Batch 8 ranks differently from batch 1: row 0 is the fastest OK there.
      r.batches[1].output_tok_s.median = i == 0 ? 5000 : 100 * static_cast<double>(i);
      if (rows[i].status == TrialStatus::kCrashed) r.batches.clear();
      ASSERT_TRUE(store_->RecordResult("", rows[i].gpu, rows[i].sm, r).ok());
    }
  }

  static std::vector<std::string> Ids(const absl::StatusOr<std::vector<StoredResult>>& rows) {
    EXPECT_TRUE(rows.ok()) << rows.status();
    std::vector<std::string> ids;
    if (rows.ok())
      for (const StoredResult& r : *rows) ids.push_back(r.result.trial_id);
    return ids;
  }
  std::string T(int i) const { return absl::StrCat(sweep_, "-", i); }

  int64_t sweep_ = 0;
};

TEST_F(QueryTest, FiltersCombineAndNewestComesFirst) {
  ResultQuery q;
  EXPECT_THAT(Ids(store_->QueryResults(q)), ElementsAre(T(5), T(4), T(3), T(2), T(1), T(0)));
  q.sm = 90;
  EXPECT_THAT(Ids(store_->QueryResults(q)), ElementsAre(T(5), T(3), T(2), T(1), T(0)));
  q.status = TrialStatus::kOk;
  EXPECT_THAT(Ids(store_->QueryResults(q)), ElementsAre(T(3), T(1), T(0)));
  q.gpu_name = "NVIDIA H200";
  EXPECT_THAT(Ids(store_->QueryResults(q)), ElementsAre(T(1), T(0)));
  q.limit = 1;
  EXPECT_THAT(Ids(store_->QueryResults(q)), ElementsAre(T(1)));

  ResultQuery m;
  m.model = "preset:tiny";
  m.sweep_id = sweep_;
  EXPECT_EQ(Ids(store_->QueryResults(m)).size(), 6u);
  m.model = "preset:other";
  EXPECT_TRUE(Ids(store_->QueryResults(m)).empty());
  m.model.reset();
  m.sweep_id = sweep_ + 1;
  EXPECT_TRUE(Ids(store_->QueryResults(m)).empty());

  ResultQuery bad;
  bad.limit = 0;
  EXPECT_EQ(store_->QueryResults(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(QueryTest, AxisValuesMustAllMatch) {
  ResultQuery q;
  q.axis_values = {{"attention", "naive"}};
  EXPECT_THAT(Ids(store_->QueryResults(q)), ElementsAre(T(5), T(4), T(3)));
  q.axis_values = {{"attention", "flash"}, {"graphs", "on"}};
  EXPECT_THAT(Ids(store_->QueryResults(q)), ElementsAre(T(2), T(1), T(0)));
  q.axis_values = {{"attention", "flash"}, {"graphs", "off"}};
  EXPECT_TRUE(Ids(store_->QueryResults(q)).empty());
  q.axis_values = {{"no-such-axis", "x"}};
  EXPECT_TRUE(Ids(store_->QueryResults(q)).empty());
}

TEST_F(QueryTest, TimeRangeIsSinceInclusiveUntilExclusive) {
  ResultQuery q;
  q.since_unix_ms = 2000;
  q.until_unix_ms = 4000;
  EXPECT_THAT(Ids(store_->QueryResults(q)), ElementsAre(T(2), T(1)));
  q.until_unix_ms.reset();
  EXPECT_THAT(Ids(store_->QueryResults(q)), ElementsAre(T(5), T(4), T(3), T(2), T(1)));
}

TEST_F(QueryTest, QueryReturnsTheStoredResultAndWhereItRan) {
  ResultQuery q;
  q.sm = 120;
  absl::StatusOr<std::vector<StoredResult>> rows = store_->QueryResults(q);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 1u);
  const StoredResult& r = (*rows)[0];
  EXPECT_EQ(r.sweep_id, sweep_);
  EXPECT_EQ(r.gpu_name, "RTX 5090");
  EXPECT_EQ(r.sm, 120);
  EXPECT_EQ(r.agent_id, "");
  EXPECT_EQ(r.result.config, kNaive);
  ASSERT_EQ(r.result.batches.size(), 2u);
  EXPECT_DOUBLE_EQ(r.result.batches[0].output_tok_s.median, 400);
}

// The best result of one (model, sm, batch) by `metric`, when it has one group of results.
absl::StatusOr<std::optional<StoredResult>> BestOf(Store& store, const std::string& model, int sm,
                                                   const std::string& metric, int batch) {
  BestQuery q;
  q.model = model;
  q.sm = sm;
  q.metric = metric;
  q.batch = batch;
  absl::StatusOr<BestAnswer> answer = store.Best(q);
  if (!answer.ok()) return answer.status();
  EXPECT_LE(answer->groups.size(), 1u);
  return answer->best;
}

TEST_F(QueryTest, BestPicksTheFastestOkResult) {
  absl::StatusOr<std::optional<StoredResult>> best =
      BestOf(*store_, "preset:tiny", 90, "output_tok_s", 1);
  ASSERT_TRUE(best.ok()) << best.status();
  ASSERT_TRUE(best->has_value());
  EXPECT_EQ((*best)->result.trial_id, T(1));  // not T(2): faster, but INCORRECT
  EXPECT_EQ((*best)->result.status, TrialStatus::kOk);

  best = BestOf(*store_, "preset:tiny", 120, "output_tok_s", 1);
  ASSERT_TRUE(best.ok() && best->has_value());
  EXPECT_EQ((*best)->result.trial_id, T(4));

  // Lower is better for latencies: T(3) has the lowest batch-1 ttft among the OK sm-90 rows.
  best = BestOf(*store_, "preset:tiny", 90, "ttft_ms", 1);
  ASSERT_TRUE(best.ok() && best->has_value()) << best.status();
  EXPECT_EQ((*best)->result.trial_id, T(3));

  // Other batch sizes rank on their own figures: row 0 is the fastest OK one at batch 8.
  best = BestOf(*store_, "preset:tiny", 90, "output_tok_s", 8);
  ASSERT_TRUE(best.ok() && best->has_value()) << best.status();
  EXPECT_EQ((*best)->result.trial_id, T(0));
  best = BestOf(*store_, "preset:tiny", 90, "prefill_tok_s", 1);
  ASSERT_TRUE(best.ok() && best->has_value()) << best.status();
  EXPECT_EQ((*best)->result.status, TrialStatus::kOk);

  best = BestOf(*store_, "preset:tiny", 90, "output_tok_s", 64);  // never measured
  ASSERT_TRUE(best.ok());
  EXPECT_FALSE(best->has_value());
  best = BestOf(*store_, "preset:other", 90, "output_tok_s", 1);
  ASSERT_TRUE(best.ok());
  EXPECT_FALSE(best->has_value());

  EXPECT_EQ(BestOf(*store_, "preset:tiny", 90, "joules", 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BestOf(*store_, "preset:tiny", 90, "output_tok_s", 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // No workload has a batch over kMaxBatchSize: such a query is a mistake, not "none found".
  const absl::Status over =
      BestOf(*store_, "preset:tiny", 90, "output_tok_s", kMaxBatchSize + 1).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kInvalidArgument) << over;
  EXPECT_THAT(std::string(over.message()), HasSubstr("must lie in [1, 1024]"));
}

// Every metric at every batch ranks within one group through result_batches: ordered by its
// index for output_tok_s, a range of its clustered key for the others; no scan of the results.
TEST_F(StoreTest, BestRanksWithinAGroupThroughTheBatchTable) {
  RawDb raw(path_);
  std::string plan = raw.Plan(BestInGroupSql("output_tok_s", true, false));
  EXPECT_THAT(plan, HasSubstr("result_batches_best (group_id=? AND ok=? AND output_tok_s>?)"))
      << plan;
  EXPECT_THAT(plan, ::testing::Not(HasSubstr("TEMP B-TREE"))) << plan;
  plan = raw.Plan(BestInGroupSql("ttft_ms", false, false));
  EXPECT_THAT(plan, HasSubstr("(group_id=?")) << plan;
  EXPECT_THAT(plan, ::testing::Not(HasSubstr("SCAN"))) << plan;
  // Within a sweep: one sweep's rows of the group, a key range of the primary key.
  plan = raw.Plan(BestInGroupSql("ttft_ms", false, true));
  EXPECT_THAT(plan, HasSubstr("PRIMARY KEY (group_id=? AND sweep_id=?)")) << plan;
  EXPECT_THAT(plan, ::testing::Not(HasSubstr("SCAN"))) << plan;
}

// Results of one preset that measured different things: 2 and 8 layers, two workloads. Best
// never ranks them together; it lists the four groups, and ranks within the one a query picks.
class IdentityTest : public StoreTest {
 protected:
  void SetUp() override {
    StoreTest::SetUp();
    std::vector<TrialRecord> trials;
    // Trial i: layers 2 or 8 (i % 2), prompt 64 or 512 (i / 2 % 2), a config per i / 4.
    for (int i = 0; i < 8; ++i) {
      TrialRecord t = MakeTrial(i / 4 ? kNaive : kFlash);
      t.layers = i % 2 ? 8 : 2;
      t.workload.prompt_len = (i / 2) % 2 ? 512 : 64;
      trials.push_back(t);
    }
    absl::StatusOr<int64_t> id = store_->CreateSweep(MakeSweep("identity"), trials);
    ASSERT_TRUE(id.ok()) << id.status();
    sweep_ = *id;
    for (int i = 0; i < 8; ++i) {
      // The 2-layer runs are the fastest, as they always are: the trap a mixed ranking falls in.
      const double tok_s = (i % 2 ? 100 : 1000) + 10 * i;
      TrialResult r =
          MakeResult(T(i), 1, TrialStatus::kOk, tok_s, 1000 + i, i / 4 ? kNaive : kFlash);
      r.model_identity = {"preset", "tiny", i % 2 ? 8 : 2, 1, "bf16", ""};
      r.engine_version = "infersweep test";
      ASSERT_TRUE(store_->RecordResult("", "NVIDIA H200", 90, r).ok());
    }
  }
  std::string T(int i) const { return absl::StrCat(sweep_, "-", i); }
  int64_t sweep_ = 0;
};

TEST_F(IdentityTest, BestListsTheGroupsInsteadOfRankingAcrossThem) {
  BestQuery q;
  q.model = "preset:tiny";
  q.sm = 90;
  absl::StatusOr<BestAnswer> answer = store_->Best(q);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_FALSE(answer->best.has_value());
  std::vector<std::string> groups;
  for (const ResultGroup& g : answer->groups) {
    groups.push_back(absl::StrCat(g.model_key, " | ", g.workload));
    EXPECT_EQ(g.ok_results, 2);
    EXPECT_EQ(g.first_sweep, sweep_);
  }
  EXPECT_THAT(groups,
              UnorderedElementsAre(
                  "preset:tiny layers=2 seed=1 weights=bf16 | prompt=64,output=32,warmup=1",
                  "preset:tiny layers=2 seed=1 weights=bf16 | prompt=512,output=32,warmup=1",
                  "preset:tiny layers=8 seed=1 weights=bf16 | prompt=64,output=32,warmup=1",
                  "preset:tiny layers=8 seed=1 weights=bf16 | prompt=512,output=32,warmup=1"));

  // Picking the model narrows to its two workloads: still no ranking.
  q.layers = 8;
  answer = store_->Best(q);
  ASSERT_TRUE(answer.ok());
  EXPECT_EQ(answer->groups.size(), 2u);
  EXPECT_FALSE(answer->best.has_value());
  // Model and workload: one group, ranked within it (the 8-layer, prompt-512 trials 3 and 7).
  q.workload = "prompt=512,output=32,warmup=1";
  answer = store_->Best(q);
  ASSERT_TRUE(answer.ok());
  ASSERT_EQ(answer->groups.size(), 1u);
  ASSERT_TRUE(answer->best.has_value());
  EXPECT_EQ(answer->best->result.trial_id, T(7));
  EXPECT_EQ(answer->best->model_key, "preset:tiny layers=8 seed=1 weights=bf16");
  EXPECT_EQ(answer->best->workload, "prompt=512,output=32,warmup=1");
  // The same by exact key; and within the sweep.
  q.layers.reset();
  q.model_key = "preset:tiny layers=8 seed=1 weights=bf16";
  q.sweep_id = sweep_;
  answer = store_->Best(q);
  ASSERT_TRUE(answer.ok()) << answer.status();
  ASSERT_EQ(answer->groups.size(), 1u);
  ASSERT_TRUE(answer->best.has_value());
  EXPECT_EQ(answer->best->result.trial_id, T(7));
  q.sweep_id = sweep_ + 1;
  answer = store_->Best(q);
  ASSERT_TRUE(answer.ok());
  EXPECT_TRUE(answer->groups.empty());
}

TEST_F(IdentityTest, QueriesFilterByIdentityAndRowsCarryIt) {
  ResultQuery q;
  q.layers = 2;
  absl::StatusOr<std::vector<StoredResult>> rows = store_->QueryResults(q);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 4u);
  for (const StoredResult& r : *rows) {
    EXPECT_EQ(r.model_key, "preset:tiny layers=2 seed=1 weights=bf16");
    EXPECT_EQ(r.result.model_identity.layers, 2);
    EXPECT_EQ(r.engine_version, "infersweep test");
    EXPECT_EQ(r.software, "");  // known: none (the result has an identity, no GPU stack)
  }
  q.workload = "prompt=64,output=32,warmup=1";
  rows = store_->QueryResultRows(q);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 2u);
  for (const StoredResult& r : *rows) {
    EXPECT_EQ(r.workload, "prompt=64,output=32,warmup=1");
    EXPECT_THAT(r.result_json, HasSubstr("\"workload\":\"prompt=64,output=32,warmup=1\""));
    EXPECT_TRUE(r.result.trial_id.empty());  // QueryResultRows does not parse
  }
  q = ResultQuery();
  q.model_key = "preset:tiny layers=8 seed=1 weights=bf16";
  EXPECT_EQ(store_->QueryResults(q)->size(), 4u);
  q.model_key = "";  // unknown identity: none here
  EXPECT_TRUE(store_->QueryResults(q)->empty());
  absl::StatusOr<std::map<std::string, int64_t>> counts = store_->CountResults(sweep_);
  ASSERT_TRUE(counts.ok());
  EXPECT_EQ(counts->at("OK"), 8);
}

// Results are stored deflated: result_json is empty, result_blob holds the JSON, and a damaged
// blob is a DataLoss error that names the row, not a crash or a wrong answer.
TEST_F(IdentityTest, ResultsAreStoredCompressedAndADamagedOneIsNamed) {
  RawDb raw(path_);
  EXPECT_EQ(raw.Query("SELECT COUNT(*) FROM results WHERE result_json = '' AND "
                      "length(result_blob) > 0"),
            "8");
  const int64_t json_bytes = std::stoll(raw.Query("SELECT SUM(length(result_blob)) FROM results"));
  ResultQuery all;
  absl::StatusOr<std::vector<StoredResult>> rows = store_->QueryResultRows(all);
  ASSERT_TRUE(rows.ok());
  int64_t text_bytes = 0;
  for (const StoredResult& r : *rows) text_bytes += static_cast<int64_t>(r.result_json.size());
  EXPECT_LT(json_bytes * 3, text_bytes) << "compressed " << json_bytes << " of " << text_bytes;
  const std::string victim = raw.Query("SELECT result_id FROM results ORDER BY result_id LIMIT 1");
  ASSERT_EQ(raw.Exec("UPDATE results SET result_blob = substr(result_blob, 1, 20) WHERE "
                     "result_id = " +
                     victim),
            SQLITE_OK);
  absl::StatusOr<std::vector<StoredResult>> broken = store_->QueryResults(all);
  ASSERT_FALSE(broken.ok());
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(broken.status().message(), HasSubstr("result row " + victim));
}

// A selector's device is stored as its name and read back as the enum; a stored name the registry
// does not know is a damaged row, named, not a trial sent to the wrong agents.
TEST_F(StoreTest, SelectorDeviceIsStoredByNameAndAnUnknownOneIsNamed) {
  absl::StatusOr<int64_t> id =
      store_->CreateSweep(MakeSweep("devices"), {MakeTrial(kCpu), MakeTrial(kFlash)});
  ASSERT_TRUE(id.ok()) << id.status();
  const std::string cpu_trial = absl::StrCat(*id, "-0");
  absl::StatusOr<TrialRecord> cpu = store_->GetTrial(cpu_trial);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->selector.device, Device::kCpu);
  absl::StatusOr<TrialRecord> cuda = store_->GetTrial(absl::StrCat(*id, "-1"));
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  EXPECT_EQ(cuda->selector.device, Device::kCuda);

  RawDb raw(path_);
  const std::string where = " WHERE trial_id = '" + cpu_trial + "'";
  EXPECT_THAT(raw.Query("SELECT selector_json FROM trials" + where),
              HasSubstr(R"("device":"cpu")"));
  ASSERT_EQ(
      raw.Exec(R"(UPDATE trials SET selector_json = replace(selector_json, '"device":"cpu"', )"
               R"('"device":"tpu"'))" +
               where),
      SQLITE_OK);
  store_.reset();
  store_ = OpenOrDie(path_);
  absl::StatusOr<TrialRecord> damaged = store_->GetTrial(cpu_trial);
  ASSERT_FALSE(damaged.ok());
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(damaged.status().message(), HasSubstr("trial '" + cpu_trial + "'"));
  EXPECT_THAT(damaged.status().message(),
              HasSubstr("selector device: unknown value 'tpu' (known: cpu, cuda)"));
}

// A kernel log is stored once for every result that ran the same kernels, and reads give each
// result its own log back, whole.
TEST_F(StoreTest, KernelLogsAreStoredOnceAndReadBackWhole) {
  const int64_t id = CreateSweep(3);
  PhaseKernels decode;
  decode.graph = true;
  decode.kernels = {{"GemvKernel<2, 1>", 96}, {"FlashDecodeKernel<128>", 48}};
  PhaseKernels other = decode;
  other.fallbacks = {"gemm=fused: decode, 64 rows (> 4): cuBLASLt"};
  for (int i = 0; i < 3; ++i) {
    TrialResult r = MakeResult(absl::StrCat(id, "-", i), 1, TrialStatus::kOk, 10, 10, kFlash);
    for (BatchFigures& b : r.batches) {
      b.decode_kernels = i == 2 && b.batch == 8 ? other : decode;
      b.prefill_kernels = PhaseKernels{};
    }
    ASSERT_TRUE(store_->RecordResult("", "NVIDIA H200", 90, r).ok());
  }
  RawDb raw(path_);
  EXPECT_EQ(raw.Count("kernel_logs"), 2);  // six batches, two distinct logs
  ResultQuery q;
  absl::StatusOr<std::vector<StoredResult>> rows = store_->QueryResults(q);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 3u);
  for (const StoredResult& r : *rows) {
    EXPECT_THAT(r.result_json, ::testing::Not(HasSubstr("kernels_ref")));
    ASSERT_EQ(r.result.batches.size(), 2u);
    const bool fell_back = r.result.trial_id == absl::StrCat(id, "-2");
    for (const BatchFigures& b : r.result.batches) {
      ASSERT_TRUE(b.decode_kernels.has_value());
      EXPECT_TRUE(b.decode_kernels->graph);
      EXPECT_EQ(b.decode_kernels->kernels, decode.kernels);
      EXPECT_EQ(b.decode_kernels->fallbacks.size(), fell_back && b.batch == 8 ? 1u : 0u);
      EXPECT_TRUE(b.prefill_kernels.has_value());
    }
  }
  // A reference to a log that is gone is named, not read as a result without kernels.
  ASSERT_EQ(raw.Exec("DELETE FROM kernel_logs WHERE kernel_log_id = 1"), SQLITE_OK);
  store_.reset();
  store_ = OpenOrDie(path_);
  rows = store_->QueryResults(q);
  ASSERT_FALSE(rows.ok());
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(rows.status().message(), HasSubstr("kernel log 1 is missing"));
}

// A batch with a memory verdict keeps it (and every batch its planned memory) through the
// store, and is never ranked: it has no figures. The result's own figures are its largest
// measured batch's.
TEST_F(StoreTest, MemoryVerdictsRoundTripAndAreNotRanked) {
  const int64_t id = CreateSweep(1);
  TrialResult r = MakeResult(absl::StrCat(id, "-0"), 1, TrialStatus::kOk, 10, 10, kFlash);
  r.batches[0].planned_memory = PlannedMemory{3 << 20, {{"weights", 2 << 20}, {"KV", 1 << 20}}};
  r.batches[0].device_memory_used_bytes = 4 << 20;
  BatchFigures& refused = r.batches[1];  // batch 8
  refused = BatchFigures{};
  refused.batch = 8;
  refused.memory_verdict = BatchMemoryVerdict::kDoesNotFit;
  refused.memory_reason = "needs 80.00 GiB on the device (...), 14.00 GiB free";
  refused.planned_memory = PlannedMemory{int64_t{80} << 30, {{"weights", int64_t{50} << 30}}};
  ASSERT_TRUE(store_->RecordResult("", "NVIDIA H200", 90, r).ok());

  absl::StatusOr<std::vector<StoredResult>> rows = store_->QueryResults(ResultQuery{});
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 1u);
  const TrialResult& back = (*rows)[0].result;
  EXPECT_EQ(ToJson(back).at("batches"), ToJson(r).at("batches"));
  ASSERT_EQ(back.batches.size(), 2u);
  EXPECT_EQ(back.batches[1].memory_verdict, BatchMemoryVerdict::kDoesNotFit);
  EXPECT_EQ(back.batches[1].memory_reason, refused.memory_reason);
  EXPECT_EQ(back.batches[0].device_memory_used_bytes, 4 << 20);

  RawDb raw(path_);
  EXPECT_EQ(raw.Query("SELECT group_concat(max_batch) FROM results"), "1");
  EXPECT_EQ(raw.Count("result_batches"), 1);
  absl::StatusOr<std::optional<StoredResult>> best =
      BestOf(*store_, "preset:tiny", 90, "output_tok_s", 8);
  ASSERT_TRUE(best.ok()) << best.status();
  EXPECT_FALSE(best->has_value());
  best = BestOf(*store_, "preset:tiny", 90, "output_tok_s", 1);
  ASSERT_TRUE(best.ok() && best->has_value()) << best.status();
}

// Commits never copy the WAL into the database (SQLite's auto-checkpoint is off): a connection
// of the store's own does it in the background, so the WAL stays bounded.
TEST_F(StoreTest, TheWalIsCheckpointedInTheBackground) {
  RawDb raw(path_);
  EXPECT_EQ(raw.Query("PRAGMA wal_autocheckpoint"), "1000");  // another connection: the default
  const int64_t id = CreateSweep(200);
  std::vector<ResultSubmission> results;
  for (int i = 0; i < 200; ++i)
    results.push_back({"", "NVIDIA H200", 90,
                       MakeResult(absl::StrCat(id, "-", i), 1, TrialStatus::kOk, 10, 10, kFlash)});
  ASSERT_TRUE(store_->RecordResults(results).ok());
  // Every page the results touched reaches the database file without another commit.
  EXPECT_TRUE(WaitFor(
      [&] {
        return raw.Query("SELECT COUNT(*) FROM results") == "200" &&
               std::filesystem::file_size(path_) >= 200 * 1024;
      },
      5))
      << std::filesystem::file_size(path_) << " bytes in the database file";
}

// Sustained ingest (a writer that never pauses) leaves a PASSIVE checkpoint no moment to start
// the WAL over; the store empties it past its limit instead, so it stays near the limit.
TEST(StoreWalTest, TheWalStaysBoundedUnderSustainedIngest) {
  TempDir dir;
  const std::string path = dir.File("coord.db");
  StoreOptions options;
  options.wal_limit_bytes = 1 << 20;
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(path, options);
  ASSERT_TRUE(store.ok()) << store.status();
  // 20,000 results in groups of 40, one group every 5 ms: 2.5 s, ten checkpoint intervals.
  constexpr int kResults = 20000, kGroup = 40;
  std::vector<TrialRecord> trials;
  for (int i = 0; i < kResults; ++i) trials.push_back(MakeTrial(i % 2 ? kNaive : kFlash, 0));
  absl::StatusOr<int64_t> id = (*store)->CreateSweep(MakeSweep("wal", 0), trials);
  ASSERT_TRUE(id.ok()) << id.status();
  std::atomic<bool> done{false};
  std::thread writer([&] {
    for (int first = 0; first < kResults; first += kGroup) {
      std::vector<ResultSubmission> group;
      for (int i = first; i < first + kGroup; ++i)
        group.push_back(
            {"", "NVIDIA H200", 90,
             MakeResult(absl::StrCat(*id, "-", i), 1, TrialStatus::kOk, 10, 10, kFlash)});
      EXPECT_TRUE((*store)->RecordResults(group).ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    done = true;
  });
  int64_t largest_wal = 0;
  while (!done) {
    std::error_code ec;
    largest_wal = std::max<int64_t>(
        largest_wal, static_cast<int64_t>(std::filesystem::file_size(path + "-wal", ec)));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  writer.join();
  const int64_t database = static_cast<int64_t>(std::filesystem::file_size(path));
  // The limit, plus what the writer adds between two checkpoints (unbounded, it passes 100 MiB).
  EXPECT_LT(largest_wal, 16 << 20) << "the database holds " << database << " bytes";
  EXPECT_GT(database, 8 << 20) << "too little was written to test the bound";
}

// Group commit: one transaction, and a refused result leaves the others stored.
TEST_F(StoreTest, RecordResultsEachStoresTheGoodOnesOfAGroup) {
  const int64_t id = CreateSweep(3);
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(store_->LeaseTrial(absl::StrCat(id, "-", i), "agent-1", 1000).ok());
  std::vector<ResultSubmission> group;
  for (int i = 0; i < 3; ++i)
    group.push_back({"agent-1", "NVIDIA H200", 90,
                     MakeResult(absl::StrCat(id, "-", i), 1, TrialStatus::kOk, 10, 10, kFlash)});
  group[1].agent_id = "agent-2";  // not its lease: refused alone
  std::vector<absl::Status> stored = store_->RecordResultsEach(group);
  ASSERT_EQ(stored.size(), 3u);
  EXPECT_TRUE(stored[0].ok()) << stored[0];
  EXPECT_EQ(stored[1].code(), absl::StatusCode::kPermissionDenied) << stored[1];
  EXPECT_TRUE(stored[2].ok()) << stored[2];
  RawDb raw(path_);
  EXPECT_EQ(raw.Count("results"), 2);
  EXPECT_EQ(raw.Count("result_batches"), 4);
  EXPECT_EQ(store_->GetTrial(absl::StrCat(id, "-1"))->state, TrialState::kLeased);
  EXPECT_EQ(store_->GetSweep(id)->trials_done, 2);
}

// A database at schema version 3, as the build before identities wrote it (result_json as
// text, result_axes), opened by this build: the migration keeps every result readable, derives
// what it can (workload, engine version, a preset's identity where the trial named its layers),
// leaves the rest unknown, and Best groups the old results by what was derived.
TEST(StoreMigrationTest, AVersion3DatabaseIsMigratedAndStaysReadable) {
  TempDir dir;
  const std::string path = dir.File("v3.db");
  {
    RawDb raw(path);
    for (int v = 0; v < 3; ++v) ASSERT_EQ(raw.Exec(Migrations()[v].sql), SQLITE_OK) << v;
    ASSERT_EQ(raw.Exec("PRAGMA user_version = 3"), SQLITE_OK);
    ASSERT_EQ(raw.Exec("INSERT INTO sweeps (sweep_id, name, spec_yaml, model, created_ms, "
                       "trials_total) VALUES (1, 'old', '', 'preset:tiny', 1, 2)"),
              SQLITE_OK);
    // Trial 1-0 names its layers (2); trial 1-1 leaves the preset's own (0): unknown here.
    for (int i = 0; i < 2; ++i) {
      const std::string trial = absl::StrCat("1-", i);
      TrialResult r = MakeResult(trial, 1, TrialStatus::kOk, 100 + i, 1000 + i, kFlash);
      r.engine_version = "infersweep-0.1.0";
      nlohmann::json j = ToJson(r);
      j.erase("model_identity");  // what the old build wrote
      j.erase("workload");
      j.erase("software");
      Workload w;
      w.prompt_len = 64;
      ASSERT_EQ(raw.Exec(absl::StrCat(
                    "INSERT INTO trials (trial_id, sweep_id, model, layers, seed, config_json, "
                    "config_string, workload_json, selector_json, priority, state, attempt, "
                    "created_ms) VALUES ('",
                    trial, "', 1, 'preset:tiny', ", i == 0 ? 2 : 0, ", 1, '",
                    nlohmann::json(kFlash).dump(), "', '", BackendConfigString(kFlash), "', '",
                    ToJson(w).dump(), "', '{}', 0, 'done', 1, 1)")),
                SQLITE_OK);
      ASSERT_EQ(
          raw.Exec(absl::StrCat(
              "INSERT INTO results (result_id, trial_id, attempt, sweep_id, agent_id, "
              "gpu_name, sm, model, status, config_string, result_json, output_tok_s, "
              "finished_ms) VALUES (",
              i + 1, ", '", trial,
              "', 1, 1, 'a', 'NVIDIA H200', "
              "90, 'preset:tiny', 'OK', '",
              BackendConfigString(kFlash), "', '", j.dump(), "', ", 100 + i, ", ", 1000 + i, ")")),
          SQLITE_OK);
      for (const auto& [axis, value] : kFlash)
        ASSERT_EQ(raw.Exec(absl::StrCat("INSERT INTO result_axes VALUES (", i + 1, ", '", axis,
                                        "', '", value, "')")),
                  SQLITE_OK);
      ASSERT_EQ(raw.Exec(absl::StrCat("INSERT INTO result_batches (result_id, batch, model, sm, "
                                      "ok, output_tok_s) VALUES (",
                                      i + 1, ", 1, 'preset:tiny', 90, 1, ", 100 + i, ")")),
                SQLITE_OK);
    }
  }
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  RawDb raw(path);
  EXPECT_EQ(raw.Query("PRAGMA user_version"), std::to_string(LatestSchemaVersion()));
  EXPECT_EQ(raw.Query("PRAGMA integrity_check"), "ok");

  ResultQuery q;
  q.axis_values = {{"attention", "flash"}};
  absl::StatusOr<std::vector<StoredResult>> rows = store->QueryResults(q);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 2u);
  const StoredResult& unknown = (*rows)[0];  // 1-1, newest
  const StoredResult& known = (*rows)[1];
  EXPECT_EQ(known.result.trial_id, "1-0");
  EXPECT_EQ(known.model_key, "preset:tiny layers=2 seed=1 weights=bf16");
  EXPECT_EQ(unknown.model_key, std::nullopt);
  for (const StoredResult* r : {&known, &unknown}) {
    EXPECT_EQ(r->workload, "prompt=64,output=32,warmup=1");
    EXPECT_EQ(r->result.workload, "prompt=64,output=32,warmup=1");
    EXPECT_EQ(r->engine_version, "infersweep-0.1.0");
    EXPECT_EQ(r->software, std::nullopt);
    EXPECT_DOUBLE_EQ(r->result.batches[0].output_tok_s.median, r == &known ? 100 : 101);
  }
  // Two groups, one of them of unknown identity: listed, not ranked together.
  BestQuery best;
  best.model = "preset:tiny";
  best.sm = 90;
  absl::StatusOr<BestAnswer> answer = store->Best(best);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->groups.size(), 2u);
  EXPECT_FALSE(answer->best.has_value());
  best.layers = 2;
  answer = store->Best(best);
  ASSERT_TRUE(answer.ok() && answer->best.has_value());
  EXPECT_EQ(answer->best->result.trial_id, "1-0");
  EXPECT_EQ(raw.Count("configs"), 1);
  EXPECT_EQ(raw.Query("SELECT COUNT(*) FROM sqlite_master WHERE name = 'result_axes'"), "0");
}

TEST_F(StoreTest, DataPersistsAcrossReopen) {
  const int64_t id = CreateSweep(2);
  const std::string t = absl::StrCat(id, "-0");
  ASSERT_TRUE(store_->LeaseTrial(t, "agent-1", 1000).ok());
  ASSERT_TRUE(store_->RecordResult("agent-1", "g", 90,
                                   MakeResult(t, 1, TrialStatus::kOk, 42, 7, kFlash))
                  .ok());
  AgentRecord agent{"agent-1", "host-a", R"({"gpus":1})", 123, true};
  ASSERT_TRUE(store_->UpsertAgent(agent).ok());
  store_.reset();

  store_ = OpenOrDie(path_);
  ASSERT_NE(store_, nullptr);
  EXPECT_EQ(store_->GetSweep(id)->trials_done, 1);
  EXPECT_EQ(store_->GetTrial(t)->state, TrialState::kDone);
  EXPECT_EQ(store_->GetTrial(absl::StrCat(id, "-1"))->state, TrialState::kQueued);
  absl::StatusOr<std::optional<StoredResult>> best =
      BestOf(*store_, "preset:tiny", 90, "output_tok_s", 1);
  ASSERT_TRUE(best.ok() && best->has_value());
  EXPECT_DOUBLE_EQ((*best)->result.batches[0].output_tok_s.median, 42);
  absl::StatusOr<std::vector<AgentRecord>> agents = store_->ListAgents();
  ASSERT_TRUE(agents.ok());
  ASSERT_EQ(agents->size(), 1u);
  EXPECT_EQ((*agents)[0].host, "host-a");
  // A new sweep after reopening gets a new id.
  EXPECT_GT(CreateSweep(1), id);
}

TEST_F(StoreTest, AgentsUpsertAndConnect) {
  ASSERT_TRUE(store_->UpsertAgent({"b", "host-b", "{}", 1, true}).ok());
  ASSERT_TRUE(store_->UpsertAgent({"a", "host-a", "{}", 1, true}).ok());
  ASSERT_TRUE(store_->UpsertAgent({"a", "host-a2", R"({"x":1})", 2, true}).ok());
  ASSERT_TRUE(store_->SetAgentConnected("b", false, 99).ok());
  EXPECT_EQ(store_->SetAgentConnected("zz", false, 99).code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::vector<AgentRecord>> agents = store_->ListAgents();
  ASSERT_TRUE(agents.ok());
  ASSERT_EQ(agents->size(), 2u);
  EXPECT_EQ((*agents)[0].agent_id, "a");
  EXPECT_EQ((*agents)[0].host, "host-a2");
  EXPECT_EQ((*agents)[0].inventory_json, R"({"x":1})");
  EXPECT_FALSE((*agents)[1].connected);
  EXPECT_EQ((*agents)[1].last_seen_unix_ms, 99);
}

TEST(StoreOpenTest, MigratesAnEmptyFile) {
  TempDir dir;
  const std::string path = dir.File("empty.db");
  { std::ofstream touch(path); }
  ASSERT_EQ(std::filesystem::file_size(path), 0u);
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  RawDb raw(path);
  EXPECT_EQ(raw.Query("PRAGMA user_version"), std::to_string(LatestSchemaVersion()));
  EXPECT_EQ(raw.Query("PRAGMA journal_mode"), "wal");
  for (const char* table : {"sweeps", "trials", "results", "configs", "config_axes",
                            "result_batches", "result_groups", "agents"})
    EXPECT_EQ(raw.Query(std::string("SELECT COUNT(*) FROM sqlite_master WHERE name = '") + table +
                        "'"),
              "1")
        << table;
  for (const char* index : {"trials_queue", "results_sm_model_status", "results_finished",
                            "results_config", "result_batches_best"})
    EXPECT_EQ(raw.Query(std::string("SELECT COUNT(*) FROM sqlite_master WHERE name = '") + index +
                        "'"),
              "1")
        << index;
}

TEST(StoreOpenTest, RefusesADatabaseFromANewerBuild) {
  TempDir dir;
  const std::string path = dir.File("new.db");
  const int newer = LatestSchemaVersion() + 7;
  {
    RawDb raw(path);
    ASSERT_EQ(raw.Exec("PRAGMA user_version = " + std::to_string(newer)), SQLITE_OK);
  }
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(path);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(store.status().message(), HasSubstr(std::to_string(newer)));
  EXPECT_THAT(store.status().message(), HasSubstr(std::to_string(LatestSchemaVersion())));
  RawDb raw(path);
  EXPECT_EQ(raw.Query("PRAGMA user_version"), std::to_string(newer));  // untouched
}

TEST(StoreOpenTest, ReopeningAMigratedFileKeepsTheVersion) {
  TempDir dir;
  const std::string path = dir.File("v.db");
  { ASSERT_NE(OpenOrDie(path), nullptr); }
  { ASSERT_NE(OpenOrDie(path), nullptr); }
  RawDb raw(path);
  EXPECT_EQ(raw.Query("PRAGMA user_version"), std::to_string(LatestSchemaVersion()));
}

TEST(StoreOpenTest, NotADatabaseIsAnError) {
  TempDir dir;
  const std::string path = dir.File("junk.db");
  {
    std::ofstream junk(path);
    junk << std::string(4096, 'x');
  }
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(path);
  ASSERT_FALSE(store.ok());
  EXPECT_THAT(store.status().message(), HasSubstr(path));
}

TEST_F(StoreTest, ABusyDatabaseFailsWithUnavailableAndRecovers) {
  const int64_t id = CreateSweep(2);
  const std::string t = absl::StrCat(id, "-0");
  store_.reset();
  StoreOptions options;
  options.busy_timeout_ms = 100;
  store_ = OpenOrDie(path_, options);
  ASSERT_NE(store_, nullptr);

  RawDb other(path_);
  ASSERT_EQ(other.Exec("BEGIN EXCLUSIVE"), SQLITE_OK);
  absl::StatusOr<TrialRecord> leased = store_->LeaseTrial(t, "agent-1", 1000);
  EXPECT_EQ(leased.status().code(), absl::StatusCode::kUnavailable) << leased.status();
  EXPECT_THAT(leased.status().message(), HasSubstr("busy"));
  absl::Status s = store_->RecordResult("", "g", 90, MakeResult(t, 1, TrialStatus::kOk, 1, 1, kFlash));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  absl::StatusOr<int64_t> created = store_->CreateSweep(MakeSweep("blocked"), {MakeTrial(kFlash)});
  EXPECT_EQ(created.status().code(), absl::StatusCode::kUnavailable) << created.status();
  // Readers are not blocked in WAL mode, and nothing changed.
  absl::StatusOr<TrialRecord> trial = store_->GetTrial(t);
  ASSERT_TRUE(trial.ok()) << trial.status();
  EXPECT_EQ(trial->state, TrialState::kQueued);
  ASSERT_EQ(other.Exec("COMMIT"), SQLITE_OK);

  leased = store_->LeaseTrial(t, "agent-1", 1000);
  ASSERT_TRUE(leased.ok()) << leased.status();
  EXPECT_EQ(leased->attempt, 1);
  ASSERT_TRUE(store_->RecordResult("agent-1", "g", 90,
                                   MakeResult(t, 1, TrialStatus::kOk, 1, 1, kFlash))
                  .ok());
  EXPECT_EQ(other.Query("PRAGMA integrity_check"), "ok");
  EXPECT_EQ(other.Count("results"), 1);
  EXPECT_EQ(other.Count("sweeps"), 1);
}

TEST(SqliteErrorTest, MapsResultCodes) {
  EXPECT_EQ(SqliteError(nullptr, SQLITE_BUSY, "op").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(SqliteError(nullptr, SQLITE_LOCKED, "op").code(), absl::StatusCode::kUnavailable);
  absl::Status full = SqliteError(nullptr, SQLITE_FULL, "inserting a result");
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("disk full"));
  EXPECT_THAT(full.message(), HasSubstr("inserting a result"));
  EXPECT_EQ(SqliteError(nullptr, SQLITE_CORRUPT, "op").code(), absl::StatusCode::kDataLoss);
  // A write refused for space (ENOSPC), a file size limit (EFBIG) or a quota is a full disk;
  // other I/O errors are not.
  for (int err : {ENOSPC, EFBIG, EDQUOT}) {
    errno = err;
    absl::Status s = SqliteError(nullptr, SQLITE_IOERR_WRITE, "appending to the WAL");
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_THAT(s.message(), HasSubstr("disk full"));
  }
  errno = EIO;
  EXPECT_EQ(SqliteError(nullptr, SQLITE_IOERR_WRITE, "op").code(), absl::StatusCode::kInternal);
  EXPECT_EQ(SqliteError(nullptr, SQLITE_CONSTRAINT_UNIQUE, "op").code(),
            absl::StatusCode::kAlreadyExists);
}

}  // namespace
}  // namespace infersweep
