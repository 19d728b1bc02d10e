// Sweep specs: parsing, validation errors with YAML lines, expansion (product, include,
// exclude, repeats, dedup) and the trial cap.
#include "coordinator/sweep_spec.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kExample[] = R"(name: moe-backends-h200
model: preset:qwen3-30b-a3b
layers: 4            # optional preset layer override
seed: 1              # optional
matrix:
  device: [cuda]
  attention: [naive, flash]
  moe: [loop, grouped, fused]
  graphs: [off, on]
include:             # optional extra combinations (each a map axis->value), added after the product
  - {device: cuda, attention: flash, moe: fused, graphs: on}
exclude:             # optional; a combination is dropped if it matches ALL keys of any entry
  - {moe: loop, graphs: on}
workload: {prompt: 128, output: 32, batch: [1, 8], repeats: 3, warmup: 1, timeout: 600}
selector: {sm: [90], gpu_name: "H200|H100", min_memory_gb: 80, gpus: 1}
repeats: 1           # how many independent trials per combination (default 1)
priority: 0
)";

// A fixed stand-in for the backend registry, shaped like NormalizeBackendConfig (defaults
// filled in, unknown axes and values rejected by name), so these tests do not follow the real
// registry as backends come and go. RealRegistry* tests below use the real one.
absl::StatusOr<BackendConfig> TestNormalize(const BackendConfig& config) {
  static const std::map<std::string, std::map<std::string, std::vector<std::string>>> kAxes = {
      {"cuda",
       {{"gemm", {"reference", "cublaslt"}},
        {"attention", {"naive", "flash"}},
        {"moe", {"loop", "grouped", "fused"}},
        {"graphs", {"off", "on"}}}},
      {"cpu", {{"matmul", {"naive", "blocked"}}, {"threads", {"1", "2", "4", "8", "all"}}}},
  };
  auto it = config.find("device");
  const std::string device = it == config.end() ? "cpu" : it->second;
  if (!kAxes.count(device))
    return absl::InvalidArgumentError(
        absl::StrCat("config axis 'device': unknown value '", device, "' (known: cpu, cuda)"));
  BackendConfig out =
      device == "cuda" ? BackendConfig{{"device", "cuda"},
                                       {"gemm", "reference"},
                                       {"attention", "naive"},
                                       {"moe", "loop"},
                                       {"graphs", "off"}}
                       : BackendConfig{{"device", "cpu"}, {"matmul", "naive"}, {"threads", "all"}};
  for (const auto& [axis, value] : config) {
    if (axis == "device") continue;
    auto a = kAxes.at(device).find(axis);
    if (a == kAxes.at(device).end())
      return absl::InvalidArgumentError(
          absl::StrCat("config axis '", axis, "' is not an axis of ", device));
    if (std::find(a->second.begin(), a->second.end(), value) == a->second.end())
      return absl::InvalidArgumentError(
          absl::StrCat("config axis '", axis, "': unknown value '", value,
                       "' (known: ", absl::StrJoin(a->second, ", "), ")"));
    out[axis] = value;
  }
  return out;
}

absl::StatusOr<SweepSpec> Parse(const std::string& yaml) {
  return ParseSweepSpec(yaml, "spec.yaml", TestNormalize);
}
absl::StatusOr<std::vector<TrialRecord>> Expand(const SweepSpec& spec, int64_t sweep_id,
                                                size_t max_trials = kDefaultMaxSweepTrials) {
  return ExpandSweep(spec, sweep_id, max_trials, TestNormalize);
}

SweepSpec ParseOrDie(const std::string& yaml) {
  absl::StatusOr<SweepSpec> spec = Parse(yaml);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : SweepSpec();
}

std::vector<TrialRecord> ExpandOrDie(const std::string& yaml, int64_t sweep_id = 7) {
  absl::StatusOr<std::vector<TrialRecord>> trials = Expand(ParseOrDie(yaml), sweep_id);
  EXPECT_TRUE(trials.ok()) << trials.status();
  return trials.ok() ? *trials : std::vector<TrialRecord>();
}

std::string Replace(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

TEST(SweepSpecTest, ParsesTheExample) {
  const SweepSpec spec = ParseOrDie(kExample);
  EXPECT_EQ(spec.source, "spec.yaml");
  EXPECT_EQ(spec.yaml, kExample);
  EXPECT_EQ(spec.name, "moe-backends-h200");
  EXPECT_EQ(spec.model, "preset:qwen3-30b-a3b");
  EXPECT_EQ(spec.layers, 4);
  EXPECT_EQ(spec.seed, 1u);
  ASSERT_EQ(spec.matrix.size(), 4u);
  EXPECT_EQ(spec.matrix.at("moe").values, (std::vector<std::string>{"loop", "grouped", "fused"}));
  EXPECT_EQ(spec.matrix.at("moe").line, 8);
  EXPECT_EQ(spec.matrix.at("graphs").values, (std::vector<std::string>{"off", "on"}));
  ASSERT_EQ(spec.include.size(), 1u);
  EXPECT_EQ(spec.include[0].line, 11);
  ASSERT_EQ(spec.exclude.size(), 1u);
  EXPECT_EQ(spec.workload.prompt_len, 128);
  EXPECT_EQ(spec.workload.output_len, 32);
  EXPECT_EQ(spec.workload.batch_sizes, (std::vector<int>{1, 8}));
  EXPECT_EQ(spec.workload.repeats, 3);
  EXPECT_EQ(spec.workload.warmup, 1);
  EXPECT_DOUBLE_EQ(spec.workload.timeout_s, 600);
  EXPECT_EQ(spec.selector.sm_archs, (std::vector<int>{90}));
  EXPECT_EQ(spec.selector.gpu_name_regex, "H200|H100");
  EXPECT_EQ(spec.selector.min_memory_bytes, 80'000'000'000);
  EXPECT_EQ(spec.selector.gpus_needed, 1);
  EXPECT_FALSE(spec.selector.needs_p2p);
  EXPECT_EQ(spec.repeats, 1);
  EXPECT_EQ(spec.priority, 0);

  const SweepRecord record = MakeSweepRecord(spec);
  EXPECT_EQ(record.name, "moe-backends-h200");
  EXPECT_EQ(record.spec_yaml, kExample);
  EXPECT_EQ(record.model, "preset:qwen3-30b-a3b");
}

TEST(SweepSpecTest, SelectorP2pIsABoolean) {
  absl::StatusOr<SweepSpec> spec = Parse(
      "name: t\nmodel: preset:tiny\nmatrix: {device: [cuda]}\n"
      "selector: {gpus: 2, p2p: true}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->selector.gpus_needed, 2);
  EXPECT_TRUE(spec->selector.needs_p2p);
}

TEST(SweepSpecTest, ExampleExpandsToTenTrials) {
  // 1 x 2 x 3 x 2 = 12 combinations; the exclude drops {naive,flash} x loop x on (2); the
  // include equals a product combination, so it is kept once: 10 trials.
  const std::vector<TrialRecord> trials = ExpandOrDie(kExample);
  ASSERT_EQ(trials.size(), 10u);
  std::set<BackendConfig> configs;
  for (size_t i = 0; i < trials.size(); ++i) {
    const TrialRecord& t = trials[i];
    EXPECT_EQ(t.trial_id, absl::StrCat("7-", i));
    EXPECT_EQ(t.sweep_id, 7);
    EXPECT_EQ(t.model, "preset:qwen3-30b-a3b");
    EXPECT_EQ(t.layers, 4);
    EXPECT_EQ(t.state, TrialState::kQueued);
    EXPECT_EQ(t.selector.device, Device::kCuda);
    EXPECT_EQ(t.selector.sm_archs, (std::vector<int>{90}));
    EXPECT_EQ(t.workload.batch_sizes, (std::vector<int>{1, 8}));
    // Normalized: the defaults of the cuda device are filled in.
    EXPECT_EQ(t.config.at("gemm"), "reference");
    EXPECT_FALSE(t.config.at("moe") == "loop" && t.config.at("graphs") == "on")
        << BackendConfigString(t.config);
    configs.insert(t.config);
  }
  EXPECT_EQ(configs.size(), 10u);
}

TEST(SweepSpecTest, IncludeCanAddBackAnExcludedCombination) {
  const std::string yaml =
      Replace(kExample, "{device: cuda, attention: flash, moe: fused, graphs: on}",
              "{device: cuda, attention: flash, moe: loop, graphs: on}");
  const std::vector<TrialRecord> trials = ExpandOrDie(yaml);
  ASSERT_EQ(trials.size(), 11u);
  EXPECT_EQ(trials.back().config.at("moe"), "loop");
  EXPECT_EQ(trials.back().config.at("graphs"), "on");
  EXPECT_EQ(trials.back().config.at("attention"), "flash");
}

TEST(SweepSpecTest, IncludeMayUseAxesOutsideTheMatrix) {
  const std::string yaml =
      Replace(kExample, "{device: cuda, attention: flash, moe: fused, graphs: on}",
              "{device: cuda, gemm: cublaslt, moe: fused}");
  const std::vector<TrialRecord> trials = ExpandOrDie(yaml);
  ASSERT_EQ(trials.size(), 11u);
  EXPECT_EQ(trials.back().config.at("gemm"), "cublaslt");
  EXPECT_EQ(trials.back().config.at("attention"), "naive");  // the default
}

TEST(SweepSpecTest, EveryExcludeEntryIsApplied) {
  const std::string yaml = Replace(kExample, "  - {moe: loop, graphs: on}\n",
                                   "  - {moe: loop, graphs: on}\n  - {attention: naive}\n");
  // attention=naive drops 6 more (of which 1 was already excluded): 12 - 2 - 5 = 5.
  const std::vector<TrialRecord> trials = ExpandOrDie(yaml);
  ASSERT_EQ(trials.size(), 5u);
  for (const TrialRecord& t : trials) EXPECT_EQ(t.config.at("attention"), "flash");
}

TEST(SweepSpecTest, RepeatsMakeIndependentTrialsRepeatMajor) {
  const std::string yaml = Replace(kExample, "repeats: 1 ", "repeats: 3 ");
  const std::vector<TrialRecord> trials = ExpandOrDie(yaml, 12);
  ASSERT_EQ(trials.size(), 30u);
  for (size_t i = 0; i < trials.size(); ++i) {
    EXPECT_EQ(trials[i].trial_id, absl::StrCat("12-", i));
    EXPECT_EQ(trials[i].config, trials[i % 10].config) << i;
  }
}

TEST(SweepSpecTest, SweepIdZeroLeavesTrialIdsForTheStore) {
  const std::vector<TrialRecord> trials = ExpandOrDie(kExample, 0);
  ASSERT_EQ(trials.size(), 10u);
  for (const TrialRecord& t : trials) EXPECT_TRUE(t.trial_id.empty());
}

TEST(SweepSpecTest, TopLevelDeviceAndDefaults) {
  const std::vector<TrialRecord> trials = ExpandOrDie(R"(model: preset:tiny
device: cpu
matrix:
  matmul: [naive, blocked]
  threads: [1, 4]
)");
  ASSERT_EQ(trials.size(), 4u);
  for (const TrialRecord& t : trials) {
    EXPECT_EQ(t.config.at("device"), "cpu");
    EXPECT_EQ(t.selector.device, Device::kCpu);
    EXPECT_EQ(t.model, "preset:tiny");
    EXPECT_EQ(t.workload.prompt_len, Workload().prompt_len);  // defaults
  }
  const SweepSpec spec = ParseOrDie("model: m\ndevice: cpu\nmatrix: {threads: [2]}\n");
  EXPECT_EQ(spec.name, "m");  // the name defaults to the model
}

TEST(SweepSpecTest, DevicesMixInOneMatrixWhenEveryAxisExistsOnEach) {
  absl::StatusOr<SweepSpec> spec = ParseSweepSpec(
      "model: m\nmatrix:\n  device: [cpu, cuda]\n  threads: [2]\n", "mixed.yaml", TestNormalize);
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(spec.status().message(),
              AllOf(HasSubstr("mixed.yaml:4"), HasSubstr("threads"), HasSubstr("cuda")));
}

struct BadCase {
  const char* name;
  std::string yaml;
  std::vector<std::string> expected;  // substrings of the message
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

class SweepSpecErrorTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(SweepSpecErrorTest, NamesTheLineAndTheField) {
  const BadCase& c = GetParam();
  absl::StatusOr<SweepSpec> spec = Parse(c.yaml);
  absl::Status status = spec.status();
  if (spec.ok()) status = Expand(*spec, 1).status();
  ASSERT_FALSE(status.ok()) << c.yaml;
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  for (const std::string& e : c.expected) EXPECT_THAT(status.message(), HasSubstr(e)) << c.yaml;
}

const std::string kHead = "name: t\nmodel: preset:tiny\n";  // lines 1-2

INSTANTIATE_TEST_SUITE_P(
    Cases, SweepSpecErrorTest,
    ::testing::Values(
        BadCase{"MalformedYaml",
                kHead + "matrix: {device: [cuda]\nworkload: {prompt: 1}\n",
                {"spec.yaml:4", "malformed YAML"}},
        BadCase{"MalformedIndent",
                kHead + "matrix:\n  device: [cuda]\n    attention: [flash]\n",
                {"spec.yaml:5", "malformed YAML"}},
        BadCase{"Empty", "", {"spec.yaml", "empty sweep spec"}},
        BadCase{"TopLevelList", "- a\n- b\n", {"spec.yaml:1", "must be a map"}},
        BadCase{"MissingModel",
                "name: t\nmatrix: {device: [cuda]}\n",
                {"spec.yaml:1", "model", "missing"}},
        BadCase{"MissingMatrix", kHead + "device: cpu\n", {"spec.yaml:1", "matrix", "missing"}},
        BadCase{"MatrixNotAMap",
                kHead + "matrix: [cuda, cpu]\n",
                {"spec.yaml:3", "matrix", "map of axis"}},
        BadCase{"AxisNotAList",
                kHead + "matrix:\n  device: cuda\n",
                {"spec.yaml:4", "matrix.device", "must be a list"}},
        BadCase{"EmptyList",
                kHead + "matrix:\n  device: [cuda]\n  moe: []\n",
                {"spec.yaml:5", "matrix.moe", "empty list"}},
        BadCase{"NonScalarValue",
                kHead + "matrix:\n  device: [cuda]\n  attention: [[naive]]\n",
                {"spec.yaml:5", "matrix.attention", "expected a single value", "a list"}},
        BadCase{"NullValue",
                kHead + "matrix:\n  device: [cuda]\n  attention:\n    -\n",
                {"spec.yaml:", "matrix.attention", "null"}},
        BadCase{"DuplicateValue",
                kHead + "matrix:\n  device: [cuda]\n  graphs: [on, on]\n",
                {"spec.yaml:5", "matrix.graphs", "duplicate value 'on'"}},
        BadCase{"DuplicateKey",
                kHead + "matrix: {device: [cuda]}\nmodel: other\n",
                {"spec.yaml:4", "duplicate key 'model'", "line 2"}},
        BadCase{"UnknownTopLevelKey",
                kHead + "matirx: {device: [cuda]}\n",
                {"spec.yaml:3", "unknown top-level key 'matirx'"}},
        BadCase{"UnknownAxis",
                kHead + "matrix:\n  device: [cuda]\n  atention: [naive, flash]\n",
                {"spec.yaml:5", "matrix.atention", "'atention'", "naive, flash"}},
        BadCase{"UnknownValue",
                kHead + "matrix:\n  device: [cuda]\n  attention:\n    - naive\n    - flsh\n",
                {"spec.yaml:7", "matrix.attention", "'flsh'", "attention"}},
        BadCase{"UnknownDevice",
                kHead + "matrix:\n  device: [tpu]\n",
                {"spec.yaml:4", "matrix.device", "'tpu'"}},
        BadCase{
            "NoDevice", kHead + "matrix:\n  attention: [flash]\n", {"spec.yaml:3", "no device"}},
        BadCase{"DeviceTwice",
                kHead + "device: cuda\nmatrix: {device: [cuda]}\n",
                {"spec.yaml:3", "device", "both", "line 4"}},
        BadCase{"WorkloadOutOfRange",
                kHead + "matrix: {device: [cpu]}\nworkload: {prompt: 0}\n",
                {"spec.yaml:4", "prompt", "[1, 65536]"}},
        BadCase{"WorkloadBatchLine",
                kHead + "matrix: {device: [cpu]}\nworkload:\n  prompt: 16\n  batch: [1, 2000]\n",
                {"spec.yaml:6", "batch", "2000"}},
        BadCase{"WorkloadNotANumber",
                kHead + "matrix: {device: [cpu]}\nworkload: {output: lots}\n",
                {"spec.yaml:4", "workload.output", "'lots' is not an integer"}},
        BadCase{"WorkloadUnknownKey",
                kHead + "matrix: {device: [cpu]}\nworkload:\n  tokens: 5\n",
                {"spec.yaml:5", "unknown key 'tokens'"}},
        BadCase{"WorkloadNotAMap",
                kHead + "matrix: {device: [cpu]}\nworkload: 5\n",
                {"spec.yaml:4", "workload", "expected a map"}},
        BadCase{"SelectorP2pType",
                kHead + "matrix: {device: [cuda]}\nselector: {p2p: maybe}\n",
                {"spec.yaml:4", "selector.p2p", "'maybe' is not true or false"}},
        BadCase{"SelectorSmType",
                kHead + "matrix: {device: [cuda]}\nselector: {sm: ninety}\n",
                {"spec.yaml:4", "selector.sm", "'ninety' is not an integer"}},
        BadCase{"SelectorGpusList",
                kHead + "matrix: {device: [cuda]}\nselector:\n  gpus: [1]\n",
                {"spec.yaml:5", "selector.gpus", "expected a single value"}},
        BadCase{"SelectorRegex",
                kHead + "matrix: {device: [cuda]}\nselector: {gpu_name: \"(H\"}\n",
                {"spec.yaml:4", "selector.gpu_name", "regular expression"}},
        BadCase{"SelectorRegexTooLong",
                kHead + "matrix: {device: [cuda]}\nselector: {gpu_name: \"" +
                    std::string(300, 'a') + "\"}\n",
                {"spec.yaml:4", "selector.gpu_name", "300 characters; the limit is 256"}},
        BadCase{"SelectorRegexNestedTooDeep",
                kHead + "matrix: {device: [cuda]}\nselector: {gpu_name: \"" + std::string(20, '(') +
                    "H200" + std::string(20, ')') + "\"}\n",
                {"spec.yaml:4", "selector.gpu_name", "nests groups 20 deep; the limit is 16"}},
        BadCase{"SelectorRegexTooCostly",
                kHead + "matrix: {device: [cuda]}\nselector: {gpu_name: \"\\\\pL{500}\"}\n",
                {"spec.yaml:4", "selector.gpu_name", "too costly to compile"}},
        BadCase{"SelectorMemory",
                kHead + "matrix: {device: [cuda]}\nselector: {min_memory_gb: -1}\n",
                {"spec.yaml:4", "selector.min_memory_gb"}},
        BadCase{"SelectorDevice",
                kHead + "matrix: {device: [cuda]}\nselector: {device: cpu}\n",
                {"spec.yaml:4", "selector.device"}},
        BadCase{"SelectorUnknownKey",
                kHead + "matrix: {device: [cuda]}\nselector: {vram: 80}\n",
                {"spec.yaml:4", "unknown key 'vram'"}},
        BadCase{"RepeatsZero",
                kHead + "matrix: {device: [cpu]}\nrepeats: 0\n",
                {"spec.yaml:4", "repeats", "outside"}},
        BadCase{"LayersNotInt",
                kHead + "layers: four\nmatrix: {device: [cpu]}\n",
                {"spec.yaml:3", "layers"}},
        BadCase{"IncludeNotAList",
                kHead + "matrix: {device: [cuda]}\ninclude: {moe: fused}\n",
                {"spec.yaml:4", "include", "list of maps"}},
        BadCase{"IncludeWithoutDevice",
                kHead + "matrix: {device: [cuda]}\ninclude:\n  - {moe: fused}\n",
                {"spec.yaml:5", "include[0]", "no device"}},
        BadCase{"IncludeUnknownValue",
                kHead + "matrix: {device: [cuda]}\ninclude:\n  - device: cuda\n    moe: fusd\n",
                {"spec.yaml:6", "include[0].moe", "'fusd'"}},
        BadCase{
            "ExcludeUnknownAxis",
            kHead + "matrix: {device: [cuda], moe: [loop, fused]}\nexclude:\n  - {graphs: on}\n",
            {"spec.yaml:5", "exclude[0]", "'graphs' is not a matrix axis"}},
        BadCase{
            "ExcludeUnknownValue",
            kHead + "matrix: {device: [cuda], moe: [loop, fused]}\nexclude:\n  - {moe: grouped}\n",
            {"spec.yaml:5", "exclude[0].moe", "'grouped'", "loop, fused"}},
        BadCase{"ExcludeEverything",
                kHead + "matrix: {device: [cuda], moe: [loop]}\nexclude:\n  - {moe: loop}\n",
                {"spec.yaml:5", "drop every combination"}},
        BadCase{"EmptyExcludeEntry",
                kHead + "matrix: {device: [cuda]}\nexclude:\n  - {}\n",
                {"spec.yaml:5", "exclude[0]", "empty entry"}},
        BadCase{"CommaInValue",
                kHead + "matrix: {device: [\"cuda,x\"]}\n",
                {"spec.yaml:3", "matrix.device", "','"}}),
    [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; });

// The free text of a spec is capped (docs/SWEEPS.md, "Free text"): a name of 128 bytes, a model of
// 4096, an axis name or value of 128, each on one line; over a cap the error names the line, the
// field, the length and the cap, and quotes only the text's start.
TEST(SweepSpecTest, FreeTextIsCapped) {
  const std::string tail = "model: preset:tiny\nmatrix: {device: [cpu]}\n";
  const SweepSpec at_cap =
      ParseOrDie("name: " + std::string(kMaxSweepNameBytes, 'n') + "\n" + tail);
  EXPECT_EQ(at_cap.name.size(), kMaxSweepNameBytes);
  const std::string huge(100000, 'n');
  for (const size_t size : {kMaxSweepNameBytes + 1, huge.size()}) {
    absl::StatusOr<SweepSpec> spec = Parse("name: " + huge.substr(0, size) + "\n" + tail);
    ASSERT_FALSE(spec.ok()) << size;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(spec.status().message(),
                HasSubstr(absl::StrCat("spec.yaml:1: name: '", huge.substr(0, 32), "...' is ", size,
                                       " bytes long; the limit is ", kMaxSweepNameBytes)));
    EXPECT_LT(spec.status().message().size(), 200u);
  }
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"name: \"two\\nlines\"\n" + tail,
       {"spec.yaml:1: name: contains a control character (byte 0x0a)"}},
      {"name: \"bell\\a\"\n" + tail, {"spec.yaml:1: name", "byte 0x07"}},
      {"name: t\nmodel: preset:" + std::string(kMaxSweepModelBytes, 'm') +
           "\nmatrix: {device: [cpu]}\n",
       {"spec.yaml:2: model: '", "is 4103 bytes long; the limit is 4096"}},
      {"name: t\nmodel: preset:tiny\nmatrix:\n  device: [cpu]\n  matmul: [naive, " +
           std::string(kMaxSweepWordBytes + 1, 'v') + "]\n",
       {"spec.yaml:5: matrix.matmul: '", "is 129 bytes long; the limit is 128"}},
      {"name: t\nmodel: preset:tiny\nmatrix:\n  device: [cpu]\n  " +
           std::string(kMaxSweepWordBytes + 1, 'a') + ": [x]\n",
       {"spec.yaml:5: matrix: '", "is 129 bytes long"}},
      {"name: t\nmodel: preset:tiny\nmatrix: {device: [cpu]}\ninclude:\n  - {device: cpu, "
       "matmul: " +
           std::string(kMaxSweepWordBytes + 1, 'v') + "}\n",
       {"spec.yaml:5: include[0].matmul: '", "is 129 bytes long"}},
  };
  for (const auto& [yaml, want] : cases) {
    absl::StatusOr<SweepSpec> spec = Parse(yaml);
    ASSERT_FALSE(spec.ok()) << yaml.substr(0, 80);
    for (const std::string& w : want) EXPECT_THAT(spec.status().message(), HasSubstr(w));
  }
}

// Batch sizes and load points increase: a list that repeats or goes down is refused at the
// line of the value out of order.
TEST(SweepSpecTest, ListsOfBatchesAndLoadPointsIncrease) {
  const std::string head = "name: t\nmodel: preset:tiny\nmatrix: {device: [cpu]}\nworkload:\n";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {head + "  batch: [8, 1]\n",
       {"spec.yaml:5: workload.batch: 1 after 8: the values must increase"}},
      {head + "  batch:\n    - 1\n    - 4\n    - 4\n", {"spec.yaml:8: workload.batch: 4 after 4"}},
      {head + "  mode: serving\n  concurrency: [4, 1]\n  requests: 2\n",
       {"spec.yaml:6: workload.concurrency: 1 after 4"}},
      {head + "  mode: serving\n  rate: [2, 0.5]\n  requests: 2\n",
       {"spec.yaml:6: workload.rate: 0.5 after 2"}},
  };
  for (const auto& [yaml, want] : cases) {
    absl::StatusOr<SweepSpec> spec = Parse(yaml);
    ASSERT_FALSE(spec.ok()) << yaml;
    for (const std::string& w : want) EXPECT_THAT(spec.status().message(), HasSubstr(w)) << yaml;
  }
  EXPECT_EQ(ParseOrDie(head + "  batch: [1, 8, 64]\n").workload.batch_sizes,
            (std::vector<int>{1, 8, 64}));
}

TEST(SweepSpecTest, CapIsCheckedBeforeExpansion) {
  const std::string yaml = Replace(kExample, "repeats: 1 ", "repeats: 1000 ");
  const SweepSpec spec = ParseOrDie(yaml);
  EXPECT_EQ(SweepTrialBound(spec), 13000u);  // (12 + 1 include) x 1000
  absl::StatusOr<std::vector<TrialRecord>> trials = Expand(spec, 1);
  ASSERT_FALSE(trials.ok());
  EXPECT_EQ(trials.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      trials.status().message(),
      AllOf(HasSubstr("spec.yaml:5"), HasSubstr("12 combinations"), HasSubstr("1000 repeats"),
            HasSubstr("13000 trials"), HasSubstr("cap of 10000")));
  // A higher cap lets it through (the bound counts before excludes and dedup: 10 x 1000 made).
  trials = Expand(spec, 1, 13000);
  ASSERT_TRUE(trials.ok()) << trials.status();
  EXPECT_EQ(trials->size(), 10000u);
  // And a lower cap stops the example itself.
  trials = Expand(ParseOrDie(kExample), 1, 12);
  ASSERT_FALSE(trials.ok());
  EXPECT_THAT(trials.status().message(), AllOf(HasSubstr("13 trials"), HasSubstr("cap of 12")));
}

TEST(SweepSpecTest, AHugeProductIsRejectedWithoutExpanding) {
  // 24 axes of 10 values: 10^24 combinations, past uint64. Built directly: ExpandSweep must
  // refuse it from the sizes alone (expanding would never finish).
  SweepSpec spec;
  spec.source = "huge.yaml";
  spec.model = "m";
  spec.matrix_line = 3;
  for (int a = 0; a < 24; ++a) {
    SweepAxis& axis = spec.matrix[absl::StrCat("axis", a)];
    for (int v = 0; v < 10; ++v) {
      axis.values.push_back(absl::StrCat(v));
      axis.value_lines.push_back(4 + a);
    }
  }
  EXPECT_EQ(SweepTrialBound(spec), UINT64_MAX);
  absl::StatusOr<std::vector<TrialRecord>> trials = Expand(spec, 1);
  ASSERT_FALSE(trials.ok());
  EXPECT_THAT(trials.status().message(),
              AllOf(HasSubstr("huge.yaml:3"), HasSubstr("more than"), HasSubstr("cap of 10000")));
}

TEST(SweepSpecTest, ExpandReportsTheLineOfAnInvalidValueInABuiltSpec) {
  SweepSpec spec = ParseOrDie(kExample);
  spec.matrix["moe"].values[1] = "grouped-typo";  // line 8, as parsed
  absl::StatusOr<std::vector<TrialRecord>> trials = Expand(spec, 1);
  ASSERT_FALSE(trials.ok());
  EXPECT_THAT(trials.status().message(),
              AllOf(HasSubstr("spec.yaml:8"), HasSubstr("moe"), HasSubstr("grouped-typo")));
}

// Control bytes are named with their line and column (yaml-cpp alone names neither: "unknown
// escape character:" for a NUL in a quoted scalar, nothing at all in a plain one).
TEST(SweepSpecTest, ControlByteIsNamedWithLineAndColumn) {
  absl::StatusOr<SweepSpec> spec =
      Parse(Replace(kExample, "moe-backends", std::string("moe\0b", 5)));
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(std::string(spec.status().message()),
            "spec.yaml:1:10: control byte 0x00 (NUL); a sweep spec is printable text (tabs and "
            "newlines allowed)");
  spec = Parse(Replace(kExample, "gpu_name: \"H200", "gpu_name: \"\x1b[1mH200"));
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(spec.status().message(), HasSubstr("spec.yaml:15:33: control byte 0x1b (ESC)"));
  spec = Parse(Replace(kExample, "naive, flash",
                       "naive, fl\x7f"
                       "ash"));
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(spec.status().message(), HasSubstr("spec.yaml:7:24: control byte 0x7f (DEL)"));
  // Tabs and CRLF line ends are text.
  EXPECT_TRUE(Parse(Replace(kExample, "layers: 4  ", "layers: 4\t")).ok());
}

std::string Nested(const std::string& open, int depth, const std::string& inner,
                   const std::string& close) {
  std::string out;
  for (int i = 0; i < depth; ++i) out += open;
  out += inner;
  for (int i = 0; i < depth; ++i) out += close;
  return out;
}

// Nesting past kMaxSweepSpecDepth is named with its line, column and the limit, in every YAML
// form (yaml-cpp alone stops at 500 levels with "malformed YAML: bad file").
TEST(SweepSpecTest, DeepNestingIsNamedWithTheLimit) {
  const std::string limit = "YAML nested deeper than 64 levels; the limit is 64";
  // Flow collections: the 64th '[' under `matrix:` is the 65th level.
  absl::StatusOr<SweepSpec> spec =
      Parse("model: preset:tiny\nmatrix: " + Nested("[", 500, "a", "]") + "\n");
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(std::string(spec.status().message()), "spec.yaml:2:72: " + limit);
  spec = Parse("model: preset:tiny\nmatrix: {device: " + Nested("{a: ", 500, "b", "}") + "}\n");
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(spec.status().message(), AllOf(HasSubstr("spec.yaml:2:"), HasSubstr(limit)));
  // Block mappings by indentation.
  std::string block = "model: preset:tiny\n";
  for (int i = 0; i < 500; ++i) block += std::string(i, ' ') + "a:\n";
  spec = Parse(block);
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(std::string(spec.status().message()), "spec.yaml:66:65: " + limit);
  // Compact sequences, "- - - x".
  spec = Parse("model: preset:tiny\nmatrix:\n  device:\n" + Nested("- ", 500, "cpu", ""));
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(spec.status().message(), AllOf(HasSubstr("spec.yaml:4:"), HasSubstr(limit)));
}

// Brackets inside quoted scalars, comments and block scalars are text, not nesting; nesting up
// to the limit is left to the parser.
TEST(SweepSpecTest, BracketsInTextAreNotNesting) {
  const std::string deep = std::string(100, '[');
  EXPECT_TRUE(Parse(Replace(kExample, "name: moe-backends-h200", "name: \"" + deep + "\"")).ok());
  EXPECT_TRUE(Parse(Replace(kExample, "name: moe-backends-h200", "name: '" + deep + "'")).ok());
  EXPECT_TRUE(Parse(Replace(kExample, "name: moe-backends-h200", "name: a" + deep)).ok());
  EXPECT_TRUE(Parse(Replace(kExample, "seed: 1 ", "seed: 1 # " + deep)).ok());
  // A block scalar's body is text (whether a field takes several lines is another rule).
  const absl::StatusOr<SweepSpec> block =
      Parse(Replace(kExample, "name: moe-backends-h200", "name: |\n  " + deep + "\n  {{{"));
  EXPECT_THAT(std::string(block.status().message()), Not(HasSubstr("nested")));
  absl::StatusOr<SweepSpec> spec =
      Parse("model: preset:tiny\nmatrix: " + Nested("[", 63, "a", "]") + "\n");
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(spec.status().message(), Not(HasSubstr("nested")));
}

TEST(SweepSpecTest, LoadsAFile) {
  const std::string path = ::testing::TempDir() + "/sweep_spec_test.yaml";
  {
    FILE* f = fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    fputs(kExample, f);
    fclose(f);
  }
  absl::StatusOr<SweepSpec> spec = LoadSweepSpecFile(path, TestNormalize);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->source, path);
  EXPECT_EQ(LoadSweepSpecFile(path + ".missing").status().code(), absl::StatusCode::kNotFound);
  remove(path.c_str());
}

// The real registry (NormalizeBackendConfig), on the CPU axes every build has.
TEST(SweepSpecRealRegistryTest, CpuSweepExpandsWithRealDefaults) {
  absl::StatusOr<SweepSpec> spec = ParseSweepSpec(
      "model: preset:tiny\nmatrix:\n  device: [cpu]\n  matmul: [naive, blocked]\n", "cpu.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<std::vector<TrialRecord>> trials = ExpandSweep(*spec, 4);
  ASSERT_TRUE(trials.ok()) << trials.status();
  ASSERT_EQ(trials->size(), 2u);
  for (const TrialRecord& t : *trials) {
    absl::StatusOr<BackendConfig> normalized = NormalizeBackendConfig(t.config);
    ASSERT_TRUE(normalized.ok());
    EXPECT_EQ(*normalized, t.config);  // already normalized: defaults filled in
    EXPECT_EQ(t.selector.device, Device::kCpu);
  }
  EXPECT_EQ((*trials)[0].trial_id, "4-0");
}

TEST(SweepSpecRealRegistryTest, UnknownValueNamesAxisValueAndLine) {
  absl::StatusOr<SweepSpec> spec = ParseSweepSpec(
      "model: preset:tiny\nmatrix:\n  device: [cpu]\n  matmul:\n    - naive\n    - blockd\n",
      "cpu.yaml");
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(spec.status().message(),
              AllOf(HasSubstr("cpu.yaml:6"), HasSubstr("matmul"), HasSubstr("'blockd'")));
  spec = ParseSweepSpec("model: preset:tiny\nmatrix:\n  device: [cpu]\n  matmull: [naive]\n",
                        "cpu.yaml");
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(spec.status().message(),
              AllOf(HasSubstr("cpu.yaml:4"), HasSubstr("'matmull'"), HasSubstr("naive")));
}

// The specs shipped in sweeps/ (the README demo's defaults) stay valid against the real registry
// as axes are added: each parses and expands to at least one trial per combination.
TEST(SweepSpecRealRegistryTest, ShippedSpecsParseAndExpand) {
  for (const char* name : {"demo-cpu.yaml", "demo-gpu.yaml", "serving-cpu.yaml",
                           "hunt-serving.yaml", "hunt-serving-tp2.yaml"}) {
    const std::string path = SourceDir() + "/sweeps/" + name;
    absl::StatusOr<SweepSpec> spec = LoadSweepSpecFile(path);
    ASSERT_TRUE(spec.ok()) << spec.status();
    absl::StatusOr<std::vector<TrialRecord>> trials = ExpandSweep(*spec, 1);
    ASSERT_TRUE(trials.ok()) << trials.status();
    EXPECT_FALSE(trials->empty()) << name;
  }
}

// The GPU demo carries the fastest batch-1 config (graphs=persistent, one kernel a decode step),
// which preflight lets through on an sm_90 GPU, and judges its other graphs=persistent
// combinations UNSUPPORTED with the reason, before anything loads.
TEST(SweepSpecRealRegistryTest, GpuDemoCarriesThePersistentKernel) {
  absl::StatusOr<SweepSpec> spec = LoadSweepSpecFile(SourceDir() + "/sweeps/demo-gpu.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<std::vector<TrialRecord>> trials = ExpandSweep(*spec, 1);
  ASSERT_TRUE(trials.ok()) << trials.status();
  const PreflightTarget h200{
      .has_cuda_build = true, .sm = 90, .gpu_count = 1, .weight_format = "bf16"};
  int runnable = 0, refused = 0;
  for (const TrialRecord& trial : *trials) {
    if (trial.config.at("graphs") != "persistent") continue;
    absl::StatusOr<BackendConfig> config = NormalizeBackendConfig(trial.config);
    ASSERT_TRUE(config.ok()) << config.status();
    const PreflightResult verdict = Preflight(*config, h200);
    if (verdict.supported) {
      ++runnable;
      EXPECT_EQ(trial.config.at("gemm"), "fused") << BackendConfigString(trial.config);
    } else {
      ++refused;
      EXPECT_FALSE(verdict.reason.empty()) << BackendConfigString(trial.config);
    }
  }
  EXPECT_GT(runnable, 0);
  EXPECT_GT(refused, 0);
}

// The hunt's serving sweeps on an H200 (two ranks on the TEST ONLY map for tp=2): preflight lets
// through every config but those the GPU or a backend's own design refuses, each with that
// reason: native_fp4 needs FP4 tensor cores; moe=loop reads the routing on the host, which no
// CUDA graph replays; qgemm=cudnn runs the linears' GEMMs, which the fused expert runners
// bypass. (cuDNN's own refusal of FP4 on sm_90 comes from the capability probe, at run time.)
TEST(SweepSpecRealRegistryTest, TheHuntIsRefusedOnlyForHardwareAndDesignLimits) {
  const PreflightTarget h200{
      .has_cuda_build = true, .sm = 90, .gpu_count = 2, .weight_format = "nvfp4"};
  for (const char* name : {"hunt-serving.yaml", "hunt-serving-tp2.yaml"}) {
    absl::StatusOr<SweepSpec> spec = LoadSweepSpecFile(SourceDir() + "/sweeps/" + name);
    ASSERT_TRUE(spec.ok()) << spec.status();
    absl::StatusOr<std::vector<TrialRecord>> trials = ExpandSweep(*spec, 1);
    ASSERT_TRUE(trials.ok()) << trials.status();
    int runnable = 0;
    for (const TrialRecord& trial : *trials) {
      absl::StatusOr<BackendConfig> config = NormalizeBackendConfig(trial.config);
      ASSERT_TRUE(config.ok()) << config.status();
      const PreflightResult verdict = Preflight(*config, h200);
      const std::string text = BackendConfigString(*config);
      if (verdict.supported) {
        ++runnable;
        continue;
      }
      const bool fp4_cores = config->at("qgemm") == "native_fp4";
      const bool host_routing = config->at("moe") == "loop" && config->at("graphs") == "on";
      const bool scaled_experts = config->at("qgemm") == "cudnn" && config->at("moe") != "loop";
      EXPECT_TRUE(fp4_cores || host_routing || scaled_experts)
          << name << " " << text << ": " << verdict.reason;
      if (scaled_experts) {
        EXPECT_THAT(verdict.reason, HasSubstr("MoE runners run the experts through their own"));
      }
      if (fp4_cores) {
        EXPECT_THAT(verdict.reason, HasSubstr("sm")) << text;
      }
      if (host_routing) {
        EXPECT_THAT(verdict.reason, HasSubstr("reads the routing on the host")) << text;
      }
    }
    if (std::string(name) == "hunt-serving-tp2.yaml") {
      for (const TrialRecord& trial : *trials) EXPECT_EQ(trial.selector.gpus_needed, 2);
    }
    // tp=1: 96, less native_fp4's 24, moe=loop's 12 under graphs and cudnn's 16 beside the
    // expert runners; tp=2: 16, less moe=loop's 4 under graphs.
    EXPECT_EQ(runnable, std::string(name) == "hunt-serving.yaml" ? 44 : 12) << name;
  }
}

}  // namespace
}  // namespace infersweep
