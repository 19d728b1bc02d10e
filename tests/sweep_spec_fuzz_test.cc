// Seeded mutation fuzzing of ParseSweepSpec + ExpandSweep.
//
// Valid specs are mutated (byte flips, truncation, duplicated, deleted and spliced lines, random
// indentation, inserted YAML punctuation) and parsed. Every input must give either OK, with
// trials whose configs are normalized and within the cap, or an error with a non-empty message
// naming the source; nothing may throw or crash.
//
// INFERSWEEP_FUZZ_SECONDS (default 5) bounds the run time, kMaxIterations the work;
// INFERSWEEP_FUZZ_SEED replaces the fixed seed to explore further.
#include <algorithm>
#include <chrono>
#include <map>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "coordinator/sweep_spec.h"
#include "gtest/gtest.h"

namespace infersweep {
namespace {

constexpr uint64_t kDefaultSeed = 0x5eeb5eeb0001ull;
constexpr int64_t kMaxIterations = 300'000;
constexpr size_t kCap = 2000;

// A fixed stand-in for the backend registry (the shape of NormalizeBackendConfig), so the seeds
// stay valid as real backends come and go.
absl::StatusOr<BackendConfig> TestNormalize(const BackendConfig& config) {
  static const std::map<std::string, std::map<std::string, std::vector<std::string>>> kAxes = {
      {"cuda",
       {{"gemm", {"reference", "cublaslt", "wgmma"}},
        {"attention", {"naive", "flash"}},
        {"moe", {"loop", "grouped", "fused"}},
        {"graphs", {"off", "on"}}}},
      {"cpu", {{"matmul", {"naive", "blocked"}}, {"threads", {"1", "2", "4", "8", "all"}}}},
  };
  auto it = config.find("device");
  const std::string device = it == config.end() ? "cpu" : it->second;
  if (!kAxes.count(device))
    return absl::InvalidArgumentError("config axis 'device': unknown value '" + device + "'");
  BackendConfig out = {{"device", device}};
  for (const auto& [axis, values] : kAxes.at(device)) out[axis] = values.front();
  for (const auto& [axis, value] : config) {
    if (axis == "device") continue;
    auto a = kAxes.at(device).find(axis);
    if (a == kAxes.at(device).end())
      return absl::InvalidArgumentError("config axis '" + axis + "' is not an axis of " + device);
    if (std::find(a->second.begin(), a->second.end(), value) == a->second.end())
      return absl::InvalidArgumentError("config axis '" + axis + "': unknown value '" + value + "'");
    out[axis] = value;
  }
  return out;
}

const std::vector<std::string>& Seeds() {
  static const std::vector<std::string> seeds = {
      R"(name: moe-backends-h200
model: preset:qwen3-30b-a3b
layers: 4
seed: 1
matrix:
  device: [cuda]
  attention: [naive, flash]
  moe: [loop, grouped, fused]
  graphs: [off, on]
include:
  - {device: cuda, attention: flash, moe: fused, graphs: on}
exclude:
  - {moe: loop, graphs: on}
workload: {prompt: 128, output: 32, batch: [1, 8], repeats: 3, warmup: 1, timeout: 600}
selector: {sm: [90], gpu_name: "H200|H100", min_memory_gb: 80, gpus: 1}
repeats: 1
priority: 0
)",
      R"(model: preset:tiny
device: cpu
matrix:
  matmul:
    - naive
    - blocked
  threads: [1, 2, 4, all]
exclude:
  - matmul: naive
    threads: all
workload:
  prompt: 16
  output: 8
  batch:
    - 1
    - 4
repeats: 2
priority: -3
)",
      R"(name: "gemm sweep"
model: /models/qwen
seed: 18446744073709551615
matrix: {device: [cuda], gemm: [reference, cublaslt, wgmma]}
include: [{device: cuda, gemm: wgmma, graphs: on}]
selector:
  sm: 90
  gpu_name: 'H\d+'
  min_memory_gb: 79.5
)",
  };
  return seeds;
}

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n');
}

std::string Join(const std::vector<std::string>& lines) {
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i) out += '\n';
    out += lines[i];
  }
  return out;
}

std::string Mutate(std::string text, std::mt19937_64& rng) {
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  static const char* kTokens[] = {":", "- ", "[", "]", "{", "}", ",", "&a ", "*a", "!!str ",
                                  "'", "\"", "#", "? ", "|", ">", "\t", "~", "null", "0x",
                                  "-1", "1e999", "\\", "%YAML 1.2\n", "---\n", "..."};
  const int n = 1 + static_cast<int>(pick(4));
  for (int m = 0; m < n; ++m) {
    switch (pick(9)) {
      case 0:  // byte flip
        if (!text.empty()) text[pick(text.size())] ^= static_cast<char>(1 << pick(8));
        break;
      case 1:  // random byte
        if (!text.empty()) text[pick(text.size())] = static_cast<char>(rng());
        break;
      case 2:  // truncation
        text.resize(pick(text.size() + 1));
        break;
      case 3: {  // duplicate a line
        std::vector<std::string> lines = Lines(text);
        const size_t i = pick(lines.size());
        lines.insert(lines.begin() + static_cast<std::ptrdiff_t>(i), lines[i]);
        text = Join(lines);
        break;
      }
      case 4: {  // delete a line
        std::vector<std::string> lines = Lines(text);
        if (lines.size() > 1) lines.erase(lines.begin() + static_cast<std::ptrdiff_t>(pick(lines.size())));
        text = Join(lines);
        break;
      }
      case 5: {  // random indentation
        std::vector<std::string> lines = Lines(text);
        std::string& line = lines[pick(lines.size())];
        const size_t strip = line.find_first_not_of(' ');
        line = std::string(pick(9), ' ') + (strip == std::string::npos ? "" : line.substr(strip));
        text = Join(lines);
        break;
      }
      case 6:  // insert YAML punctuation
        text.insert(pick(text.size() + 1), kTokens[pick(std::size(kTokens))]);
        break;
      case 7: {  // splice a line from another seed
        const std::vector<std::string> other = Lines(Seeds()[pick(Seeds().size())]);
        std::vector<std::string> lines = Lines(text);
        lines.insert(lines.begin() + static_cast<std::ptrdiff_t>(pick(lines.size() + 1)),
                     other[pick(other.size())]);
        text = Join(lines);
        break;
      }
      case 8: {  // swap two lines
        std::vector<std::string> lines = Lines(text);
        std::swap(lines[pick(lines.size())], lines[pick(lines.size())]);
        text = Join(lines);
        break;
      }
    }
  }
  return text;
}

TEST(SweepSpecFuzzTest, MutatedSpecsGiveOkOrAnError) {
  for (const std::string& seed : Seeds()) {
    absl::StatusOr<SweepSpec> spec = ParseSweepSpec(seed, "seed.yaml", TestNormalize);
    ASSERT_TRUE(spec.ok()) << spec.status();
    ASSERT_TRUE(ExpandSweep(*spec, 1, kCap, TestNormalize).ok());
  }
  double seconds = 5;
  if (const char* env = std::getenv("INFERSWEEP_FUZZ_SECONDS")) seconds = std::atof(env);
  uint64_t seed = kDefaultSeed;
  if (const char* env = std::getenv("INFERSWEEP_FUZZ_SEED")) seed = std::strtoull(env, nullptr, 0);
  std::mt19937_64 rng(seed);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);

  int64_t iterations = 0, parsed = 0, expanded = 0, errors = 0;
  while (iterations < kMaxIterations && std::chrono::steady_clock::now() < deadline) {
    ++iterations;
    const std::string input = Mutate(Seeds()[rng() % Seeds().size()], rng);
    try {
      absl::StatusOr<SweepSpec> spec = ParseSweepSpec(input, "fuzz.yaml", TestNormalize);
      if (!spec.ok()) {
        ++errors;
        ASSERT_FALSE(spec.status().message().empty()) << input;
        ASSERT_EQ(spec.status().message().substr(0, 9), "fuzz.yaml") << spec.status();
        continue;
      }
      ++parsed;
      absl::StatusOr<std::vector<TrialRecord>> trials = ExpandSweep(*spec, 3, kCap, TestNormalize);
      if (!trials.ok()) {
        ++errors;
        ASSERT_FALSE(trials.status().message().empty()) << input;
        continue;
      }
      ++expanded;
      ASSERT_FALSE(trials->empty()) << input;
      ASSERT_LE(trials->size(), kCap) << input;
      ASSERT_EQ(trials->size() % static_cast<size_t>(spec->repeats), 0u) << input;
      for (const TrialRecord& t : *trials) {
        absl::StatusOr<BackendConfig> normalized = TestNormalize(t.config);
        ASSERT_TRUE(normalized.ok()) << input << "\n" << normalized.status();
        ASSERT_EQ(*normalized, t.config) << input;
        ASSERT_EQ(t.selector.device, ConfigDevice(t.config)) << input;
        ASSERT_TRUE(ValidateWorkload(t.workload).ok()) << input;
      }
    } catch (const std::exception& e) {
      FAIL() << "exception escaped: " << e.what() << "\ninput:\n" << input;
    } catch (...) {
      FAIL() << "unknown exception escaped\ninput:\n" << input;
    }
  }
  std::printf("# %lld iterations (seed %llu): %lld parsed, %lld expanded, %lld errors\n",
              static_cast<long long>(iterations), static_cast<unsigned long long>(seed),
              static_cast<long long>(parsed), static_cast<long long>(expanded),
              static_cast<long long>(errors));
  EXPECT_GT(iterations, 100);
  EXPECT_GT(expanded, 0);  // some mutations keep the spec valid
  EXPECT_GT(errors, 0);
}

}  // namespace
}  // namespace infersweep
