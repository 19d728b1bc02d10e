#include "harness/memory_verdict.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"

namespace infersweep {

absl::StatusOr<MemoryDecision> DecideMemory(const std::vector<BatchMemoryPlan>& batches,
                                            int64_t free_bytes,
                                            const MemoryDecisionOptions& options) {
  if (batches.empty()) return absl::InvalidArgumentError("memory decision: no batch sizes");
  if (free_bytes < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("memory decision: free bytes ", free_bytes, " < 0"));
  std::set<int> seen;
  for (const BatchMemoryPlan& b : batches) {
    if (b.batch < 1)
      return absl::InvalidArgumentError(absl::StrCat("memory decision: batch size ", b.batch));
    if (!seen.insert(b.batch).second)
      return absl::InvalidArgumentError(
          absl::StrCat("memory decision: batch size ", b.batch, " given twice"));
  }

  MemoryDecision decision;
  for (const BatchMemoryPlan& b : batches) {
    if (Fits(b.plan, free_bytes))
      decision.run.push_back(b.batch);
    else
      decision.does_not_fit[b.batch] = MemoryVerdictText(b.plan, free_bytes);
  }
  // An UNSUPPORTED trial runs nothing; the sizes that do not fit keep their words, so the
  // result still says "does not fit" per batch size.
  auto refuse = [&](std::string reason) {
    decision.unsupported = std::move(reason);
    decision.run.clear();
    return decision;
  };
  if (!decision.does_not_fit.empty()) {
    const auto smallest = std::min_element(
        batches.begin(), batches.end(),
        [](const BatchMemoryPlan& a, const BatchMemoryPlan& b) { return a.batch < b.batch; });
    // The reason names the smallest size refused.
    const auto& [refused_batch, refused_text] = *decision.does_not_fit.begin();
    if (refused_batch == smallest->batch || options.every_batch_or_none)
      return refuse(absl::StrCat("batch ", refused_batch, ": ", refused_text));
  }
  if (options.judging != nullptr && !Fits(*options.judging, free_bytes))
    return refuse(
        absl::StrCat("correctness check: ", MemoryVerdictText(*options.judging, free_bytes)));
  return decision;
}

absl::StatusOr<ServingMemoryDecision> DecideServingMemory(const ServeSpec& spec,
                                                          const SlotMemoryPlanner& plan,
                                                          int64_t free_bytes,
                                                          const MemoryPlan* judging) {
  const std::vector<LoadPoint> points = LoadPoints(spec);
  if (points.empty()) return absl::InvalidArgumentError("serving memory decision: no load points");
  ServingMemoryDecision decision;
  if (judging != nullptr && !Fits(*judging, free_bytes)) {
    decision.unsupported =
        absl::StrCat("correctness check: ", MemoryVerdictText(*judging, free_bytes));
    return decision;
  }
  int most = 1;
  for (const LoadPoint& p : points) most = std::max(most, ServingSlots(spec, p));
  ASSIGN_OR_RETURN(const MemoryPlan at_most, plan(most));
  if (Fits(at_most, free_bytes)) return decision;
  ASSIGN_OR_RETURN(const MemoryPlan at_one, plan(1));
  if (!Fits(at_one, free_bytes)) {
    decision.unsupported = absl::StrCat("1 KV slot: ", MemoryVerdictText(at_one, free_bytes));
    return decision;
  }
  int fits = 1, too_many = most;  // plan(fits) fits, plan(too_many) does not
  while (too_many - fits > 1) {
    const int mid = fits + (too_many - fits) / 2;
    ASSIGN_OR_RETURN(const MemoryPlan at_mid, plan(mid));
    (Fits(at_mid, free_bytes) ? fits : too_many) = mid;
  }
  decision.slot_cap = fits;
  std::optional<int> smallest_refused;
  for (const LoadPoint& p : points) {
    if (p.open_loop || p.concurrency <= fits) continue;
    ASSIGN_OR_RETURN(const MemoryPlan refused, plan(p.concurrency));
    decision.does_not_fit[LoadPointName(p)] =
        absl::StrCat(p.concurrency, " KV slots: ", MemoryVerdictText(refused, free_bytes));
    if (!smallest_refused || p.concurrency < *smallest_refused) smallest_refused = p.concurrency;
  }
  if (decision.does_not_fit.size() == points.size())
    decision.unsupported =
        absl::StrCat("concurrency=", *smallest_refused, ": ",
                     decision.does_not_fit.at(LoadPointName({false, *smallest_refused, 0})));
  return decision;
}

PlannedMemory PlannedMemoryOf(const MemoryPlan& plan) {
  PlannedMemory planned;
  planned.total_bytes = plan.total_bytes();
  for (MemoryPool pool : kMemoryPools) planned.pool_bytes[MemoryPoolName(pool)] = plan.bytes(pool);
  return planned;
}

}  // namespace infersweep
