// `best` answers which configs do not fit at a batch size, per GPU, beside the fastest one: the
// coordinator's Best over gRPC on loopback, from results in its SQLite store, and the
// `infersweep best` process printing them (docs/VERDICTS.md "Memory").
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/backend_config.h"
#include "coordinator/client.h"
#include "coordinator/server.h"
#include "storage/store.h"
#include "tests/fleet_process.h"
#include "tests/raw_db.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::UnorderedElementsAre;

const BackendConfig kFlash = {{"device", "cuda"}, {"attention", "flash"}, {"graphs", "on"}};
const BackendConfig kNaive = {{"device", "cuda"}, {"attention", "naive"}, {"graphs", "off"}};
const BackendConfig kFlashOff = {{"device", "cuda"}, {"attention", "flash"}, {"graphs", "off"}};

BatchFigures Measured(int batch, double tok_s) {
  BatchFigures b;
  b.batch = batch;
  b.output_tok_s = {tok_s, tok_s, tok_s};
  b.ttft_ms = {10, 10, 10};
  b.tpot_ms = {5, 5, 5};
  b.prefill_tok_s = {1000, 1000, 1000};
  return b;
}

BatchFigures Refused(int batch, BatchMemoryVerdict verdict, const std::string& reason) {
  BatchFigures b;
  b.batch = batch;
  b.memory_verdict = verdict;
  b.memory_reason = reason;
  return b;
}

class BestMemoryVerdicts : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "best-memory-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    CoordinatorOptions o;
    o.tick_ms = 50;
    o.log = [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(log_mu_);
      log_ += line + "\n";
    };
    server_ = std::make_unique<CoordinatorServer>(o);
    auto port = server_->Start("127.0.0.1:0", dir_ + "/c.db");
    ASSERT_TRUE(port.ok()) << port.status();
    address_ = absl::StrCat("127.0.0.1:", *port);
    client_ = std::make_unique<ServiceClient>(address_, 10'000);

    // One sweep of six trials; their results, oldest first.
    std::vector<TrialRecord> trials(6);
    for (TrialRecord& t : trials) {
      t.model = "preset:tiny";
      t.config = kFlash;
      t.workload.batch_sizes = {1, 64};
      t.workload.prompt_len = 64;
    }
    SweepRecord sweep;
    sweep.name = "memory";
    sweep.spec_yaml = "name: memory\n";
    sweep.model = "preset:tiny";
    absl::StatusOr<int64_t> id = server_->store()->CreateSweep(sweep, trials);
    ASSERT_TRUE(id.ok()) << id.status();
    sweep_ = *id;
    int64_t finished = 1'000'000;
    auto record = [&](int index, const std::string& gpu, const BackendConfig& config,
                      TrialStatus status, std::vector<BatchFigures> batches) {
      TrialResult r;
      r.trial_id = absl::StrCat(sweep_, "-", index);
      r.attempt = 1;
      r.status = status;
      r.model = "preset:tiny";
      r.config = config;
      r.device = gpu;
      r.sm = 90;
      r.batches = std::move(batches);
      r.started_unix_ms = finished - 10;
      r.finished_unix_ms = finished++;
      ASSERT_TRUE(server_->store()->RecordResult("", gpu, 90, r).ok());
    };
    // flash/on on the H200: batch 1 runs, batch 64 does not fit.
    record(0, "NVIDIA H200", kFlash, TrialStatus::kOk,
           {Measured(1, 100), Refused(64, BatchMemoryVerdict::kDoesNotFit,
                                      "needs 150.00 GiB on the device (...), 139.00 GiB free")});
    // flash/off on the H200: once 64 did not fit, then a later result ran it.
    record(1, "NVIDIA H200", kFlashOff, TrialStatus::kOk,
           {Measured(1, 90), Refused(64, BatchMemoryVerdict::kDoesNotFit, "needs more")});
    record(2, "NVIDIA H200", kFlashOff, TrialStatus::kOk, {Measured(1, 91), Measured(64, 2000)});
    // naive on the H200: not even batch 1 fits, so the trial is UNSUPPORTED.
    record(3, "NVIDIA H200", kNaive, TrialStatus::kUnsupported,
           {Refused(1, BatchMemoryVerdict::kDoesNotFit, "needs 200.00 GiB on the device (...)"),
            Refused(64, BatchMemoryVerdict::kDoesNotFit, "needs 260.00 GiB on the device (...)")});
    // flash/on on an H100 (also sm_90): 64 ran out of memory as it ran.
    record(4, "NVIDIA H100 80GB HBM3", kFlash, TrialStatus::kOk,
           {Measured(1, 80), Refused(64, BatchMemoryVerdict::kOutOfMemory,
                                     "attention KV cache: cudaMalloc: out of memory")});
    // flash/on on the H200 at batch 256 alone: it does not fit, and nothing else ran there.
    record(5, "NVIDIA H200", kFlash, TrialStatus::kUnsupported,
           {Refused(256, BatchMemoryVerdict::kDoesNotFit, "needs 400.00 GiB on the device")});
  }
  void TearDown() override {
    client_.reset();
    server_->Stop();
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  v1::BestResponse Best(int batch) {
    v1::BestRequest req;
    req.set_model("preset:tiny");
    req.set_sm(90);
    req.set_batch(batch);
    absl::StatusOr<v1::BestResponse> resp = client_->Best(req);
    EXPECT_TRUE(resp.ok()) << resp.status();
    return resp.value_or(v1::BestResponse{});
  }

  static std::vector<std::string> Named(const v1::BestResponse& resp) {
    std::vector<std::string> out;
    for (const v1::MemoryVerdictRow& m : resp.does_not_fit())
      out.push_back(
          absl::StrCat(m.config(), " @ ", m.gpu_name(), " ", m.batch(), " ", m.verdict()));
    return out;
  }

  std::string Log() {
    std::lock_guard<std::mutex> lock(log_mu_);
    return log_;
  }

  std::string dir_, address_;
  std::mutex log_mu_;
  std::string log_;
  int64_t sweep_ = 0;
  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<ServiceClient> client_;
};

// At batch 64 the fastest measured config is ranked, and beside it every (config, GPU) whose
// latest result there has a memory verdict; a config that later ran at 64 is not among them.
TEST_F(BestMemoryVerdicts, BestNamesTheConfigsThatDoNotFitPerGpu) {
  const v1::BestResponse at64 = Best(64);
  ASSERT_TRUE(at64.found());
  auto best = TrialResultFromJson(nlohmann::json::parse(at64.row().result_json()));
  ASSERT_TRUE(best.ok()) << best.status();
  EXPECT_EQ(BackendConfigString(best->config), BackendConfigString(kFlashOff));
  const std::string flash = BackendConfigString(kFlash), naive = BackendConfigString(kNaive);
  EXPECT_THAT(Named(at64),
              UnorderedElementsAre(flash + " @ NVIDIA H200 64 DOES_NOT_FIT",
                                   naive + " @ NVIDIA H200 64 DOES_NOT_FIT",
                                   flash + " @ NVIDIA H100 80GB HBM3 64 OUT_OF_MEMORY"));
  for (const v1::MemoryVerdictRow& m : at64.does_not_fit()) {
    EXPECT_EQ(m.sweep_id(), sweep_);
    if (m.config() == naive) {
      EXPECT_EQ(m.reason(), "needs 260.00 GiB on the device (...)");
    }
  }
  // At batch 1 only naive does not fit.
  EXPECT_THAT(Named(Best(1)), UnorderedElementsAre(naive + " @ NVIDIA H200 1 DOES_NOT_FIT"));
  // Serving answers rank load points and carry no lockstep verdicts.
  v1::BestRequest serving;
  serving.set_model("preset:tiny");
  serving.set_sm(90);
  serving.set_serving(true);
  absl::StatusOr<v1::BestResponse> served = client_->Best(serving);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(served->does_not_fit_size(), 0);
}

// A stored result that no longer parses does not take the ranking down with it: best answers
// without its verdicts, and the coordinator's log says why.
TEST_F(BestMemoryVerdicts, AnUnreadableResultLeavesTheRankingStanding) {
  {
    RawDb raw(dir_ + "/c.db");
    ASSERT_EQ(raw.Exec(absl::StrCat("UPDATE results SET result_blob = x'00ff' WHERE trial_id = '",
                                    sweep_, "-3'")),
              SQLITE_OK);
  }
  const v1::BestResponse at64 = Best(64);
  ASSERT_TRUE(at64.found());
  EXPECT_EQ(at64.does_not_fit_size(), 0);
  EXPECT_THAT(Log(), HasSubstr("best for preset:tiny on sm_90: answered without its memory "
                               "verdicts: DATA_LOSS"));
}

// `infersweep best` prints them under the figures, the config still its last line; --format
// json carries them under "does_not_fit".
TEST_F(BestMemoryVerdicts, TheBestCommandPrintsThem) {
  int rc = -1;
  const std::string table = RunCommand(
      absl::StrCat("'", WorkerBinary(), "' best --model preset:tiny --sm-arch sm_90 --batch 64 ",
                   "--coordinator ", address_, " 2>&1"),
      &rc);
  EXPECT_EQ(rc, 0) << table;
  const std::string naive = BackendConfigString(kNaive);
  EXPECT_THAT(table, HasSubstr(absl::StrCat(
                         "# ", naive, " on NVIDIA H200 at batch 64: does not fit (trial ", sweep_,
                         "-3, sweep ", sweep_, "): needs 260.00 GiB on the device (...)")));
  EXPECT_THAT(table, HasSubstr("on NVIDIA H100 80GB HBM3 at batch 64: ran out of memory"));
  EXPECT_THAT(table, Not(HasSubstr(BackendConfigString(kFlashOff) + " on NVIDIA H200")));
  EXPECT_THAT(table, testing::EndsWith(BackendConfigString(kFlashOff) + "\n"));

  const std::string json = RunCommand(
      absl::StrCat("'", WorkerBinary(), "' best --model preset:tiny --sm-arch sm_90 --batch 64 ",
                   "--format json --coordinator ", address_),
      &rc);
  EXPECT_EQ(rc, 0) << json;
  const nlohmann::json parsed = nlohmann::json::parse(json, nullptr, false);
  ASSERT_FALSE(parsed.is_discarded()) << json;
  ASSERT_TRUE(parsed.contains("does_not_fit")) << json;
  EXPECT_EQ(parsed["does_not_fit"].size(), 3u);

  // Where nothing ran at that size, the verdicts are the answer: "nothing fits here".
  const std::string none = RunCommand(
      absl::StrCat("'", WorkerBinary(), "' best --model preset:tiny --sm-arch sm_90 --batch 256 ",
                   "--coordinator ", address_, " 2>&1"),
      &rc);
  EXPECT_NE(rc, 0) << none;
  EXPECT_THAT(none, HasSubstr("# no OK result for preset:tiny on sm_90 at batch 256"));
  EXPECT_THAT(none, HasSubstr(absl::StrCat("# ", BackendConfigString(kFlash),
                                           " on NVIDIA H200 at batch 256: does not fit")));
  const std::string none_json = RunCommand(
      absl::StrCat("'", WorkerBinary(), "' best --model preset:tiny --sm-arch sm_90 --batch 256 ",
                   "--format json --coordinator ", address_),
      &rc);
  const nlohmann::json none_parsed = nlohmann::json::parse(none_json, nullptr, false);
  ASSERT_FALSE(none_parsed.is_discarded()) << none_json;
  EXPECT_TRUE(none_parsed["best"].is_null());
  EXPECT_EQ(none_parsed["does_not_fit"].size(), 1u);
}

}  // namespace
}  // namespace infersweep
