// sweep_bench: the life of a 10,000-trial sweep up to scheduling, phase by phase.
//
//   sweep_bench [--runs R] [--db PATH]
//
// Per run (fresh database file each time): parse the YAML, expand it into trials, store them
// (Store::CreateSweep, one transaction), then lease every trial the way the scheduler does
// (QueuedTrials pages of 500, LeaseTrial each, one transaction per lease). Prints the median of
// R runs per phase. Lines starting with '#' are metadata.
//
// Spec "synthetic": 4 axes x 10 values = 10,000 distinct combinations, checked against a
// stand-in registry (the real one has far fewer values). Spec "cpu-repeats": the real registry's
// CPU axes, 2 x 5 combinations x 1,000 repeats = 10,000 trials.
#include <sqlite3.h>
#include <sys/utsname.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/sweep_spec.h"
#include "storage/store.h"

namespace infersweep {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "sweep_bench: %s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Stand-in registry for the synthetic spec: device cuda, axes a0..a3 with values v0..v9.
absl::StatusOr<BackendConfig> SyntheticNormalize(const BackendConfig& config) {
  BackendConfig out = {{"device", "cuda"}, {"a0", "v0"}, {"a1", "v0"}, {"a2", "v0"}, {"a3", "v0"}};
  for (const auto& [axis, value] : config) {
    if (!out.count(axis))
      return absl::InvalidArgumentError(absl::StrCat("config axis '", axis, "' is unknown"));
    if (axis == "device" ? value != "cuda"
                         : value.size() != 2 || value[0] != 'v' || value[1] < '0' || value[1] > '9')
      return absl::InvalidArgumentError(
          absl::StrCat("config axis '", axis, "': unknown value '", value, "'"));
    out[axis] = value;
  }
  return out;
}

std::string SyntheticSpec() {
  std::string yaml = "name: synthetic\nmodel: preset:qwen3-30b-a3b\ndevice: cuda\nmatrix:\n";
  for (int a = 0; a < 4; ++a) {
    absl::StrAppend(&yaml, "  a", a, ": [");
    for (int v = 0; v < 10; ++v) absl::StrAppend(&yaml, v ? ", " : "", "v", v);
    absl::StrAppend(&yaml, "]\n");
  }
  absl::StrAppend(&yaml,
                  "workload: {prompt: 128, output: 32, batch: [1, 8]}\n"
                  "selector: {sm: [90], gpu_name: \"H200|H100\", min_memory_gb: 80}\n");
  return yaml;
}

constexpr char kCpuSpec[] = R"(name: cpu-repeats
model: preset:tiny
matrix:
  device: [cpu]
  matmul: [naive, blocked]
  threads: [1, 2, 4, 8, all]
workload: {prompt: 16, output: 8, batch: [1]}
repeats: 1000
)";

struct Phases {
  std::vector<double> parse, expand, create, lease;
};

void RunOnce(const std::string& yaml, const ConfigNormalizer& normalize, const std::string& db,
             Phases* phases) {
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(db + suffix);
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(db);
  Check(store.status(), "open");

  auto t = Clock::now();
  absl::StatusOr<SweepSpec> spec = ParseSweepSpec(yaml, "bench.yaml", normalize);
  Check(spec.status(), "ParseSweepSpec");
  phases->parse.push_back(Ms(Clock::now() - t));

  t = Clock::now();
  absl::StatusOr<std::vector<TrialRecord>> trials =
      ExpandSweep(*spec, 0, kDefaultMaxSweepTrials, normalize);
  Check(trials.status(), "ExpandSweep");
  phases->expand.push_back(Ms(Clock::now() - t));
  if (trials->size() != 10'000) {
    std::fprintf(stderr, "sweep_bench: expected 10000 trials, got %zu\n", trials->size());
    std::exit(1);
  }

  t = Clock::now();
  absl::StatusOr<int64_t> id = (*store)->CreateSweep(MakeSweepRecord(*spec), *trials);
  Check(id.status(), "CreateSweep");
  phases->create.push_back(Ms(Clock::now() - t));

  t = Clock::now();
  size_t leased = 0;
  for (;;) {
    absl::StatusOr<std::vector<TrialRecord>> page = (*store)->QueuedTrials(500);
    Check(page.status(), "QueuedTrials");
    if (page->empty()) break;
    for (const TrialRecord& trial : *page) {
      Check((*store)->LeaseTrial(trial.trial_id, "agent-1", 1'900'000'000'000).status(),
            "LeaseTrial");
      ++leased;
    }
  }
  phases->lease.push_back(Ms(Clock::now() - t));
  if (leased != trials->size()) {
    std::fprintf(stderr, "sweep_bench: leased %zu of %zu\n", leased, trials->size());
    std::exit(1);
  }
  store->reset();
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(db + suffix);
}

void Report(const char* name, const Phases& p, int runs) {
  const double parse = Median(p.parse), expand = Median(p.expand), create = Median(p.create),
               lease = Median(p.lease);
  std::printf("%-12s parse          %9.2f ms\n", name, parse);
  std::printf("%-12s expand         %9.2f ms\n", name, expand);
  std::printf("%-12s create_sweep   %9.2f ms  (%.1f us/trial)\n", name, create, create * 100 / 1000);
  std::printf("%-12s lease_all      %9.2f ms  (%.1f us/trial)\n", name, lease, lease * 100 / 1000);
  std::printf("%-12s parse+expand+store %9.2f ms  (medians of %d runs, 10000 trials)\n", name,
              parse + expand + create, runs);
}

int Main(int argc, char** argv) {
  int runs = 5;
  std::string db = "/tmp/infersweep_sweep_bench.db";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) {
      runs = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--db") && i + 1 < argc) {
      db = argv[++i];
    } else {
      std::fprintf(stderr, "usage: sweep_bench [--runs R] [--db PATH]\n");
      return 2;
    }
  }
  utsname u{};
  uname(&u);
  std::printf("# sweep_bench: 10000-trial sweeps, medians of %d runs, fresh db each run\n", runs);
  std::printf("# machine: %s %s, %u hardware threads; sqlite %s; db %s\n", u.sysname, u.machine,
              std::thread::hardware_concurrency(), sqlite3_libversion(), db.c_str());

  Phases synthetic;
  const std::string yaml = SyntheticSpec();
  for (int r = 0; r < runs; ++r) RunOnce(yaml, SyntheticNormalize, db, &synthetic);
  Report("synthetic", synthetic, runs);

  // The real registry's CPU axes; skipped (with a note) if they change under it.
  if (absl::StatusOr<SweepSpec> probe = ParseSweepSpec(kCpuSpec, "cpu.yaml"); !probe.ok()) {
    std::printf("# cpu-repeats skipped: %s\n", std::string(probe.status().message()).c_str());
    return 0;
  }
  Phases cpu;
  for (int r = 0; r < runs; ++r) RunOnce(kCpuSpec, NormalizeBackendConfig, db, &cpu);
  Report("cpu-repeats", cpu, runs);
  return 0;
}

}  // namespace
}  // namespace infersweep

int main(int argc, char** argv) { return infersweep::Main(argc, argv); }
