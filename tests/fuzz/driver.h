// The fuzz harness's targets and the loop that runs one: every parser of untrusted input as a
// function of bytes, fed the mutation engine's inputs (tests/fuzz/mutator.h) under a contract:
// the parser accepts, or rejects with a non-empty message naming where; it never throws,
// crashes, hangs or runs out of stack. A target's function has the shape of libFuzzer's
// LLVMFuzzerTestOneInput, so the same table can back a coverage-guided fuzzer.
//
// Environment (docs/SECURITY.md "Fuzzing the parsers"):
//   INFERSWEEP_FUZZ_INPUTS   random-stage inputs per target (default 3000); the structural stage
//                            always runs whole
//   INFERSWEEP_FUZZ_SECONDS  wall-clock bound of a target's random stage (default 10)
//   INFERSWEEP_FUZZ_SEED     the run seed (default fixed)
//   INFERSWEEP_FUZZ_REPLAY   "<target>:<input>": run only that input of that target, and write it
//                            to fuzz-<target>-<input>.bin
//   INFERSWEEP_FUZZ_HANG_SECONDS  an input running longer is a hang (default 60)
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "tests/fuzz/mutator.h"

namespace infersweep::fuzz {

// What a target made of one input.
struct Outcome {
  bool accepted = false;
  std::string violation;  // non-empty: the contract is broken, and how
};

inline Outcome Accepted() { return {true, ""}; }
inline Outcome Broken(std::string why) { return {false, std::move(why)}; }
// A rejection: fine when the message is non-empty and contains `must_name` (the source).
Outcome Rejected(const absl::Status& status, std::string_view must_name = "");

struct FuzzTarget {
  std::string name;
  Outcome (*run)(std::string_view input) = nullptr;
  std::vector<std::string> (*seeds)() = nullptr;  // valid inputs, each accepted
  std::vector<std::string> dictionary;
  size_t max_input_bytes = 1 << 20;
  Framing framing;
};

// gtest names a parameterized test's target by its name.
inline void PrintTo(const FuzzTarget& target, std::ostream* os) { *os << target.name; }

// Every target (tests/fuzz/targets.cc).
const std::vector<FuzzTarget>& Targets();

struct RunOptions {
  uint64_t seed = 0;
  int64_t random_inputs = 3000;
  double seconds = 10;
  double hang_seconds = 60;
  int64_t only_input = -1;  // >= 0: just this input (a replay)
};
RunOptions OptionsFromEnvironment();

struct RunReport {
  int64_t inputs = 0;
  int64_t structural = 0;
  int64_t accepted = 0;
  int64_t rejected = 0;
  double seconds = 0;
  int64_t slowest_input = -1;
  double slowest_seconds = 0;
  size_t largest_bytes = 0;
  std::string failure;  // the first broken contract: input number, how it was made, what broke
};

// Runs the structural stage, then the random stage until random_inputs or seconds run out,
// stopping at the first broken contract. A crash or hang prints the target, the input number
// and the replay command, and writes the input to fuzz-<target>-<input>.bin first.
RunReport RunTarget(const FuzzTarget& target, const RunOptions& options);

// The run seed a target's inputs are drawn with: the options' seed mixed with its name.
uint64_t TargetSeed(const FuzzTarget& target, uint64_t seed);

}  // namespace infersweep::fuzz
