// Memory as a verdict (docs/VERDICTS.md "Memory"): the memory plan of each requested batch size
// against the device's free memory, decided before any weight loads. A trial whose smallest
// batch size cannot fit is UNSUPPORTED with the bytes it needs; a batch size larger than fits
// gets a verdict of its own ("does not fit") while the ones that fit run. Host code: built and
// tested without CUDA.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/serve_spec.h"
#include "api/trial.h"
#include "engine/plan/memory_plan.h"

namespace infersweep {

// The plan of one requested batch size.
struct BatchMemoryPlan {
  int batch = 1;
  MemoryPlan plan;
};

struct MemoryDecision {
  // Set: the trial cannot run at all and is UNSUPPORTED with this reason, e.g. "batch 1: needs
  // 61.50 GiB on the device (weights ..., graph pools 0 B), 13.90 GiB free".
  std::optional<std::string> unsupported;
  // The batch sizes that fit, in the order given: the ones to run.
  std::vector<int> run;
  // The batch sizes that do not fit, each with MemoryVerdictText's words; kept when the trial is
  // UNSUPPORTED, so its result names them too.
  std::map<int, std::string> does_not_fit;
};

struct MemoryDecisionOptions {
  // The plan of the config's correctness check (the eval it runs before any batch): it must fit
  // for the trial to run at all. Null: not checked.
  const MemoryPlan* judging = nullptr;
  // Every batch size or none: any batch size that does not fit makes the trial UNSUPPORTED.
  // Rank processes of one trial (tp > 1) must run the same batch sizes, since each step is a
  // collective, and each rank decides on its own GPU's free memory.
  bool every_batch_or_none = false;
};

// The decision for `batches` (each size once) against `free_bytes` of device memory free for
// this trial. The smallest batch size not fitting (or the correctness check not fitting) makes
// the trial UNSUPPORTED; otherwise the sizes that fit run and the others are named. Errors:
// InvalidArgument for no batch sizes, a size given twice or below 1, or negative free bytes.
absl::StatusOr<MemoryDecision> DecideMemory(const std::vector<BatchMemoryPlan>& batches,
                                            int64_t free_bytes,
                                            const MemoryDecisionOptions& options = {});

// A serving trial's memory decision (docs/VERDICTS.md "Memory"): every load point's KV slots
// (ServingSlots) planned against the free memory, before any weight loads.
struct ServingMemoryDecision {
  // Set: no load point can be served; the trial is UNSUPPORTED with this reason.
  std::optional<std::string> unsupported;
  // > 0: the most KV slots that fit, below what some point asks for. Open-loop points (and SLO
  // probes) reserve no more; closed-loop points above it are in does_not_fit.
  int slot_cap = 0;
  // The closed-loop points refused, by LoadPointName, each with MemoryVerdictText's words.
  std::map<std::string, std::string> does_not_fit;
};

// The plan of a serving trial at `slots` KV slots.
using SlotMemoryPlanner = std::function<absl::StatusOr<MemoryPlan>(int slots)>;

// The decision for `spec`'s load points against `free_bytes`. The largest slot count any point
// asks for fitting: nothing is capped. Else the cap is the most slots that fit (bisection over
// `plan`, which grows with the slots), and a closed-loop point above it does not fit. No slot
// fitting, or every point a refused closed loop: UNSUPPORTED, with the smallest refused point's
// words. `judging` (optional): a plan the trial's correctness check needs, refused like the
// lockstep one. Errors: `plan`'s, and InvalidArgument for a spec without load points.
absl::StatusOr<ServingMemoryDecision> DecideServingMemory(const ServeSpec& spec,
                                                          const SlotMemoryPlanner& plan,
                                                          int64_t free_bytes,
                                                          const MemoryPlan* judging = nullptr);

// A plan's figures as a result carries them (api/trial.h): the total and each pool by name.
PlannedMemory PlannedMemoryOf(const MemoryPlan& plan);

}  // namespace infersweep
