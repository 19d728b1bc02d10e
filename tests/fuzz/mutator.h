// The fuzz harness's mutation engine: seeded and deterministic, so that input N of a run is a
// pure function of (run seed, target, N) and any failure replays from its number.
//
// Inputs come in two stages. The structural stage is enumerated, not drawn: every seed, with
// each of its tokens wrapped in thousands of nested brackets, each line nested under hundreds of
// YAML levels, a NUL at each line, the seed repeated to the size cap, one very long token. It
// reaches the resource bugs (deep nesting, huge inputs) on every run, whatever the time budget.
// The random stage then stacks 1-4 mutations drawn from byte flips, inserts, deletes, splices,
// dictionary tokens, edge-case numbers, repeated chunks, nest-wraps, long tokens and control
// bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace infersweep::fuzz {

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  uint64_t Next() { return engine_(); }
  // Uniform in [0, n); 0 when n is 0.
  size_t Below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(engine_() % n); }
  bool Chance(int percent) { return Below(100) < static_cast<size_t>(percent); }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[Below(v.size())];
  }

 private:
  std::mt19937_64 engine_;
};

// A half-open byte range of an input.
struct Span {
  size_t begin = 0;
  size_t end = 0;
};

// The tokens a structural mutation wraps: quoted strings (quotes included, within one line) and
// runs of bytes that are not blanks or JSON/YAML punctuation.
std::vector<Span> Tokens(std::string_view text);

// How a target's inputs are framed and which extra mutations suit them.
struct Framing {
  // The text the generic mutations edit (safetensors: the header JSON). Null: the whole input.
  std::function<std::string(std::string_view input)> unwrap;
  // The edited text put back into the frame of `original` (the header's length prefix).
  std::function<std::string(std::string_view original, std::string_view text)> rewrap;
  // Format-aware mutations of a whole input (a wrong length prefix, wire-level protobuf edits);
  // drawn for about a third of the random stage's mutations.
  std::function<void(std::string& input, Rng& rng)> mutate;
};

struct MutatorOptions {
  std::vector<std::string> seeds;       // valid inputs
  std::vector<std::string> dictionary;  // tokens of the format, inserted and swapped in
  size_t max_input_bytes = 1 << 20;     // no mutation grows an input past this
  Framing framing;
};

struct FuzzInput {
  std::string bytes;
  std::string how;  // what made it, for reports: "seed 0, token 17 wrapped in 20000 '('"
};

class Mutator {
 public:
  explicit Mutator(MutatorOptions options);

  // Inputs of the structural stage (inputs 0 .. structural_count() - 1).
  int64_t structural_count() const { return static_cast<int64_t>(plan_.size()); }
  // Input `index` of the run seeded `run_seed`.
  FuzzInput Make(uint64_t run_seed, int64_t index) const;

  // Nesting depth of the structural stage's bracket wraps (the depth that overflowed
  // std::regex's recursive compiler from a sweep spec's selector.gpu_name).
  static constexpr int kDeepNesting = 20000;
  // YAML block levels of the structural stage's line nesting (yaml-cpp gives up at 500).
  static constexpr int kDeepYamlLevels = 600;

 private:
  enum class Step { kWrap, kWrapWhole, kYamlNest, kDashNest, kNulAtLine, kRepeatWhole, kLongToken };
  struct Planned {
    size_t seed;
    Step step;
    Span span;    // kWrap: the token; line steps: the line
    int variant;  // kWrap, kWrapWhole: which bracket pair
  };

  FuzzInput MakeStructural(const Planned& p) const;
  FuzzInput MakeRandom(Rng& rng) const;
  // One generic mutation of `text`; returns its name.
  std::string MutateOnce(std::string& text, Rng& rng) const;
  std::string Unwrap(std::string_view input) const;
  std::string Rewrap(std::string_view original, std::string_view text) const;
  size_t Room(size_t size) const {
    return size >= options_.max_input_bytes ? 0 : options_.max_input_bytes - size;
  }

  MutatorOptions options_;
  std::vector<std::string> texts_;  // the seeds, unwrapped
  std::vector<Planned> plan_;
};

}  // namespace infersweep::fuzz
