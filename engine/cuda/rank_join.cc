// A CUDA rank process's GPU and its place in the ranks' collective (engine/rank_context.h,
// engine/cuda/cuda_model.h's CudaRank).
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/status_macros.h"
#include "engine/cuda/communicator.h"
#include "engine/cuda/cuda_model.h"
#include "engine/plan/collective_plan.h"
#include "engine/rank_context.h"
#include "kernels/cuda/check.h"

namespace infersweep {

absl::Status UseRankDevice(int rank, int ranks) {
  ASSIGN_OR_RETURN(auto devices, RankDevices(ranks));
  if (rank < 0 || rank >= ranks)
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of ", ranks));
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  const int device = devices[rank];
  if (device >= count) return absl::OkStatus();  // the preflight refuses the trial
  return CudaStatus(cudaSetDevice(device),
                    absl::StrCat("rank ", rank, ": cudaSetDevice(", device, ")").c_str());
}

namespace {

// Rank 0 makes the ncclUniqueId, every rank reads it from rank 0's line, and all join.
absl::StatusOr<std::shared_ptr<Communicator>> JoinNccl(const RankContext& context,
                                                       const std::vector<int>& devices) {
  std::set<int> distinct(devices.begin(), devices.end());
  if (distinct.size() != devices.size())
    return absl::UnimplementedError(absl::StrCat(
        "allreduce=nccl takes one rank a GPU (NCCL refuses a duplicate GPU); the ranks' GPUs "
        "are ",
        absl::StrJoin(devices, ","),
        " (INFERSWEEP_RANK_DEVICES): allreduce=custom and fused run "
        "there"));
  std::string mine;
  if (context.rank == 0) {
    ASSIGN_OR_RETURN(auto id, MakeNcclId());
    mine = HexBytes(id.data(), id.size());
  }
  ASSIGN_OR_RETURN(auto lines, context.exchange(mine));
  NcclId id;
  if (auto s = BytesFromHex(lines.front(), id.data(), id.size()); !s.ok())
    return absl::InvalidArgumentError(absl::StrCat("rank 0's ncclUniqueId: ", s.message()));
  ASSIGN_OR_RETURN(auto comm, MakeNcclCommunicator(id, context.ranks, context.rank));
  return std::shared_ptr<Communicator>(std::move(comm));
}

// Every rank makes its peer buffer and sends its CUDA IPC handle; each opens the others'.
absl::StatusOr<std::shared_ptr<Communicator>> JoinPeers(const RankContext& context,
                                                        AllReduce kind) {
  ASSIGN_OR_RETURN(auto peer,
                   PeerRank::Create(kind, context.ranks, context.rank, kRankMessageBytes));
  const PeerHandle own = peer->handle();
  ASSIGN_OR_RETURN(auto lines, context.exchange(HexBytes(own.data(), own.size())));
  std::vector<PeerHandle> handles(lines.size());
  for (size_t r = 0; r < lines.size(); ++r)
    if (auto s = BytesFromHex(lines[r], handles[r].data(), handles[r].size()); !s.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", r, "'s peer buffer handle: ", s.message()));
  ASSIGN_OR_RETURN(auto comm, peer->Connect(handles));
  return std::shared_ptr<Communicator>(std::move(comm));
}

}  // namespace

absl::StatusOr<CudaRank> JoinCudaRank(const ParallelOptions& parallel) {
  const RankContext& context = CurrentRankContext();
  if (context.ranks != parallel.tp || !context.exchange)
    return absl::UnimplementedError(absl::StrCat(
        "tp=", parallel.tp, ": the CUDA engine runs tp > 1 as ", parallel.tp,
        " rank processes, one a GPU, joined by the trial's parent (harness/rank_supervisor.h); "
        "this process is not one of them"));
  // One collective a process, kept for the process's life (never destroyed: NCCL's and the
  // peer buffers' teardown after the CUDA runtime's at exit could hang; the driver frees them
  // with the process).
  static CudaRank& joined = *new CudaRank;
  static AllReduce joined_kind = AllReduce::kAuto;
  ASSIGN_OR_RETURN(const CollectivePlan plan, PlanCollective(parallel, /*rank_process=*/true, 0));
  const AllReduce kind = plan.kind;
  if (joined.comm) {
    if (joined_kind == kind) return joined;
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", context.rank, " joined allreduce=", AxisValueName(joined_kind),
                     " already; a second collective (", AxisValueName(kind), ") is not made"));
  }
  ASSIGN_OR_RETURN(auto devices, RankDevices(context.ranks));
  std::shared_ptr<Communicator> comm;
  switch (plan.transport) {
    case CollectiveTransport::kNccl: {
      ASSIGN_OR_RETURN(comm, JoinNccl(context, devices));
      break;
    }
    case CollectiveTransport::kPeerBuffers: {
      ASSIGN_OR_RETURN(comm, JoinPeers(context, kind));
      break;
    }
    case CollectiveTransport::kNone:
      return absl::InternalError("a rank process without a collective");
  }
  joined.comm = std::move(comm);
  joined.max_message_bytes = plan.max_message_bytes;
  joined_kind = kind;
  return joined;
}

}  // namespace infersweep
