// The collective's plan: which all-reduce a CUDA model's step runs its row-parallel sums through
// (engine/cuda/communicator.h), over which transport, in messages of what size. The rank
// process's join, the model's own communicator at tp=1, the model limits and the memory plan
// read it. Host code: built and tested without CUDA.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "engine/options.h"

namespace infersweep {

// A rank process's peer buffers take messages of this many bytes; longer sums run in pieces.
inline constexpr int64_t kRankMessageBytes = int64_t{8} << 20;

enum class CollectiveTransport {
  kNone,         // no collective: blocks add into the residual stream
  kNccl,         // NCCL's all-reduce
  kPeerBuffers,  // our one-shot / two-shot kernels over IPC-mapped peer buffers (custom, fused)
};

struct CollectivePlan {
  CollectiveTransport transport = CollectiveTransport::kNone;
  AllReduce kind = AllReduce::kAuto;  // the all-reduce that runs: auto is NCCL's
  int64_t max_message_bytes = 0;      // a call's largest message; 0: any (NCCL pieces its own)
};

// `rank_process`: a tp > 1 rank process, which joins its ranks' collective; else the model's own
// collective at tp=1 (a named all-reduce over one rank), whose peer buffer holds `step_bytes`.
// InvalidArgument for allreduce=reference, the CPU's.
absl::StatusOr<CollectivePlan> PlanCollective(const ParallelOptions& parallel, bool rank_process,
                                              int64_t step_bytes);

}  // namespace infersweep
