#include "harness/memory_verdict.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

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
  auto refuse = [&](std::string reason) {
    decision.unsupported = std::move(reason);
    decision.run.clear();
    decision.does_not_fit.clear();
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

PlannedMemory PlannedMemoryOf(const MemoryPlan& plan) {
  PlannedMemory planned;
  planned.total_bytes = plan.total_bytes();
  for (MemoryPool pool : kMemoryPools) planned.pool_bytes[MemoryPoolName(pool)] = plan.bytes(pool);
  return planned;
}

}  // namespace infersweep
