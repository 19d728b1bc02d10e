// The CUDA engine's collective seam: how tensor-parallel ranks all-reduce a device buffer in
// place on a stream, one implementation a value of the allreduce axis (docs/BACKENDS.md):
//   nccl    ncclAllReduce (sum, fp32 or bf16) on a communicator made by ncclCommInitRank; a
//           single-rank communicator (tp=1) is legal and reduces nothing;
//   custom  one-shot and two-shot kernels over the ranks' peer buffers (kernels/cuda/allreduce.h),
//           the message size picking one;
//   fused   the custom all-reduce, with the residual add and the next RMSNorm in its kernel.
// Every call is capturable in a CUDA graph. NCCL is kept from building NVLink multicast (NVLS)
// objects: the communicator sets NCCL_NVLS_ENABLE=0 before its first NCCL call.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tensor_ref.h"
#include "engine/options.h"
#include "kernels/cuda/allreduce.h"

namespace infersweep {

// ncclUniqueId's bytes, so that the harness can hand it to rank processes without nccl.h.
using NcclId = std::array<char, 128>;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual AllReduce kind() const = 0;
  virtual int ranks() const = 0;
  virtual int rank() const = 0;

  // data[count] of `dtype`, summed over the ranks in place on `stream`; the same call on every
  // rank. InvalidArgument naming the limit for a message the implementation cannot take.
  virtual absl::Status Sum(void* data, int64_t count, cuda::ReduceDType dtype,
                           cudaStream_t stream) = 0;

  // The residual stream's update after a row-parallel block: residual[rows, n] += the ranks' sum
  // of partial[rows, n] (partial is summed in place or left as it was), then out =
  // RMSNorm(residual)
  // * gain. fused runs it as one kernel; the others as the all-reduce, an add and a norm.
  virtual absl::Status SumAddNorm(float* partial, int rows, int n, float* residual,
                                  const MatrixRef& gain, float eps, float* out,
                                  cudaStream_t stream);

  // Stops the communicator's outstanding work after a peer rank died (ncclCommAbort); the
  // communicator takes no more calls.
  virtual void Abort() {}
};

// A new NCCL unique id (the trial's parent makes one and hands it to every rank).
absl::StatusOr<NcclId> MakeNcclId();

// Rank `rank` of `ranks` on the current device, joined through `id` (ncclCommInitRank: every
// rank calls it at once). ranks == 1 is a single-rank communicator.
absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const NcclId& id, int ranks,
                                                                   int rank);

// The ranks of one process, rank r on devices[r] (devices may repeat: ranks as streams of one
// GPU, which the tests use). nccl: ncclCommInitAll (distinct devices only); custom and fused:
// peer buffers of `max_bytes` staging each, peer access enabled between distinct devices.
// InvalidArgument for a kind, a rank count or a size the seam does not take.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeLocalCommunicators(
    AllReduce kind, const std::vector<int>& devices, int64_t max_bytes);

// The custom and fused all-reduces across rank processes: each rank makes its peer buffer,
// hands its CUDA IPC handle to every other rank (through the trial's parent), and connects with
// every rank's handle in rank order.
using PeerHandle = std::array<char, 64>;  // cudaIpcMemHandle_t's bytes
class PeerRank {
 public:
  static absl::StatusOr<std::unique_ptr<PeerRank>> Create(AllReduce kind, int ranks, int rank,
                                                          int64_t max_bytes);
  virtual ~PeerRank() = default;
  virtual PeerHandle handle() const = 0;
  // handles[r]: rank r's handle (this rank's own included). Opens the peers' buffers.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Connect(
      const std::vector<PeerHandle>& handles) = 0;
};

}  // namespace infersweep
