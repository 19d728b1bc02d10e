// store_bench: fills a Store with N results, then times the coordinator's read paths.
//
//   store_bench [--rows N] [--db PATH] [--batch B] [--runs R] [--keep]   (--help: every flag)
//
// Creates sweeps of 10,000 trials each, records N results through RecordResults in
// transactions of B results (coordinator-made results, so no leases are needed), then times the
// coordinator's read paths over R runs each (median and p99): QueryResultRows (what the
// coordinator serves: the stored JSON, not parsed), QueryResults (parsed), Best. Results carry
// identities and the size of a real GPU result's JSON. Lines starting with '#' are metadata.
#include <sqlite3.h>
#include <sys/utsname.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "storage/store.h"

namespace infersweep {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "store_bench: %s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

struct Options {
  int64_t rows = 1'000'000;
  std::string db = "/tmp/infersweep_store_bench.db";
  int batch = 512;  // the coordinator's group commit cap
  int runs = 20;
  bool keep = false;
  // Results from an agent, as the coordinator stores them: each trial leased first, each result
  // with its agent id (and so its content digest).
  bool agent = false;
};

// What --help prints: every flag with its meaning and default (from Options).
std::string Usage() {
  const Options d;
  std::string out =
      "usage: store_bench [--rows N] [--db PATH] [--batch B] [--runs R] [--agent] [--keep]\n"
      "Fills a Store with N results, then times QueryResults and Best.\n";
  auto flag = [&out](std::string name, const std::string& meaning) {
    name.resize(std::max<size_t>(name.size() + 1, 13), ' ');
    absl::StrAppend(&out, "  ", name, meaning, "\n");
  };
  flag("--rows N", absl::StrCat("results to record (default ", d.rows, ")"));
  flag("--db PATH", absl::StrCat("the database, made fresh (default ", d.db, ")"));
  flag("--batch B", absl::StrCat("results per write transaction (default ", d.batch, ")"));
  flag("--runs R",
       absl::StrCat("timed runs of each query; the median is printed (default ", d.runs, ")"));
  flag("--agent",
       "lease every trial to an agent and record its results as the agent's (with their "
       "content digests), as the coordinator does; default: coordinator-made results");
  flag("--keep", "keep the database afterwards (default: removed)");
  flag("--help", "print this and exit");
  return out;
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "store_bench: %s needs a value\n", flag);
        std::exit(2);
      }
      return argv[++i];
    };
    if (!std::strcmp(argv[i], "--rows")) {
      o.rows = std::atoll(value("--rows"));
    } else if (!std::strcmp(argv[i], "--db")) {
      o.db = value("--db");
    } else if (!std::strcmp(argv[i], "--batch")) {
      o.batch = std::atoi(value("--batch"));
    } else if (!std::strcmp(argv[i], "--runs")) {
      o.runs = std::atoi(value("--runs"));
    } else if (!std::strcmp(argv[i], "--keep")) {
      o.keep = true;
    } else if (!std::strcmp(argv[i], "--agent")) {
      o.agent = true;
    } else if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::printf("%s", Usage().c_str());
      std::exit(0);
    } else {
      std::fprintf(stderr, "store_bench: unknown flag '%s'\n%s", argv[i], Usage().c_str());
      std::exit(2);
    }
  }
  if (o.rows < 1 || o.batch < 1 || o.runs < 1) {
    std::fprintf(stderr, "store_bench: --rows, --batch and --runs must be >= 1\n");
    std::exit(2);
  }
  return o;
}

struct Timing {
  double median_ms = 0, p99_ms = 0;
};

// Wall time of `runs` calls: the median and the nearest-rank 99th percentile, in ms.
Timing TimeRuns(int runs, const std::function<void()>& fn) {
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    const auto start = Clock::now();
    fn();
    ms.push_back(Ms(Clock::now() - start));
  }
  std::sort(ms.begin(), ms.end());
  const size_t p99 = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(ms.size()))) - 1;
  return {ms[ms.size() / 2], ms[std::min(p99, ms.size() - 1)]};
}

void PrintTiming(const char* name, const Timing& t, int runs, const std::string& note) {
  std::printf("%-26s %9.2f ms median %9.2f ms p99  (%d runs; %s)\n", name, t.median_ms, t.p99_ms,
              runs, note.c_str());
}

const std::vector<std::string> kModels = {"preset:qwen3-30b-a3b", "preset:qwen3-8b",
                                          "preset:llama3-8b", "preset:tiny"};
// Each model at two layer counts and each result at one of two workloads: four (identity,
// workload) groups per model, as a fleet that varies them keeps.
const std::vector<int> kLayers = {48, 2};
const std::vector<std::string> kWorkloads = {"prompt=128,output=32,warmup=1",
                                             "prompt=1024,output=128,warmup=1"};

std::string ModelKey(const std::string& model, int layers) {
  return absl::StrCat(model, " layers=", layers, " seed=1 weights=bf16");
}
// sm 90 gets about 40% of the rows; the rest spread over four other architectures.
const std::vector<int> kSms = {90, 90, 90, 90, 80, 89, 100, 120, 120, 86};
const std::vector<BackendConfig> kConfigs = {
    {{"device", "cuda"}, {"gemm", "reference"}, {"attention", "naive"}, {"moe", "loop"}, {"graphs", "off"}},
    {{"device", "cuda"}, {"gemm", "cublaslt"}, {"attention", "naive"}, {"moe", "fused"}, {"graphs", "on"}},
    {{"device", "cuda"}, {"gemm", "cublaslt"}, {"attention", "flash"}, {"moe", "fused"}, {"graphs", "off"}},
    {{"device", "cuda"}, {"gemm", "reference"}, {"attention", "flash"}, {"moe", "grouped"}, {"graphs", "on"}},
};

// What a GPU step launches, as the engine's launch log records it (one per config and batch:
// a fleet's results repeat these).
PhaseKernels DecodeKernels(size_t config, int batch) {
  PhaseKernels p;
  p.graph = config % 2 == 1;
  p.kernels = {{"StepInputsKernel", 1},
               {"RmsNormKernel", 97},
               {batch > 4 ? "cublasLt:bf16 gemm" : "GemvKernel<2, 1>", 96},
               {"QkNormRopeAppendKernel<__nv_bfloat16>", 48},
               {"FlashDecodeKernel<128, __nv_bfloat16>", 48},
               {"FlashDecodeCombineKernel<128>", 48},
               {"GemvKernel<1, 1>", 48},
               {batch >= 16 ? "cublasLt:fp32 gemm" : "RouterGemvKernel<8>", 48},
               {"TopKSoftmaxKernel<8>", 48},
               {batch > 4 ? "BucketPairsKernel" : "MoeGateUpKernel<2>", 48},
               {batch > 4 ? "GroupedGateUpKernel<8, 2>" : "MoeDownCombineKernel<2>", 48},
               {"GemvStreamKernel<1>", 1},
               {"GreedyTokensKernel", 1}};
  if (batch > 4)
    p.fallbacks = {absl::StrCat("gemm=fused: decode, ", batch,
                                " rows (> 4): the layers' linears unfused (cuBLASLt for bf16 "
                                "weights), not the fused GEMV")};
  return p;
}

PhaseKernels PrefillKernels(size_t config) {
  PhaseKernels p;
  p.kernels = {{"StepInputsKernel", 1},
               {"RmsNormKernel", 97},
               {"cublasLt:bf16 gemm", 96},
               {"QkNormRopeAppendKernel<__nv_bfloat16>", 48},
               {config % 2 ? "FlashPrefillKernel<64, __nv_bfloat16>" : "AttentionKernel", 48},
               {"cublasLt:fp32 gemm", 48},
               {"TopKSoftmaxKernel<8>", 48},
               {"BucketPairsKernel", 48},
               {"GroupedGateUpWgmmaKernel<128>", 48},
               {"GroupedDownWgmmaKernel<128>", 48},
               {"CombineExpertOutputsKernel", 48},
               {"GemvStreamKernel<1>", 1},
               {"GreedyTokensKernel", 1}};
  return p;
}

BatchFigures Figures(int batch, double tok_s, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> jitter(0.9, 1.1);
  BatchFigures b;
  b.batch = batch;
  const double t = tok_s * jitter(rng);
  b.output_tok_s = {t, t * 0.97, t * 1.03};
  b.output_tok_s_per_seq = {t / batch, t / batch * 0.97, t / batch * 1.03};
  b.ttft_ms = {20 * jitter(rng), 19, 22};
  b.tpot_ms = {1000.0 / t * batch, 1, 2};
  b.latency_ms = {200 * jitter(rng), 190, 210};
  b.prefill_tok_s = {5000 * jitter(rng), 4900, 5100};
  b.itl_ms = {5, 6, 9};
  b.decode_bytes_per_step = 6.1e9;
  b.achieved_gb_s = 3000 * jitter(rng);
  b.roofline_tok_s = 800;
  b.roofline_fraction = 0.6;
  return b;
}

int Main(int argc, char** argv) {
  const Options o = ParseArgs(argc, argv);
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(o.db + suffix);

  utsname u{};
  uname(&u);
  std::printf("# store_bench: %lld results, transactions of %d, medians of %d runs\n",
              static_cast<long long>(o.rows), o.batch, o.runs);
  std::printf("# machine: %s %s, %u hardware threads; sqlite %s; db %s\n", u.sysname, u.machine,
              std::thread::hardware_concurrency(), sqlite3_libversion(), o.db.c_str());

  absl::StatusOr<std::unique_ptr<Store>> opened = Store::Open(o.db);
  Check(opened.status(), "open");
  Store& store = **opened;

  // Trials: sweeps of 10,000.
  constexpr int64_t kTrialsPerSweep = 10'000;
  std::vector<std::string> trial_ids;
  std::vector<int64_t> sweep_of;
  trial_ids.reserve(o.rows);
  const auto t_trials = Clock::now();
  for (int64_t done = 0; done < o.rows;) {
    const int64_t n = std::min(kTrialsPerSweep, o.rows - done);
    std::vector<TrialRecord> trials(n);
    for (int64_t i = 0; i < n; ++i) {
      trials[i].model = kModels[((done + i) / 7) % kModels.size()];
      trials[i].config = kConfigs[(done + i) % kConfigs.size()];
      trials[i].workload.batch_sizes = {1, 8};
      if ((done + i) % 2 == 1) {
        trials[i].workload.prompt_len = 1024;
        trials[i].workload.output_len = 128;
      }
    }
    SweepRecord sweep;
    sweep.name = absl::StrCat("bench-", done / kTrialsPerSweep);
    sweep.model = kModels[0];
    absl::StatusOr<int64_t> id = store.CreateSweep(sweep, trials);
    Check(id.status(), "CreateSweep");
    for (int64_t i = 0; i < n; ++i) trial_ids.push_back(absl::StrCat(*id, "-", i));
    done += n;
  }
  const double trials_ms = Ms(Clock::now() - t_trials);

  // Leases, for results stored as an agent's.
  constexpr char kAgent[] = "bench-agent";
  double lease_ms = 0;
  if (o.agent) {
    const auto t_lease = Clock::now();
    for (int64_t done = 0; done < o.rows;) {
      const int64_t n = std::min<int64_t>(o.batch, o.rows - done);
      std::vector<LeaseRequest> leases(n);
      for (int64_t i = 0; i < n; ++i)
        leases[i] = {trial_ids[done + i], kAgent, int64_t{1} << 50, LeasePlace{"NVIDIA H200", 90}};
      for (const absl::StatusOr<TrialRecord>& t : store.LeaseTrials(leases))
        Check(t.status(), "LeaseTrials");
      done += n;
    }
    lease_ms = Ms(Clock::now() - t_lease);
  }

  // Results. A sampler reads the database's and the WAL's sizes every 20 ms: the peak is what
  // the ingest needs on disk.
  std::atomic<bool> inserting{true};
  std::atomic<int64_t> peak_disk{0}, peak_wal{0};
  std::thread sampler([&] {
    while (inserting) {
      std::error_code ec;
      const auto db = static_cast<int64_t>(std::filesystem::file_size(o.db, ec));
      const auto wal = static_cast<int64_t>(std::filesystem::file_size(o.db + "-wal", ec));
      const int64_t w = ec ? 0 : wal;
      peak_wal = std::max<int64_t>(peak_wal, w);
      peak_disk = std::max<int64_t>(peak_disk, db + w);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  std::mt19937_64 rng(42);
  const int64_t t0_ms = 1'700'000'000'000;
  const auto t_insert = Clock::now();
  for (int64_t done = 0; done < o.rows;) {
    const int64_t n = std::min<int64_t>(o.batch, o.rows - done);
    std::vector<ResultSubmission> batch(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t k = done + i;
      ResultSubmission& s = batch[i];
      if (o.agent) s.agent_id = kAgent;
      s.sm = kSms[rng() % kSms.size()];
      s.gpu_name = s.sm == 90 ? "NVIDIA H200" : absl::StrCat("GPU sm_", s.sm);
      TrialResult& r = s.result;
      r.trial_id = trial_ids[k];
      r.attempt = 1;
      const uint64_t roll = rng() % 100;
      r.status = roll < 85   ? TrialStatus::kOk
                 : roll < 90 ? TrialStatus::kIncorrect
                 : roll < 95 ? TrialStatus::kUnsupported
                             : TrialStatus::kCrashed;
      r.model = kModels[(k / 7) % kModels.size()];
      r.config = kConfigs[k % kConfigs.size()];
      r.model_identity.source = "preset";
      r.model_identity.name = r.model.substr(7);
      r.model_identity.layers = kLayers[(k / 3) % kLayers.size()];
      r.model_identity.seed = 1;
      r.model_identity.weights = "bf16";
      r.software = {"580.65.06", "13.0", "13.0", "13.0.0", "13.0.0", "", ""};
      r.device = s.gpu_name;
      r.sm = s.sm;
      r.engine_version = "infersweep v0.1.0-123-gabcdef012345";
      r.load_seconds = 3.2;
      r.peak_memory_bytes = 40'000'000'000;
      r.verdict.precision_class = "bf16";
      r.verdict.max_rel_error = 0.01;
      r.verdict.top1_agreement = 0.99;
      r.verdict.free_run_agreement = 0.97;
      if (r.status == TrialStatus::kOk || r.status == TrialStatus::kIncorrect) {
        const double base = 100 + 50 * static_cast<double>(k % kConfigs.size());
        r.batches = {Figures(1, base, rng), Figures(8, base * 6, rng)};
        for (BatchFigures& b : r.batches) {
          b.decode_kernels = DecodeKernels(k % kConfigs.size(), b.batch);
          b.prefill_kernels = PrefillKernels(k % kConfigs.size());
        }
      } else {
        r.reason = "needs sm_90a";
      }
      r.finished_unix_ms = t0_ms + k * 1000 + static_cast<int64_t>(rng() % 1000);
      r.started_unix_ms = r.finished_unix_ms - 60'000;
    }
    Check(store.RecordResults(batch), "RecordResults");
    done += n;
  }
  const double insert_ms = Ms(Clock::now() - t_insert);
  inserting = false;
  sampler.join();
  std::printf("create_trials          %10.0f ms  (%lld trials, %.1f us/trial)\n", trials_ms,
              static_cast<long long>(o.rows), trials_ms * 1000 / o.rows);
  if (o.agent)
    std::printf("lease_trials           %10.0f ms  (%.1f us/trial, %d a transaction)\n", lease_ms,
                lease_ms * 1000 / o.rows, o.batch);
  std::printf("insert_results         %10.0f ms  (%.0f results/s, %.1f us/result)\n", insert_ms,
              o.rows / (insert_ms / 1000), insert_ms * 1000 / o.rows);
  std::error_code ec;
  std::printf(
      "peak_on_disk              %9.0f MiB        (database + WAL during the insert, "
      "sampled every 20 ms; WAL at most %.0f MiB)\n",
      peak_disk / 1048576.0, peak_wal / 1048576.0);
  std::printf("# db size after insert: %.0f MiB (+ wal %.0f MiB)\n",
              std::filesystem::file_size(o.db, ec) / 1048576.0,
              std::filesystem::exists(o.db + "-wal") ? std::filesystem::file_size(o.db + "-wal", ec) / 1048576.0 : 0.0);

  // The database as it stays on disk: the WAL folded in (what a checkpoint leaves).
  opened->reset();
  {
    sqlite3* raw = nullptr;
    sqlite3_open_v2(o.db.c_str(), &raw, SQLITE_OPEN_READWRITE, nullptr);
    sqlite3_exec(raw, "PRAGMA wal_checkpoint(TRUNCATE)", nullptr, nullptr, nullptr);
    sqlite3_close(raw);
  }
  std::printf("db_size                   %9.0f MiB        (%.0f bytes/result, WAL checkpointed)\n",
              std::filesystem::file_size(o.db, ec) / 1048576.0,
              static_cast<double>(std::filesystem::file_size(o.db, ec)) / o.rows);
  opened = Store::Open(o.db);
  Check(opened.status(), "reopen");
  Store& reopened = **opened;

  size_t rows_seen = 0, bytes_seen = 0;
  ResultQuery by_sm;
  by_sm.sm = 90;
  by_sm.limit = 1000;
  // Warm the page cache once, as a running coordinator's is.
  Check(reopened.QueryResultRows(by_sm).status(), "QueryResultRows");
  Timing t = TimeRuns(o.runs, [&] {
    absl::StatusOr<std::vector<StoredResult>> r = reopened.QueryResultRows(by_sm);
    Check(r.status(), "QueryResultRows");
    rows_seen = r->size();
    bytes_seen = 0;
    for (const StoredResult& row : *r) bytes_seen += row.result_json.size();
  });
  PrintTiming("query_sm90_limit1000", t, o.runs,
              absl::StrCat(rows_seen, " rows, ", bytes_seen / 1024,
                           " KiB of JSON decompressed, not parsed: what the coordinator serves"));

  const int parse_runs = std::min(o.runs, 20);
  t = TimeRuns(parse_runs, [&] {
    absl::StatusOr<std::vector<StoredResult>> r = reopened.QueryResults(by_sm);
    Check(r.status(), "QueryResults");
    rows_seen = r->size();
  });
  PrintTiming("query_sm90_parsed", t, parse_runs,
              absl::StrCat(rows_seen, " rows parsed into TrialResults (the client's cost)"));

  ResultQuery by_all = by_sm;
  by_all.model = kModels[1];
  by_all.status = TrialStatus::kOk;
  by_all.axis_values = {{"attention", "flash"}};
  t = TimeRuns(o.runs, [&] {
    absl::StatusOr<std::vector<StoredResult>> r = reopened.QueryResultRows(by_all);
    Check(r.status(), "QueryResultRows");
    rows_seen = r->size();
  });
  PrintTiming("query_sm_model_ok_axis", t, o.runs, absl::StrCat(rows_seen, " rows"));

  BestQuery best;
  best.model = kModels[0];
  best.sm = 90;
  size_t groups = 0;
  t = TimeRuns(o.runs, [&] {
    absl::StatusOr<BestAnswer> b = reopened.Best(best);
    Check(b.status(), "Best");
    groups = b->groups.size();
  });
  PrintTiming("best_groups_b1", t, o.runs,
              absl::StrCat(groups, " (model identity, workload) groups: listed, none ranked"));
  best.model_key = ModelKey(kModels[0], kLayers[0]);
  best.workload = kWorkloads[0];
  double best_value = 0;
  t = TimeRuns(o.runs, [&] {
    absl::StatusOr<BestAnswer> b = reopened.Best(best);
    Check(b.status(), "Best");
    best_value = b->best ? b->best->result.batches[0].output_tok_s.median : 0;
  });
  PrintTiming("best_output_tok_s_b1", t, o.runs,
              absl::StrFormat("one group; best %.1f tok/s", best_value));
  best.metric = "ttft_ms";
  t = TimeRuns(o.runs, [&] { Check(reopened.Best(best).status(), "Best"); });
  PrintTiming("best_ttft_ms_b1", t, o.runs, "one group: a key range and a sort");
  best.metric = "output_tok_s";
  best.batch = 8;
  t = TimeRuns(o.runs, [&] { Check(reopened.Best(best).status(), "Best"); });
  PrintTiming("best_output_tok_s_b8", t, o.runs, "one group, batch 8");

  opened->reset();
  if (!o.keep)
    for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(o.db + suffix, ec);
  return 0;
}

}  // namespace
}  // namespace infersweep

int main(int argc, char** argv) { return infersweep::Main(argc, argv); }
