// Correctness verdicts: a config under test against the reference on the same weights.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "api/backend_config.h"
#include "api/trial.h"
#include "engine/model.h"

namespace infersweep {

// Fixed evaluation inputs: teacher-forced prompts and free-running greedy generation.
struct EvalSpec {
  int prompts = 4;
  int prompt_len = 32;
  int free_run_prompt_len = 8;
  int free_run_len = 24;
  // Teacher-forced decode steps judged like the prefill's logits: the last decode_steps tokens of
  // each prompt go one step at a time (n = 1), at batch `prompts` and again at batch 1 (prompt
  // 0 alone), so the decode kernels of every batch shape meet the logit thresholds, not only the
  // free run's degeneracy check (batch-1 decode has kernels of its own: the GEMV's one-row path,
  // graphs=persistent).
  int decode_steps = 8;
  uint64_t seed = 0x5eed;
};

// The teacher-forced positions one kind of forward pass produced (prefill or decode, at the eval
// batch or at batch 1): ranges [begin, end) of positions (rows of EvalOutputs::logits). Each pass
// is judged on its own as well as in the whole, so that a kernel path that makes few of the
// positions (batch-1 decode: 8 of 160) cannot hide a wrong answer in the average.
struct EvalPass {
  std::string name;  // e.g. "decode at batch 1"
  std::vector<std::pair<int64_t, int64_t>> ranges;
};

// What a model produced on the eval inputs.
struct EvalOutputs {
  // Teacher-forced: [prompts, prompt_len, vocab] at batch `prompts` (the last decode_steps
  // positions of each as decode steps), then [prompt_len, vocab] of prompt 0 at batch 1.
  std::vector<float> logits;
  std::vector<EvalPass> passes;            // which pass made which positions (empty: one pass, all)
  std::vector<std::vector<int32_t>> free;  // [prompts][free_run_len] greedy tokens
};

absl::StatusOr<EvalOutputs> RunEval(Model& model, const EvalSpec& spec);

struct Thresholds {
  double max_rel_error;  // max|test - ref| / max|ref|
  double min_top1;       // argmax agreement
  double max_kl_mean;    // nats
  double max_kl;         // nats, worst position
  // Each forward pass on its own (EvalPass): its kl_mean at most pass_max_kl_mean, its argmax
  // agreement at least pass_min_top1. A pass of 8 positions is ~4.5x as noisy as the 160, so
  // the pass ceiling sits above the overall one; the fp8 and fp4 classes, whose ceilings sit
  // close above their noise already, judge no pass (INFINITY, 0).
  double pass_max_kl_mean;
  double pass_min_top1;
};
// docs/VERDICTS.md explains each class's numbers.
Thresholds ThresholdsFor(PrecisionClass precision);

// KL(softmax(ref) || softmax(test)) of one position's logits, in nats (>= 0); INFINITY when
// `test` holds a NaN or an infinity.
double LogitsKl(const float* ref, const float* test, int vocab);

// A sequence is degenerate when its last half repeats with period 1 or 2 ("!!!!", "ab ab").
bool IsDegenerate(const std::vector<int32_t>& tokens);

// The reference's greedy pick at every token of the test config's free runs, on the test's own
// path: picks[s][i] is the reference's argmax after free run s's start and free[s][0..i). One
// prefill of the starts plus all but the last token of each run (LogitsMode::kAll). A config
// that computes what the reference computes picks the same tokens on its own path, up to
// near-ties, wherever that path goes; garbage does not. `free` must have the eval's shape
// ([spec.prompts][spec.free_run_len]).
absl::StatusOr<std::vector<std::vector<int32_t>>> ReferencePicksOnFreeRuns(
    Model& reference, const EvalSpec& spec, const std::vector<std::vector<int32_t>>& free);

// The thresholds of a class widened to a model's own drift, `yardstick` being the metrics of the
// config's yardstick against the reference (CreateYardstick, YardstickFor: bf16 inputs, or E4M3
// rows where the config quantizes activations to E4M3). On a model more sensitive to
// bf16 rounding than the fixed ceilings assume (deep synthetic hybrids: kl_mean 0.03 at 16
// layers of qwen3-next where qwen3-30b-a3b stays at 0.001 at 48), no correct bf16 kernel gets
// closer to the reference than rounding alone does: the KL ceilings become twice the
// yardstick's and the top-1 floors its agreement less 0.15, never tighter than the class's.
// nullopt when twice the yardstick's KL is within the class's ceilings and its top-1 meets the
// class's floor (nothing to widen), or when it is not finite. The trigger is twice its KL, not
// its KL: a yardstick just under a ceiling leaves a correct config no room, and the ceilings
// would jump from the class's to twice the drift as it crossed.
std::optional<Thresholds> WidenedToYardstick(PrecisionClass precision,
                                             const VerdictMetrics& yardstick);

// Fills the metrics and returns OK or INCORRECT. The reference's passes split the positions:
// besides the thresholds over all of them, every pass must meet the class's pass thresholds.
// `reference_picks` (ReferencePicksOnFreeRuns on test.free, or null): with it, a test run that
// falls into a loop counts as degenerate only when the test's tokens agree with the reference's
// picks on that run less often than the class's top-1 floor, i.e. when the loop is the config's
// and not the model's (a random-weight model loops easily once a near-tie sends a correct
// config off the reference's path). Without it every loop counts.
// `thresholds` (optional) replaces the class's (WidenedToYardstick).
TrialStatus JudgeOutputs(const EvalOutputs& reference, const EvalOutputs& test, int vocab,
                         PrecisionClass precision, VerdictMetrics* metrics,
                         const std::vector<std::vector<int32_t>>* reference_picks = nullptr,
                         const Thresholds* thresholds = nullptr);

}  // namespace infersweep
