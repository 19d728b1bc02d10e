#include "engine/cuda/communicator.h"

#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "core/launch_log.h"
#include "engine/cuda/device_util.h"
#include "kernels/cuda/ops.h"

namespace infersweep {
namespace {

static_assert(sizeof(ncclUniqueId) == sizeof(NcclId));
static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(PeerHandle));

// NVLink multicast (NVLS) objects are never made: every NCCL entry point here calls this first,
// before NCCL reads its environment.
void DisableNvls() { setenv("NCCL_NVLS_ENABLE", "0", 1); }

absl::Status NcclStatus(const char* what, ncclResult_t r) {
  if (r == ncclSuccess) return absl::OkStatus();
  const char* last = ncclGetLastError(nullptr);
  return absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(r),
                                          last && *last ? absl::StrCat(" (", last, ")") : ""));
}

absl::Status CheckRanks(int ranks, int rank) {
  if (ranks < 1 || ranks > cuda::kAllReduceMaxRanks)
    return absl::InvalidArgumentError(
        absl::StrCat("all-reduce ranks: ", ranks, " is outside 1..", cuda::kAllReduceMaxRanks));
  if (rank < 0 || rank >= ranks)
    return absl::InvalidArgumentError(absl::StrCat("all-reduce rank ", rank, " of ", ranks));
  return absl::OkStatus();
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int ranks, int rank)
      : comm_(comm), ranks_(ranks), rank_(rank) {}
  ~NcclCommunicator() override {
    if (comm_) ncclCommDestroy(comm_);
  }
  AllReduce kind() const override { return AllReduce::kNccl; }
  int ranks() const override { return ranks_; }
  int rank() const override { return rank_; }

  absl::Status Sum(void* data, int64_t count, cuda::ReduceDType dtype,
                   cudaStream_t stream) override {
    if (!comm_) return absl::FailedPreconditionError("nccl all-reduce after Abort");
    RecordLaunch("nccl:all-reduce");  // the launch log (core/launch_log.h): one per call
    return NcclStatus("ncclAllReduce",
                      ncclAllReduce(data, data, static_cast<size_t>(count),
                                    dtype == cuda::ReduceDType::kFp32 ? ncclFloat32 : ncclBfloat16,
                                    ncclSum, comm_, stream));
  }

  void Abort() override {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

 private:
  ncclComm_t comm_;
  const int ranks_, rank_;
};

// custom and fused: the kernels of kernels/cuda/allreduce.h over peer buffers; `release` frees
// this rank's own buffer and unmaps or frees the peers' as their owner requires.
class PeerCommunicator final : public Communicator {
 public:
  PeerCommunicator(AllReduce kind, const cuda::PeerBuffers& peers, std::function<void()> release)
      : kind_(kind), peers_(peers), release_(std::move(release)) {}
  ~PeerCommunicator() override {
    if (release_) release_();
  }
  AllReduce kind() const override { return kind_; }
  int ranks() const override { return peers_.ranks; }
  int rank() const override { return peers_.rank; }

  absl::Status Sum(void* data, int64_t count, cuda::ReduceDType dtype,
                   cudaStream_t stream) override {
    const int64_t bytes = count * static_cast<int64_t>(cuda::ReduceDTypeBytes(dtype));
    if (bytes % 16 != 0)
      return absl::InvalidArgumentError(
          absl::StrCat("allreduce=", AxisValueName(kind_), ": the message (", bytes,
                       " bytes) must be a multiple of 16 bytes (the kernels move 16-byte packs)"));
    if (bytes > peers_.staging_bytes)
      return absl::InvalidArgumentError(
          absl::StrCat("allreduce=", AxisValueName(kind_), ": the message (", bytes,
                       " bytes) exceeds the peer buffers' ", peers_.staging_bytes, " bytes"));
    cuda::CustomAllReduce(peers_, data, count, dtype,
                          cuda::PickCustomAlgorithm(peers_.ranks, bytes), stream);
    return CudaStatus(cudaGetLastError(), "custom all-reduce launch");
  }

  absl::Status SumAddNorm(float* partial, int rows, int n, float* residual, const MatrixRef& gain,
                          float eps, float* out, cudaStream_t stream) override {
    const int64_t bytes = int64_t{4} * rows * n;
    if (kind_ != AllReduce::kFused || n % 4 != 0 || bytes > peers_.staging_bytes)
      return Communicator::SumAddNorm(partial, rows, n, residual, gain, eps, out, stream);
    cuda::FusedAllReduceAddNorm(peers_, partial, rows, n, residual, gain, eps, out, stream);
    return CudaStatus(cudaGetLastError(), "fused all-reduce launch");
  }

 private:
  const AllReduce kind_;
  const cuda::PeerBuffers peers_;
  std::function<void()> release_;
};

absl::StatusOr<DeviceBuffer<char>> AllocatePeerBuffer(int64_t max_bytes) {
  const size_t bytes = cuda::PeerBufferBytes(max_bytes);
  DeviceBuffer<char> p;
  RETURN_IF_ERROR(p.Allocate(bytes, "cudaMalloc of the all-reduce peer buffer"));
  RETURN_IF_ERROR(
      CudaStatus(cudaMemset(p.get(), 0, bytes), "cudaMemset of the all-reduce signals"));
  // The legacy stream's memset, finished before a rank's non-blocking stream reads the signals.
  RETURN_IF_ERROR(
      CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize after zeroing the signals"));
  return p;
}

absl::Status CheckPeerKind(AllReduce kind, int64_t max_bytes) {
  if (kind != AllReduce::kCustom && kind != AllReduce::kFused)
    return absl::InvalidArgumentError(absl::StrCat(
        "allreduce=", AxisValueName(kind), ": not a peer-buffer all-reduce (custom, fused)"));
  if (max_bytes < 16 || max_bytes % 16 != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("all-reduce max_bytes: ", max_bytes, " is not a positive multiple of 16"));
  return absl::OkStatus();
}

class IpcPeerRank final : public PeerRank {
 public:
  IpcPeerRank(AllReduce kind, int ranks, int rank, int64_t max_bytes, DeviceBuffer<char> own,
              const cudaIpcMemHandle_t& handle)
      : kind_(kind), ranks_(ranks), rank_(rank), max_bytes_(max_bytes), own_(std::move(own)) {
    std::memcpy(handle_.data(), &handle, sizeof(handle));
  }
  PeerHandle handle() const override { return handle_; }

  absl::StatusOr<std::unique_ptr<Communicator>> Connect(
      const std::vector<PeerHandle>& handles) override {
    if (!own_) return absl::FailedPreconditionError("PeerRank::Connect called twice");
    if (static_cast<int>(handles.size()) != ranks_)
      return absl::InvalidArgumentError(
          absl::StrCat("peer handles: ", handles.size(), " for ", ranks_, " ranks"));
    cuda::PeerBuffers peers;
    peers.ranks = ranks_;
    peers.rank = rank_;
    peers.staging_bytes = max_bytes_;
    std::vector<void*> opened;
    auto close_opened = [](const std::vector<void*>& ptrs) {
      for (void* p : ptrs) cudaIpcCloseMemHandle(p);
    };
    for (int r = 0; r < ranks_; ++r) {
      if (r == rank_) {
        peers.base[r] = own_.get();
        continue;
      }
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handles[r].data(), sizeof(h));
      void* p = nullptr;
      if (auto s = CudaStatus(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
                              absl::StrCat("cudaIpcOpenMemHandle of rank ", r).c_str());
          !s.ok()) {
        close_opened(opened);
        return s;
      }
      opened.push_back(p);
      peers.base[r] = p;
    }
    // The communicator owns the buffer now: the peers' mappings close before it is freed.
    auto own = std::make_shared<DeviceBuffer<char>>(std::move(own_));
    return std::unique_ptr<Communicator>(
        new PeerCommunicator(kind_, peers, [own, opened, close_opened] {
          close_opened(opened);
          own->reset();
        }));
  }

 private:
  const AllReduce kind_;
  const int ranks_, rank_;
  const int64_t max_bytes_;
  DeviceBuffer<char> own_;  // empty once Connect hands it to the communicator
  PeerHandle handle_;
};

}  // namespace

absl::Status Communicator::SumAddNorm(float* partial, int rows, int n, float* residual,
                                      const MatrixRef& gain, float eps, float* out,
                                      cudaStream_t stream) {
  const int64_t count = int64_t{rows} * n;
  RETURN_IF_ERROR(Sum(partial, count, cuda::ReduceDType::kFp32, stream));
  cuda::AddScaled(residual, partial, 1.f, count, stream);
  cuda::RmsNorm(residual, rows, n, gain, eps, out, stream);
  return CudaStatus(cudaGetLastError(), "add and norm launch");
}

absl::StatusOr<NcclId> MakeNcclId() {
  DisableNvls();
  ncclUniqueId id;
  RETURN_IF_ERROR(NcclStatus("ncclGetUniqueId", ncclGetUniqueId(&id)));
  NcclId out;
  std::memcpy(out.data(), &id, sizeof(id));
  return out;
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const NcclId& id, int ranks,
                                                                   int rank) {
  RETURN_IF_ERROR(CheckRanks(ranks, rank));
  DisableNvls();
  ncclUniqueId unique;
  std::memcpy(&unique, id.data(), sizeof(unique));
  ncclComm_t comm = nullptr;
  RETURN_IF_ERROR(NcclStatus("ncclCommInitRank", ncclCommInitRank(&comm, ranks, unique, rank)));
  return std::unique_ptr<Communicator>(new NcclCommunicator(comm, ranks, rank));
}

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeLocalCommunicators(
    AllReduce kind, const std::vector<int>& devices, int64_t max_bytes) {
  const int ranks = static_cast<int>(devices.size());
  RETURN_IF_ERROR(CheckRanks(ranks, 0));
  std::vector<std::unique_ptr<Communicator>> out;
  if (kind == AllReduce::kNccl) {
    if (std::set<int>(devices.begin(), devices.end()).size() != devices.size())
      return absl::InvalidArgumentError(
          "allreduce=nccl: NCCL takes one rank a device (a device listed twice)");
    DisableNvls();
    std::vector<ncclComm_t> comms(ranks);
    if (auto s =
            NcclStatus("ncclCommInitAll", ncclCommInitAll(comms.data(), ranks, devices.data()));
        !s.ok())
      return s;
    for (int r = 0; r < ranks; ++r) out.emplace_back(new NcclCommunicator(comms[r], ranks, r));
    return out;
  }
  RETURN_IF_ERROR(CheckPeerKind(kind, max_bytes));
  int previous = 0;
  CUDA_OR_DIE(cudaGetDevice(&previous));
  struct Buffers {  // every rank's buffer, freed on its device once no rank maps it
    std::vector<int> devices;
    std::vector<DeviceBuffer<char>> base;
    ~Buffers() {
      for (size_t r = 0; r < base.size(); ++r) {
        cudaSetDevice(devices[r]);
        base[r].reset();
      }
    }
  };
  auto buffers = std::make_shared<Buffers>();
  buffers->devices = devices;
  absl::Status status;
  for (int r = 0; r < ranks && status.ok(); ++r) {
    status = CudaStatus(cudaSetDevice(devices[r]), "cudaSetDevice");
    if (!status.ok()) break;
    for (int peer : devices) {
      if (peer == devices[r]) continue;
      int can = 0;
      cudaDeviceCanAccessPeer(&can, devices[r], peer);
      if (!can) {
        status = absl::FailedPreconditionError(
            absl::StrCat("allreduce=", AxisValueName(kind), ": GPU ", devices[r],
                         " cannot access GPU ", peer, "'s memory (no peer path)"));
        break;
      }
      const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
        status = CudaStatus(e, "cudaDeviceEnablePeerAccess");
      cudaGetLastError();
    }
    if (!status.ok()) break;
    auto p = AllocatePeerBuffer(max_bytes);
    if (!p.ok()) {
      status = p.status();
      break;
    }
    buffers->base.push_back(*std::move(p));
  }
  CUDA_OR_DIE(cudaSetDevice(previous));
  if (!status.ok()) return status;
  for (int r = 0; r < ranks; ++r) {
    cuda::PeerBuffers peers;
    peers.ranks = ranks;
    peers.rank = r;
    peers.staging_bytes = max_bytes;
    for (int q = 0; q < ranks; ++q) peers.base[q] = buffers->base[q].get();
    out.emplace_back(new PeerCommunicator(kind, peers, [buffers] {}));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<PeerRank>> PeerRank::Create(AllReduce kind, int ranks, int rank,
                                                           int64_t max_bytes) {
  RETURN_IF_ERROR(CheckRanks(ranks, rank));
  RETURN_IF_ERROR(CheckPeerKind(kind, max_bytes));
  ASSIGN_OR_RETURN(auto own, AllocatePeerBuffer(max_bytes));
  cudaIpcMemHandle_t handle;
  RETURN_IF_ERROR(CudaStatus(cudaIpcGetMemHandle(&handle, own.get()), "cudaIpcGetMemHandle"));
  return std::unique_ptr<PeerRank>(
      new IpcPeerRank(kind, ranks, rank, max_bytes, std::move(own), handle));
}

}  // namespace infersweep
