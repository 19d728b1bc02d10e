#include "engine/plan/collective_plan.h"

#include "absl/strings/str_cat.h"
#include "core/unreachable.h"

namespace infersweep {

absl::StatusOr<CollectivePlan> PlanCollective(const ParallelOptions& p, bool rank_process,
                                              int64_t step_bytes) {
  CollectivePlan plan;
  if (!p.RunsCollective()) return plan;
  plan.kind = p.allreduce == AllReduce::kAuto ? AllReduce::kNccl : p.allreduce;
  switch (plan.kind) {
    case AllReduce::kNccl:
      plan.transport = CollectiveTransport::kNccl;
      return plan;
    case AllReduce::kCustom:
    case AllReduce::kFused:
      plan.transport = CollectiveTransport::kPeerBuffers;
      plan.max_message_bytes = rank_process ? kRankMessageBytes : step_bytes;
      return plan;
    case AllReduce::kReference:  // the registry keeps it off device=cuda
      return absl::InvalidArgumentError(
          absl::StrCat("allreduce=", AxisValueName(plan.kind),
                       ": the CPU's all-reduce; a CUDA model's are auto, nccl, custom, fused"));
    case AllReduce::kAuto:
      break;
  }
  Unreachable("PlanCollective: allreduce=auto left unresolved");
}

}  // namespace infersweep
