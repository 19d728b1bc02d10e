// The fuzz harness as a test: every target of tests/fuzz/targets.cc takes its seeds, then runs
// the structural stage and a bounded random stage (tests/fuzz/driver.h lists the environment
// that extends a run). A broken contract fails with the input's number, how it was made and
// the replay command; a crash or hang prints the same before the process dies.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "gtest/gtest.h"
#include "tests/fuzz/driver.h"
#include "tests/fuzz/mutator.h"

namespace infersweep::fuzz {
namespace {

class FuzzTest : public ::testing::TestWithParam<FuzzTarget> {};

TEST_P(FuzzTest, SeedsAreAccepted) {
  const FuzzTarget& t = GetParam();
  const std::vector<std::string> seeds = t.seeds();
  ASSERT_FALSE(seeds.empty());
  for (size_t i = 0; i < seeds.size(); ++i) {
    const Outcome o = t.run(seeds[i]);
    EXPECT_TRUE(o.accepted && o.violation.empty())
        << t.name << " seed " << i << ": " << o.violation;
  }
}

TEST_P(FuzzTest, MutatedInputsKeepTheContract) {
  const FuzzTarget& t = GetParam();
  RunOptions options = OptionsFromEnvironment();
  if (const char* replay = std::getenv("INFERSWEEP_FUZZ_REPLAY"); replay != nullptr) {
    const std::string spec = replay;
    const size_t colon = spec.rfind(':');
    if (colon == std::string::npos || spec.substr(0, colon) != t.name)
      GTEST_SKIP() << "replaying another target";
    ASSERT_TRUE(absl::SimpleAtoi(spec.substr(colon + 1), &options.only_input)) << spec;
  }
  const RunReport r = RunTarget(t, options);
  std::printf(
      "# fuzz %s: %lld inputs (%lld structural) in %.1f s: %lld accepted, %lld rejected; "
      "largest %zu bytes; slowest input %lld, %.3f s\n",
      t.name.c_str(), static_cast<long long>(r.inputs), static_cast<long long>(r.structural),
      r.seconds, static_cast<long long>(r.accepted), static_cast<long long>(r.rejected),
      r.largest_bytes, static_cast<long long>(r.slowest_input), r.slowest_seconds);
  ASSERT_TRUE(r.failure.empty()) << t.name << " " << r.failure;
  if (options.only_input < 0) {
    EXPECT_EQ(r.inputs - r.structural > 0 || options.random_inputs == 0, true);
    // Both outcomes occur, or the mutations are not exercising the parser.
    EXPECT_GT(r.accepted, 0) << t.name;
    EXPECT_GT(r.rejected, 0) << t.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzTest, ::testing::ValuesIn(Targets()),
                         [](const ::testing::TestParamInfo<FuzzTarget>& info) {
                           return info.param.name;
                         });

// Input N is the same on every run: a reported input number replays.
TEST(FuzzMutator, InputsAreAPureFunctionOfSeedAndNumber) {
  MutatorOptions o;
  o.seeds = {"a: [1, 2]\nb: {c: 'x'}\n", "{\"k\": [true, null, 3.5]}"};
  o.dictionary = {"zz"};
  o.max_input_bytes = 1 << 16;
  const Mutator a(o), b(o);
  for (int64_t i = 0; i < a.structural_count() + 500; ++i) {
    ASSERT_EQ(a.Make(42, i).bytes, b.Make(42, i).bytes) << i;
    ASSERT_LE(a.Make(42, i).bytes.size(), o.max_input_bytes) << i;
  }
  int differ = 0;
  for (int64_t i = a.structural_count(); i < a.structural_count() + 100; ++i)
    differ += a.Make(42, i).bytes != a.Make(43, i).bytes;
  EXPECT_GT(differ, 50);
}

// The structural stage nests every token of every seed 20,000 deep in parentheses: a sweep
// spec's selector.gpu_name among them (the regex that overflowed the coordinator's stack), on
// every run, however short.
TEST(FuzzMutator, StructuralStageNestsEachTokenDeep) {
  MutatorOptions o;
  o.seeds = {"selector: {sm: [90], gpu_name: \"H200|H100\"}\n"};
  o.max_input_bytes = 1 << 20;
  const Mutator m(o);
  const std::string deep = std::string(Mutator::kDeepNesting, '(') + "H200|H100" +
                           std::string(Mutator::kDeepNesting, ')');
  bool found = false;
  for (int64_t i = 0; i < m.structural_count() && !found; ++i)
    found = m.Make(1, i).bytes == "selector: {sm: [90], gpu_name: \"" + deep + "\"}\n";
  EXPECT_TRUE(found);
}

TEST(FuzzMutator, TokensAreQuotedStringsAndWords) {
  const std::string text = "a: 'b c', [d1,\"e\\\"f\"]";
  std::vector<std::string> tokens;
  for (const Span& s : Tokens(text)) tokens.push_back(text.substr(s.begin, s.end - s.begin));
  EXPECT_EQ(tokens,
            (std::vector<std::string>{"a", "'b c'", "b", "c", "d1", "\"e\\\"f\"", "e\\", "f"}));
}

}  // namespace
}  // namespace infersweep::fuzz
